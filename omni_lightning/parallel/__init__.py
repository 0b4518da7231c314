"""Parallel primitives and rank math (torch only, no Lightning, no models): degrees and every process group, FSDP,
tensor-parallel linears, context and Ulysses attention, expert dispatch, timing."""

from omni_lightning.parallel.dims import FLATTENED_DIMS, MESH_DIM_NAMES, ParallelDims
from omni_lightning.parallel.fsdp import apply_fsdp
from omni_lightning.parallel.layout import OmniMeshes, build_meshes

__all__ = ["FLATTENED_DIMS", "MESH_DIM_NAMES", "OmniMeshes", "ParallelDims", "apply_fsdp", "build_meshes"]
