"""Llama-style decoder over packed sequences: RMSNorm, RoPE (positions reset per sample), GQA, SwiGLU or MoE.

Projections are plain ``nn.Linear`` layers whose names (``attention.wq`` ... ``feed_forward.w2``) the tensor
parallel plan refers to. Attention reshapes by ``head_dim``, not by head count, so the same code runs with the
local heads of a tensor-parallel shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_lightning.models.attention import AttentionBackend, varlen_attention
from omni_lightning.models.config import LLMConfig
from omni_lightning.models.layers import RMSNorm
from omni_lightning.parallel.context_parallel import ContextShard, cp_attention

__all__ = ["Attention", "FeedForward", "MoEFeedForward", "DecoderBlock", "Decoder", "rotary_embedding"]


def rotary_embedding(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[tokens, head_dim // 2]`` for integer positions (computed on the fly: no buffers to shard)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * freqs[None, :]
    return angles.cos(), angles.sin()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LLMConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.backend = backend
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: torch.Tensor,
        cp_shard: ContextShard | None = None,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.wq(x).view(tokens, -1, self.head_dim)
        k = self.wk(x).view(tokens, -1, self.head_dim)
        v = self.wv(x).view(tokens, -1, self.head_dim)
        q, k = _apply_rotary(q, *rope), _apply_rotary(k, *rope)
        if cp_shard is not None:
            out = cp_attention(q, k, v, cp_shard)
        else:
            out = varlen_attention(q, k, v, cu_seqlens, causal=True, backend=self.backend)
        return self.wo(out.reshape(tokens, -1))


class FeedForward(nn.Module):
    """SwiGLU."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEFeedForward(nn.Module):
    """Top-k routed mixture of SwiGLU experts (router softmax, renormalised top-k weights)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(dim, hidden) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).float().softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).type_as(x)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            token, slot = (chosen == index).nonzero(as_tuple=True)
            # Every expert runs, even on zero tokens, so every rank produces a gradient for every expert weight
            # (FSDP reduce-scatters assume all ranks contribute the same tensors).
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out


class DecoderBlock(nn.Module):
    def __init__(self, config: LLMConfig, layer_index: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, backend)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward: nn.Module = (
            MoEFeedForward(config.dim, config.ffn_hidden, config.n_experts, config.moe_top_k)
            if config.is_moe_layer(layer_index)
            else FeedForward(config.dim, config.ffn_hidden)
        )

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: torch.Tensor,
        cp_shard: ContextShard | None = None,
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, cu_seqlens, cp_shard)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    """Token embedding, decoder blocks, final norm and LM head; the caller may overwrite embeddings (encoders)."""

    def __init__(self, config: LLMConfig, backend: AttentionBackend = "auto") -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderBlock(config, i, backend) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(
        self, embeddings: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
        cp_shard: ContextShard | None = None,
    ) -> torch.Tensor:
        """``embeddings [tokens, dim]``, ``positions [tokens]`` -> logits ``[tokens, vocab]``.

        With ``cp_shard`` (context parallelism) the tokens are this rank's share of the packed batch and attention
        sees the whole of it through the context-parallel group.
        """
        rope = rotary_embedding(positions, self.config.head_dim, self.config.rope_theta)
        x = embeddings
        for layer in self.layers:
            x = layer(x, rope, cu_seqlens, cp_shard)
        return self.output(self.norm(x))
