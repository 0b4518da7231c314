"""Measured balance of a real multi-process run: naive split vs grouped reordering, side by side.

Trains the tiny reference MLLM on ``--ranks`` fork-started CPU processes (FSDP over all of them) twice over the
same synthetic shards, once with ``reorder="none"`` (each rank trains on what it read) and once with
``"grouped"``. Each rank's compute per step is its training thread's CPU time (LoadMonitor), which holds on an
oversubscribed machine because a rank blocked in a collective uses no CPU. Prints, per configuration, the mean
over steps of max/mean per-rank compute, and the modeled dedicated-hardware time (sum over steps of the slowest
rank). Results go to ``benchmarks/results/loader_balance.json``.

    python benchmarks/loader_balance.py [--workload vlm_dynres] [--ranks 4] [--steps 24]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from common import free_port

from omni_lightning import OmniDataModule, OmniModule, OmniStrategy, ReferenceMLLMConfig
from omni_lightning.data.synthetic import make_synthetic_shards
from omni_lightning.monitor import LoadMonitor

RESULTS = Path(__file__).resolve().parent / "results"


class _SaveHistory(pl.Callback):
    def __init__(self, monitor: LoadMonitor, path: Path) -> None:
        self.monitor, self.path = monitor, path

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps(self.monitor.history))


def run(mode: str, shards: str, args: argparse.Namespace, out: Path) -> list[list[float]]:
    os.environ["MASTER_PORT"] = str(free_port())
    monitor = LoadMonitor()
    history = out / f"{mode}.json"
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.ranks, strategy=OmniStrategy(launcher="fork", timeout=300),
        max_steps=args.steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[monitor, _SaveHistory(monitor, history)],
    )
    data = OmniDataModule(shards, samples_per_step=args.samples_per_step, group_steps=args.group_steps,
                          reorder=mode, reorder_group_size=None, seed=args.seed)
    trainer.fit(OmniModule(ReferenceMLLMConfig.tiny(), init_seed=args.seed), datamodule=data)
    return json.loads(history.read_text())


def summarize(history: list[list[float]], warmup: int) -> dict[str, float]:
    per_step = np.array(history[warmup:])
    return {
        "mean_max_over_mean": float((per_step.max(axis=1) / per_step.mean(axis=1)).mean()),
        "modeled_seconds": float(per_step.max(axis=1).sum()),
        "ideal_seconds": float(per_step.mean(axis=1).sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="vlm_dynres")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--samples-per-step", type=int, default=8)
    parser.add_argument("--group-steps", type=int, default=8)
    parser.add_argument("--length-scale", type=float, default=0.05)
    parser.add_argument("--max-llm-tokens", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out (allocator and import warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        shard_count = 2 * args.ranks
        per_shard = -(-args.steps * args.samples_per_step * args.ranks // shard_count) + args.samples_per_step
        make_synthetic_shards(scratch, workload=args.workload, num_shards=shard_count, samples_per_shard=per_shard,
                              seed=args.seed, length_scale=args.length_scale, max_llm_tokens=args.max_llm_tokens)
        shards = f"{scratch}/train-{{000000..{shard_count - 1:06d}}}.tar"
        results = {mode: summarize(run(mode, shards, args, Path(scratch)), args.warmup) for mode in ("none", "grouped")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "loader_balance.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    for mode, label in (("none", "naive split"), ("grouped", "grouped reordering")):
        r = results[mode]
        print(f"{label:>20}: measured max/mean per-rank compute {r['mean_max_over_mean']:.3f}, "
              f"modeled time {r['modeled_seconds']:.2f} s (ideal {r['ideal_seconds']:.2f} s)")
    speedup = results["none"]["modeled_seconds"] / results["grouped"]["modeled_seconds"]
    print(f"modeled speedup grouped/naive: {speedup:.3f}")
    print(f"measured max/mean: naive {results['none']['mean_max_over_mean']:.3f}, "
          f"grouped {results['grouped']['mean_max_over_mean']:.3f}")


if __name__ == "__main__":
    main()
