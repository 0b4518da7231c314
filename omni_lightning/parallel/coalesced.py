"""Summing many small tensors over a group in a few collectives instead of one each.

A collective costs a launch and a synchronisation however little it carries (tens of microseconds with NCCL, about
a millisecond with Gloo), so reducing a model's gradients one parameter at a time costs hundreds of them a step.
:func:`all_reduce_coalesced` packs tensors of one device and dtype into flat buckets, reduces each bucket once and
copies the sums back in place.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["all_reduce_coalesced"]

# Big enough that a model's encoder gradients take a few buckets; small enough that the flat copy stays a small
# fraction of a GPU's memory.
BUCKET_BYTES = 256 * 2**20


def all_reduce_coalesced(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None,
                         bucket_bytes: int = BUCKET_BYTES) -> int:
    """Sum ``tensors`` over ``group`` in place, in buckets of up to ``bucket_bytes`` of one device and dtype (a
    tensor larger than that alone); returns the collectives issued. Every rank of ``group`` must pass tensors of the
    same shapes, dtypes and order."""
    buckets: list[list[torch.Tensor]] = []
    open_bucket: dict[tuple[torch.device, torch.dtype], int] = {}  # index in buckets, per device and dtype
    filled: dict[tuple[torch.device, torch.dtype], int] = {}
    for tensor in tensors:
        key, size = (tensor.device, tensor.dtype), tensor.numel() * tensor.element_size()
        if key not in open_bucket or filled[key] + size > bucket_bytes:
            open_bucket[key], filled[key] = len(buckets), 0
            buckets.append([])
        buckets[open_bucket[key]].append(tensor)
        filled[key] += size
    for bucket in buckets:
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, group=group)
        for tensor, summed in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
            tensor.copy_(summed.view_as(tensor))
    return len(buckets)
