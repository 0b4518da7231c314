"""Tensor parallelism (Megatron-style column/row splits) for the reference decoder.

Attention heads and SwiGLU hidden units are split over the TP mesh; activations between blocks stay replicated,
so the encoders' outputs can be written into the embeddings without any resharding. The LM head's logits stay
sharded over the vocabulary (a DTensor) and the loss is computed under ``loss_parallel``. Encoders are not split:
they are small, and their balance comes from data and sequence parallelism instead (see DESIGN.md).
MoE feed-forward layers stay replicated over TP (expert parallelism is a separate dimension).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from omni_lightning.models.config import LLMConfig
from omni_lightning.models.llm import Decoder, FeedForward

__all__ = ["apply_tp", "check_tp_compatible"]


def check_tp_compatible(config: LLMConfig, tp: int) -> None:
    """Raise ``ValueError`` naming the first model size that ``tp`` does not divide."""
    for name in ("n_heads", "n_kv_heads", "ffn_hidden", "vocab_size"):
        value = getattr(config, name)
        if value % tp:
            raise ValueError(f"llm.{name}={value} is not divisible by tp={tp}; choose a tp that divides it")


def apply_tp(decoder: Decoder, tp_mesh: DeviceMesh) -> None:
    """Split the decoder's projections, embedding and head over ``tp_mesh`` (in place)."""
    check_tp_compatible(decoder.config, tp_mesh.size())
    # A pipeline stage may hold neither the embedding (not first) nor the head (not last).
    plan = {}
    if hasattr(decoder, "tok_embeddings"):
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if hasattr(decoder, "output"):
        # Logits stay sharded over the vocabulary; the loss runs under ``loss_parallel`` so they are never
        # gathered (a [tokens, vocab] all-gather per step is the largest activation of the model).
        plan["output"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if plan:
        parallelize_module(decoder, tp_mesh, plan)
    for block in decoder.layers.values():
        plan: dict[str, nn.Module] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
        }
        if isinstance(block.feed_forward, FeedForward):
            plan |= {
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            }
        parallelize_module(block, tp_mesh, plan)
