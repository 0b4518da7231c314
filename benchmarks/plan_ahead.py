"""The loader's planning on the training thread against planning the next group ahead, on a pipeline layout.

Trains ``benchmarks/e2e.py``'s reference MLLM on the same synthetic shards under ``OmniStrategy(pp=2)`` (1F1B,
``--micro-batches`` micro-batches a step, shaped by the loader's 1F1B search: the costliest planner a job runs
redundantly on every rank) on ``--ranks`` fork-started CPU processes, with

* (s) ``OmniDataModule(plan_ahead=False)``: every group read, planned and exchanged on the training thread, between
  the last step of one group and the first of the next;
* (p) ``OmniDataModule(plan_ahead=True)`` (the default): the next group read, planned and exchanged on the loader's
  planning thread while the current group trains.

Both train the same samples with the same plans (checked). Each rank's CPU over each step's interval (from the end
of one step to the end of the next) is counted in five parts: the training thread inside the step (*train*) and
between steps (*fetch*: in (s) the planning runs there), the planning thread (*plan*), the other Python threads (the
shard reader, the decoders: *other*), and the rest of the process (*comm*: Gloo's threads). Two models of the step
on dedicated devices:

* *summed* (``benchmarks/e2e.py``'s modeled step): the slowest rank's sum of the five parts, step by step, as if
  every part were on the critical path;
* *critical path*: per reorder group and rank, the larger of the training thread's CPU (train + fetch) and the
  planning thread's over the group's steps (the planning thread plans the next group while this one trains, and the
  training thread waits for it only where it is the longer), plus other and comm; the slowest rank's, per step.

Every configuration runs ``--repeats`` times, interleaved; each (step, rank, part) keeps its least CPU time over the
repeats. The spread between (s)'s first two repeats is the run's noise. The timed steps are whole groups after a
warm-up of whole groups. Results go to ``benchmarks/results/plan_ahead.json`` and ``.txt``; the last line is
``critical-path step (s)/(p): X``.

    python benchmarks/plan_ahead.py [--workload FILE] [--ranks 4] [--micro-batches 8] [--steps 16] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from common import SHARED_WORKLOADS, free_port
from e2e import CONFIG, RESULTS, _StepClock, batch_metas, python_threads_cpu, spread

from omni_lightning import OmniDataModule, OmniModule, OmniStrategy
from omni_lightning.data.synthetic import make_synthetic_shards
from omni_lightning.parallel.compat import all_gather_single

PARTS = ("train", "fetch", "plan", "other", "comm")
CONFIGURATIONS = {"s": "planning on the training thread", "p": "planning ahead on the planning thread"}
PLANNING_THREAD = "omni-plan-ahead"


class _ThreadClock(_StepClock):
    """Each step's CPU on this rank in :data:`PARTS` (see the module docstring), every rank's kept by rank 0, with the
    samples each rank trained (to check that both configurations train the same). ``e2e.py``'s clock, with the
    planning thread read apart from the other Python threads."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.parts: list[list[list[float]]] = []  # [step][rank][part]
        self.samples: list[Any] = []

    def _read(self) -> np.ndarray:  # type: ignore[override]
        """CPU seconds so far: this thread, the planning thread, the other Python threads (each since first seen),
        the process."""
        planning, other = python_threads_cpu(self._threads, PLANNING_THREAD)
        return np.array([time.thread_time(), planning, other, time.process_time()])

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = self._read()
        main, planning, other, process = now - self._mark
        train, fetch = now[0] - self._batch_start, self._batch_start - self._mark[0]
        comm = max(process - main - planning - other, 0.0)
        mine = torch.tensor([train, fetch, planning, other, comm], dtype=torch.float64)
        everyone = torch.empty(dist.get_world_size() * len(PARTS), dtype=torch.float64)
        all_gather_single(everyone, mine)
        self.parts.append(everyone.view(-1, len(PARTS)).tolist())
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, [meta for mb in batch["micro_batches"] for meta in batch_metas(mb)])
        self.samples.append(per_rank)
        self._mark = self._read()  # the gathers above are this step's last collectives

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps({"parts": self.parts, "samples": self.samples}))


