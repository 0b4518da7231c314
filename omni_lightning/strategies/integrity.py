"""The collective half of checkpoint manifests (:mod:`.manifest`): every rank hashes its share of the files, and all
of them agree on what the manifest says, whether a checkpoint verifies, and which one ``ckpt_path="last"`` means.

Rank 0 lists the files and reads manifests and broadcasts them, so that ranks on other nodes of a shared file system
cannot decide from different views of it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from omni_lightning.strategies.manifest import (
    DamagedCheckpoint,
    Manifest,
    check_files,
    checkpoint_step,
    damaged_zip,
    hash_files,
    list_files,
    read_manifest,
    write_manifest,
)

__all__ = ["newest_verified", "refuse_if_damaged", "verify", "write_manifest_together"]

log = logging.getLogger(__name__)


def _gathered(strategy: Any, mine: Any) -> list[Any]:
    everyone: list[Any] = [None] * strategy.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def write_manifest_together(strategy: Any, root: Path, global_step: int) -> None:
    """Hash every file of the checkpoint directory ``root`` (each rank a share) and write its manifest on rank 0.
    Call once every rank's files are complete."""
    names = strategy.broadcast(list_files(root) if strategy.global_rank == 0 else None)
    share = names[strategy.global_rank :: strategy.world_size]
    records = {name: record for part in _gathered(strategy, hash_files(root, share)) for name, record in part.items()}
    if strategy.global_rank == 0:
        write_manifest(root, Manifest(records, global_step))


def verify(strategy: Any, path: Path) -> list[str] | None:
    """What is wrong with the checkpoint ``path`` (empty: it verifies), agreed by every rank; ``None`` if it cannot be
    verified (a directory written before manifests)."""
    if not path.is_dir():
        return strategy.broadcast(damaged_zip(path) if strategy.global_rank == 0 else None)
    read: Manifest | str | None = None
    if strategy.global_rank == 0:
        try:
            read = read_manifest(path)
        except DamagedCheckpoint as error:
            read = str(error)
    read = strategy.broadcast(read)
    if isinstance(read, str):
        return [read]
    if read is None:
        return None
    names = sorted(read.files)
    share = {name: read.files[name] for name in names[strategy.global_rank :: strategy.world_size]}
    return sorted(problem for part in _gathered(strategy, check_files(path, share)) for problem in part)


def refuse_if_damaged(strategy: Any, path: Path) -> None:
    """Raise :class:`DamagedCheckpoint` on every rank if ``path`` does not verify; warn if it cannot be verified."""
    problems = verify(strategy, path)
    if problems is None:
        rank_zero_warn(f"checkpoint {path} has no manifest (it was written before checkpoints carried one): it is "
                       "loaded unverified")
    elif problems:
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: {'; '.join(problems)}. Resume from another checkpoint "
                                "(fit(ckpt_path='last') takes the newest one that verifies)")


def newest_verified(strategy: Any, folder: Path) -> Path:
    """The checkpoint with the highest step in ``folder`` that verifies (or, among those written before manifests,
    loads unverified), saying which newer ones it skipped; :class:`DamagedCheckpoint` if none does."""
    candidates: list[Path] = strategy.broadcast(_by_step(folder) if strategy.global_rank == 0 else None)
    skipped: list[str] = []
    for candidate in candidates:
        problems = verify(strategy, candidate)
        if problems:
            skipped.append(f"{candidate.name} ({'; '.join(problems)})")
            continue
        if skipped:
            rank_zero_warn(f"ckpt_path='last': resuming from {candidate}, the newest checkpoint in {folder} that "
                           f"verifies; skipped the newer, damaged {', '.join(skipped)}")
        if problems is None:
            rank_zero_warn(f"checkpoint {candidate} has no manifest (it was written before checkpoints carried one): "
                           "it is loaded unverified")
        return candidate
    raise DamagedCheckpoint(f"ckpt_path='last': no checkpoint in {folder} verifies: {', '.join(skipped)}. Resume "
                            "from an explicit checkpoint path, or start without one")


def _by_step(folder: Path) -> list[Path]:
    """The checkpoints ``ModelCheckpoint`` wrote in ``folder``, highest step first (the newest first among equals)."""
    found = [p for p in folder.glob(f"*{ModelCheckpoint.FILE_EXTENSION}") if not p.name.startswith(".")]
    return sorted(found, key=lambda p: (checkpoint_step(p) or -1, p.stat().st_mtime), reverse=True)
