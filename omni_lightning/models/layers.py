"""Building blocks shared by the encoders and the decoder."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from omni_lightning.balance.reshard import SplitChunk
from omni_lightning.parallel.attention import AttentionBackend, varlen_attention
from omni_lightning.parallel.sequence_parallel import long_short_attention

__all__ = ["RMSNorm", "GeluMLP", "EncoderBlock", "sincos_features"]


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (Llama)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, out_dim: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, out_dim or dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderBlock(nn.Module):
    """Pre-norm bidirectional transformer block over packed items (each item attends only to itself)."""

    def __init__(self, dim: int, n_heads: int, mlp_ratio: float, backend: AttentionBackend) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.backend = backend
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = GeluMLP(dim, int(dim * mlp_ratio))

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, chunks: Sequence[SplitChunk] = (),
        sp_groups: Mapping[int, dist.ProcessGroup] | None = None,
    ) -> torch.Tensor:
        """``x``: whole items packed (delimited by ``cu_seqlens``), then this rank's chunk of each split item."""
        total, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(total, 3, self.n_heads, dim // self.n_heads).unbind(1)
        if chunks:
            attn = long_short_attention(q, k, v, cu_seqlens, chunks, sp_groups, backend=self.backend)
        else:
            attn = varlen_attention(q, k, v, cu_seqlens, causal=False, backend=self.backend)
        x = x + self.proj(attn.reshape(total, dim))
        return x + self.mlp(self.norm2(x))


def sincos_features(positions: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Fixed sinusoidal features ``[n, dim]`` of integer positions ``[n]`` (no parameters, so any length works)."""
    half = dim // 2
    freqs = torch.exp(-math.log(base) * torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)
