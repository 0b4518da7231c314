"""Soak: a long 4-rank run of the tiny reference MLLM over shards holding bad samples, one rank SIGKILLed mid-run
and the job resumed from its last checkpoint; no sample may be lost or repeated, memory must not grow.

The data: ``--shards`` omni-mix shards in which every ``--bad-every``-th sample is broken (a member missing, an
undecodable image, metadata that contradicts the payload); OmniDataModule skips those (``on_bad_sample="skip"``).
Each rank reads two shards, and without a token budget the balancer trains every record of a group of
``group_steps`` steps within those steps, so an epoch of every rank is exactly ``records per rank /
samples_per_step`` steps and its steps must train every good sample of the shards exactly once.

Reported:

* samples seen, lost and duplicated, from the sample keys every rank trained at every step (the run that was
  killed up to its last checkpoint, then the resumed run) against the shards' good keys: ``lost`` counts good keys
  missing from a complete epoch, ``duplicated`` the extra occurrences of a key within an epoch (the last, partial
  epoch included) plus any bad key trained;
* RSS of every rank over time (``/proc/self/statm``, sampled after every step): per run segment (the killed run,
  the resumed one), warm-up lasts through the segment's first checkpoint save and at least its first quarter (the
  first save allocates the checkpoint's staging buffers once per process, and RSS is a high-water mark);
  ``rss_growth`` = (max RSS over the last 10% of the segment's steps - max RSS over the 10% of its steps right
  after warm-up) / the latter, the largest over ranks and segments;
* checkpoint overhead: mean seconds of a checkpoint save (every rank writes its shards) against the mean step, and
  the share of wall time the saves took at the interval used.

Results go to ``benchmarks/results/soak.txt`` and ``soak.json``.

    python benchmarks/soak.py [--quick] [--steps 500]

Its last line is ``lost=N duplicated=M rss_growth=P%``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import tempfile
import time
from collections import Counter
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
from omni_lightning.data.synthetic import make_synthetic_shards
from omni_lightning.module import initial_state_dict

RESULTS = Path(__file__).resolve().parent / "results"
RANKS = 4
SHARDS = 8  # two per rank
SAMPLES_PER_STEP = 2
GROUP_STEPS = 4
PAGE = os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------------------------------------- data
def break_sample(raw: dict[str, Any], how: int) -> dict[str, Any]:
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


def make_shards(folder: Path, samples_per_shard: int, bad_every: int) -> tuple[str, list[str], list[str]]:
    """Shards with every ``bad_every``-th sample broken: (pattern, good keys, bad keys)."""
    paths = make_synthetic_shards(folder, workload="omni_mix", num_shards=SHARDS, samples_per_shard=samples_per_shard,
                                  seed=0, length_scale=0.03, max_llm_tokens=160)
    good, bad, index = [], [], 0
    for path in paths:
        samples = []
        for raw in tarfile_samples([{"url": path}]):
            raw = {k: v for k, v in raw.items() if k != "__url__"}
            index += 1
            if index % bad_every == 0:
                raw = break_sample(raw, index // bad_every % 3)
                bad.append(raw["__key__"])
            else:
                good.append(raw["__key__"])
            samples.append(raw)
        buffer = io.BytesIO()
        with TarWriter(buffer, encoder=False, mtime=0) as writer:
            for raw in samples:
                writer.write(raw)
        Path(path).write_bytes(buffer.getvalue())
    return str(folder / f"train-{{000000..{SHARDS - 1:06d}}}.tar"), good, bad


# ----------------------------------------------------------------------------------------------------- recording
class Recorder(pl.Callback):
    """Every rank records, per step (1 = first), the keys it trained, its RSS, and (rank 0) step and save times."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.record: dict[str, dict[int, Any]] = {"keys": {}, "rss_mib": {}, "step_s": {}}
        self._started = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.record["keys"][trainer.global_step + 1] = list(batch["keys"])
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


def fit(out_dir: Path, shards: str, seed: Path, ckpt_dir: Path, *, steps: int, every: int,
        callbacks: list[pl.Callback], ckpt_path: str | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ["MASTER_PORT"] = str(free_port())
    trainer = pl.Trainer(
        accelerator="cpu", devices=RANKS, strategy=OmniStrategy(launcher="fork", timeout=300, dp_shard=RANKS),
        max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Recorder(out_dir), TimedCheckpoint(out_dir, dirpath=ckpt_dir, every_n_train_steps=every,
                                                      save_top_k=2, monitor="step", mode="max"), *callbacks],
    )
    module = OmniModule(ReferenceMLLMConfig.tiny(), learning_rate=1e-3, init_checkpoint=str(seed))
    data = OmniDataModule(shards, samples_per_step=SAMPLES_PER_STEP, group_steps=GROUP_STEPS,
                          reorder_group_size=None, on_bad_sample="skip")
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)


# -------------------------------------------------------------------------------------------------------- report
def load(run: Path) -> list[dict[str, dict[int, Any]]]:
    records = [json.loads((run / f"rank{r}.json").read_text()) for r in range(RANKS)]
    return [{name: {int(s): v for s, v in values.items()} for name, values in rec.items()} for rec in records]


