"""Top-k mixture-of-experts feed-forward with stacked expert weights and a global load-balance loss.

Expert weights are stacked (``w1 [experts, hidden, dim]`` ...), so expert parallelism shards them along the
expert dimension as one DTensor and checkpoints keep the same names under every layout. Routing is capacity-free:
every token reaches its top-k experts. The auxiliary loss (Switch Transformer) is computed from the *global*
routing statistics of the step (one small all-reduce over each of ``stats_groups`` when data is split over ranks), so
it, and its gradient, do not depend on how tokens were spread over ranks. Under tensor parallelism each peer routes
its own share of the tokens (``token_split_group``, see :mod:`omni_lightning.parallel.expert_parallel`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from omni_lightning.parallel.expert_parallel import ExpertCompute, gather_rows, split_rows
from omni_lightning.parallel.local import local_tensor

__all__ = ["GroupedExperts", "MoEFeedForward", "combine_experts"]


class GroupedExperts(nn.Module):
    """SwiGLU experts with stacked weights.

    ``forward(rows, counts)`` takes token rows sorted by expert and the number of rows per expert. ``dispatcher``
    (set by expert parallelism) moves rows to the ranks that hold their experts and back; without it every expert
    is local. ``expert_parameter_names``: the stacked weights (experts along dimension 0) that expert parallelism
    shards.
    """

    expert_parameter_names = ("w1", "w3", "w2")

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.dispatcher: Callable[[torch.Tensor, torch.Tensor, ExpertCompute], torch.Tensor] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Each expert initialised like an nn.Linear of its shape (uniform in +-1/sqrt(fan_in)).
        for weight in (self.w1, self.w3, self.w2):
            bound = 1.0 / weight.shape[-1] ** 0.5
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.dispatcher is None:
            return self.compute(rows, counts)
        return self.dispatcher(rows, counts, self.compute)

    def compute(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Run the experts held here on ``rows`` sorted by (local) expert, ``counts`` rows each."""
        # Expert weights stay fp32 outside FSDP's mixed-precision policy: compute in the activations' dtype.
        w1, w3, w2 = (local_tensor(w).to(rows.dtype) for w in (self.w1, self.w3, self.w2))
        outputs = []
        # Every local expert runs, even on zero rows, so its weights always get a (possibly zero) gradient.
        for expert, part in enumerate(rows.split(counts.tolist())):
            outputs.append((F.silu(part @ w1[expert].t()) * (part @ w3[expert].t())) @ w2[expert].t())
        return torch.cat(outputs)


class MoEFeedForward(nn.Module):
    """Top-k routed mixture of SwiGLU experts (router softmax, renormalised top-k weights).

    After each forward, ``aux_loss`` holds this rank's share of the step's load-balance loss
    ``n_experts * sum_e f_e * p_e`` (``f_e``: fraction of assignments routed to expert ``e``, ``p_e``: mean router
    probability of ``e``, both over every token of the ranks in ``stats_groups``); the shares of the ranks sum to
    the global loss. With a ``token_split_group`` (the tensor-parallel peers, whose activations are equal) each peer
    routes and computes its share of the tokens and the outputs are all-gathered.
    """

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, dim, hidden)
        self.stats_groups: tuple[dist.ProcessGroup, ...] = ()
        self.token_split_group: dist.ProcessGroup | None = None
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, group = x.shape[0], self.token_split_group
        if group is not None:
            x = split_rows(x, group)
        probs = self.router(x).float().softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).type_as(x)
        self.aux_loss = self._load_balance_share(probs, chosen)
        out = combine_experts(x, chosen, weights, self.experts)
        return gather_rows(out, rows, group) if group is not None else out

    def _load_balance_share(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        n_experts = probs.shape[1]
        stats = torch.cat([
            torch.bincount(chosen.reshape(-1), minlength=n_experts).to(probs.dtype),
            probs.new_tensor([probs.shape[0]]),
        ])
        for group in self.stats_groups:
            dist.all_reduce(stats, group=group)
        tokens = stats[-1].clamp(min=1.0)
        routed_fraction = stats[:-1] / (tokens * self.top_k)
        return n_experts * (routed_fraction * probs.sum(0)).sum() / tokens


def combine_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, experts: nn.Module) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{chosen[t, k]}(x[t])`` for every token ``t``: rows sorted by expert (stably),
    run by ``experts(rows, counts)`` (wherever expert parallelism puts them), weighted and added back per token."""
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // chosen.shape[1]
    counts = torch.bincount(flat, minlength=experts.n_experts)
    rows = experts(x[token], counts) * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add(0, token, rows.to(x.dtype))
