"""Tensor parallelism (Megatron-style column/row splits) for a decoder LLM, following the plans it declares.

Attention heads and MLP hidden units are split over the TP mesh; activations between blocks stay replicated,
so the encoders' outputs can be written into the embeddings without any resharding. The LM head's logits stay
sharded over the vocabulary (a DTensor) and the loss is computed under ``loss_parallel``. Encoders are not split:
they are small, and their balance comes from data and sequence parallelism instead (see DESIGN.md).
The plans themselves belong to the model (:class:`~omni_lightning.models.adapters.LLMAdapter`): the reference
decoder keeps MoE feed-forward layers replicated over TP (expert parallelism is a separate dimension); Hugging Face
decoders follow their ``base_model_tp_plan``.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from omni_lightning.models.adapters.protocol import LLMAdapter

__all__ = ["apply_tp"]


def apply_tp(llm: LLMAdapter, tp_mesh: DeviceMesh) -> None:
    """Split the LLM's embedding, head and block projections over ``tp_mesh`` (in place), by its TP plans."""
    llm.check_tp(tp_mesh.size())
    # A pipeline stage may hold neither the embedding (not first) nor the head (not last).
    plan = {name: style for name, style in llm.tp_plan().items() if hasattr(llm, name)}
    if plan:
        parallelize_module(llm, tp_mesh, plan)
    for block in llm.layers.values():
        parallelize_module(block, tp_mesh, llm.layer_tp_plan(block))
