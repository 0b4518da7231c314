"""Llama-style decoder over packed sequences: RMSNorm, RoPE (positions reset per sample), GQA, SwiGLU or MoE.

Projections are plain ``nn.Linear`` layers whose names (``attention.wq`` ... ``feed_forward.w2``) the tensor
parallel plan (:meth:`Decoder.layer_tp_plan`) refers to. Attention reshapes by ``head_dim``, not by head count, so the
same code runs with the local heads of a tensor-parallel shard.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.models.config import LLMConfig
from omni_lightning.models.flops import decoder_cost
from omni_lightning.models.layers import RMSNorm
from omni_lightning.models.moe import MoEFeedForward
from omni_lightning.parallel.attention import AttentionBackend, varlen_attention
from omni_lightning.parallel.context_parallel import ContextShard, cp_attention
from omni_lightning.parallel.tensor_parallel import ColwiseLinear, RowwiseLinear

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
        # Keyed by layer number, so that a pipeline stage holding some of them keeps their checkpoint names.
        self.layers = nn.ModuleDict({str(i): DecoderBlock(config, i, backend) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    @property
    def n_experts(self) -> int:
        """Experts of each MoE layer (0: a dense decoder)."""
        return self.config.n_experts if self.config.moe_every else 0

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[tokens, dim]`` (before encoder outputs replace the placeholders')."""
        return self.tok_embeddings(input_ids)

    def forward(
        self, embeddings: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
        cp_shard: ContextShard | None = None,
    ) -> torch.Tensor:
        """``embeddings [tokens, dim]``, ``positions [tokens]`` -> logits ``[tokens, vocab]``.

        With ``cp_shard`` (context parallelism) the tokens are this rank's share of the packed batch and attention
        sees the whole of it through the context-parallel group.
        """
        return self.head_logits(self.run_layers(embeddings, positions, cu_seqlens, self.layers.items(), cp_shard))

    def run_layers(
        self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
        layers: Iterable[tuple[str, nn.Module]], cp_shard: ContextShard | None = None,
        deepstack: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states through ``layers`` (a pipeline stage's run of blocks, or all of them)."""
        if deepstack is not None:
            raise ValueError("the reference decoder takes no DeepStack features")
        rope = rotary_embedding(positions, self.config.head_dim, self.config.rope_theta)
        for _, layer in layers:
            x = layer(x, rope, cu_seqlens, cp_shard)
        return x

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head."""
        return self.output(self.norm(x))

    def check_tp(self, tp: int) -> None:
        """Raise ``ValueError`` naming the first model size that ``tp`` does not divide."""
        for name in ("n_heads", "n_kv_heads", "ffn_hidden", "vocab_size"):
            value = getattr(self.config, name)
            if value % tp:
                raise ValueError(f"llm.{name}={value} is not divisible by tp={tp}; choose a tp that divides it")

    def tp_plan(self) -> dict[str, ParallelStyle]:
        """Megatron-style TP of the embedding and the LM head (see :mod:`omni_lightning.parallel.tensor_parallel`)."""
        return {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            # Logits stay sharded over the vocabulary; the loss runs under ``loss_parallel`` so they are never
            # gathered (a [tokens, vocab] all-gather per step is the largest activation of the model).
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }

    def layer_tp_plan(self, layer: nn.Module) -> dict[str, ParallelStyle]:
        """Heads and SwiGLU hidden units split over TP; MoE feed-forwards stay replicated (EP shards them)."""
        plan: dict[str, ParallelStyle] = {
            "attention.wq": ColwiseLinear(),
            "attention.wk": ColwiseLinear(),
            "attention.wv": ColwiseLinear(),
            "attention.wo": RowwiseLinear(),
        }
        if isinstance(layer.feed_forward, FeedForward):
            plan |= {
                "feed_forward.w1": ColwiseLinear(),
                "feed_forward.w3": ColwiseLinear(),
                "feed_forward.w2": RowwiseLinear(),
            }
        return plan

    def cost(self) -> ModuleCost:
        """Training FLOPs per token and per causal attention pair
        (:func:`~omni_lightning.models.flops.decoder_cost`)."""
        return decoder_cost(self.config)

    def moe_aux_loss(self) -> torch.Tensor:
        """This rank's share of the load-balance loss of the last forward, summed over MoE layers (0 if none)."""
        shares = [layer.feed_forward.aux_loss for layer in self.layers.values()
                  if isinstance(layer.feed_forward, MoEFeedForward) and layer.feed_forward.aux_loss is not None]
        return torch.stack(shares).sum() if shares else torch.zeros((), device=self.norm.weight.device)
