"""What the non-finite guard's gradient check costs a step on this CPU, by the norm it takes first.

The guard (``OmniStrategy(on_nonfinite=...)``) looks at every gradient shard a rank holds after the step's last
backward. It takes their 2-norms in one fused call and settles only a non-finite one by the max-norm (finite exactly
where every element is); this prints what each norm costs over the shards of ``benchmarks/e2e.py``'s reference model
as one of ``--ranks`` FSDP ranks holds them (each parameter's rows split evenly), in float32 and bfloat16, and what the
whole check costs where every gradient is finite. The least of ``--repeats`` timings of ``--calls`` calls each.

    python benchmarks/guard_cost.py [--ranks 4] [--calls 200] [--repeats 5]

The last line is ``guard gradient check per step: X ms (max-norm alone: Y ms)`` (float32).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from e2e import CONFIG

from omni_lightning import ReferenceMLLM
from omni_lightning.strategies.nonfinite import _any_nonfinite_grad


def least_ms(call: Callable[[], object], calls: int, repeats: int) -> float:
    """The least over ``repeats`` of the mean milliseconds of ``calls`` calls."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4, help="FSDP ranks the parameters are sharded over")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = ReferenceMLLM(CONFIG)
    print(f"{sum(1 for _ in model.parameters())} gradient shards, {sum(p.numel() for p in model.parameters())} "
          f"parameters over {args.ranks} ranks; {torch.get_num_threads()} thread, least of {args.repeats} x "
          f"{args.calls} calls")
    for dtype in (torch.bfloat16, torch.float32):
        params = []
        for p in model.parameters():
            shard = torch.nn.Parameter(torch.empty(-(-p.shape[0] // args.ranks), *p.shape[1:], dtype=dtype))
            shard.grad = torch.randn_like(shard)
            params.append(shard)
        grads = [p.grad for p in params]
        two = least_ms(lambda: torch._foreach_norm(grads, 2), args.calls, args.repeats)  # noqa: B023
        most = least_ms(lambda: torch._foreach_norm(grads, float("inf")), args.calls, args.repeats)  # noqa: B023
        check = least_ms(lambda: _any_nonfinite_grad(params, torch.device("cpu")), args.calls,  # noqa: B023
                         args.repeats)
        print(f"{str(dtype).removeprefix('torch.'):>9}: 2-norm {two:.3f} ms, max-norm {most:.3f} ms, "
              f"the whole check {check:.3f} ms")
    print(f"guard gradient check per step: {check:.2f} ms (max-norm alone: {most:.2f} ms)")


if __name__ == "__main__":
    main()
