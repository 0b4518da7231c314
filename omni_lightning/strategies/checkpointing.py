"""Sharded checkpoints whose optimizer state is keyed by parameter name, so any rank can load it, written
atomically.

Lightning's ``ModelParallelStrategy`` saves the optimizer state in its nested form: ``param_groups`` is a list
per rank whose ``params`` entries are the rank's own parameter names. When ranks hold different parameters
(pipeline stages), torch.distributed.checkpoint keeps one copy of each list entry by its position, so a stage
restores another stage's group (without ``lr`` or ``betas``, or with names it does not own). The flattened form
keys every state and hyper-parameter by parameter name (``param_groups.<name>.lr``), which loads under any layout
whose parameters have the same names.

A checkpoint is written under a hidden sibling name (:func:`partial_path`) and renamed to its final name by
:func:`publish_checkpoint` only once every rank has finished writing, so a job killed while saving never leaves a
partial checkpoint under a name that ``ModelCheckpoint`` or a resuming user would pick: the previous checkpoint
stays the latest.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies.fsdp import _METADATA_FILENAME
from torch import nn
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

__all__ = ["load_sharded_checkpoint", "optimizer_state_by_name", "partial_path", "publish_checkpoint",
           "remove_path"]

_BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)


def optimizer_state_by_name(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """This rank's optimizer state, flattened and keyed by parameter name (see the module docstring)."""
    return get_optimizer_state_dict(model, optimizer, options=_BY_NAME)


def load_sharded_checkpoint(path: Path, model: nn.Module, optimizers: list[Optimizer], *, strict: bool,
                            weights_only: bool | None) -> dict[str, Any]:
    """Restore ``model`` and ``optimizers`` from a sharded checkpoint directory written with
    :func:`optimizer_state_by_name`; returns the rest of the checkpoint (loops, callbacks, ...)."""
    model_state = {"state_dict": get_model_state_dict(model)}
    dcp.load(model_state, checkpoint_id=path)
    model.load_state_dict(model_state["state_dict"], strict=strict)
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        state = {key: get_optimizer_state_dict(model, optimizer, options=_BY_NAME)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state[key], options=_BY_NAME)
    return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)


def partial_path(path: Path) -> Path:
    """Where the checkpoint ``path`` is written before it is complete: a hidden sibling (``.NAME.partial``).

    Same directory, so the final rename stays on one file system (atomic); a leading dot and another suffix, so
    ``ModelCheckpoint``, which lists and removes its own ``*.ckpt`` names, never sees it.
    """
    return path.with_name(f".{path.name}.partial")


def publish_checkpoint(partial: Path, path: Path) -> None:
    """Rename the complete checkpoint ``partial`` (a file or a directory) to ``path``, replacing any older one.

    A directory cannot replace a non-empty directory in one rename, so an older checkpoint of the same name is first
    moved aside to ``.NAME.old`` and deleted after: a kill between the two renames leaves it there, loadable.
    """
    if not (path.exists() or path.is_symlink()):
        os.replace(partial, path)
        return
    old = path.with_name(f".{path.name}.old")
    remove_path(old)
    os.replace(path, old)
    os.replace(partial, path)
    remove_path(old)


def remove_path(path: Path) -> None:
    """Delete a file, symlink or directory tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
