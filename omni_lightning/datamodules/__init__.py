"""Lightning data modules over multimodal webdataset shards, and the synthetic shard generator."""

from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.data.reorder_stream import ReorderSettings
from omni_lightning.data.shards import SyntheticShards, expand_shards
from omni_lightning.data.streaming import ShardStream
from omni_lightning.datamodules.omni import OmniDataModule
from omni_lightning.datamodules.web import WebDataModule

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
