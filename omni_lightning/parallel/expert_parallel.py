"""Expert parallelism: MoE experts sharded over the EP group, tokens dispatched and combined with all-to-alls.

The EP group re-factors the FSDP ranks (``dp_shard * cp``, see :class:`ParallelDims`): its ``ep`` consecutive
ranks each hold ``n_experts / ep`` experts, as one DTensor sharded along the expert dimension (so checkpoints keep
their names and resume under any layout). In each MoE layer every rank sends each routed token row to the rank
holding its expert (one ``all_to_all_single`` of per-expert counts, then one differentiable ``all_to_all_single`` of
rows, uneven splits), runs its experts, and sends the results back the same way; a rank that routes nothing to some
expert still takes part in both exchanges, so none can hang.

Expert weights are replicated over the other FSDP ranks (the *expert replicas*: same position in another EP
group), so FSDP does not manage them: :func:`sync_expert_gradients` sums their gradients over the replicas and
divides by the data-parallel size, matching the average FSDP takes of every other gradient.

Tensor-parallel peers hold the same (replicated) activations, so a MoE layer would run every token through its
experts on each of them: instead each peer routes its own contiguous share of the rows (:func:`split_rows`, whose
backward sums the input gradient over the peers) and the outputs are all-gathered (:func:`gather_rows`, whose
backward keeps each peer's own share). The router and expert gradients are then partial sums over the peers, which
:func:`sync_token_split_gradients` adds up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from omni_lightning.parallel.coalesced import all_reduce_coalesced
from omni_lightning.parallel.local import local_tensor
from omni_lightning.parallel.transfer import to_device

__all__ = ["ExpertCompute", "ExpertDispatcher", "apply_ep", "expert_major_order", "gather_rows", "row_share",
           "split_rows", "sync_expert_gradients", "sync_token_split_gradients"]

# Runs the experts held here on rows sorted by (local) expert, given the rows per expert.
ExpertCompute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def expert_major_order(received_counts: np.ndarray) -> np.ndarray:
    """Row order that turns rows received source by source (each source's rows by expert) into expert-major order.

    ``received_counts[s, e]`` rows came from source ``s`` for local expert ``e``.
    """
    counts = np.asarray(received_counts, dtype=np.int64)
    starts = (np.cumsum(counts.reshape(-1)) - counts.reshape(-1)).reshape(counts.shape)
    pieces = [np.arange(starts[s, e], starts[s, e] + counts[s, e]) for e in range(counts.shape[1])
              for s in range(counts.shape[0])]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


class ExpertDispatcher:
    """Moves routed rows to their experts' EP rank and back (installed as ``GroupedExperts.dispatcher``)."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int, replica_group: dist.ProcessGroup | None,
                 gradient_divide: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.local_experts = n_experts // self.ep
        self.replica_group = replica_group
        self.gradient_divide = gradient_divide

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, compute: ExpertCompute) -> torch.Tensor:
        send_counts = counts.view(self.ep, self.local_experts).sum(1).tolist()
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts.contiguous(), group=self.group)  # `local_experts` each
        received_counts = received_counts.view(self.ep, self.local_experts)
        recv_counts = received_counts.sum(1).tolist()
        received = funcol.all_to_all_single_autograd(rows, recv_counts, send_counts, self.group)
        order = to_device(expert_major_order(received_counts.cpu().numpy()), rows.device)
        outputs = compute(received[order], received_counts.sum(0))
        restored = torch.empty_like(outputs).index_copy(0, order, outputs)
        return funcol.all_to_all_single_autograd(restored, send_counts, recv_counts, self.group)


def apply_ep(experts: Iterable[nn.Module], ep_mesh: DeviceMesh, replica_group: dist.ProcessGroup | None,
             gradient_divide: int) -> list[nn.Parameter]:
    """Shard every stacked-experts module of ``experts`` over ``ep_mesh`` (in place): its weights named in
    ``expert_parameter_names`` along the expert dimension, and its ``dispatcher`` set to move rows to their experts'
    rank. Returns their parameters, which FSDP must leave alone."""
    ep = ep_mesh.size()
    sharded: list[nn.Parameter] = []
    for module in experts:
        if module.n_experts % ep:
            raise ValueError(f"llm.n_experts={module.n_experts} is not divisible by ep={ep}; pick ep dividing it")
        for name in module.expert_parameter_names:
            param = nn.Parameter(distribute_tensor(getattr(module, name).data, ep_mesh, [Shard(0)]))
            module.register_parameter(name, param)
            sharded.append(param)
        module.dispatcher = ExpertDispatcher(ep_mesh.get_group(), module.n_experts, replica_group, gradient_divide)
    return sharded


