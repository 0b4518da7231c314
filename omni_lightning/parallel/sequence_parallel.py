"""Ulysses sequence parallelism for a long encoder item split over an SP group.

Each member holds a contiguous chunk of the item's tokens (chunks may differ in length, so an item whose length
does not divide the group needs no padding). Everything but attention is per token and runs on the chunk; for
attention one all-to-all trades the sequence split for a head split, every member attends over the whole item
with ``heads / sp`` heads, and a second all-to-all trades back. Both are differentiable: backward sends gradients
the reverse way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from omni_lightning.balance.reshard import SplitChunk, split_lengths
from omni_lightning.parallel.attention import AttentionBackend, cu_seqlens_from_lengths, varlen_attention
from omni_lightning.parallel.compat import all_gather_single

__all__ = ["SplitChunk", "long_short_attention", "split_lengths", "ulysses_attention"]


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    group: dist.ProcessGroup,
    *,
    causal: bool = False,
    scale: float | None = None,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over one item whose tokens are split over ``group`` by ``lengths`` (this rank holds its chunk).

    Args:
        q, k, v: ``[chunk, heads, head_dim]``; ``heads`` must be divisible by the group size.
        lengths: chunk length of every member, in group-rank order (they sum to the item's length).
        group: the SP group.
        causal: causal attention over the whole item (vision and audio encoders use ``False``).
        scale: of the scores (``None``: ``1 / sqrt(head_dim)``).
        segments: integer key of each token of the chunk: tokens attend only to tokens of the item with the same
            key (windowed attention, e.g. Qwen2.5-VL's windows or an audio tower's chunks); ``None``: the whole item.

    Returns:
        ``[chunk, heads, head_dim]``: this rank's chunk of the output, as if one rank had run the whole item.
    """
    size = dist.get_world_size(group)
    heads = q.shape[1]
    if heads % size:
        raise ValueError(f"{heads} attention heads cannot be split over an SP group of {size} ranks")
    if len(lengths) != size or lengths[dist.get_rank(group)] != q.shape[0]:
        raise ValueError(f"chunk lengths {lengths} do not match the SP group of {size} or this chunk ({q.shape[0]})")
    if q.shape[:2] == k.shape[:2] == v.shape[:2]:  # one all-to-all for q, k and v side by side, not three
        dims = (q.shape[-1], k.shape[-1], v.shape[-1])
        full = _sequence_to_heads(torch.cat([q, k, v], dim=-1), lengths, group).split(dims, dim=-1)
    else:
        full = tuple(_sequence_to_heads(t, lengths, group) for t in (q, k, v))
    if segments is None:
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in full), is_causal=causal, scale=scale)
        out = out.transpose(0, 1)
    else:
        out = _segmented_attention(*full, _gather_keys(segments, lengths, group), causal=causal, scale=scale)
    return _heads_to_sequence(out.contiguous(), lengths, group)


def _segmented_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, *, causal: bool,
                         scale: float | None) -> torch.Tensor:
    """Attention within each group of tokens sharing a key: the tokens sorted by key (stably, so each group keeps
    its order), packed attention over the groups, the outputs put back in place."""
    order = torch.argsort(keys, stable=True)
    _, counts = torch.unique_consecutive(keys[order], return_counts=True)
    out = varlen_attention(q[order], k[order], v[order], cu_seqlens_from_lengths(counts), causal=causal, scale=scale)
    return torch.empty_like(out).index_copy(0, order, out)


def _gather_keys(keys: torch.Tensor, lengths: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Every member's chunk of integer keys, concatenated in group order (no gradient)."""
    width = max(lengths)
    padded = keys.new_zeros(width)
    padded[: keys.numel()] = keys
    gathered = keys.new_empty(len(lengths) * width)
    all_gather_single(gathered, padded, group=group)
    return torch.cat([piece[:n] for piece, n in zip(gathered.view(len(lengths), width), lengths, strict=True)])


def long_short_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunks: Sequence[SplitChunk] = (),
    sp_groups: Mapping[int, dist.ProcessGroup] | None = None,
    *,
    backend: AttentionBackend = "auto",
    scale: float | None = None,
    chunk_segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bidirectional attention over a rank's encoder rows: whole items first, packed (``cu_seqlens`` covers them),
    then the rank's chunk of each split item in ``chunks`` order, each attended with Ulysses over its SP block.

    ``sp_groups[degree]`` is this rank's aligned block of ``degree`` ranks (the block a chunk of that degree
    belongs to: blocks are aligned, so a rank is in exactly one per degree). ``chunk_segments``: an integer key per
    chunk row (after the whole items' rows) restricting attention to tokens of the same key within the item
    (:func:`ulysses_attention`'s ``segments``).
    """
    whole = int(cu_seqlens[-1])
    outputs = [varlen_attention(q[:whole], k[:whole], v[:whole], cu_seqlens, causal=False, backend=backend,
                                scale=scale)]
    offset = whole
    for chunk in chunks:
        group = (sp_groups or {}).get(len(chunk.lengths))
        if group is None:
            raise ValueError(f"no SP group of {len(chunk.lengths)} ranks for a split item")
        rows = slice(offset, offset + chunk.lengths[dist.get_rank(group)])
        segments = chunk_segments[rows.start - whole : rows.stop - whole] if chunk_segments is not None else None
        outputs.append(ulysses_attention(q[rows], k[rows], v[rows], list(chunk.lengths), group, scale=scale,
                                         segments=segments))
        offset = rows.stop
    if offset != q.shape[0]:
        raise ValueError(f"{q.shape[0]} rows but whole items and chunks cover {offset}")
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def _sequence_to_heads(x: torch.Tensor, lengths: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """``[chunk, heads, d]`` -> ``[item, heads / sp, d]``: member j receives head group j of every chunk."""
    size = len(lengths)
    chunk, heads, dim = x.shape
    per_group = heads // size
    send = x.reshape(chunk, size, per_group, dim).permute(1, 0, 2, 3).reshape(-1)
    received = funcol.all_to_all_single_autograd(
        send, [n * per_group * dim for n in lengths], [chunk * per_group * dim] * size, group
    )
    return received.reshape(sum(lengths), per_group, dim)


def _heads_to_sequence(x: torch.Tensor, lengths: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """``[item, heads / sp, d]`` -> ``[chunk, heads, d]``: the inverse of :func:`_sequence_to_heads`."""
    size = len(lengths)
    _, per_group, dim = x.shape
    chunk = lengths[dist.get_rank(group)]
    received = funcol.all_to_all_single_autograd(
        x.reshape(-1), [chunk * per_group * dim] * size, [n * per_group * dim for n in lengths], group
    )
    return received.reshape(size, chunk, per_group, dim).permute(1, 0, 2, 3).reshape(chunk, size * per_group, dim)
