"""Count the collectives each e2e configuration issues per step, by caller: the per-step overhead no cost model prices.

Runs :func:`e2e.run` for each of ``--configs`` on the same synthetic shards with every ``torch.distributed``
collective that Python code calls wrapped to count it (one inside another, as ``all_gather_object``'s two
``all_gather`` calls, counts each; FSDP's own all-gathers and reduce-scatters go through the
C++ functional collectives and are not counted; they are the same in every configuration), over the steps after the
warm-up, on rank 0. Beside ``benchmarks/link_cost.py``'s CPU per collective this says what each configuration's
extra collectives cost a step.

    python benchmarks/collectives.py [--workload FILE] [--configs abcd]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import e2e
import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from common import SHARED_WORKLOADS

from omni_lightning.data.synthetic import make_synthetic_shards

WRAPPED = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather", "reduce_scatter_tensor",
           "all_to_all_single", "broadcast", "barrier", "all_gather_object", "all_to_all")
_COUNTS: collections.Counter[tuple[str, str]] = collections.Counter()
_COUNTING = {"on": False}


def _caller() -> str:
    """The innermost project (or benchmark) frame that called the collective, else the library frame."""
    frames = [f for f in traceback.extract_stack(limit=12) if not f.filename.endswith("collectives.py")]
    ours = [f for f in frames if "omni_lightning" in f.filename or "benchmarks" in f.filename]
    frame = ours[-1] if ours else frames[-1]
    return f"{Path(frame.filename).name}:{frame.name}"


def _wrap(module: Any, name: str) -> None:
    original = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        if _COUNTING["on"]:
            _COUNTS[(name, _caller())] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)


class _Window(pl.Callback):
    """Counts from the first step after the warm-up to the end; rank 0 writes the counts."""

    def __init__(self, warmup: int, path: Path) -> None:
        self.warmup, self.path = warmup, path

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int
                             ) -> None:
        _COUNTING["on"] = _COUNTING["on"] or batch_idx == self.warmup

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        _COUNTING["on"] = False
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps([[*key, n] for key, n in _COUNTS.most_common()]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default=str(SHARED_WORKLOADS / "vlm_dynres.yaml"))
    parser.add_argument("--configs", default="abcd")
    args = parser.parse_args()
    # e2e's own arguments and defaults, so that a setting e2e.run gains reaches these runs too.
    training = argparse.ArgumentParser()
    e2e.add_training_arguments(training)
    run_args = training.parse_args(["--workload", args.workload, "--steps", "12"])
    for module in (dist, c10d):
        for name in WRAPPED:
            if hasattr(module, name):  # all_gather_single is new in PyTorch 2.13
                _wrap(module, name)
    torch.set_num_threads(1)
    measured = run_args.steps - run_args.warmup
    with tempfile.TemporaryDirectory() as scratch:
        make_synthetic_shards(scratch, workload=args.workload, num_shards=8, samples_per_shard=32, seed=0,
                              length_scale=run_args.length_scale, max_llm_tokens=run_args.max_llm_tokens)
        shards = f"{scratch}/train-{{000000..000007}}.tar"
        original_init = pl.Trainer.__init__
        for name in args.configs:
            path = Path(scratch) / f"counts_{name}.json"

            def init(self: pl.Trainer, *a: Any, _path: Path = path, **kw: Any) -> None:
                kw["callbacks"] = [_Window(run_args.warmup, _path), *kw.get("callbacks", [])]
                original_init(self, *a, **kw)

            pl.Trainer.__init__ = init  # type: ignore[method-assign]
            e2e.run(name, shards, run_args, Path(scratch))
            counts = json.loads(path.read_text())
            print(f"({name}) {sum(n for *_, n in counts) / measured:.2f} collectives per step on rank 0 "
                  f"(Python-issued; {Path(args.workload).stem}, {measured} steps)")
            for kind, caller, n in counts:
                print(f"    {n / measured:6.2f}  {kind:<22} {caller}")
        pl.Trainer.__init__ = original_init  # type: ignore[method-assign]
    sys.stdout.flush()


if __name__ == "__main__":
    main()
