"""omni-lightning: multimodal-LLM training for PyTorch Lightning with decoupled encoder/LLM parallelism.

Importing the package registers ``strategy="omni"`` with Lightning's strategy registry.
"""

from lightning.pytorch.strategies import StrategyRegistry

from omni_lightning.datamodules import OmniDataModule, SyntheticShards, WebDataModule
from omni_lightning.models import ReferenceMLLM, ReferenceMLLMConfig
from omni_lightning.module import OmniModule
from omni_lightning.parallel import OmniMeshes, ParallelDims, build_meshes
from omni_lightning.runtime.optim import WarmupCosineLR
from omni_lightning.strategies import OmniStrategy

__all__ = [
    "OmniDataModule",
    "OmniModule",
    "OmniStrategy",
    "OmniMeshes",
    "ParallelDims",
    "ReferenceMLLM",
    "ReferenceMLLMConfig",
    "SyntheticShards",
    "WarmupCosineLR",
    "WebDataModule",
    "build_meshes",
]
__version__ = "0.1.0"

OmniStrategy.register_strategies(StrategyRegistry)
