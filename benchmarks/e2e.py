"""End to end, side by side: what a Lightning user has today against OmniStrategy, on the same data and steps.

Trains the same reference MLLM on the same synthetic shards for the same steps and global batch on ``--ranks``
fork-started CPU processes, under

* (a) Lightning's ``ModelParallelStrategy`` with FSDP2 over every rank and the plain per-rank data split;
* (b) OmniStrategy (FSDP2) with balancing off (``OmniDataModule(reorder="none")``, no encoder resharding);
* (c) OmniStrategy with grouped reordering in the loader;
* (d) (c) plus encoder resharding with long-short sequence parallelism (``enc_sp``), priced in the seconds its
  batches 1 and 2 measure (``OmniStrategy(reshard_calibration_steps=2)``, the default; the warm-up steps cover them);
* (e) DistTrain's disaggregated placement (``OmniStrategy(placement="disaggregated")``): an encoder pool sized by
  the pool solver (:func:`~omni_lightning.strategies.omni.size_encoder_pool`) for this workload, with costs fitted
  to what (a)-(c) measured in this invocation (DistTrain sizes from profiled costs too; the FLOP model misjudges
  CPU cost, e.g. 3 encoder ranks + 1 LLM rank on vlm_dynres where the measured costs give fewer), whose
  outputs stream micro-batch by micro-batch (4 a step: a stream's fill and drain shrink with more) to the LLM pool,
  with grouped reordering in the LLM pool's loader and whole items balanced over the encoder pool (DistTrain's
  reordering; no LSSP). The same global batch:
  the LLM pool's data-parallel ranks read ``samples_per_step * ranks`` samples a step between them (from the same
  shards, split over fewer readers, so its timed steps hold other samples than (a)-(d)'s, which hold the same).

This machine has 2 cores and runs more ranks than that, so wall time is not what dedicated devices would see. Each
rank's time per step is CPU time, which a rank blocked in a collective does not spend. It is counted in three parts
over the interval from the end of one step to the end of the next: *train*, the training thread's CPU inside the
step (forward, backward, optimizer, and the CPU it spends inside collectives); *loader*, the training thread's CPU
between steps (fetching the batch: packing runs there) plus the CPU of the loader's own threads (the planning
thread, which reads, plans and exchanges the next group while this one trains; shard reading, decoding); *comm*, the
CPU of every other thread of the process (Gloo runs each collective's copies and socket work on its own threads).
The *modeled step time* is the slowest rank's sum of the three (``time.process_time`` over the interval), i.e. the
step time on dedicated devices with the whole loader on the critical path (the planning thread's CPU too:
``benchmarks/plan_ahead.py`` models it off that path) and communication that does not overlap compute; the training
thread alone is printed beside it (``train-only``), as are wall-clock rates. The timed steps are whole reorder
groups after a warm-up of whole groups: grouped reordering spreads a group's samples over its steps, so a window
that cut a group would time (c)-(e) on other samples than (a) and (b). Every configuration runs ``--repeats`` times
(at least 2), interleaved with the others, and each (step, rank) keeps its least CPU time over the repeats (the same
samples and plans each time): one slow spell of this shared machine then moves no configuration's figure. The run's
noise is the spread between two measurements of (a) made the way every figure is made: (a)'s odd and even repeats,
each half summarised alone (with ``--repeats 2``, one repeat against the other): ``noise (a) vs (a): X%`` for the
modeled step and for the mean per-rank CPU, beside which the other configurations' differences are read. Slow spells
here last a whole run (one configuration read 14% apart in two runs of a quiet hour), so the widest spread between
two single repeats of (a) is printed beside it: what one run alone could be off by. For (e) the pools
run side by side, but the LLM pool cannot start before the encoder pool's first micro-batch and the encoder pool's
last backward follows the LLM's: its modeled step adds that fill and drain, the encoder pool's slowest rank divided
by the micro-batches of a step (as the pool solver models it). Reported per configuration: samples/s and tokens/s
(wall, for reference), the modeled step time, its max/mean imbalance over ranks, and the ratio to (a). Results go to
``benchmarks/results/e2e.json`` (``--out``) and a plot of per-rank time per step to ``e2e.png`` (needs the ``bench``
extra: matplotlib).

    python benchmarks/e2e.py [--workload FILE] [--ranks 4] [--steps 16] [--group-steps 4] [--repeats 2] [--quick]
                             [--no-pools] [--no-plan-ahead] [--out NAME]

``--model hf`` runs the Hugging Face comparison instead ((f) what a Lightning user writes for a Qwen2.5-VL
checkpoint against (g) OmniStrategy with everything on: see ``benchmarks/e2e_hf.py``, which takes its own arguments).

Its last two lines are ``modeled speedup (d)/(e): Y`` (absent with ``--no-pools``, which skips (e)) and
``modeled speedup (d)/(a): X``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from common import SHARED_WORKLOADS, fit_to_runs, free_port
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from omni_lightning import OmniDataModule, OmniModule, OmniStrategy, ReferenceMLLM, WebDataModule
from omni_lightning.balance.cost import CostModel
from omni_lightning.balance.workload import SampleMeta
from omni_lightning.batch import BYTE_ROLES
from omni_lightning.data.synthetic import make_synthetic_shards
from omni_lightning.models.config import (
    AudioEncoderConfig,
    LLMConfig,
    ReferenceMLLMConfig,
    VisionEncoderConfig,
)
from omni_lightning.module import initial_state_dict
from omni_lightning.monitor import LoadMonitor
from omni_lightning.parallel.compat import all_gather_single
from omni_lightning.strategies.launcher import NoWeightsMultiProcessingLauncher
from omni_lightning.strategies.pool_size import size_encoder_pool

AUDIO_ID = BYTE_ROLES.placeholder("audio")
IMAGE_ID = BYTE_ROLES.placeholder("image")

RESULTS = Path(__file__).resolve().parent / "results"
# Encoders wide enough that their work, and its imbalance, matter next to the LLM's (as in real VLMs).
CONFIG = ReferenceMLLMConfig(
    vision=VisionEncoderConfig(dim=96, n_layers=2, n_heads=4),
    audio=AudioEncoderConfig(n_mels=80, dim=96, n_layers=2, n_heads=4),
    llm=LLMConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_hidden=256),
)
CONFIGURATIONS = {
    "a": "Lightning ModelParallelStrategy (FSDP2), naive split",
    "b": "OmniStrategy, balancing off",
    "c": "OmniStrategy, grouped reordering",
    "d": "OmniStrategy, grouped reordering + encoder resharding/LSSP",
    "e": "disaggregated pools (DistTrain), solver-sized",
}
STREAMED = 4  # micro-batches a step of (e) streams from the encoder pool to the LLM pool


class ForkedModelParallel(ModelParallelStrategy):
    """Lightning's strategy, started by fork like the other runs (its default re-runs the script)."""

    def _configure_launcher(self) -> None:
        self._launcher = NoWeightsMultiProcessingLauncher(self, start_method="fork")


