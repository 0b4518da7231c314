"""Initial weights for ranks that each hold a different part of the model (pipeline stages, the encoder pool).

FSDP's ``broadcast_from_rank0`` loading needs every rank to hold the same parameter names as rank 0. A pipeline
rank holds its stages' parameters only, so rank 0 (which read the checkpoint) sends every tensor once to all ranks,
one at a time, and each keeps those of its part: a rank's memory peaks at its part plus one tensor in transit,
never a whole copy of the model.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
import torch.distributed as dist

__all__ = ["broadcast_parts"]


def broadcast_parts(state: Mapping[str, torch.Tensor], keep: Collection[str],
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Rank 0's ``state`` (other ranks pass ``{}``) broadcast tensor by tensor on ``device`` (the compute device:
    the default group is NCCL on a GPU job); returns the tensors named in ``keep``, on ``device``."""
    rank = dist.get_rank()
    listing = [[(name, tuple(t.shape), t.dtype) for name, t in state.items()] if rank == 0 else None]
    dist.broadcast_object_list(listing, src=0, device=device)
    kept = {}
    for name, shape, dtype in listing[0]:
        tensor = state[name].to(device) if rank == 0 else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=0)
        if name in keep:
            kept[name] = tensor
    return kept
