"""Clipping by the global gradient norm: the norm of the full gradients, a few collectives a step, no host read.

Tolerance: the norm within 1e-6 relative of the full gradients' (fp32 gradients, squares summed in fp64 in another
order), each clipped gradient within 1e-6 relative of the full gradient times ``max_norm / norm``.
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from built_step import built_step
from device_discipline import device_syncs
from distributed import run_distributed
from torch.distributed.tensor import DTensor

from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.parallel.dims import ParallelDims
from omni_lightning.parallel.grad_norm import clip_grad_norm_
from omni_lightning.runtime.loss import next_token_loss_sum, vocab_parallel_loss


def _full(grad: torch.Tensor) -> torch.Tensor:
    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()


def _check_clip(rank: int, world: int, degrees: dict[str, int], max_norm: float,
                monkeypatch: pytest.MonkeyPatch) -> None:
    dims = ParallelDims(world_size=world, **degrees)
    model, step = built_step(dims, reshard=False, link="auto")
    rng = np.random.default_rng(dims.local_rank_in("dp", rank))
    batch = pack_samples([DecodedSample("s", rng.integers(4, 256, 12).astype(np.int32),
                                        [rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)],
                                        rng.standard_normal((8, 80)).astype(np.float16))])
    logits = model(batch)
    with vocab_parallel_loss() if isinstance(logits, DTensor) else nullcontext():  # vocabulary-sharded logits under TP
        loss_sum, count = next_token_loss_sum(logits, batch["labels"])
        (loss_sum / count).backward()
    step.sync_gradients()  # as the strategy does before clipping: tensor-parallel peers' encoder gradients sum
    parameters = [p for p in model.parameters() if p.grad is not None]
    full = [_full(p.grad) for p in parameters]
    expected = torch.stack([g.double().norm() for g in full]).norm()

    collectives: Counter[str] = Counter()
    for module, name in ((dist, "all_reduce"), (funcol, "all_reduce")):
        original = getattr(module, name)

        def counting(*args: Any, _original: Any = original, _name: str = f"{module.__name__}.{name}",
                     **kwargs: Any) -> Any:
            collectives[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    with device_syncs() as syncs:
        norm = clip_grad_norm_(list(model.parameters()), max_norm)
    monkeypatch.undo()

    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    scale = min(1.0, max_norm / float(expected))
    for p, before in zip(parameters, full, strict=True):
        torch.testing.assert_close(_full(p.grad), before * scale, rtol=1e-6, atol=1e-9)
    # One all-reduce per mesh dimension a gradient is sharded over (FSDP's; TP's on the 2-D mesh), not one per
    # parameter; and no read of a device value on the host.
    assert sum(collectives.values()) <= 3 < len(parameters), collectives
    assert not syncs, syncs


@pytest.mark.parametrize(("world", "degrees"), [(2, {"dp_shard": 2}), (4, {"dp_shard": 2, "tp": 2})])
@pytest.mark.parametrize("max_norm", [1e-3, 1e6])
def test_clipping_scales_by_the_norm_of_the_full_gradients_in_a_few_collectives(
        world: int, degrees: dict[str, int], max_norm: float, monkeypatch: pytest.MonkeyPatch) -> None:
    run_distributed(_check_clip, world, degrees, max_norm, monkeypatch)


def test_a_non_finite_norm_leaves_the_gradients_alone() -> None:
    weights = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    weights[0].grad = torch.tensor([1.0, float("nan"), 2.0])
    weights[1].grad = torch.tensor([3.0, 4.0])
    norm = clip_grad_norm_(weights, 1.0)
    assert not torch.isfinite(norm)
    torch.testing.assert_close(weights[1].grad, torch.tensor([3.0, 4.0]))


def test_plain_bf16_gradients_are_clipped_in_place() -> None:
    weight = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    weight.grad = torch.full((4,), 2.0, dtype=torch.bfloat16)
    norm = clip_grad_norm_([weight], 1.0)
    torch.testing.assert_close(norm, torch.tensor(4.0, dtype=torch.float64))
    torch.testing.assert_close(weight.grad, torch.full((4,), 0.5, dtype=torch.bfloat16), rtol=1e-2, atol=0)
