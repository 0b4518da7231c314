"""Sharded checkpoints whose optimizer state is keyed by parameter name, so any rank can load it.

Lightning's ``ModelParallelStrategy`` saves the optimizer state in its nested form: ``param_groups`` is a list
per rank whose ``params`` entries are the rank's own parameter names. When ranks hold different parameters
(pipeline stages), torch.distributed.checkpoint keeps one copy of each list entry by its position, so a stage
restores another stage's group (without ``lr`` or ``betas``, or with names it does not own). The flattened form
keys every state and hyper-parameter by parameter name (``param_groups.<name>.lr``), which loads under any layout
whose parameters have the same names.
"""

from __future__ import annotations

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

__all__ = ["load_sharded_checkpoint", "optimizer_state_by_name"]

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
