"""Checkpoints that prove they are whole: a manifest of every file with its size and checksum, written last.

A sharded checkpoint directory is complete when its manifest (:data:`MANIFEST_NAME`) exists and every file it lists
has the listed size and SHA-256. It is written after every rank's shards and ``meta.pt``, just before the directory
is published under its name, so a directory that lost or damaged a file after it was published (a failed disk, a
copy cut short, a cleanup gone wrong) is refused with the names of those files instead of failing somewhere inside
torch.distributed.checkpoint. A single-file checkpoint (``save_distributed_checkpoint=False``) is a zip archive
whose members carry CRC-32s; it is checked against those.

The pure parts live here (listing, hashing, comparing); :class:`~omni_lightning.strategies.omni.OmniStrategy` splits
the hashing over the ranks and agrees on the result.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["MANIFEST_NAME", "CheckpointNotSaved", "DamagedCheckpoint", "FileRecord", "LastVerified", "Manifest",
           "check_files", "checkpoint_step", "damaged_zip", "hash_files", "list_files", "read_manifest",
           "write_manifest"]

MANIFEST_NAME = "omni_manifest.json"
_FORMAT = "omni-lightning checkpoint manifest"
_CHUNK = 8 << 20


class DamagedCheckpoint(RuntimeError):
    """A checkpoint whose files are missing or differ from its manifest."""


class CheckpointNotSaved(RuntimeError):
    """A checkpoint could not be written; the ones published before it are intact."""


class LastVerified(str):
    """What ``fit(ckpt_path="last")`` becomes under OmniStrategy: the checkpoint with the highest step in this
    directory (the ``ModelCheckpoint``'s) that verifies, chosen when the checkpoint is loaded (every rank checks its
    share of the files)."""


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint as the manifest lists it."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest: its files (paths relative to the checkpoint directory) and the step it holds."""

    files: dict[str, FileRecord]
    global_step: int

    def to_json(self) -> str:
        return json.dumps({"format": _FORMAT, "version": 1, "global_step": self.global_step,
                           "files": {name: {"bytes": r.bytes, "sha256": r.sha256} for name, r in self.files.items()}},
                          indent=1, sort_keys=True)


def list_files(root: Path) -> list[str]:
    """Every regular file under the checkpoint directory ``root`` but the manifest, relative and sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def hash_files(root: Path, names: list[str]) -> dict[str, FileRecord]:
    """Size and SHA-256 of each of ``names`` under ``root``."""
    records = {}
    for name in names:
        digest = hashlib.sha256()
        with open(root / name, "rb") as file:
            while chunk := file.read(_CHUNK):
                digest.update(chunk)
        records[name] = FileRecord((root / name).stat().st_size, digest.hexdigest())
    return records


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Write the manifest durably (a temporary name, fsync, rename), after every file it lists."""
    tmp = root / f".{MANIFEST_NAME}.tmp"
    with open(tmp, "w") as file:
        file.write(manifest.to_json())
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, root / MANIFEST_NAME)
    directory = os.open(root, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read_manifest(root: Path) -> Manifest | None:
    """The manifest of the checkpoint directory ``root`` (``None`` if it has none); :class:`DamagedCheckpoint` if it
    cannot be read."""
    path = root / MANIFEST_NAME
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != _FORMAT:
            raise ValueError(f"format {data.get('format')!r}")
        files = {name: FileRecord(int(r["bytes"]), str(r["sha256"])) for name, r in data["files"].items()}
        return Manifest(files, int(data["global_step"]))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise DamagedCheckpoint(f"checkpoint {root}: its manifest {MANIFEST_NAME} is damaged ({error})") from None


def check_files(root: Path, expected: dict[str, FileRecord]) -> list[str]:
    """What is wrong with the files ``expected`` under ``root``: ``"NAME: missing"``, ``"NAME: N bytes, the
    manifest says M"`` or ``"NAME: checksum differs from the manifest"`` (sizes first: no hashing where they
    differ)."""
    problems, to_hash = [], []
    for name, record in sorted(expected.items()):
        path = root / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif (size := path.stat().st_size) != record.bytes:
            problems.append(f"{name}: {size} bytes, the manifest says {record.bytes}")
        else:
            to_hash.append(name)
    for name, found in hash_files(root, to_hash).items():
        if found.sha256 != expected[name].sha256:
            problems.append(f"{name}: checksum differs from the manifest")
    return problems


def damaged_zip(path: Path) -> list[str]:
    """What is wrong with the single-file checkpoint ``path`` (a zip archive, as ``torch.save`` writes): its
    unreadable or corrupt members."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as error:
        return [f"{path.name}: not a readable archive ({error})"]
    return [] if bad is None else [f"{path.name}: member {bad} is corrupt (CRC-32)"]


def checkpoint_step(path: Path) -> int | None:
    """The global step a checkpoint holds: from its manifest, else from ``step=N`` in its name (``None``: unknown)."""
    try:
        manifest = read_manifest(path) if path.is_dir() else None
    except DamagedCheckpoint:
        manifest = None
    if manifest is not None:
        return manifest.global_step
    found = re.search(r"step=(\d+)", path.name)
    return int(found[1]) if found else _step_in_metadata(path)


def _step_in_metadata(path: Path) -> int | None:
    """``global_step`` of a sharded checkpoint's ``meta.pt`` (a small file)."""
    meta = path / "meta.pt"
    if not meta.is_file():
        return None
    try:
        loaded: Any = torch.load(meta, map_location="cpu", weights_only=False)
    except Exception:  # damaged: the caller's verification names it
        return None
    return int(loaded["global_step"]) if isinstance(loaded, dict) and "global_step" in loaded else None