def sample_accounting(keys_by_step: dict[int, list[str]], good: list[str], bad: list[str],
                      epoch_steps: int) -> dict[str, int]:
    """Samples seen, lost (missing from a complete epoch) and duplicated (extra within an epoch, or bad)."""
    steps = max(keys_by_step)
    assert sorted(keys_by_step) == list(range(1, steps + 1)), "steps missing from the records"
    lost = duplicated = 0
    for start in range(1, steps + 1, epoch_steps):
        seen = Counter(k for s in range(start, min(start + epoch_steps, steps + 1)) for k in keys_by_step[s])
        duplicated += sum(n - 1 for n in seen.values() if n > 1) + sum(seen[k] for k in bad)
        if start + epoch_steps - 1 <= steps:
            lost += sum(1 for k in good if k not in seen)
    return {"seen": sum(len(v) for v in keys_by_step.values()), "lost": lost, "duplicated": duplicated,
            "epochs_complete": steps // epoch_steps}


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
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--quick", action="store_true", help="96 steps (2-3 minutes on 2 busy cores)")
    parser.add_argument("--samples-per-shard", type=int, default=16)
    parser.add_argument("--bad-every", type=int, default=7)
    parser.add_argument("--checkpoint-every", type=int, default=None, help="steps (default: about steps/5)")
    parser.add_argument("--seed", type=int, default=0, help="draws the killed rank and step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = 96 if args.quick else args.steps
    every = args.checkpoint_every or max(steps // 5, 2)
    records_per_rank = SHARDS // RANKS * args.samples_per_shard
    if records_per_rank % (SAMPLES_PER_STEP * GROUP_STEPS):
        parser.error(f"--samples-per-shard: a rank's {records_per_rank} records must fill whole groups of "
                     f"{SAMPLES_PER_STEP * GROUP_STEPS}")
    epoch_steps = records_per_rank // SAMPLES_PER_STEP
    rng = random.Random(args.seed)
    kill_step, kill_rank = rng.randint(steps // 3, 2 * steps // 3), rng.randrange(RANKS)

    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shards, good, bad = make_shards(root / "shards", args.samples_per_shard, args.bad_every)
        seed = root / "seed.pt"
        torch.save(initial_state_dict(ReferenceMLLMConfig.tiny(), seed=1234), seed)
        ckpt = root / "ckpt"
        say(f"soak: {steps} steps on {RANKS} ranks, {len(good)} good + {len(bad)} bad samples in {SHARDS} shards, "
            f"epoch = {epoch_steps} steps; checkpoint every {every} steps; rank {kill_rank} SIGKILLed at step "
            f"{kill_step}")
        started = time.perf_counter()
        try:
            fit(root / "killed", shards, seed, ckpt, steps=steps, every=every,
                callbacks=[SigkillAt(kill_step, kill_rank)])
        except Exception as error:  # the launcher reports the killed worker
            if "SIGKILL" not in str(error):
                raise
            say(f"killed run: {error} ({time.perf_counter() - started:.0f} s)")
        else:
            raise RuntimeError(f"rank {kill_rank} was not killed at step {kill_step}")
        resume_step = max(int(p.name.split("step=")[1].split(".")[0]) for p in ckpt.glob("*.ckpt"))
        latest = next(ckpt.glob(f"*step={resume_step}.ckpt"))
        started = time.perf_counter()
        fit(root / "resumed", shards, seed, ckpt, steps=steps, every=every, callbacks=[], ckpt_path=str(latest))
        say(f"resumed from step {resume_step}: {time.perf_counter() - started:.0f} s")
        killed, resumed = load(root / "killed"), load(root / "resumed")
        saves = [s for run in ("killed", "resumed") if (root / run / "saves.json").exists()
                 for s in json.loads((root / run / "saves.json").read_text())]

    keys_by_step: dict[int, list[str]] = {}
    for rank in range(RANKS):
        kept = {s: k for s, k in killed[rank]["keys"].items() if s <= resume_step} | resumed[rank]["keys"]
        for step, keys in kept.items():
            keys_by_step.setdefault(step, []).extend(keys)
    accounting = sample_accounting(keys_by_step, good, bad, epoch_steps)
    growth = {f"rank{r} {name}": rss_growth(run[r]["rss_mib"], every) for r in range(RANKS)
              for name, run in (("killed", killed), ("resumed", resumed))}
    peak = {f"rank{r}": max(max(run[r]["rss_mib"].values()) for run in (killed, resumed)) for r in range(RANKS)}
    step_s = [t for run in (killed, resumed) for t in run[0]["step_s"].values()]
    mean_step, mean_save = float(np.mean(step_s)), float(np.mean(saves)) if saves else 0.0
    say(f"samples: seen {accounting['seen']}, lost {accounting['lost']}, duplicated {accounting['duplicated']} "
        f"over {accounting['epochs_complete']} complete epochs{' and a partial one' if steps % epoch_steps else ''}"
        f" of {len(good)} good samples")
    say("peak RSS MiB per rank: " + ", ".join(f"{r} {v:.0f}" for r, v in peak.items()))
    say("RSS growth after warm-up: " + ", ".join(f"{k} {100 * v:+.1f}%" for k, v in growth.items()))
    say(f"checkpoint: {len(saves)} saves, mean {mean_save:.2f} s vs mean step {mean_step:.3f} s "
        f"({mean_save / mean_step:.1f} steps); every {every} steps that is "
        f"{100 * mean_save / (mean_save + every * mean_step):.1f}% of wall time")
    worst = max(growth.values())
    say(f"lost={accounting['lost']} duplicated={accounting['duplicated']} rss_growth={100 * worst:.1f}%")

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "soak.txt").write_text("\n".join(lines) + "\n")
    (RESULTS / "soak.json").write_text(json.dumps({
        "steps": steps, "kill_step": kill_step, "kill_rank": kill_rank, "resume_step": resume_step,
        "checkpoint_every": every, "accounting": accounting, "rss_growth": growth, "peak_rss_mib": peak,
        "rss_mib": {f"rank{r}": {name: run[r]["rss_mib"] for name, run in (("killed", killed), ("resumed", resumed))}
                    for r in range(RANKS)},
        "checkpoint_seconds": saves, "mean_step_seconds": mean_step,
    }, indent=1))


if __name__ == "__main__":
    main()
