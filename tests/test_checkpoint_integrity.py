"""Checkpoints that prove they are whole: a manifest of every file with its size and SHA-256, written last; a damaged
checkpoint refused on every rank with the names of its files; ``ckpt_path="last"`` taking the newest checkpoint that
verifies; a save that fails midway (a full disk) stopping the job and leaving the previous checkpoint whole."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from lightning_runs import RecordRun, fit, record_worker_errors
from torch.distributed.checkpoint.filesystem import FileSystem

from omni_lightning.strategies import integrity
from omni_lightning.strategies.manifest import MANIFEST_NAME, hash_files, list_files, read_manifest

pytestmark = pytest.mark.distributed

RANKS = 2
LAYOUT = {"dp_shard": RANKS}
EVERY = 2
STEPS = 6


def _saving(folder: Path) -> pl.callbacks.ModelCheckpoint:
    return pl.callbacks.ModelCheckpoint(dirpath=folder, every_n_train_steps=EVERY, save_top_k=-1)


def _checkpoints(folder: Path) -> dict[int, Path]:
    return {int(re.search(r"step=(\d+)", p.name)[1]): p for p in folder.glob("*.ckpt")}


def _losses(run: Path) -> dict[int, float]:
    return {int(step): loss for step, loss in json.loads((run / "losses.json").read_text()).items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, tiny_shards: str, seed_checkpoint: Path) -> Path:
    """A 6-step run on 2 ranks with checkpoints at steps 2, 4 and 6 (its losses in ``losses.json``)."""
    run = tmp_path_factory.mktemp("saved")
    fit(run, tiny_shards, seed_checkpoint, layout=LAYOUT, devices=RANKS, max_steps=STEPS,
        callbacks=[_saving(run / "ckpt"), RecordRun(run)])
    return run


def _copy(saved: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt", folder)
    return folder


def _resume(run: Path, shards: str, seed: Path, ckpt_path: str, steps: int = STEPS + 1) -> None:
    fit(run, shards, seed, layout=LAYOUT, devices=RANKS, max_steps=steps, callbacks=[RecordRun(run)],
        ckpt_path=ckpt_path)


@contextmanager
def recorded_warnings(out: Path) -> Iterator[Path]:
    """The checkpoint checks' warnings, as rank 0 of the fork-started workers gives them, appended to a file (pytest
    keeps a forked worker's warnings to itself)."""
    path = out / "warnings.txt"

    def record(message: str, *args: Any, **kwargs: Any) -> None:
        if dist.get_rank() == 0:
            with path.open("a") as file:
                file.write(message + "\n")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(integrity, "rank_zero_warn", record)
        yield path


def _rank_errors(out: Path) -> list[tuple[str, str]]:
    return [tuple(json.loads((out / f"error_rank{r}.json").read_text())[1:]) for r in range(RANKS)]


def test_a_checkpoint_lists_its_files_with_sizes_and_checksums_written_last(saved: Path) -> None:
    for step, path in _checkpoints(saved / "ckpt").items():
        manifest = read_manifest(path)
        assert manifest is not None and manifest.global_step == step
        names = list_files(path)
        assert sorted(manifest.files) == names and {"meta.pt", ".metadata"} <= set(names)
        assert manifest.files == hash_files(path, names)
        written_last = (path / MANIFEST_NAME).stat().st_mtime_ns
        assert all((path / name).stat().st_mtime_ns <= written_last for name in names)


