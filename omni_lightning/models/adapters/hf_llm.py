"""Hugging Face Llama-family causal LMs (``LlamaForCausalLM``, ``Qwen2ForCausalLM``) as an :class:`LLMAdapter`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel
from transformers import PreTrainedModel

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.models.adapters.hf_attention import PackedItems, use_packed_attention
from omni_lightning.models.flops import TRAIN, attention_pair_flops, matmul_flops
from omni_lightning.models.lora import lora_layer_plan
from omni_lightning.parallel.context_parallel import ContextShard
from omni_lightning.parallel.tensor_parallel import ColwiseLinear, RowwiseLinear

__all__ = ["TP_STYLES", "HFCausalLMAdapter"]

# HF's per-layer TP plan vocabulary (``config.base_model_tp_plan``) -> DTensor styles. Only the two plain styles:
# others (packed, local, gather) change activation layouts in ways this adapter's forward does not expect.
TP_STYLES = {"colwise": ColwiseLinear, "rowwise": RowwiseLinear}


def head_norm_plan(layer: nn.Module) -> dict[str, ParallelStyle]:
    """Per-head norms of queries and keys (Qwen3's ``q_norm``, ``k_norm``): under tensor parallelism each rank
    normalises its own heads with the one replicated weight, whose gradient is then a sum over the ranks' heads; as
    a DTensor over the heads' dimension (2 of ``[batch, tokens, heads, head_dim]``) the sum is DTensor's."""
    return {name: SequenceParallel(sequence_dim=2, use_local_output=True)
            for name in ("self_attn.q_norm", "self_attn.k_norm") if _has_submodule(layer, name)}


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


class HFCausalLMAdapter(nn.Module):
    """A Llama-family ``*ForCausalLM`` over one packed sequence.

    Takes the HF model's pieces (embedding, decoder layers, final norm, rotary table, LM head), so the parameter
    names become ``tok_embeddings.*``, ``layers.{i}.*``, ``norm.*``, ``output.*``; load pretrained weights into the
    HF model before wrapping it. Packed samples attend only within themselves (causal, through
    :mod:`~omni_lightning.models.adapters.hf_attention` whatever attention implementation the model was built
    with: no dense mask), and RoPE positions restart per sample (``positions``), so a packed micro-batch gives every
    sample the logits it would get alone. Tensor parallelism follows the model's own ``base_model_tp_plan``.

    Raises ``ValueError`` for sliding-window layers (packed attention is full causal within a sample), and (at
    parallelisation) for tied embeddings under tensor parallelism.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self._adopt(model.config, model.model, model.get_output_embeddings())

    def _adopt(self, config: Any, base: nn.Module, head: nn.Module) -> None:
        """Take the decoder's pieces: ``base`` holds ``embed_tokens``, ``layers``, ``norm`` and ``rotary_emb``."""
        windowed = [kind for kind in getattr(config, "layer_types", None) or () if kind != "full_attention"]
        if windowed:
            raise ValueError(f"layers of type {sorted(set(windowed))} are not supported: packed attention is full "
                             "causal attention within each sample (e.g. build Qwen2 with use_sliding_window=False)")
        use_packed_attention(config)  # whatever it was built with: samples attend within themselves, no dense mask
        self.config = config
        self.tok_embeddings = base.embed_tokens
        # Keyed by index like the reference decoder, so pipeline-style slicing keeps checkpoint names.
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(base.layers)})
        self.norm = base.norm
        self.rotary_emb = base.rotary_emb
        self.output = head
        self.tied = self.output.weight is self.tok_embeddings.weight

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(input_ids)

    def forward(self, embeddings: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                cp_shard: ContextShard | None = None) -> torch.Tensor:
        """``embeddings [tokens, dim]`` -> logits ``[tokens, vocab]`` (vocabulary-sharded under TP)."""
        return self.head_logits(self.run_layers(embeddings, positions, cu_seqlens, self.layers.items(), cp_shard))

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                   layers: Iterable[tuple[str, nn.Module]], cp_shard: ContextShard | None = None,
                   deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states through ``layers``, each attending within the packed samples (under context parallelism
        over the whole batch through the group); ``deepstack[i]`` is added after layer ``i``."""
        hidden = x[None]
        position_ids = self.position_ids(positions)
        rope = self.rotary_emb(hidden, position_ids)
        items = PackedItems.of(cu_seqlens, cp_shard)
        text_positions = position_ids if position_ids.ndim == 2 else None  # layers take 1-D text positions only
        for name, layer in layers:
            hidden = layer(hidden, attention_mask=items, position_ids=text_positions, position_embeddings=rope)
            if deepstack is not None and int(name) < deepstack.shape[0]:
                hidden = hidden + deepstack[int(name)][None].to(hidden.dtype)
        return hidden[0]

    def position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """The rotary table's ``position_ids`` of packed positions (``[1, tokens]`` for 1-D RoPE)."""
        return positions[None].long()

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head; the batch dimension is gone, so the vocabulary-sharded logits are a DTensor
        under TP."""
        return self.output(self.norm(x))

    def check_tp(self, tp: int) -> None:
        config = self.config
        sizes = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
                 "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
        for name, value in sizes.items():
            if value % tp:
                raise ValueError(f"{name}={value} of the HF model is not divisible by tp={tp}")
        if tp > 1 and self.tied:
            raise ValueError("tensor parallelism distributes the embedding and the LM head as separate parameters, "
                             "which would untie a tied weight: build the model with tie_word_embeddings=False")
        if tp > 1:
            self._layer_plan()  # unsupported plan entries fail here, before any module is parallelised

    def tp_plan(self) -> dict[str, ParallelStyle]:
        return {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            # Vocabulary-sharded logits, never gathered (see next_token_loss_sum).
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }

    def layer_tp_plan(self, layer: nn.Module) -> dict[str, ParallelStyle]:
        plan = lora_layer_plan(layer, self._layer_plan())  # LoRA-wrapped projections split with their base
        return plan | head_norm_plan(layer)

    def _layer_plan(self) -> dict[str, ParallelStyle]:
        plan = {}
        for pattern, style in (self.config.base_model_tp_plan or {}).items():
            prefix = "layers.*."
            if not pattern.startswith(prefix) or style not in TP_STYLES:
                raise ValueError(f"tensor-parallel plan entry {pattern!r}: {style!r} is not supported (only "
                                 f"'{prefix}<module>' entries with styles {sorted(TP_STYLES)})")
            plan[pattern[len(prefix):]] = TP_STYLES[style]()
        if not plan:
            raise ValueError(f"{type(self.config).__name__} has no base_model_tp_plan to split its layers by")
        return plan

    def moe_aux_loss(self) -> torch.Tensor:
        return torch.zeros((), device=self.norm.weight.device)

    def cost(self) -> ModuleCost:
        """Per token: q/k/v/o (grouped-query), the gated MLP's three projections in every layer, and the LM head."""
        config, dim = self.config, self.config.hidden_size
        head_dim = getattr(config, "head_dim", None) or dim // config.num_attention_heads
        q_width, kv_width = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        attention = matmul_flops(dim, q_width + 2 * kv_width) + matmul_flops(q_width, dim)
        gated_mlp = 3 * matmul_flops(dim, config.intermediate_size)
        head = matmul_flops(dim, config.vocab_size)
        return ModuleCost(linear=TRAIN * (config.num_hidden_layers * (attention + gated_mlp) + head),
                          quadratic=attention_pair_flops(q_width, config.num_hidden_layers))