def run(name: str, shards: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    os.environ["MASTER_PORT"] = str(free_port())
    record = out / f"{name}.json"
    strategy = OmniStrategy(launcher="fork", timeout=600, pp=2, dp_shard=args.ranks // 2,
                            pp_microbatches=args.micro_batches)
    data = OmniDataModule(shards, samples_per_step=args.samples_per_step, group_steps=args.group_steps,
                          reorder_group_size=None, seed=args.seed, plan_ahead=name == "p")
    trainer = pl.Trainer(accelerator="cpu", devices=args.ranks, strategy=strategy, max_steps=args.steps,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[_ThreadClock(record)])
    trainer.fit(OmniModule(CONFIG, init_seed=args.seed), datamodule=data)
    return json.loads(record.read_text())


def summarize(records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Both models of the step (see the module docstring) over the timed steps, least CPU over the repeats."""
    parts = np.min([record["parts"][args.warmup:] for record in records], axis=0)  # [step, rank, part]
    train, fetch, plan, other, comm = np.moveaxis(parts, 2, 0)
    groups = parts.shape[0] // args.group_steps

    def by_group(x: np.ndarray) -> np.ndarray:  # [group, rank]: summed over each group's steps
        return x.reshape(groups, args.group_steps, -1).sum(axis=1)

    critical = np.maximum(by_group(train + fetch), by_group(plan)) + by_group(other + comm)
    summed = parts.sum(axis=2)
    return {
        "critical_path_step_s": float(critical.max(axis=1).mean() / args.group_steps),
        "summed_step_s": float(summed.max(axis=1).mean()),
        "mean_parts_s": parts.mean(axis=(0, 1)).tolist(),  # the mean rank's step, part by part
        "mean_rank_cpu_s": float(summed.mean()),
        "per_rank_parts_s": parts.tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_workload = SHARED_WORKLOADS / "vlm_dynres.yaml"
    parser.add_argument("--workload", default=str(default_workload) if default_workload.exists() else "vlm_dynres")
    parser.add_argument("--ranks", type=int, default=4, help="pp=2 times the data-parallel ranks")
    parser.add_argument("--micro-batches", type=int, default=8, help="1F1B micro-batches a step")
    parser.add_argument("--samples-per-step", type=int, default=16, help="samples each data-parallel rank reads")
    parser.add_argument("--group-steps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16, help="steps trained, warm-up included")
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out (whole groups)")
    parser.add_argument("--quick", action="store_true", help="12 steps")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration, interleaved")
    parser.add_argument("--length-scale", type=float, default=0.08)
    parser.add_argument("--max-llm-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="plan_ahead", help="name of the result files under benchmarks/results/")
    args = parser.parse_args()
    if args.quick:
        args.steps = 12
    if args.ranks % 2 or args.repeats < 2:
        raise SystemExit("--ranks must be even (two pipeline stages) and --repeats at least 2 (the noise)")
    measured = args.steps - args.warmup
    if args.warmup < 1 or args.warmup % args.group_steps or measured < 1 or measured % args.group_steps:
        raise SystemExit(f"--warmup {args.warmup} and --steps {args.steps} minus it must be positive multiples of "
                         f"--group-steps {args.group_steps}: the models of the step add up whole groups")
    torch.set_num_threads(1)
    dp = args.ranks // 2
    with tempfile.TemporaryDirectory() as scratch:
        shard_count = 2 * dp
        per_shard = -(-(args.steps + args.group_steps) * args.samples_per_step * dp // shard_count) + 2
        make_synthetic_shards(scratch, workload=args.workload, num_shards=shard_count, samples_per_shard=per_shard,
                              seed=args.seed, length_scale=args.length_scale, max_llm_tokens=args.max_llm_tokens)
        shards = f"{scratch}/train-{{000000..{shard_count - 1:06d}}}.tar"
        records: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGURATIONS}
        for _ in range(args.repeats):
            for name in records:
                records[name].append(run(name, shards, args, Path(scratch)))
    if any(record["samples"] != records["s"][0]["samples"] for runs in records.values() for record in runs):
        raise SystemExit("the configurations trained different samples: planning ahead changed the plans")
    results = {name: summarize(runs, args) for name, runs in records.items()}
    alone = {name: [summarize([record], args)["critical_path_step_s"] for record in runs]
             for name, runs in records.items()}  # each repeat summarised alone
    noise = spread(*alone["s"][:2])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"args": vars(args), "results": results, "noise": noise,
                                                          "repeats_alone_s": alone}, indent=2))
    lines = ["$ python benchmarks/plan_ahead.py " + " ".join(sys.argv[1:]),
             f"{Path(args.workload).stem}: {args.ranks} ranks (pp=2 x dp={dp}), 1F1B with {args.micro_batches} "
             f"micro-batches a step shaped by the loader's search, {args.samples_per_step} samples per data-parallel "
             f"rank and step, groups of {args.group_steps} steps, {args.steps} steps (first {args.warmup} left out), "
             f"least CPU of {args.repeats} repeats"]
    for name, label in CONFIGURATIONS.items():
        r = results[name]
        mean = " + ".join(f"{part} {x * 1e3:.1f}" for part, x in zip(PARTS, r["mean_parts_s"], strict=True))
        lines.append(f"({name}) {label:<38} critical path {r['critical_path_step_s'] * 1e3:7.1f} ms/step, summed "
                     f"{r['summed_step_s'] * 1e3:7.1f} ms/step; mean rank: {mean} ms")
    lines.append("critical path of each repeat alone (ms/step): " + "; ".join(
        f"({name}) " + ", ".join(f"{x * 1e3:.1f}" for x in figures) for name, figures in alone.items()))
    lines.append(f"noise (s) vs (s): {noise * 100:.1f}% critical-path step (two repeats, each alone)")
    lines.append(f"summed step (s)/(p): {results['s']['summed_step_s'] / results['p']['summed_step_s']:.3f}")
    lines.append("critical-path step (s)/(p): "
                 f"{results['s']['critical_path_step_s'] / results['p']['critical_path_step_s']:.3f}")
    (RESULTS / f"{args.out}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
