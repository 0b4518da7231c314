"""The global gradient norm of parameters sharded on different meshes, and clipping by it."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(parameters: list[torch.nn.Parameter], max_norm: float,
                    pp_group: dist.ProcessGroup | None = None,
                    not_in_norm: set[torch.nn.Parameter] | None = None, counted: bool = True) -> torch.Tensor:
    """Clip by the global gradient norm across parameters sharded on different meshes (plain tensors too).

    ``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails when DTensors live on different
    meshes (decoder on ``dp x tp``, encoders on ``dp``); reducing each norm to a plain scalar first avoids that.
    Under pipeline parallelism each rank holds only its stages' parameters: ``pp_group`` sums the squares over the
    stages; ``not_in_norm`` are copies another pipeline rank already counts (they are still scaled). With
    ``counted=False`` this rank's squares stay out of that sum (a peer in ``pp_group`` holds the same ones).
    """
    squares = []
    device = next((p.device for p in parameters), torch.device("cpu"))  # a rank without gradients still reduces
    for p in parameters:
        if p.grad is None or (not_in_norm and p in not_in_norm):
            continue
        norm = p.grad.norm()
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).double() ** 2)
    total_squares = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=device)
    if not counted:
        total_squares = torch.zeros_like(total_squares)
    if pp_group is not None:
        dist.all_reduce(total_squares, group=pp_group)
    total = total_squares.sqrt()
    scale = max_norm / (float(total) + 1e-6)
    if scale < 1.0 and math.isfinite(scale):
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(scale)
    return total
