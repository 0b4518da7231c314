"""Training-FLOP counts for adapter cost descriptors, with the conventions of :meth:`CostModel.from_config`."""

from __future__ import annotations

__all__ = ["TRAIN", "TRAIN_FIRST_LAYER", "matmul_flops", "attention_pair_flops"]

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
