"""One attention entry point for packed variable-length sequences.

Items (images, audio clips, text samples) are packed back to back into one token dimension and delimited by
``cu_seqlens`` (cumulative lengths, ``[0, l0, l0+l1, ...]``). On CUDA with flash-attn installed the packed tensors
go straight to ``flash_attn_varlen_func``; elsewhere PyTorch SDPA runs with a block-diagonal (optionally causal)
boolean mask, which is exact but quadratic in the packed length, so it suits the small CPU tier.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["AttentionBackend", "flash_attn_available", "varlen_attention", "block_diagonal_mask"]

AttentionBackend = Literal["auto", "sdpa", "flash"]


def flash_attn_available() -> bool:
    """Whether the flash-attn varlen kernel can be used in this process."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def block_diagonal_mask(cu_seqlens: torch.Tensor, total: int, *, causal: bool) -> torch.Tensor:
    """Boolean ``[total, total]`` mask: a token sees only its own item's tokens (if causal, only earlier ones)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    item_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    if item_of_token.numel() != total:
        raise ValueError(f"cu_seqlens covers {item_of_token.numel()} tokens but the packed tensor has {total}")
    mask = item_of_token[:, None] == item_of_token[None, :]
    if causal:
        mask &= torch.ones(total, total, dtype=torch.bool, device=mask.device).tril()
    return mask


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
        backend: ``"flash"`` forces flash-attn, ``"sdpa"`` forces the masked SDPA path, ``"auto"`` picks flash-attn
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
    mask = block_diagonal_mask(cu_seqlens.to(q.device), total, causal=causal)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        enable_gqa=n_heads != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)
