"""Encoder work split over the ranks that hold the same samples: a data-parallel rank's context- and
tensor-parallel peers.

Those peers read the same micro-batches. Rather than each encoding all of its items (the work repeated ``cp * tp``
times), they split them: every peer plans the same split (longest item first onto the least-loaded peer), encodes
its own items, and the outputs are all-gathered back into item order. In backward a peer takes its own items'
gradient, summed over its context-parallel peers (each holds the gradient of the placeholders in its own share of
the tokens) but not over its tensor-parallel ones (theirs is the same). The encoders' weight gradients are then
summed over the tensor-parallel peers (:func:`sum_over_tensor_parallel_peers`); FSDP already reduces them over the
data- and context-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from omni_lightning.parallel.coalesced import all_reduce_coalesced
from omni_lightning.parallel.compat import all_gather_single
from omni_lightning.parallel.local import local_tensor
from omni_lightning.parallel.transfer import to_device

__all__ = ["SamplePeers", "gather_peer_outputs", "sum_over_tensor_parallel_peers"]


@dataclass(frozen=True)
class SamplePeers:
    """This rank's context- and tensor-parallel peers (``group``: all of them), which hold the same samples, and
    ``replica``, their data-parallel index, which turns their items' peer labels
    (:func:`~omni_lightning.balance.pipeline_order.turned_peers`)."""

    group: dist.ProcessGroup
    cp_group: dist.ProcessGroup | None
    tp_group: dist.ProcessGroup | None
    replica: int = 0

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)


def gather_peer_outputs(own: torch.Tensor, owner: np.ndarray, outputs_per_item: list[int],
                        peers: SamplePeers) -> torch.Tensor:
    """Every item's outputs in item order, from ``own`` (this peer's items' outputs, in item order); differentiable
    (see the module docstring for the backward)."""
    return _GatherPeerOutputs.apply(own, owner, outputs_per_item, peers)


class _GatherPeerOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, own: torch.Tensor, owner: np.ndarray, outputs_per_item: list[int],
                peers: SamplePeers) -> torch.Tensor:
        size, rank = peers.size, peers.rank
        rows = [sum(n for n, o in zip(outputs_per_item, owner.tolist(), strict=True) if o == r) for r in range(size)]
        padded = own.new_zeros(max(rows), own.shape[1])
        padded[: own.shape[0]] = own
        gathered = own.new_empty(size * max(rows), own.shape[1])
        all_gather_single(gathered, padded, group=peers.group)
        pieces = gathered.view(size, max(rows), own.shape[1])
        taken, chunks = [0] * size, []
        for n, o in zip(outputs_per_item, owner.tolist(), strict=True):
            chunks.append(pieces[o, taken[o] : taken[o] + n])
            taken[o] += n
        starts = np.concatenate([[0], np.cumsum(outputs_per_item)]).astype(np.int64)
        mine = [np.arange(starts[i], starts[i + 1]) for i in np.flatnonzero(owner == rank)]
        ctx.mine = np.concatenate(mine) if mine else np.zeros(0, dtype=np.int64)
        ctx.peers, ctx.own_rows = peers, own.shape[0]
        return torch.cat(chunks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        peers: SamplePeers = ctx.peers
        if peers.cp_group is not None:  # each context-parallel peer holds its token share's part of the gradient
            grad = grad.contiguous()
            dist.all_reduce(grad, group=peers.cp_group)
        mine = grad[to_device(ctx.mine, grad.device)]
        return mine, None, None, None


def sum_over_tensor_parallel_peers(encoders: Iterable[nn.Module], peers: SamplePeers | None) -> None:
    """Sum the encoders' weight gradients over the tensor-parallel peers, each of which encoded its own items (call
    before the optimizer step)."""
    if peers is None or peers.tp_group is None:
        return
    all_reduce_coalesced([local_tensor(param.grad)
                          for encoder in encoders for param in encoder.parameters()
                          if param.requires_grad and param.grad is not None], peers.tp_group)
