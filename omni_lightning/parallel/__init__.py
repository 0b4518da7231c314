"""How ranks are organised and how modules are parallelised (torch only, no Lightning)."""

from typing import Any

from omni_lightning.parallel.dims import FLATTENED_DIMS, MESH_DIM_NAMES, ParallelDims
from omni_lightning.parallel.fsdp import apply_fsdp
from omni_lightning.parallel.mesh import OmniMeshes, build_meshes

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

# The model-specific plans import the models, which in turn use this package's attention collectives
# (sequence and context parallelism): load them on first use so neither import order is circular.
_MODEL_PLANS = {"apply_tp": "tensor_parallel", "parallelize_mllm": "parallelize"}


def __getattr__(name: str) -> Any:
    if name in _MODEL_PLANS:
        import importlib

        return getattr(importlib.import_module(f"omni_lightning.parallel.{_MODEL_PLANS[name]}"), name)
    raise AttributeError(f"module 'omni_lightning.parallel' has no attribute {name!r}")
