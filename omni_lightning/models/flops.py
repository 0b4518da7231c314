"""Training FLOPs of the models' modules per token and per attention pair: their cost models for the planners.

Counts matmul FLOPs only (2 per multiply-add; norms, activations, softmax and RoPE are a few percent at real sizes).
Backward is twice the forward, except for layers that read raw data (patch embedding, first audio convolution),
whose backward has no input gradient. Per attention pair: ``2 matmuls * 2 FLOPs * heads * head_dim`` per layer,
times 3 for training.
"""

from __future__ import annotations

from omni_lightning.balance.cost import CostModel, ModuleCost
from omni_lightning.models.config import AudioEncoderConfig, LLMConfig, ReferenceMLLMConfig, VisionEncoderConfig

__all__ = [
    "TRAIN",
    "TRAIN_FIRST_LAYER",
    "attention_pair_flops",
    "audio_encoder_cost",
    "decoder_cost",
    "encoder_block_flops",
    "matmul_flops",
    "reference_cost_model",
    "vision_encoder_cost",
]

# Training FLOPs per forward FLOP: a matmul's backward computes the input and the weight gradient.
TRAIN = 3.0
# A layer reading raw data needs no input gradient: forward + weight gradient.
TRAIN_FIRST_LAYER = 2.0


def matmul_flops(fan_in: int, fan_out: int) -> float:
    """Forward FLOPs per token of a ``fan_in -> fan_out`` projection (2 per multiply-add)."""
    return 2.0 * fan_in * fan_out


def attention_pair_flops(width: int, n_layers: int) -> float:
    """Training FLOPs per attention pair: ``QK^T`` and ``AV`` over ``width = heads * head_dim``, every layer."""
    return TRAIN * n_layers * 2 * 2.0 * width


def encoder_block_flops(dim: int, mlp_ratio: float) -> float:
    """Forward matmul FLOPs per token of one reference ``EncoderBlock`` outside attention: qkv, proj, GELU MLP."""
    hidden = int(dim * mlp_ratio)  # as EncoderBlock builds its GeluMLP
    return matmul_flops(dim, 3 * dim) + matmul_flops(dim, dim) + matmul_flops(dim, hidden) + matmul_flops(hidden, dim)


def vision_encoder_cost(config: VisionEncoderConfig, llm_dim: int) -> ModuleCost:
    """Per patch: patch embedding, the encoder blocks, and the projector, which runs on ``patches / merge`` merged
    tokens and is charged here per patch."""
    projector = (matmul_flops(config.dim * config.merge, llm_dim) + matmul_flops(llm_dim, llm_dim)) / config.merge
    return ModuleCost(
        linear=TRAIN_FIRST_LAYER * matmul_flops(config.patch_dim, config.dim)
        + TRAIN * (config.n_layers * encoder_block_flops(config.dim, config.mlp_ratio) + projector),
        quadratic=attention_pair_flops(config.dim, config.n_layers),
    )


def audio_encoder_cost(config: AudioEncoderConfig, llm_dim: int) -> ModuleCost:
    """Per downsampled frame: both stride-2 convolutions (the first has two outputs per token), the encoder blocks
    and the projector."""
    conv1 = config.downsample // 2 * 3 * matmul_flops(config.n_mels, config.dim)
    conv2 = 3 * matmul_flops(config.dim, config.dim)
    projector = matmul_flops(config.dim, llm_dim) + matmul_flops(llm_dim, llm_dim)
    return ModuleCost(
        linear=TRAIN_FIRST_LAYER * conv1
        + TRAIN * (conv2 + config.n_layers * encoder_block_flops(config.dim, config.mlp_ratio) + projector),
        quadratic=attention_pair_flops(config.dim, config.n_layers),
    )


def decoder_cost(config: LLMConfig) -> ModuleCost:
    """Per token: q/k/v/o (grouped-query), SwiGLU (three matmuls) or, in MoE layers, the router plus ``top_k``
    experts, and the LM head (logits at every position; the loss masks later)."""
    q_width, kv_width = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    attention = matmul_flops(config.dim, q_width + 2 * kv_width) + matmul_flops(q_width, config.dim)
    swiglu = 3 * matmul_flops(config.dim, config.ffn_hidden)
    moe = matmul_flops(config.dim, config.n_experts) + config.moe_top_k * swiglu
    layers = sum(attention + (moe if config.is_moe_layer(i) else swiglu) for i in range(config.n_layers))
    return ModuleCost(linear=TRAIN * (layers + matmul_flops(config.dim, config.vocab_size)),
                      quadratic=attention_pair_flops(q_width, config.n_layers))


def reference_cost_model(config: ReferenceMLLMConfig) -> CostModel:
    """The cost model, in training FLOPs, of the reference MLLM built from ``config``."""
    return CostModel(vision=vision_encoder_cost(config.vision, config.llm.dim),
                     audio=audio_encoder_cost(config.audio, config.llm.dim), llm=decoder_cost(config.llm))
