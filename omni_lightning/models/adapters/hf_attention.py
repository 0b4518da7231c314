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

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from omni_lightning.parallel.attention import varlen_attention

__all__ = ["PACKED_ATTENTION", "PackedItems", "packed_attention", "use_packed_attention"]

PACKED_ATTENTION = "omni_packed"


@dataclass(frozen=True)
class PackedItems:
    """Where the packed items of a sequence start and end (int32 ``[0, l0, l0+l1, ...]``), for every layer."""

    cu_seqlens: torch.Tensor
    max_seqlen: int

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor) -> PackedItems:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        return cls(cu_seqlens.to(torch.int32), int(lengths.max()) if lengths.numel() else 0)


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
    out = varlen_attention(q, k, v, attention_mask.cu_seqlens, causal=causal,
                           max_seqlen=attention_mask.max_seqlen, scale=scaling)
    return out[None], None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
# The HF model keeps working on its own, with SDPA's masks (an adapter's layers are the model's layers).
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)


def use_packed_attention(config: Any) -> None:
    """Point a layer config (and its sub-configs) at :func:`packed_attention`."""
    config._attn_implementation = PACKED_ATTENTION
