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

import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies.fsdp import _METADATA_FILENAME
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from omni_lightning.data.position import DataPosition, merge_positions
from omni_lightning.parallel.dims import ParallelDims

__all__ = ["LOADER_STATE_PATH", "dims_record", "get_path", "load_sharded_checkpoint", "loader_state_for_rank",
           "optimizer_state_by_name", "partial_path", "publish_checkpoint", "remove_path"]

log = logging.getLogger(__name__)

# Where Lightning keeps the train loader state inside a checkpoint (written from rank 0 only).
LOADER_STATE_PATH = ("loops", "fit_loop", "state_dict", "combined_loader")

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


def loader_state_for_rank(saved: dict[str, Any], dp_rank: int, dp_size: int, *, encoder_pool: bool = False,
                          pp: int | None = None) -> Any:
    """The loader state a resuming data-parallel rank continues from, or ``None`` to restart its stream.

    With the same data-parallel size and pipeline degree (``pp``; ``None``: not checked), ranks are matched by
    data-parallel rank (TP/CP peers share a stream), so the layout resumes exactly: the same samples in the same
    order as an uninterrupted run. A stream's state counts the micro-batches it handed out, which a pipeline cuts
    its steps into: when the pipeline degree changes, the resume goes by the positions below instead.

    With another data-parallel size (another world size, or the same one with other degrees) every rank gets the
    merged rank-independent position of all the saved ranks (:mod:`omni_lightning.data.position`): each reads its new
    share of the shards from it, skipping what was trained, so the rest of the epoch trains every sample the
    interrupted run had not trained exactly once. A checkpoint whose loader states hold no such position (written
    before they did, or from a custom ``train_samples()``) resumes the old way, with a warning: every rank restarts its
    stream from the beginning of the data; model, optimizer and step count are still restored.
    """
    saved_dp = saved["parallel_dims"]["dp"]
    if saved_dp != dp_size or (pp is not None and saved["parallel_dims"].get("pp", 1) != pp):
        return _resized_loader_state(saved, saved_dp, dp_size)
    # An LLM rank resumes from an LLM rank's stream; an encoder-pool rank, which reads a copy of a stream to keep the
    # pools' epochs in step, from that stream (a checkpoint of the other placement holds no encoder-pool ranks).
    saved_ranks = [rank for rank in saved["ranks"] if rank["dp_rank"] == dp_rank]
    state = next((rank for rank in saved_ranks if rank.get("encoder_pool", False) == encoder_pool),
                 saved_ranks[0] if saved_ranks else None)
    if state is None:
        raise ValueError(f"the checkpoint holds no loader state for data-parallel rank {dp_rank} of {dp_size}")
    return state["loader"]


def _resized_loader_state(saved: dict[str, Any], saved_dp: int, dp_size: int) -> Any:
    """Every train loader's merged position (one per loader of Lightning's combined loader), or ``None`` (warned)."""
    states = [rank["loader"] for rank in saved["ranks"]]
    positions = [[loader.get("position") if isinstance(loader, dict) else None for loader in state or [None]]
                 for state in states]
    why = None
    if any(p is None for ranks in positions for p in ranks) or len({len(ranks) for ranks in positions}) != 1:
        why = "its loader states hold no shard positions (written before they did, or resumed from such a one)"
    else:
        try:
            merged = [merge_positions(DataPosition.from_state(ranks[i]) for ranks in positions)
                      for i in range(len(positions[0]))]
        except ValueError as error:
            why = str(error)
        else:
            if not all(m.tracked for m in merged):
                why = "its samples came from a custom train_samples() that records no shard positions"
    if why is not None:
        rank_zero_warn(
            f"the checkpoint was written with {saved_dp} data-parallel ranks and this run has {dp_size}, and {why}: "
            "it resumes the old way, every data-parallel rank restarting its shard stream from the beginning (model, "
            "optimizer and step count are restored)"
        )
        return None
    what = (f"resized: {saved_dp} -> {dp_size} data-parallel ranks" if saved_dp != dp_size
            else "the pipeline degree changed, and with it how steps are cut into micro-batches")
    log.info("%s; each rank resumes its share of the shards from the positions the %d saved ranks recorded", what,
             saved_dp)
    return [{"resume_from": m.to_state()} for m in merged]


def dims_record(dims: ParallelDims) -> dict[str, int]:
    record = {k: v for k, v in asdict(dims).items() if not k.startswith("_")}
    record["dp_shard"] = dims.dp_shard_size
    record["dp"] = dims.dp
    return record


def get_path(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree
