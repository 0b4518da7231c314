"""Fault injection on a 4-rank run: one rank SIGKILLed at a random step; the resumed run, which must train on exactly
the samples and losses of an uninterrupted run, has a rank killed while it writes a checkpoint; a checkpoint taken on 4
data-parallel ranks mid-epoch resumes on 2, training what was left of the epoch exactly once."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import tarfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_runs import (
    BATCH_SIZE,
    RecordKeys,
    RecordRun,
    SigkillRankAtStep,
    fit,
    record_worker_errors,
    recorded_keys,
)
from torch.distributed.checkpoint import FileSystemWriter

from omni_lightning.data.synthetic import make_synthetic_shards
from omni_lightning.strategies.checkpointing import partial_path, publish_checkpoint

pytestmark = pytest.mark.distributed

RANKS = 4
LAYOUT = {"dp_shard": RANKS}
SAMPLES_PER_SHARD = 6  # one shard per rank: an epoch is 3 steps of BATCH_SIZE samples on every rank
EPOCH_STEPS = SAMPLES_PER_SHARD // BATCH_SIZE
STEPS = 8
EVERY = 2  # checkpoint interval
SAVE_KILL_STEP = 8  # the second run is killed while writing this step's checkpoint
RNG = random.Random(2026)
KILL_STEP, KILL_RANK, SAVE_KILL_RANK = RNG.randint(3, 5), RNG.randrange(RANKS), RNG.randrange(RANKS)


@contextmanager
def sigkill_while_writing(name: str, rank: int) -> Iterator[None]:
    """Rank ``rank`` is SIGKILLed inside torch.distributed.checkpoint's write of the checkpoint ``name`` (the other
    ranks write their shards and wait for it). Patched before the workers fork, so they inherit it."""
    write_data = FileSystemWriter.write_data

    def write_then_die(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == rank and name in str(self.path):
            os.kill(os.getpid(), signal.SIGKILL)
        return write_data(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FileSystemWriter, "write_data", write_then_die)
        yield


def checkpoints(folder: Path) -> dict[int, Path]:
    """The checkpoints ModelCheckpoint sees in ``folder``, by step."""
    return {int(re.search(r"step=(\d+)", p.name)[1]): p for p in folder.glob("*.ckpt")}


def shard_keys(pattern_dir: Path) -> list[str]:
    keys = []
    for path in sorted(pattern_dir.glob("train-*.tar")):
        with tarfile.open(path) as tar:
            keys.extend(dict.fromkeys(m.name.split(".", 1)[0] for m in tar.getmembers()))
    return keys


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    """Four small shards (one per rank) and the keys of all their samples."""
    out = tmp_path_factory.mktemp("fault_shards")
    make_synthetic_shards(out, workload="omni_mix", num_shards=RANKS, samples_per_shard=SAMPLES_PER_SHARD, seed=5,
                          length_scale=0.03, max_llm_tokens=160)
    return str(out / f"train-{{000000..{RANKS - 1:06d}}}.tar"), shard_keys(out)


def _killed_fit(expected_rank: int, **kwargs: Any) -> str:
    with pytest.raises(Exception, match=rf"process {expected_rank} terminated with signal SIGKILL") as error:
        fit(**kwargs)
    return str(error.value)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory, shards: tuple[str, list[str]],
          seed_checkpoint: Path) -> dict[str, Any]:
    """An uninterrupted run; run A, one rank SIGKILLed at a random step; run B, resumed from A's last checkpoint and
    killed while writing the step-8 checkpoint (after training step 8)."""
    pattern, _ = shards
    root = tmp_path_factory.mktemp("chain")
    runs = {name: root / name for name in ("uninterrupted", "a", "b")}
    ckpt = root / "ckpt"

    def common(run: Path) -> dict[str, Any]:
        return {"out_dir": run, "shards": pattern, "seed_checkpoint": seed_checkpoint, "layout": LAYOUT,
                "max_steps": STEPS}

    def saving() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=ckpt, every_n_train_steps=EVERY, save_top_k=-1)

    u = runs["uninterrupted"]
    fit(**common(u), callbacks=[RecordRun(u), RecordKeys(u)])

    a = runs["a"]
    a.mkdir()
    with record_worker_errors(a):
        error_a = _killed_fit(KILL_RANK, **common(a), callbacks=[
            saving(), RecordRun(a), RecordKeys(a), SigkillRankAtStep(KILL_STEP, KILL_RANK, a)])
    killed_at = float((a / "killed_at").read_text())
    stopped_after_s = time.time() - killed_at
    survivors = {r: json.loads((a / f"error_rank{r}.json").read_text()) for r in range(RANKS) if r != KILL_RANK}
    resume_a = max(checkpoints(ckpt))

    b = runs["b"]
    with sigkill_while_writing(f"step={SAVE_KILL_STEP}.", SAVE_KILL_RANK):
        _killed_fit(SAVE_KILL_RANK, **common(b), callbacks=[saving(), RecordRun(b), RecordKeys(b)],
                    ckpt_path=str(checkpoints(ckpt)[resume_a]))
    leftovers = sorted(p.name for p in ckpt.iterdir())
    return {**runs, "ckpt": ckpt, "pattern": pattern, "error_a": error_a, "stopped_after_s": stopped_after_s,
            "resume_a": resume_a, "leftovers": leftovers,
            "survivors": {r: (at - killed_at, kind, message) for r, (at, kind, message) in survivors.items()}}


def _losses(run: Path) -> dict[int, float]:
    return {int(step): loss for step, loss in json.loads((run / "losses.json").read_text()).items()}


def _stitched(chain: dict[str, Any], record: Any) -> dict[int, Any]:
    """Steps 1..resume_a from run A, then what run B trained after resuming there (through step 8)."""
    a, b = record(chain["a"]), record(chain["b"])
    return {**{s: x for s, x in a.items() if s <= chain["resume_a"]}, **b}


def test_survivors_fail_at_once_with_a_clear_error(chain: dict[str, Any]) -> None:
    """Each surviving rank fails by itself in its next collective with gloo's error naming a crashed peer, within
    seconds (the process-group timeout is 120 s); the launcher then raises naming the killed rank and the signal."""
    for rank, (after_s, kind, message) in chain["survivors"].items():
        # gloo names the lost peer: "Connection closed by peer" or "Read error ... Connection reset by peer".
        assert kind == "RuntimeError" and re.search(r"Connection (closed|reset) by peer", message), (rank, message)
        assert after_s < 10, (rank, after_s)
    assert f"process {KILL_RANK} terminated with signal SIGKILL" in chain["error_a"]
    assert chain["stopped_after_s"] < 15, chain["stopped_after_s"]
    assert chain["resume_a"] == KILL_STEP // EVERY * EVERY  # the last checkpoint before the kill


def test_kill_while_saving_leaves_no_partial_checkpoint_under_its_name(chain: dict[str, Any]) -> None:
    """The write was cut short under the hidden name; the checkpoint before it is the latest one (and loads:
    test_resume_on_fewer_data_parallel_ranks resumes from it)."""
    ckpt = chain["ckpt"]
    assert max(checkpoints(ckpt)) == SAVE_KILL_STEP - EVERY, chain["leftovers"]
    (partial,) = [p for p in ckpt.iterdir() if p.name.startswith(".")]
    assert partial == partial_path(ckpt / partial.name[1:].removesuffix(".partial"))
    assert f"step={SAVE_KILL_STEP}." in partial.name and not (partial / ".metadata").exists()


def test_resumed_runs_train_on_the_samples_and_losses_of_an_uninterrupted_run(chain: dict[str, Any]) -> None:
    assert sorted(_losses(chain["b"])) == list(range(chain["resume_a"] + 1, STEPS + 1))
    assert _stitched(chain, _losses) == _losses(chain["uninterrupted"])  # same layout and reduction order: exact
    reference = recorded_keys(chain["uninterrupted"], RANKS)
    for rank in range(RANKS):
        assert _stitched(chain, lambda run, r=rank: recorded_keys(run, RANKS)[r]) == reference[rank], f"rank {rank}"


def test_every_sample_once_per_epoch_across_the_resumed_runs(chain: dict[str, Any],
                                                              shards: tuple[str, list[str]]) -> None:
    _, all_keys = shards
    by_step: dict[int, list[str]] = {}
    for rank in range(RANKS):
        for step, keys in _stitched(chain, lambda run, r=rank: recorded_keys(run, RANKS)[r]).items():
            by_step.setdefault(step, []).extend(keys)
    assert sorted(by_step) == list(range(1, STEPS + 1))
    for epoch in range(STEPS // EPOCH_STEPS):
        seen = Counter(k for s in range(epoch * EPOCH_STEPS + 1, (epoch + 1) * EPOCH_STEPS + 1) for k in by_step[s])
        assert seen == Counter(all_keys), f"epoch {epoch}"


def test_resume_on_fewer_data_parallel_ranks(chain: dict[str, Any], seed_checkpoint: Path, tmp_path: Path) -> None:
    """Saved on 4 ranks (dp_shard=4) at step 4, a third into the second epoch, resumed on 2 (dp_shard=2): the 2 ranks
    deal the 4 shards anew and train what the 4 had left of that epoch, each sample once, then start the next."""
    checkpoint = checkpoints(chain["ckpt"])[4]
    left_samples = RANKS * SAMPLES_PER_SHARD - RANKS * BATCH_SIZE * (4 - EPOCH_STEPS)  # 16 of the epoch's 24
    steps = left_samples // (2 * BATCH_SIZE)  # 2 ranks of 2 samples a step, each with 2 shards of 4 left
    fit(tmp_path, chain["pattern"], seed_checkpoint, layout={"dp_shard": 2}, devices=2, max_steps=4 + steps + 1,
        callbacks=[RecordKeys(tmp_path)], ckpt_path=str(checkpoint))
    uninterrupted = recorded_keys(chain["uninterrupted"], RANKS)
    left = Counter(k for rank in uninterrupted for s in (5, 6) for k in rank[s])  # the epoch after step 4
    resumed = recorded_keys(tmp_path, 2)
    assert sorted(resumed[0]) == list(range(5, 5 + steps + 1))
    assert Counter(k for rank in resumed for s in range(5, 5 + steps) for k in rank[s]) == left
    assert not {k for rank in resumed for k in rank[5 + steps]} & set(left)  # the next epoch


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_publish_replaces_a_checkpoint_of_the_same_name(tmp_path: Path, kind: str) -> None:
    """ModelCheckpoint may save under a name that exists (``last.ckpt``, or after a resume): the new one replaces
    it whole, and nothing is left beside it."""
    final = tmp_path / "last.ckpt"
    for version, target in enumerate([final, partial_path(final)]):
        if kind == "directory":
            target.mkdir()
            (target / "meta.pt").write_text(str(version))
        else:
            target.write_text(str(version))
    publish_checkpoint(partial_path(final), final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert (final / "meta.pt" if kind == "directory" else final).read_text() == "1"
