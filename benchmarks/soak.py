"""Soak: a long run over shards holding bad samples, one rank SIGKILLed mid-run, the newest checkpoint damaged, and
the job resumed with another data-parallel size from the newest checkpoint that verifies; no sample may be lost or
repeated, memory must not grow.

Two models (``--model``):

* ``reference`` (default): the tiny reference MLLM over omni-mix shards in which every ``--bad-every``-th sample is
  broken (a member missing, an undecodable image, metadata that contradicts the payload);
* ``hf``: a tiny Qwen2.5-VL written by ``examples/make_tiny_hf_vlm.py`` (``OmniModule(pretrained=...)``, its vision
  tower frozen) over the conversations of ``examples/make_demo_conversations.py`` converted by ``make-shards``, in
  which every ``--bad-every``-th dialogue is broken (an image cut in half, which fails to decode after the plan; a
  member it names missing; a media member it does not name); its audio dialogues are skipped too (the family hears
  nothing).

The run: ``--layout`` (default ``dp_shard=4``) until one rank is SIGKILLed at a seeded step; the newest checkpoint
gets a shard file cut short; the job resumes with ``ckpt_path="last"`` under ``--resized-layout`` (default
``dp_shard=2``), which must skip the damaged checkpoint and resume from the one before, on another number of
data-parallel ranks, exactly. ``OmniDataModule`` skips the bad samples (``on_bad_sample="skip"``) and reorders over all
data-parallel ranks.

Reported:

* samples seen, lost and duplicated, from the (shard, epoch, index) of every sample every data-parallel rank trained
  at every step (the killed run up to the step the resumed run started from, then the resumed run) against the
  shards' good samples: ``lost`` counts good samples missing from a complete pass over the data (every shard read
  into the next epoch), ``duplicated`` the extra occurrences of a sample within a pass plus any bad sample trained;
* RSS of every rank over time (``/proc/self/statm``, sampled after every step): per run segment (the killed run, the
  resumed one), warm-up lasts through the segment's first checkpoint save and at least its first quarter (the first
  save allocates the checkpoint's staging buffers once per process, and RSS is a high-water mark); ``rss_growth`` =
  (max RSS over the last 10% of the segment's steps - max RSS over the 10% of its steps right after warm-up) / the
  latter, the largest over ranks and segments;
* checkpoint overhead: mean seconds of a checkpoint save (every rank writes its shards, the manifest hashes them)
  against the mean step, and the share of wall time the saves took at the interval used.

Results go to ``benchmarks/results/soak.txt`` and ``soak.json`` (``soak_hf.*`` for ``--model hf``).

    python benchmarks/soak.py [--quick] [--steps 1000] [--model reference|hf] [--layout dp_shard=4]
        [--resized-layout dp_shard=2]

It prints a line ``resized: N -> M ranks`` and its last line is ``lost=N duplicated=M rss_growth=P%``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from common import free_port
from lightning.pytorch.callbacks import ModelCheckpoint
from webdataset import TarWriter
from webdataset.tariterators import tarfile_samples

from omni_lightning import OmniDataModule, OmniModule, OmniStrategy, ReferenceMLLMConfig
from omni_lightning.cli import make_shards_main
from omni_lightning.data.shards import expand_shards
from omni_lightning.data.synthetic import make_synthetic_shards
from omni_lightning.module import initial_state_dict

RESULTS = Path(__file__).resolve().parent / "results"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SHARDS = 8
SAMPLES_PER_STEP = 2
GROUP_STEPS = 4
PAGE = os.sysconf("SC_PAGE_SIZE")
DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


# ---------------------------------------------------------------------------------------------------------- data
@dataclass
class Data:
    """The shards, what each (shard, index) holds, the keys of the samples that must be skipped, and the model."""

    shards: list[str]
    keys: dict[tuple[int, int], str]
    bad: set[str]
    module: Callable[[], OmniModule]


def rewrite(paths: list[str], edit: Callable[[int, dict[str, Any]], dict[str, Any] | None]) -> dict[
        tuple[int, int], str]:
    """Rewrite every shard with ``edit(running index, raw sample)`` applied; the key of each (shard, index)."""
    keys, running = {}, 0
    for shard, path in enumerate(paths):
        samples = []
        for raw in tarfile_samples([{"url": path}]):
            raw = edit(running, {k: v for k, v in raw.items() if k != "__url__"})
            running += 1
            keys[shard, len(samples)] = raw["__key__"]
            samples.append(raw)
        buffer = io.BytesIO()
        with TarWriter(buffer, encoder=False, mtime=0) as writer:
            for raw in samples:
                writer.write(raw)
        Path(path).write_bytes(buffer.getvalue())
    return keys


def break_synthetic(raw: dict[str, Any], how: int) -> dict[str, Any]:
    """A copy of ``raw`` under a ``bad-`` key that the loader must reject, in one of three ways."""
    out = {**raw, "__key__": f"bad-{raw['__key__']}"}
    if how == 0:
        del out["tokens.npy"]
    elif how == 1 and "img0.png" in raw:
        out["img0.png"] = raw["img0.png"][: len(raw["img0.png"]) // 2]
    else:
        meta = json.loads(raw["json"])
        meta["text_tokens"] += 1
        out["json"] = json.dumps(meta).encode()
    return out


def reference_data(folder: Path, samples_per_shard: int, bad_every: int) -> Data:
    paths = [str(p) for p in make_synthetic_shards(folder / "shards", workload="omni_mix", num_shards=SHARDS,
                                                   samples_per_shard=samples_per_shard, seed=0, length_scale=0.03,
                                                   max_llm_tokens=160)]

    def edit(i: int, raw: dict[str, Any]) -> dict[str, Any]:
        return break_synthetic(raw, (i + 1) // bad_every % 3) if (i + 1) % bad_every == 0 else raw

    keys = rewrite(paths, edit)
    seed = folder / "seed.pt"
    torch.save(initial_state_dict(ReferenceMLLMConfig.tiny(), seed=1234), seed)
    return Data(paths, keys, {k for k in keys.values() if k.startswith("bad-")},
                lambda: OmniModule(ReferenceMLLMConfig.tiny(), learning_rate=1e-3, init_checkpoint=str(seed)))


def break_dialogue(raw: dict[str, Any], how: int) -> dict[str, Any]:
    """A copy of ``raw`` under a ``bad-`` key that the loader must skip: its image cut in half (the header still
    plans it; the pixels fail to decode after the plan), a member it names missing, or a media member it does not
    name."""
    out = {**raw, "__key__": f"bad-{raw['__key__']}"}
    media = sorted(m for m in raw if m.endswith((".jpg", ".png", ".mp4", ".wav")))
    if how == 0 and any(m.endswith(".jpg") for m in media):
        image = next(m for m in media if m.endswith(".jpg"))
        out[image] = raw[image][: len(raw[image]) // 2]
    elif how == 1 and media:
        del out[media[0]]
    else:
        out["9.jpg"] = next((raw[m] for m in media if m.endswith(".jpg")), b"\xff\xd8")
    return out


def hf_data(folder: Path, dialogues: int, bad_every: int) -> Data:
    """The demo conversations in ``SHARDS`` shards and a tiny Qwen2.5-VL reading them with their tokenizer, written
    by the examples' own scripts."""
    demo, model = folder / "demo_chat", folder / "tiny_qwen2_5_vl"
    subprocess.run([sys.executable, str(EXAMPLES / "make_demo_conversations.py"), str(demo), "--dialogues",
                    str(dialogues)], check=True, stdout=subprocess.DEVNULL)
    make_shards_main(["--from-conversations", str(demo / "dialogues.json"), "--media-root", str(demo / "media"),
                      "--out", str(demo / "shards"), "--samples-per-shard", str(math.ceil(dialogues / SHARDS))])
    subprocess.run([sys.executable, str(EXAMPLES / "make_tiny_hf_vlm.py"), str(model), "--tokenizer",
                    str(demo / "processor")], check=True, stdout=subprocess.DEVNULL)
    paths = expand_shards(str(demo / "shards"))

    def edit(i: int, raw: dict[str, Any]) -> dict[str, Any]:
        return break_dialogue(raw, (i + 1) // bad_every % 3) if (i + 1) % bad_every == 0 else raw

    keys = rewrite(paths, edit)
    skipped = {k for k in keys.values() if k.startswith(("bad-", "audio"))}  # the family has no audio encoder
    return Data(paths, keys, skipped, lambda: OmniModule(pretrained=str(model), freeze=["vision"], learning_rate=1e-3))


# ----------------------------------------------------------------------------------------------------- recording
class Recorder(pl.Callback):
    """Every rank records, per step (1 = first), its data-parallel rank, the (shard, epoch, index) of the samples it
    trained, its RSS, and (rank 0) step and save times."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.record: dict[str, Any] = {"sources": {}, "rss_mib": {}, "step_s": {}}
        self._started = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.record["dp_rank"] = trainer.strategy.distributed_sampler_kwargs["rank"]
        micro_batches = batch.get("micro_batches", [batch])
        self.record["sources"][trainer.global_step + 1] = [list(s[:3]) for mb in micro_batches for s in mb["sources"]]
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        self.record["step_s"][step] = time.perf_counter() - self._started
        with open("/proc/self/statm") as statm:
            self.record["rss_mib"][step] = int(statm.read().split()[1]) * PAGE / 2**20
        path = self.out_dir / f"rank{trainer.global_rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(self.record))
        os.replace(path.with_suffix(".tmp"), path)  # a rank killed mid-write leaves the previous version


class TimedCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that appends each save's seconds (on rank 0) to ``saves.json``."""

    def __init__(self, out_dir: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out_dir = out_dir

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        started = time.perf_counter()
        super()._save_checkpoint(trainer, filepath)
        if trainer.global_rank == 0:
            path = self.out_dir / "saves.json"
            saves = json.loads(path.read_text()) if path.exists() else []
            path.write_text(json.dumps([*saves, time.perf_counter() - started]))


class SigkillAt(pl.Callback):
    """Rank ``rank`` is SIGKILLed when ``step`` steps are done."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


def parse_layout(text: str) -> dict[str, int]:
    """``"dp_shard=2,pp=2"`` as OmniStrategy degrees."""
    layout = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name.strip() not in DEGREES:
            raise argparse.ArgumentTypeError(f"{name!r} is not one of {DEGREES}")
        layout[name.strip()] = int(value)
    return layout


def world(layout: dict[str, int]) -> int:
    return math.prod(layout.values())


def data_parallel(layout: dict[str, int]) -> int:
    return layout.get("dp_replicate", 1) * layout.get("dp_shard", 1)


def fit(out_dir: Path, data: Data, ckpt_dir: Path, *, layout: dict[str, int], steps: int, every: int,
        callbacks: list[pl.Callback], ckpt_path: str | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ["MASTER_PORT"] = str(free_port())
    trainer = pl.Trainer(
        accelerator="cpu", devices=world(layout), strategy=OmniStrategy(launcher="fork", timeout=300, **layout),
        max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Recorder(out_dir), TimedCheckpoint(out_dir, dirpath=ckpt_dir, every_n_train_steps=every,
                                                      save_top_k=2, monitor="step", mode="max"), *callbacks],
    )
    datamodule = OmniDataModule(data.shards, samples_per_step=SAMPLES_PER_STEP, group_steps=GROUP_STEPS,
                                reorder_group_size=None, on_bad_sample="skip")
    trainer.fit(data.module(), datamodule=datamodule, ckpt_path=ckpt_path)


def damage_newest(ckpt_dir: Path) -> tuple[int, str]:
    """Cut the largest file of the newest checkpoint in half, as a failing disk or a copy cut short would."""
    steps = {int(p.name.split("step=")[1].split(".")[0]): p for p in ckpt_dir.glob("*.ckpt")}
    newest = max(steps)
    victim = max((p for p in steps[newest].iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    return newest, victim.name


# -------------------------------------------------------------------------------------------------------- report
def load(run: Path) -> list[dict[str, Any]]:
    records = [json.loads(p.read_text()) for p in sorted(run.glob("rank*.json"))]
    return [{**rec, **{name: {int(s): v for s, v in rec[name].items()} for name in ("sources", "rss_mib", "step_s")}}
            for rec in records]


def trained_sources(run: list[dict[str, Any]], keep: Callable[[int], bool]) -> list[tuple[int, int, int]]:
    """The samples each data-parallel rank trained (its tensor and pipeline peers trained the same ones)."""
    by_dp = {}
    for record in run:
        by_dp.setdefault(record["dp_rank"], record["sources"])
    return [tuple(s) for sources in by_dp.values() for step, samples in sources.items() if keep(step)
            for s in samples]


def sample_accounting(trained: list[tuple[int, int, int]], keys: dict[tuple[int, int], str],
                      bad: set[str]) -> dict[str, int]:
    """Samples seen, lost (a good sample missing from a complete pass: one after which every shard was read into the
    next) and duplicated (extra within a pass, or a bad sample trained)."""
    seen = Counter(trained)
    newest = {shard: max((e for s, e, _ in seen if s == shard), default=-1) for shard in {s for s, _ in keys}}
    complete = min(newest.values())  # passes 0 .. complete - 1 are over on every shard
    lost = sum(1 for epoch in range(complete) for (shard, index), key in keys.items()
               if key not in bad and not seen[shard, epoch, index])
    duplicated = sum(n - 1 for n in seen.values() if n > 1) + sum(
        n for (shard, _, index), n in seen.items() if keys[shard, index] in bad)
    return {"seen": sum(seen.values()), "lost": lost, "duplicated": duplicated, "passes_complete": complete}


def rss_growth(rss_by_step: dict[int, float], every: int) -> float:
    """(max over the last 10% of steps - max over the 10% right after warm-up) / the latter; warm-up lasts through
    the first checkpoint save (every ``every`` steps) and at least the first quarter of the steps."""
    steps = sorted(rss_by_step)
    n = len(steps)
    window = max(n // 10, 1)
    first_save = next((i for i, s in enumerate(steps) if s % every == 0), 0)
    warmup = min(max(first_save + 1, n // 4), n - 2 * window)
    base = max(rss_by_step[s] for s in steps[warmup : warmup + window])
    return (max(rss_by_step[s] for s in steps[-window:]) - base) / base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="96 steps (a few minutes on 2 busy cores)")
    parser.add_argument("--model", choices=["reference", "hf"], default="reference")
    parser.add_argument("--layout", type=parse_layout, default="dp_shard=4", help="degrees of the first run")
    parser.add_argument("--resized-layout", type=parse_layout, default="dp_shard=2",
                        help="degrees of the resumed run (another data-parallel size)")
    parser.add_argument("--samples-per-shard", type=int, default=16, help="reference model: samples per shard")
    parser.add_argument("--bad-every", type=int, default=7)
    parser.add_argument("--checkpoint-every", type=int, default=None, help="steps (default: about steps/5)")
    parser.add_argument("--seed", type=int, default=0, help="draws the killed rank and step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = 96 if args.quick else args.steps
    every = args.checkpoint_every or max(steps // 5, 2)
    rng = random.Random(args.seed)
    # Two checkpoints before the kill: the newest is damaged, the one before resumes.
    kill_step = rng.randint(max(steps // 3, 2 * every + 1), max(2 * steps // 3, 2 * every + 1))
    kill_rank = rng.randrange(world(args.layout))
    name = "soak" if args.model == "reference" else "soak_hf"

    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = (reference_data(root, args.samples_per_shard, args.bad_every) if args.model == "reference"
                else hf_data(root, SHARDS * args.samples_per_shard, args.bad_every))
        ckpt = root / "ckpt"
        good = sum(1 for key in data.keys.values() if key not in data.bad)
        say(f"soak ({args.model}): {steps} steps on {world(args.layout)} ranks ({args.layout}), then "
            f"{world(args.resized_layout)} ({args.resized_layout}); {good} good + {len(data.keys) - good} skipped "
            f"samples in {len(data.shards)} shards; checkpoint every {every} steps; rank {kill_rank} SIGKILLed at "
            f"step {kill_step}")
        started = time.perf_counter()
        try:
            fit(root / "killed", data, ckpt, layout=args.layout, steps=steps, every=every,
                callbacks=[SigkillAt(kill_step, kill_rank)])
        except Exception as error:  # the launcher reports the killed worker
            if "SIGKILL" not in str(error):
                raise
            say(f"killed run: {error} ({time.perf_counter() - started:.0f} s)")
        else:
            raise RuntimeError(f"rank {kill_rank} was not killed at step {kill_step}")
        damaged, victim = damage_newest(ckpt)
        say(f"damaged the newest checkpoint (step {damaged}): {victim} cut in half")
        started = time.perf_counter()
        fit(root / "resumed", data, ckpt, layout=args.resized_layout, steps=steps, every=every, callbacks=[],
            ckpt_path="last")
        killed, resumed = load(root / "killed"), load(root / "resumed")
        resume_step = min(resumed[0]["sources"]) - 1
        if resume_step >= damaged:
            raise RuntimeError(f"the resumed run started after step {resume_step}, from the damaged checkpoint")
        say(f"resized: {data_parallel(args.layout)} -> {data_parallel(args.resized_layout)} ranks")
        say(f"resumed from step {resume_step}, the newest checkpoint that verifies (the damaged step-{damaged} one "
            f"skipped): {time.perf_counter() - started:.0f} s")
        saves = [s for run in ("killed", "resumed") if (root / run / "saves.json").exists()
                 for s in json.loads((root / run / "saves.json").read_text())]

    trained = trained_sources(killed, lambda s: s <= resume_step) + trained_sources(resumed, lambda s: True)
    accounting = sample_accounting(trained, data.keys, data.bad)
    growth = {f"rank{r} {segment}": rss_growth(run[r]["rss_mib"], every)
              for segment, run in (("killed", killed), ("resumed", resumed)) for r in range(len(run))}
    peak = {f"{segment} rank{r}": max(run[r]["rss_mib"].values())
            for segment, run in (("killed", killed), ("resumed", resumed)) for r in range(len(run))}
    step_s = [t for run in (killed, resumed) for t in run[0]["step_s"].values()]
    mean_step, mean_save = float(np.mean(step_s)), float(np.mean(saves)) if saves else 0.0
    say(f"samples: seen {accounting['seen']}, lost {accounting['lost']}, duplicated {accounting['duplicated']} over "
        f"{accounting['passes_complete']} complete passes over the data and a partial one, {good} good samples a pass")
    say("peak RSS MiB: " + ", ".join(f"{k} {v:.0f}" for k, v in peak.items()))
    say("RSS growth after warm-up: " + ", ".join(f"{k} {100 * v:+.1f}%" for k, v in growth.items()))
    say(f"checkpoint: {len(saves)} saves, mean {mean_save:.2f} s vs mean step {mean_step:.3f} s "
        f"({mean_save / mean_step:.1f} steps); every {every} steps that is "
        f"{100 * mean_save / (mean_save + every * mean_step):.1f}% of wall time")
    worst = max(growth.values())
    say(f"lost={accounting['lost']} duplicated={accounting['duplicated']} rss_growth={100 * worst:.1f}%")

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.txt").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps({
        "model": args.model, "steps": steps, "layout": args.layout, "resized_layout": args.resized_layout,
        "kill_step": kill_step, "kill_rank": kill_rank, "damaged_step": damaged, "resume_step": resume_step,
        "checkpoint_every": every, "accounting": accounting, "rss_growth": growth, "peak_rss_mib": peak,
        "rss_mib": {f"{segment} rank{r}": run[r]["rss_mib"] for segment, run in (("killed", killed),
                                                                                   ("resumed", resumed))
                    for r in range(len(run))},
        "checkpoint_seconds": saves, "mean_step_seconds": mean_step,
    }, indent=1))


if __name__ == "__main__":
    main()
