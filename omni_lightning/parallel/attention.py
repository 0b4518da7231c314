"""One attention entry point for packed variable-length sequences.

Items (images, audio clips, text samples) are packed back to back into one token dimension and delimited by
``cu_seqlens`` (cumulative lengths, ``[0, l0, l0+l1, ...]``). On CUDA with flash-attn installed the packed tensors
go straight to ``flash_attn_varlen_func``; elsewhere PyTorch SDPA runs item by item (optionally causal), which
does the same work, ``sum(len_i ** 2)``, at the cost of one call per item.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["AttentionBackend", "cu_seqlens_from_lengths", "flash_attn_available", "varlen_attention"]

AttentionBackend = Literal["auto", "sdpa", "flash"]


def cu_seqlens_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``[l0, l1, ...]`` -> int32 ``[0, l0, l0+l1, ...]``."""
    return F.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)


def flash_attn_available() -> bool:
    """Whether the flash-attn varlen kernel can be used in this process."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    causal: bool,
    max_seqlen: int | None = None,
    backend: AttentionBackend = "auto",
) -> torch.Tensor:
    """Attention over packed items.

    Args:
        q: ``[total, n_heads, head_dim]``.
        k, v: ``[total, n_kv_heads, head_dim]``; ``n_heads`` must be a multiple of ``n_kv_heads`` (GQA).
        cu_seqlens: int32 ``[n_items + 1]`` cumulative item lengths.
        causal: mask future tokens inside each item.
        max_seqlen: longest item (flash-attn needs it; computed when omitted).
        backend: ``"flash"`` forces flash-attn, ``"sdpa"`` forces the per-item SDPA path, ``"auto"`` picks flash-attn
            when it is importable and the tensors are on CUDA.

    Returns:
        ``[total, n_heads, head_dim]``.
    """
    total, n_heads, _ = q.shape
    if n_heads % k.shape[1]:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of key/value heads ({k.shape[1]})")
    if total == 0:
        # Keep q, k and v in the graph so that a rank with nothing to attend still produces (zero) gradients for
        # every projection: FSDP reduce-scatters expect the same gradients on every rank.
        return q + 0.0 * (k.sum() + v.sum())
    use_flash = backend == "flash" or (backend == "auto" and q.is_cuda and flash_attn_available())
    if use_flash:
        from flash_attn import flash_attn_varlen_func

        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        return flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=causal)
    # Item by item: the work is sum(len_i ** 2), as with flash-attn, where a block-diagonal mask over the packed
    # sequence would cost (sum len_i) ** 2 and make the cost model's per-item attention term wrong.
    bounds = cu_seqlens.tolist()
    if bounds[-1] != total:
        raise ValueError(f"cu_seqlens covers {bounds[-1]} tokens but the packed tensor has {total}")
    outputs = [
        F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),
            k[start:end].transpose(0, 1),
            v[start:end].transpose(0, 1),
            is_causal=causal,
            enable_gqa=n_heads != k.shape[1],
        ).transpose(0, 1)
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        if end > start
    ]
    return torch.cat(outputs)
