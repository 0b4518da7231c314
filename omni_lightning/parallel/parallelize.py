"""Apply the LLM and encoder parallelisms to the reference MLLM, in torchtitan's order: TP, then FSDP."""

from __future__ import annotations

import torch

from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.parallel.fsdp import apply_fsdp
from omni_lightning.parallel.mesh import OmniMeshes
from omni_lightning.parallel.tensor_parallel import apply_tp, check_tp_compatible

__all__ = ["parallelize_mllm", "check_model_fits_layout"]

# Parallelisms that ParallelDims can lay out but the runtime does not apply yet.
_NOT_YET_APPLIED = ("pp", "cp", "ep", "enc_sp")


def check_model_fits_layout(model: ReferenceMLLM, meshes: OmniMeshes) -> None:
    """Raise ``ValueError`` naming the model size or degree that the layout cannot serve."""
    dims = meshes.parallel_dims
    unsupported = [f"{name}={dims.size(name)}" for name in _NOT_YET_APPLIED if dims.size(name) > 1]
    if unsupported:
        raise ValueError(
            f"{', '.join(unsupported)}: the reference model runtime applies TP and FSDP/HSDP only so far; "
            "set these degrees to 1"
        )
    check_tp_compatible(model.config.llm, dims.tp)


def parallelize_mllm(model: ReferenceMLLM, meshes: OmniMeshes, *, param_dtype: torch.dtype | None = None) -> None:
    """Tensor-parallelise the decoder, then shard every transformer block and the root with FSDP2 (in place).

    Encoder weights are sharded over the same data-parallel ranks as the decoder and replicated over TP peers,
    which see the same samples and so compute the same encoder gradients.
    """
    check_model_fits_layout(model, meshes)
    if (tp_mesh := meshes.get("tp")) is not None:
        apply_tp(model.llm, tp_mesh)
    if (fsdp_mesh := meshes.fsdp_mesh) is not None:
        blocks = [*model.llm.layers, *model.vision.blocks, *model.audio.blocks]
        apply_fsdp(model, fsdp_mesh, blocks=blocks, param_dtype=param_dtype)
