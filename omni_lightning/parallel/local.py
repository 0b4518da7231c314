"""This rank's part of a tensor that may be a ``DTensor``."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_tensor"]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s local shard or replica where it is a ``DTensor`` (sharing its storage), else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
