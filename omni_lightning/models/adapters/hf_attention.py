"""Packed variable-length attention inside Hugging Face layers, without a dense mask.

HF attention layers call the function their config names (``config._attn_implementation``) from transformers'
``AttentionInterface`` with the mask the caller handed the layer. The adapters register :func:`packed_attention`
under :data:`PACKED_ATTENTION`, switch their layers' configs to it and hand each layer a :class:`PackedItems` as its
"mask": the item bounds, which travel with the layer's arguments (so activation checkpointing's recompute gets them
too). Attention then runs :func:`~omni_lightning.parallel.attention.varlen_attention` over the items (flash-attn or
PyTorch varlen kernels in half precision on CUDA, SDPA item by item elsewhere): memory and work grow with
``sum(len_i ** 2)``, never with the square of the pack. The HF model the layers came from still runs on its own,
through SDPA with its usual masks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from omni_lightning.balance.reshard import SplitChunk
from omni_lightning.parallel.attention import varlen_attention
from omni_lightning.parallel.context_parallel import ContextShard, cp_attention
from omni_lightning.parallel.sequence_parallel import long_short_attention
from omni_lightning.parallel.transfer import to_device

__all__ = ["PACKED_ATTENTION", "TOWER_ATTENTION", "PackedItems", "SplitItems", "packed_attention",
           "tower_attention", "use_packed_attention", "use_tower_attention"]

PACKED_ATTENTION = "omni_packed"
# transformers' vision and audio towers (Qwen2-VL's, Qwen2.5-Omni's audio ...) call their attention once over every
# row with the items' ``cu_seqlens`` only for an implementation whose name says "flash"; any other gets one call per
# item, which cannot run an item split over ranks. So the towers' implementation is named for that path.
TOWER_ATTENTION = "omni_flash_varlen_tower"


@dataclass(frozen=True)
class PackedItems:
    """Where the packed items of a sequence start and end (int32 ``[0, l0, l0+l1, ...]``), for every layer; under
    context parallelism, this rank's share of the tokens (``cp_shard``): attention then sees the whole batch
    through the context-parallel group; in an encoder, the chunks of split items after the whole ones (``split``:
    attended with Ulysses sequence parallelism)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    cp_shard: ContextShard | None = None
    split: SplitItems | None = None

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, cp_shard: ContextShard | None = None,
           split: SplitItems | None = None) -> PackedItems:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        return cls(cu_seqlens.to(torch.int32), int(lengths.max()) if lengths.numel() else 0, cp_shard, split)


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [1, heads, T, d]``, ``key``/``value [1, kv_heads, T,
    d]`` -> ``[1, T, heads, d]``, attending within each item of ``attention_mask`` (a :class:`PackedItems`)."""
    if not isinstance(attention_mask, PackedItems):  # the HF model's own forward (its layers are shared): SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported by packed attention: set the model's "
                         "attention dropout to 0")
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError("packed attention supports neither logit soft-capping nor sliding windows")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    if attention_mask.split is not None:  # a tower's rows: whole items, then chunks of split ones (Ulysses)
        split = attention_mask.split
        return long_short_attention(q, k, v, attention_mask.cu_seqlens, split.chunks, split.sp_groups, scale=scaling,
                                    chunk_segments=split.segments)[None], None
    if attention_mask.cp_shard is not None:
        if not causal:
            raise ValueError("context parallelism shards causal decoders only")
        return cp_attention(q, k, v, attention_mask.cp_shard, scale=scaling)[None], None
    out = varlen_attention(q, k, v, attention_mask.cu_seqlens, causal=causal,
                           max_seqlen=attention_mask.max_seqlen, scale=scaling)
    return out[None], None


@dataclass(frozen=True)
class SplitItems:
    """The rows after a tower's whole items: this rank's chunk of each item split over an SP block
    (:func:`~omni_lightning.parallel.sequence_parallel.long_short_attention`), and optionally an integer key per such
    row restricting attention to rows of the same key (windows)."""

    chunks: Sequence[SplitChunk]
    sp_groups: Mapping[int, dist.ProcessGroup]
    segments: torch.Tensor | None = None


def tower_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                    split_items: SplitItems | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A tower's bidirectional attention over all its rows in one call: the whole items ``cu_seq_lens_q`` delimits
    packed (varlen kernels), then ``split_items``' chunks with Ulysses sequence parallelism. ``query``
    ``[1, heads, T, d]`` -> ``[1, T, heads, d]``."""
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported in the towers: set it to 0")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    if cu_seq_lens_q is None:  # one item (a caller without bounds)
        cu_seq_lens_q = to_device([0, q.shape[0]], q.device, torch.int32)
    split = split_items or SplitItems((), {})
    out = long_short_attention(q, k, v, cu_seq_lens_q, split.chunks, split.sp_groups, scale=scaling,
                               chunk_segments=split.segments)
    return out[None], None


def use_tower_attention(config: Any) -> None:
    """Point a tower's config at :func:`tower_attention`."""
    config._attn_implementation = TOWER_ATTENTION


def use_packed_attention(config: Any) -> None:
    """Point a layer config (and its sub-configs) at :func:`packed_attention`."""
    config._attn_implementation = PACKED_ATTENTION


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionInterface.register(TOWER_ATTENTION, tower_attention)
# The HF model keeps working on its own, with SDPA's masks (an adapter's layers are the model's layers).
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