class _UserFSDPModule(OmniModule):
    """What a Lightning user writes for ModelParallelStrategy: FSDP2 on its data-parallel mesh in configure_model."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        model = ReferenceMLLM(self.config)
        model.load_state_dict(initial_state_dict(self.config, seed=self.hparams.init_seed))
        mesh = self.device_mesh["data_parallel"]
        for block in [*model.llm.layers.values(), *model.vision.blocks, *model.audio.blocks]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model


def batch_metas(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """The samples of a packed micro-batch as ``SampleMeta.to_json`` dicts, read back from its layout (placeholder
    counts per sample, image grids, mel lengths), so the simulator's validation can price what each rank trained on.
    Video frames arrive as images: both are one vision attention item each, so the cost features are the same."""
    if not batch["num_samples"]:  # a filler micro-batch (a rank with no sample for it) trains nothing
        return []
    ids = batch["input_ids"]
    bounds = batch["cu_seqlens"].tolist()
    grids = iter(tuple(g) for g in batch["vision_grids"].tolist())
    mels = iter(batch["audio_lengths"].tolist())
    merge = {"image": CONFIG.vision.merge, "video": CONFIG.vision.merge, "audio": 4}  # pack_samples' downsample 4
    metas = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        vision = int((ids[start:end] == IMAGE_ID).sum())
        audio = int((ids[start:end] == AUDIO_ID).sum())
        images: list[tuple[int, int]] = []
        while sum(h * w // merge["image"] for h, w in images) < vision:
            images.append(next(grids))
        frames = next(mels) if audio else 0
        modality = "image" if images else "audio" if frames else "text"
        metas.append(SampleMeta(modality=modality, text_tokens=end - start - 1 - vision - audio, images=tuple(images),
                                audio_frames=frames, merge=tuple(merge.items())).to_json())
    return metas


def python_threads_cpu(seen: dict[int, float], named: str = "") -> tuple[float, float]:
    """CPU seconds of the Python threads other than this one, each counted from when ``seen`` first saw it: those
    called ``named``, and the rest."""
    mine = rest = 0.0
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.ident is None:
            continue
        try:
            seconds = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, ProcessLookupError):  # ended since enumerate()
            continue
        used = seconds - seen.setdefault(thread.ident, seconds)
        if thread.name == named:
            mine += used
        else:
            rest += used
    return mine, rest


class _StepClock(pl.Callback):
    """Each step's CPU time on this rank in three parts (train, loader, comm; see the module docstring), all-gathered.

    The training thread's CPU comes from ``time.thread_time``, each other Python thread's (the loader's shard
    reader and decoders) from its own CPU clock, the whole process's from ``time.process_time``; what the process
    spent beyond those ran on threads Python does not know, i.e. Gloo's (and none of PyTorch's intra-op pool, which
    is one thread here). A Python thread that ends between two readings loses its last interval's CPU to ``comm``.
    """

    def __init__(self) -> None:
        self.history: list[list[list[float]]] = []  # [step][rank] -> [train, loader, comm]
        self._mark: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self._batch_start = 0.0
        self._threads: dict[int, float] = {}

    def _read(self) -> tuple[float, float, float]:
        return time.thread_time(), sum(python_threads_cpu(self._threads)), time.process_time()

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._mark = self._read()

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int
                             ) -> None:
        self._batch_start = time.thread_time()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        main, threads, process = self._read()
        train = main - self._batch_start
        fetch = self._batch_start - self._mark[0]
        loader_threads = threads - self._mark[1]
        comm = max((process - self._mark[2]) - (main - self._mark[0]) - loader_threads, 0.0)
        mine = torch.tensor([train, fetch + loader_threads, comm], dtype=torch.float64)
        everyone = torch.empty(dist.get_world_size() * 3, dtype=torch.float64)
        all_gather_single(everyone, mine)
        self.history.append(everyone.view(-1, 3).tolist())
        self._mark = self._read()  # the gather above is this step's last collective: the next interval starts here


class _Throughput(pl.Callback):
    """Rank 0 keeps wall time, global tokens and every rank's samples of every step; all saved at the end."""

    def __init__(self, monitor: LoadMonitor, clock: _StepClock, path: Path) -> None:
        self.monitor, self.clock, self.path = monitor, clock, path
        self.wall: list[float] = []
        self.tokens: list[float] = []
        self.samples: list[list[list[dict[str, Any]]]] = []
        self.reshard: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # An encoder-pool rank of (e) reads a copy of a stream only to keep the pools' epochs in step: not its samples.
        micro = [] if getattr(trainer.strategy, "is_encoder_rank", False) else batch.get("micro_batches", [batch])
        tokens = torch.tensor([float(sum(mb["input_ids"].numel() for mb in micro))], dtype=torch.float64)
        dist.all_reduce(tokens)
        self.wall.append(time.perf_counter())
        self.tokens.append(float(tokens) / trainer.strategy.parallel_dims.tp
                           if isinstance(trainer.strategy, OmniStrategy) else float(tokens))
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, [meta for mb in micro for meta in batch_metas(mb)])
        self.samples.append(per_rank)
        # The encoder plan's group-wide figures (rank 0's group): what (d) moved and split, step by step.
        plan = getattr(getattr(module, "step", None), "encoder_stats", None) or {}
        self.reshard.append({key: float(plan.get(key, 0.0)) for key in RESHARD_STATS})

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps({"cpu": self.monitor.history, "parts": self.clock.history,
                                             "wall": self.wall, "tokens": self.tokens, "samples": self.samples,
                                             "reshard": self.reshard}))


