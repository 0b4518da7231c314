"""Attention masks that keep packed items apart, in the additive form Hugging Face attention layers take."""

from __future__ import annotations

import torch

__all__ = ["packed_attention_mask"]


def packed_attention_mask(cu_seqlens: torch.Tensor, *, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """``[1, 1, T, T]`` additive mask: 0 where a query may attend to a key (same item; and not later, if causal),
    the dtype's minimum elsewhere.

    Additive rather than boolean because HF's eager attention adds the mask to the scores (SDPA takes either).
    Dense ``T x T`` memory: fine for the CPU tests and moderate packs; flash-attn varlen kernels avoid it on GPUs.
    """
    total = int(cu_seqlens[-1])
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    item = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    allowed = item[:, None] == item[None, :]
    if causal:
        allowed &= torch.ones(total, total, dtype=torch.bool, device=cu_seqlens.device).tril()
    mask = torch.zeros(total, total, dtype=dtype, device=cu_seqlens.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]
