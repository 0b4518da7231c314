"""Activation checkpointing of transformer blocks and ``torch.compile`` of modules (applied in place).

Both go after tensor parallelism and before FSDP, as torchtitan orders them: checkpointing a block stores only its
input and recomputes the rest in the backward, and FSDP's hooks on the block then gather the weights for that
recomputation too. Neither changes a parameter name, so checkpoints stay interchangeable with runs without them.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_ac", "apply_compile"]


def apply_ac(blocks: Iterable[nn.Module]) -> None:
    """Recompute each block's activations in the backward instead of keeping them (non-reentrant checkpointing,
    so it composes with DTensor parameters and hooks)."""
    for block in blocks:
        block.forward = partial(checkpoint, block.forward, use_reentrant=False)  # type: ignore[method-assign]


def apply_compile(modules: Iterable[nn.Module], backend: str = "inductor") -> None:
    """Compile each of ``modules`` (with dynamic token counts). The model's plan chooses them: dense MLPs, since
    attention over packed items of varying lengths loops over them (SDPA) or calls flash-attn's varlen kernel, which
    compilation would cut into pieces and recompile per item count, and MoE layers route a data-dependent number of
    tokens to each expert."""
    for module in modules:
        module.compile(backend=backend, dynamic=True)