def sync_expert_gradients(*roots: nn.Module) -> None:
    """Sum expert gradients over their replicas and divide by the data-parallel size (call before the optimizer
    step, after the last accumulated backward), for every expert under ``roots``: one bucketed all-reduce per replica
    group, not one per parameter."""
    by_group: dict[tuple[dist.ProcessGroup | None, float], list[torch.Tensor]] = {}
    for module in (m for root in roots for m in root.modules()):
        dispatcher = getattr(module, "dispatcher", None)
        if not isinstance(dispatcher, ExpertDispatcher):
            continue
        by_group.setdefault((dispatcher.replica_group, dispatcher.gradient_divide), []).extend(
            local_tensor(param.grad) for param in module.parameters() if param.grad is not None)
    for (group, divide), grads in by_group.items():
        if group is not None:
            all_reduce_coalesced(grads, group)
        torch._foreach_div_(grads, divide)


def row_share(rows: int, peers: int, peer: int) -> tuple[int, int]:
    """``[start, stop)`` of peer ``peer``'s contiguous share of ``rows`` rows split over ``peers`` (sizes differ by
    at most one, the first peers taking the extra rows)."""
    base, extra = divmod(rows, peers)
    start = peer * base + min(peer, extra)
    return start, start + base + (peer < extra)


class _SplitRows(torch.autograd.Function):
    """This peer's share of rows that every peer holds; the backward sums the shares' gradients over the peers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rows = group, x.shape[0]
        start, stop = row_share(x.shape[0], dist.get_world_size(group), dist.get_rank(group))
        ctx.start = start
        return x[start:stop]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        full = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        full[ctx.start: ctx.start + grad.shape[0]] = grad
        dist.all_reduce(full, group=ctx.group)
        return full, None


class _GatherRows(torch.autograd.Function):
    """Every peer's rows, in peer order; the backward keeps this peer's share (the peers' output gradients are
    equal, as their activations are)."""

    @staticmethod
    def forward(ctx: Any, share: torch.Tensor, rows: int, group: dist.ProcessGroup) -> torch.Tensor:
        peers, peer = dist.get_world_size(group), dist.get_rank(group)
        bounds = [row_share(rows, peers, p) for p in range(peers)]
        ctx.start, ctx.stop = bounds[peer]
        # Equal-sized pieces (shares differ by at most one row): padded, gathered in one collective, trimmed.
        width = bounds[0][1] - bounds[0][0]
        padded = share.new_zeros((width, *share.shape[1:]))
        padded[: share.shape[0]] = share
        gathered = share.new_empty((peers * width, *share.shape[1:]))
        dist.all_gather_into_tensor(gathered, padded, group=group)
        return torch.cat([gathered[p * width: p * width + stop - start] for p, (start, stop) in enumerate(bounds)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad[ctx.start: ctx.stop], None, None


def split_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This tensor-parallel peer's share of the rows of ``x`` (equal on every peer of ``group``)."""
    return _SplitRows.apply(x, group)


def gather_rows(share: torch.Tensor, rows: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The ``rows`` rows whose shares the peers of ``group`` computed (:func:`split_rows`' inverse)."""
    return _GatherRows.apply(share, rows, group)


def sync_token_split_gradients(*roots: nn.Module) -> None:
    """Sum the gradients of every module under ``roots`` that split its tokens over tensor-parallel peers (its
    ``token_split_group``) over those peers (call before the optimizer step, after the last accumulated backward):
    one bucketed all-reduce per group."""
    by_group: dict[dist.ProcessGroup, list[torch.Tensor]] = {}
    for module in (m for root in roots for m in root.modules()):
        group = getattr(module, "token_split_group", None)
        if group is None:
            continue
        by_group.setdefault(group, []).extend(local_tensor(param.grad) for param in module.parameters()
                                              if param.grad is not None)
    for group, grads in by_group.items():
        all_reduce_coalesced(grads, group)
