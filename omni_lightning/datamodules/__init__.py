"""Lightning data modules over multimodal webdataset shards, and the synthetic shard generator."""

from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.data.reorder_stream import ReorderSettings
from omni_lightning.data.shards import SyntheticShards, expand_shards
from omni_lightning.data.streaming import ShardStream
from omni_lightning.datamodules.omni import OmniDataModule
from omni_lightning.datamodules.web import WebDataModule
from omni_lightning.deprecations import warn_renamed

__all__ = [
    "ReorderSettings",
    "DecodedSample",
    "OmniDataModule",
    "ShardStream",
    "SyntheticShards",
    "WebDataModule",
    "expand_shards",
    "pack_samples",
]


def __getattr__(name: str) -> object:
    if name == "BalanceSettings":  # release 0.1's name
        warn_renamed("omni_lightning.datamodules.BalanceSettings")
        return ReorderSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
