"""The few ``torch.distributed`` calls whose API moved between the torch versions we support (2.11 and up; CI tests
2.13): each call site uses these instead of the newer spelling."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_single"]


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                      async_op: bool = False) -> dist.Work | None:
    """Every member's ``input``, concatenated along dim 0 into ``output`` (``all_gather_single`` from torch 2.13,
    ``all_gather_into_tensor`` before it); with ``async_op``, the work to wait for."""
    gather = getattr(dist, "all_gather_single", None)  # looked up per call: test harnesses wrap it
    if gather is not None:
        return gather(output, input, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)
