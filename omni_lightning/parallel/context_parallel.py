"""Context parallelism for the decoder: head-tail sharded packed sequences and all-gather-KV causal attention.

The ``cp`` peers of a data-parallel rank hold the same packed micro-batch. Each keeps only its share of the
tokens: every sample is cut into ``2 * cp`` near-equal chunks and rank ``r`` keeps chunks ``r`` and
``2 * cp - 1 - r`` (head-tail), so each rank gets early tokens (cheap under a causal mask) and late ones
(expensive), and causal attention work is even across the group without padding any sample. Everything but
attention is per token. Attention gathers every peer's keys and values (one differentiable uneven all-gather per
layer, built on ``all_to_all_single``), restores global token order and attends each local query to the keys of
its own sample up to its position. Every rank sends and receives in every layer, forward and backward, whatever its
mask, so no rank can leave a peer waiting. Plain torch ops only, so it runs on CPU/gloo (torch's built-in
``context_parallel`` needs CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from omni_lightning.balance.reshard import split_lengths
from omni_lightning.parallel.attention import host_bounds
from omni_lightning.parallel.transfer import to_device

__all__ = ["ContextShard", "cp_attention", "head_tail_indices", "shard_for_context_parallel"]


def head_tail_indices(lengths: list[int], cp: int) -> list[list[int]]:
    """Global token indices each of ``cp`` ranks keeps of a packed batch of samples of ``lengths`` (pure).

    Within each sample, rank ``r`` keeps chunk ``r`` and chunk ``2 * cp - 1 - r`` of ``2 * cp`` near-equal chunks;
    a rank's tokens are ordered by sample, then head before tail.
    """
    if cp < 1:
        raise ValueError(f"cp={cp} must be at least 1")
    kept: list[list[int]] = [[] for _ in range(cp)]
    start = 0
    for length in lengths:
        chunks = split_lengths(length, 2 * cp)
        bounds = [start + sum(chunks[:i]) for i in range(2 * cp + 1)]
        for rank in range(cp):
            for chunk in (rank, 2 * cp - 1 - rank):
                kept[rank].extend(range(bounds[chunk], bounds[chunk + 1]))
        start += length
    return kept


@dataclass
class ContextShard:
    """This rank's share of one packed micro-batch and what attention needs to see the whole of it.

    ``local_index``: global indices of the tokens kept here (grouped by sample). ``counts``: tokens kept by each
    peer. ``global_order``: where each token of the peers' concatenated shares sits in the packed batch.
    ``cu_seqlens``: the packed batch's sample boundaries; ``local_cu_seqlens``: the same for the local tokens.
    """

    group: dist.ProcessGroup
    local_index: torch.Tensor
    counts: list[int]
    global_order: torch.Tensor
    cu_seqlens: list[int]
    local_cu_seqlens: list[int]


def shard_for_context_parallel(cu_seqlens: torch.Tensor, group: dist.ProcessGroup) -> ContextShard:
    """The head-tail shard of this rank (identical bookkeeping on every peer: it depends on ``cu_seqlens`` only)."""
    bounds = list(host_bounds(cu_seqlens))
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    kept = head_tail_indices(lengths, cp)
    device = cu_seqlens.device
    order = to_device([i for share in kept for i in share], device, torch.long)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    local_cu = [0]
    for length in lengths:
        chunks = split_lengths(length, 2 * cp)
        local_cu.append(local_cu[-1] + chunks[rank] + chunks[2 * cp - 1 - rank])
    return ContextShard(group, to_device(kept[rank], device, torch.long),
                        [len(share) for share in kept], inverse, bounds, local_cu)


def _gather_sequence(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """Every peer's ``x`` in global token order; backward sums each peer's gradient back to its owner."""
    cp = len(shard.counts)
    everyone = funcol.all_to_all_single_autograd(
        torch.cat([x] * cp), shard.counts, [x.shape[0]] * cp, shard.group
    )
    return everyone[shard.global_order]


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ContextShard,
                 scale: float | None = None) -> torch.Tensor:
    """Causal attention of local queries ``[local, heads, d]`` over the whole packed batch's keys and values.

    ``k``/``v`` are local ``[local, kv_heads, d]`` (grouped-query attention: ``heads`` a multiple of ``kv_heads``).
    Sample by sample: a local query attends to the keys of its own sample at or before its position. ``scale``:
    of the scores (``None``: ``1 / sqrt(d)``).
    """
    keys, values = _gather_sequence(k, shard), _gather_sequence(v, shard)
    groups = q.shape[1] // k.shape[1]
    local_positions = shard.local_index.new_tensor(shard.cu_seqlens)  # sample starts, to make positions relative
    outputs = []
    # Split once rather than slice per sample: each slice's backward writes a gradient the size of the whole tensor.
    local_lengths = [hi - lo for lo, hi in zip(shard.local_cu_seqlens[:-1], shard.local_cu_seqlens[1:], strict=True)]
    lengths = [end - start for start, end in zip(shard.cu_seqlens[:-1], shard.cu_seqlens[1:], strict=True)]
    pieces = zip(q.split(local_lengths), keys.split(lengths), values.split(lengths),
                 shard.local_index.split(local_lengths), strict=True)
    for sample, (queries, sample_keys, sample_values, local_index) in enumerate(pieces):
        if not queries.shape[0]:
            continue
        query_positions = local_index - local_positions[sample]
        key_positions = torch.arange(sample_keys.shape[0], device=q.device)
        mask = key_positions[None, :] <= query_positions[:, None]
        out = F.scaled_dot_product_attention(
            queries.transpose(0, 1), sample_keys.repeat_interleave(groups, dim=1).transpose(0, 1),
            sample_values.repeat_interleave(groups, dim=1).transpose(0, 1), attn_mask=mask, scale=scale)
        outputs.append(out.transpose(0, 1))
    if not outputs:  # no local tokens: keep the gathered keys and values in the graph for the backward exchange
        return q + 0.0 * (keys.sum() + values.sum())
    return torch.cat(outputs)
