"""Lightning data modules over multimodal webdataset shards, and the synthetic shard generator."""

from omni_lightning.datamodules.balanced import BalanceSettings
from omni_lightning.datamodules.collate import DecodedSample, pack_samples
from omni_lightning.datamodules.omni import OmniDataModule
from omni_lightning.datamodules.streaming import ShardStream
from omni_lightning.datamodules.web import SyntheticShards, WebDataModule, expand_shards

__all__ = [
    "BalanceSettings",
    "DecodedSample",
    "OmniDataModule",
    "ShardStream",
    "SyntheticShards",
    "WebDataModule",
    "expand_shards",
    "pack_samples",
]