def _damage(checkpoint: Path) -> list[str]:
    """One shard file removed, another cut short, a byte of meta.pt flipped: what the error must name."""
    shards = sorted(p.name for p in checkpoint.glob("*.distcp"))
    (checkpoint / shards[0]).unlink()
    (checkpoint / shards[1]).write_bytes((checkpoint / shards[1]).read_bytes()[:100])
    meta = bytearray((checkpoint / "meta.pt").read_bytes())
    meta[len(meta) // 2] ^= 0xFF
    (checkpoint / "meta.pt").write_bytes(meta)
    return [f"{shards[0]}: missing", f"{shards[1]}: 100 bytes, the manifest says",
            "meta.pt: checksum differs from the manifest"]


def test_a_damaged_checkpoint_is_refused_on_every_rank_naming_its_files(saved: Path, tmp_path: Path,
                                                                        tiny_shards: str, seed_checkpoint: Path
                                                                        ) -> None:
    folder = _copy(saved, tmp_path)
    checkpoint = _checkpoints(folder)[4]
    expected = _damage(checkpoint)
    with record_worker_errors(tmp_path), pytest.raises(Exception, match="DamagedCheckpoint"):
        _resume(tmp_path / "run", tiny_shards, seed_checkpoint, str(checkpoint))
    for kind, message in _rank_errors(tmp_path):
        assert kind == "DamagedCheckpoint" and message.startswith(f"checkpoint {checkpoint} is damaged: ")
        for problem in expected:
            assert problem in message, (problem, message)


def test_last_resumes_from_the_newest_checkpoint_that_verifies(saved: Path, tmp_path: Path, tiny_shards: str,
                                                               seed_checkpoint: Path) -> None:
    folder = _copy(saved, tmp_path)
    (_checkpoints(folder)[6] / MANIFEST_NAME).write_text("{not json")  # the newest: its manifest damaged
    run = tmp_path / "run"
    with recorded_warnings(tmp_path) as warned:
        fit(run, tiny_shards, seed_checkpoint, layout=LAYOUT, devices=RANKS, max_steps=STEPS,
            callbacks=[_saving(folder), RecordRun(run)], ckpt_path="last")
    resumed, original = _losses(run), _losses(saved)
    assert sorted(resumed) == [5, 6]
    assert [resumed[s] for s in (5, 6)] == [original[s] for s in (5, 6)]  # step 4's checkpoint, exactly
    err = warned.read_text()
    assert re.search(r"ckpt_path='last': resuming from \S+step=4.ckpt, the newest checkpoint in \S+ that verifies; "
                     r"skipped the newer, damaged \S+step=6.ckpt \(checkpoint \S+: its manifest omni_manifest.json is "
                     r"damaged", err), err


def test_last_fails_clearly_when_no_checkpoint_verifies(saved: Path, tmp_path: Path, tiny_shards: str,
                                                         seed_checkpoint: Path) -> None:
    folder = _copy(saved, tmp_path)
    for checkpoint in _checkpoints(folder).values():
        (checkpoint / "meta.pt").unlink()
    with record_worker_errors(tmp_path), pytest.raises(Exception, match="no checkpoint in"):
        fit(tmp_path / "run", tiny_shards, seed_checkpoint, layout=LAYOUT, devices=RANKS, max_steps=STEPS,
            callbacks=[_saving(folder)], ckpt_path="last")
    for kind, message in _rank_errors(tmp_path):
        assert kind == "DamagedCheckpoint" and message.startswith(f"ckpt_path='last': no checkpoint in {folder} "
                                                                  "verifies: ")
        assert all(f"step={s}.ckpt (meta.pt: missing)" in message for s in (2, 4, 6)), message


def test_a_checkpoint_without_a_manifest_loads_with_a_warning(saved: Path, tmp_path: Path, tiny_shards: str,
                                                              seed_checkpoint: Path) -> None:
    folder = _copy(saved, tmp_path)
    checkpoint = _checkpoints(folder)[4]
    (checkpoint / MANIFEST_NAME).unlink()  # as every checkpoint written before manifests
    with recorded_warnings(tmp_path) as warned:
        _resume(tmp_path / "run", tiny_shards, seed_checkpoint, str(checkpoint), steps=5)
    assert sorted(_losses(tmp_path / "run")) == [5]
    assert f"checkpoint {checkpoint} has no manifest" in warned.read_text()


@contextmanager
def disk_full_while_writing(name: str, rank: int) -> Iterator[None]:
    """Rank ``rank``'s write of a shard file of the checkpoint ``name`` fails after 1000 bytes with ENOSPC, as on a
    full disk. Patched before the workers fork, so they inherit it."""
    create_stream = FileSystem.create_stream

    @contextmanager
    def full(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        with create_stream(self, path, mode) as stream:
            if dist.get_rank() != rank or name not in str(path) or not str(path).endswith(".distcp"):
                yield stream
                return
            write, room = stream.write, [1000]

            def write_until_full(data: Any) -> int:
                if len(memoryview(data).cast("B")) > room[0]:
                    write(bytes(memoryview(data).cast("B")[: room[0]]))
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                room[0] -= len(memoryview(data).cast("B"))
                return write(data)

            stream.write = write_until_full
            yield stream

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FileSystem, "create_stream", full)
        yield


def test_a_save_that_fails_midway_stops_the_job_and_keeps_the_previous_checkpoint(
        tmp_path: Path, tiny_shards: str, seed_checkpoint: Path) -> None:
    folder, run = tmp_path / "ckpt", tmp_path / "run"
    run.mkdir()
    with disk_full_while_writing("step=4", rank=1), record_worker_errors(run), \
            pytest.raises(Exception, match="CheckpointNotSaved"):
        fit(run, tiny_shards, seed_checkpoint, layout=LAYOUT, devices=RANKS, max_steps=STEPS,
            callbacks=[_saving(folder), RecordRun(run)])
    for kind, message in _rank_errors(run):
        assert kind == "CheckpointNotSaved", (kind, message)
        assert re.match(rf"checkpoint {folder}/\S+step=4.ckpt could not be saved \(.*No space left on device.*\); the "
                        r"checkpoints saved before it are intact", message, re.S), message
    assert sorted(_losses(run)) == [1, 2, 3, 4]  # the job stopped at the failed save
    assert sorted(_checkpoints(folder)) == [2]
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == [".epoch=0-step=4.ckpt.partial"]
    resumed = tmp_path / "resumed"
    fit(resumed, tiny_shards, seed_checkpoint, layout=LAYOUT, devices=RANKS, max_steps=3,
        callbacks=[_saving(folder), RecordRun(resumed)], ckpt_path="last")  # the step-2 checkpoint, whole
    assert sorted(_losses(resumed)) == [3]