def encoder_pool(args: argparse.Namespace, cost_model: CostModel) -> int:
    """(e)'s encoder ranks: the pool solver's choice for this model and workload, as the shards draw it."""
    return size_encoder_pool(CONFIG, args.workload, world_size=args.ranks, llm_unit=1, tp=1,
                             seq_len=args.max_llm_tokens, length_scale=args.length_scale, cost_model=cost_model)


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """What the runs of :func:`run` read: the workload, the layout, the steps and the repeats."""
    default_workload = SHARED_WORKLOADS / "vlm_dynres.yaml"
    parser.add_argument("--workload", default=str(default_workload) if default_workload.exists() else "vlm_dynres")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16, help="steps trained, warm-up included")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration, interleaved")
    parser.add_argument("--samples-per-step", type=int, default=4)
    parser.add_argument("--group-steps", type=int, default=4)
    parser.add_argument("--enc-sp", type=int, default=2)
    parser.add_argument("--length-scale", type=float, default=0.08)
    parser.add_argument("--max-llm-tokens", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out (allocator and import warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plan-ahead", action="store_true",
                        help="(b)-(e) plan each group on the training thread (OmniDataModule(plan_ahead=False))")


def write_shards(args: argparse.Namespace, scratch: str) -> str:
    """Synthetic shards of ``args.workload`` under ``scratch``, enough for every step; their brace pattern."""
    shard_count = 2 * args.ranks
    per_shard = -(-args.steps * args.samples_per_step * args.ranks // shard_count) + 2 * args.samples_per_step
    make_synthetic_shards(scratch, workload=args.workload, num_shards=shard_count, samples_per_shard=per_shard,
                          seed=args.seed, length_scale=args.length_scale, max_llm_tokens=args.max_llm_tokens)
    return f"{scratch}/train-{{000000..{shard_count - 1:06d}}}.tar"


# The encoder plan's figures the benchmark records for (d), step by step.
RESHARD_STATS = ("items_moved", "items_split", "size_gathers")


def run(name: str, shards: str, args: argparse.Namespace, out: Path, pool: int = 0,
        callbacks: tuple[pl.Callback, ...] = ()) -> dict[str, Any]:
    """Train configuration ``name`` on ``shards``; ``callbacks`` (profilers) join the benchmark's own."""
    os.environ["MASTER_PORT"] = str(free_port())
    monitor = LoadMonitor()
    clock = _StepClock()
    record = out / f"{name}.json"
    if name == "e":
        llm_ranks = args.ranks - pool
        if args.samples_per_step * args.ranks % llm_ranks:
            raise SystemExit(f"(e): the global batch of {args.samples_per_step * args.ranks} samples does not split "
                             f"over the LLM pool's {llm_ranks} ranks: pick --samples-per-step or --ranks")
        strategy = OmniStrategy(launcher="fork", timeout=600, placement="disaggregated", encoder_world_size=pool,
                                pp_microbatches=STREAMED)
        module = OmniModule(CONFIG, init_seed=args.seed)
        data = OmniDataModule(shards, samples_per_step=args.samples_per_step * args.ranks // llm_ranks,
                              group_steps=args.group_steps, reorder="grouped", reorder_group_size=None,
                              seed=args.seed, plan_ahead=not args.no_plan_ahead)
    elif name == "a":
        strategy: Any = ForkedModelParallel(data_parallel_size=args.ranks, tensor_parallel_size=1)
        module: OmniModule = _UserFSDPModule(CONFIG, init_seed=args.seed)
        data: pl.LightningDataModule = WebDataModule(shards, batch_size=args.samples_per_step, seed=args.seed)
    else:
        strategy = OmniStrategy(launcher="fork", timeout=600, encoder_reshard=name == "d",
                                enc_sp=args.enc_sp if name == "d" else 1)
        module = OmniModule(CONFIG, init_seed=args.seed)
        data = OmniDataModule(shards, samples_per_step=args.samples_per_step, group_steps=args.group_steps,
                              reorder="none" if name == "b" else "grouped", reorder_group_size=None,
                              seed=args.seed, plan_ahead=not args.no_plan_ahead)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.ranks, strategy=strategy, max_steps=args.steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[monitor, clock, _Throughput(monitor, clock, record), *callbacks],
    )
    trainer.fit(module, datamodule=data)
    return json.loads(record.read_text())


def summarize(records: list[dict[str, Any]], args: argparse.Namespace, encoder_ranks: int = 0) -> dict[str, Any]:
    """Per-configuration figures over its repeats; ``encoder_ranks`` (the last ranks, for (e)) adds the pools' fill
    and drain.

    A repeat trains the same samples with the same plans, so each (step, rank) keeps its least CPU time over the
    repeats (of each part, train, loader and comm, separately): what the rank's work costs, without the spikes other
    processes on this shared machine add to one run.
    """
    samples = records[0]["samples"][args.warmup:]  # [step][rank] -> SampleMeta.to_json() dicts
    if any(record["samples"][args.warmup:] != samples for record in records[1:]):
        raise SystemExit("a repeat trained other samples than the first: the runs are not deterministic")
    train = np.min([record["cpu"][args.warmup:] for record in records], axis=0)
    parts = np.min([record["parts"][args.warmup:] for record in records], axis=0)  # [step, rank, part]
    total = parts.sum(axis=2)
    # Wall-clock rates (for reference) from the fastest repeat, timed from the end of the warm-up.
    seconds = min(float(record["wall"][-1] - record["wall"][args.warmup - 1]) for record in records)
    steps = args.steps - args.warmup

    def modeled(per_rank: np.ndarray) -> float:
        fill = per_rank[:, -encoder_ranks:].max(axis=1) / STREAMED if encoder_ranks else 0.0
        return float((per_rank.max(axis=1) + fill).mean())

    slowest = total.argmax(axis=1)  # the rank whose step is the modeled one, per step
    return {
        "modeled_step_s": modeled(total),
        "train_only_step_s": modeled(train),
        # The slowest rank's parts, averaged over the steps: where the modeled step goes.
        "slowest_parts_s": parts[np.arange(len(slowest)), slowest].mean(axis=0).tolist(),
        "mean_parts_s": parts.mean(axis=(0, 1)).tolist(),  # the mean rank's: where the CPU goes
        "mean_rank_cpu_s": float(total.mean()),
        "encoder_ranks": encoder_ranks,
        "imbalance": float((total.max(axis=1) / total.mean(axis=1)).mean()),
        "wall_step_s": seconds / steps,
        "samples_per_s": steps * args.samples_per_step * args.ranks / seconds,
        "tokens_per_s": float(sum(records[0]["tokens"][args.warmup:])) / seconds,
        "per_rank_step_s": train.tolist(),
        "per_rank_total_s": total.tolist(),
        "per_rank_samples": samples,
        # Mean over the timed steps and the repeats (calibrated prices may plan a repeat differently).
        "reshard_per_step": {key: float(np.mean([step[key] for record in records
                                                 for step in record.get("reshard", [])[args.warmup:]] or [0.0]))
                             for key in RESHARD_STATS},
    }


def spread(first: float, second: float) -> float:
    """How far two measurements of the same thing differ, as a fraction of the smaller."""
    return abs(first - second) / min(first, second)


def widest_spread(measurements: list[float]) -> float:
    """The largest spread between any two of several measurements of the same thing."""
    return spread(max(measurements), min(measurements))


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return
    figure, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3), sharey=True)
    for axis, (name, result) in zip(axes, results.items(), strict=True):
        per_rank = np.array(result["per_rank_total_s"]) * 1e3
        for rank in range(per_rank.shape[1]):
            axis.plot(per_rank[:, rank], label=f"rank {rank}", linewidth=1)
        axis.set_title(f"({name}) max/mean {result['imbalance']:.2f}", fontsize=9)
        axis.set_xlabel("step")
    axes[0].set_ylabel("CPU per step (ms: train + loader + comm)")
    axes[-1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    which = argparse.ArgumentParser(add_help=False)
    which.add_argument("--model", choices=["reference", "hf"], default="reference")
    chosen, rest = which.parse_known_args()
    if chosen.model == "hf":
        import e2e_hf

        e2e_hf.main(rest)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["reference", "hf"], default="reference",
                        help="hf: the Hugging Face comparison of benchmarks/e2e_hf.py")
    add_training_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="12 steps (about 5 minutes here)")
    parser.add_argument("--no-pools", action="store_true", help="skip (e), the disaggregated placement")
    parser.add_argument("--out", default="e2e", help="name of the result files under benchmarks/results/")
    args = parser.parse_args()
    if args.quick:
        args.steps = 12
    if args.repeats < 2:
        raise SystemExit(f"--repeats {args.repeats}: every configuration runs at least twice (two runs of (a) are "
                         "the noise the other configurations are read against)")
    measured_steps = args.steps - args.warmup
    if args.warmup < 1 or args.warmup % args.group_steps or measured_steps < 1 or measured_steps % args.group_steps:
        # A reorder group's samples are spread over its steps: a window that cuts a group would time (c)-(e) on
        # other samples than (a) and (b).
        raise SystemExit(f"--warmup {args.warmup} and the measured steps (--steps {args.steps} minus the warm-up) "
                         f"must be positive multiples of --group-steps {args.group_steps}, so that every "
                         "configuration is timed on the same samples")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        shards = write_shards(args, scratch)
        # Repeats interleave the configurations, so that a slow spell of this shared machine hits all of them, and
        # each repeat starts one configuration later, so that none always runs right after the same other one.
        names = "abcd"
        records: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for repeat in range(args.repeats):
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                records[name].append(run(name, shards, args, Path(scratch)))
        results = {name: summarize(runs, args) for name, runs in records.items()}
        # Two measurements of (a) made as every figure is made (least CPU over repeats), from disjoint repeats.
        repeats_of_a = [summarize(records["a"][half::2], args) for half in (0, 1)]
        single_repeats_of_a = [summarize([record], args) for record in records["a"]]
        timed = {name: sorted(json.dumps(meta, sort_keys=True) for step in result["per_rank_samples"]
                              for rank in step for meta in rank) for name, result in results.items()}
        if any(samples != timed["a"] for samples in timed.values()):
            raise SystemExit("(a)-(d) timed different samples: the timed window does not cover whole reorder groups")
        if not args.no_pools:
            measured, _ = fit_to_runs(results, ("a", "b", "c"), slice(None))
            pool = encoder_pool(args, measured)
            results["e"] = summarize([run("e", shards, args, Path(scratch), pool) for _ in range(args.repeats)],
                                     args, pool)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"args": vars(args), "results": results,
                                                           "repeats_of_a": repeats_of_a,
                                                           "single_repeats_of_a": single_repeats_of_a}, indent=2))
    plot(results, RESULTS / f"{args.out}.png")
    base = results["a"]["modeled_step_s"]
    print(f"{Path(args.workload).stem}: {args.ranks} ranks, {args.steps} steps, {args.samples_per_step} samples per "
          f"rank and step (first {args.warmup} steps left out), least CPU time of {args.repeats} repeats"
          + (", the loader planning on the training thread (--no-plan-ahead)" if args.no_plan_ahead else ""))
    print("modeled step: the slowest rank's train + loader + comm CPU per step; train-only: its training thread alone")
    for name, label in CONFIGURATIONS.items():
        if name not in results:
            print(f"({name}) {label:<58} skipped (--no-pools)")
            continue
        r = results[name]
        train, loader, comm = (x * 1e3 for x in r["slowest_parts_s"])
        print(f"({name}) {label:<58} modeled step {r['modeled_step_s'] * 1e3:7.1f} ms "
              f"(slowest rank: train {train:.1f} + loader {loader:.1f} + comm {comm:.1f}), "
              f"train-only {r['train_only_step_s'] * 1e3:7.1f} ms, max/mean {r['imbalance']:.3f}, "
              f"mean rank CPU {r['mean_rank_cpu_s'] * 1e3:7.1f} ms "
              f"({' + '.join(f'{x * 1e3:.1f}' for x in r['mean_parts_s'])}); "
              f"wall {r['wall_step_s'] * 1e3:7.1f} ms/step, "
              f"{r['samples_per_s']:6.1f} samples/s, {r['tokens_per_s']:8.0f} tokens/s; "
              f"vs (a) {base / r['modeled_step_s']:.3f}x modeled, "
              f"{results['a']['train_only_step_s'] / r['train_only_step_s']:.3f}x train-only, "
              f"{results['a']['wall_step_s'] / r['wall_step_s']:.3f}x wall")
    first, second = repeats_of_a
    print(f"noise (a) vs (a): {spread(first['modeled_step_s'], second['modeled_step_s']) * 100:.1f}% modeled step, "
          f"{spread(first['mean_rank_cpu_s'], second['mean_rank_cpu_s']) * 100:.1f}% mean rank CPU, "
          f"{spread(first['wall_step_s'], second['wall_step_s']) * 100:.1f}% wall "
          + ("(two repeats, each alone)" if args.repeats == 2 else
             f"(least of the odd against least of the even of {args.repeats} repeats)"))
    if args.repeats > 2:
        print("widest spread between two single repeats of (a): " + ", ".join(
            f"{widest_spread([r[key] for r in single_repeats_of_a]) * 100:.1f}% {what}"
            for key, what in (("modeled_step_s", "modeled step"), ("mean_rank_cpu_s", "mean rank CPU"))))
    print("mean per-rank CPU vs (a): " + ", ".join(
        f"({name}) {results[name]['mean_rank_cpu_s'] / results['a']['mean_rank_cpu_s']:.3f}x" for name in "bcd"))
    moved = results["d"]["reshard_per_step"]
    print(f"(d) encoder resharding, per timed step: {moved['items_moved']:.2f} items moved, "
          f"{moved['items_split']:.2f} split, {moved['size_gathers']:.2f} gathers of item sizes (rank 0's group, mean "
          "over the repeats; none where the loader's word shows that resharding could not pay)")
    if "e" in results:
        pools = results["e"]["encoder_ranks"]
        print(f"(e) ran {pools} encoder rank(s) + {args.ranks - pools} LLM rank(s), as the pool solver sized them "
              "with the costs (a)-(c) measured")
        print(f"modeled speedup (d)/(e): {results['e']['modeled_step_s'] / results['d']['modeled_step_s']:.3f}")
    print(f"modeled speedup (d)/(a): {base / results['d']['modeled_step_s']:.3f}")


if __name__ == "__main__":
    main()
