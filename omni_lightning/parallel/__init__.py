"""How ranks are organised and how modules are parallelised (torch only, no Lightning)."""

from omni_lightning.parallel.dims import FLATTENED_DIMS, MESH_DIM_NAMES, ParallelDims
from omni_lightning.parallel.fsdp import apply_fsdp
from omni_lightning.parallel.mesh import OmniMeshes, build_meshes
from omni_lightning.parallel.parallelize import parallelize_mllm
from omni_lightning.parallel.tensor_parallel import apply_tp

__all__ = [
    "FLATTENED_DIMS",
    "MESH_DIM_NAMES",
    "OmniMeshes",
    "ParallelDims",
    "apply_fsdp",
    "apply_tp",
    "build_meshes",
    "parallelize_mllm",
]
