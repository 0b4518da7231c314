"""WebDataModule: the plain (non-balancing) streaming data module over multimodal webdataset shards."""

from __future__ import annotations

import logging
import os
from typing import Any

from lightning.pytorch import LightningDataModule
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override

from omni_lightning.data.resumable import ResumableLoader
from omni_lightning.data.shards import SyntheticShards, existing_shards, expand_shards, synthetic_target
from omni_lightning.data.streaming import ShardStream, assign_shards
from omni_lightning.data.synthetic import make_synthetic_shards
from omni_lightning.modalities import packing_spec
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.parallel.layout import OmniLayout

__all__ = ["WebDataModule"]

log = logging.getLogger(__name__)


class WebDataModule(LightningDataModule):
    """Streams packed micro-batches from webdataset shards, each data-parallel rank reading its own shards.

    Args:
        shards: brace pattern, glob, directory or list of ``.tar`` shards.
        batch_size: samples per micro-batch on each data-parallel rank.
        num_workers: loader worker processes per rank (each needs at least one shard).
        seed: seeds the per-epoch shard order.
        synthetic: generate synthetic shards into the directory of ``shards`` if none exist yet.
        val_shards: optional validation shards (same format).
        val_batches: micro-batches per validation pass on every rank (equal counts keep FSDP collectives aligned).
        patch_size, vision_merge, audio_downsample: must match the model's vision/audio configuration.

    The data-parallel rank and size come from ``trainer.strategy.distributed_sampler_kwargs``, so TP/CP/PP peers
    of OmniStrategy read the same samples and any other strategy works too.
    """

    def __init__(
        self,
        shards: str | list[str] | None = "data/tiny_omni/train-{000000..000005}.tar",
        *,
        batch_size: int = 4,
        num_workers: int = 0,
        seed: int = 0,
        synthetic: SyntheticShards | None = None,
        val_shards: str | list[str] | None = None,
        val_batches: int = 4,
        patch_size: int = 14,
        vision_merge: int = 4,
        audio_downsample: int = 4,
    ) -> None:
        super().__init__()
        self.shards = shards
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.synthetic = synthetic
        self.val_shards = val_shards
        self.val_batches = val_batches
        self.packing = packing_spec(patch_size=patch_size, vision_merge=vision_merge, audio_downsample=audio_downsample)
        self.dp_rank, self.dp_size = 0, 1
        # OmniStrategy hands its layout over before setup: the ranks, the pipeline, the model's packing and costs.
        self.omni_layout: OmniLayout | None = None

    @override
    def prepare_data(self) -> None:
        if self.shards is None:  # a subclass supplies its own samples
            return
        paths = expand_shards(self.shards)
        if self.synthetic is None or (paths and all(os.path.exists(p) for p in paths)):
            return
        out_dir, prefix = synthetic_target(self.shards, paths)
        log.info("writing %d synthetic shards to %s", self.synthetic.num_shards, out_dir)
        make_synthetic_shards(
            out_dir,
            workload=self.synthetic.workload,
            num_shards=self.synthetic.num_shards,
            samples_per_shard=self.synthetic.samples_per_shard,
            seed=self.synthetic.seed,
            length_scale=self.synthetic.length_scale,
            max_llm_tokens=self.synthetic.max_llm_tokens,
            patch_size=self.packing.patch_size,
            prefix=prefix,
        )

    @override
    def setup(self, stage: str) -> None:
        trainer = self.trainer
        if trainer is not None and trainer.world_size > 1:
            kwargs = trainer.strategy.distributed_sampler_kwargs
            self.dp_rank, self.dp_size = kwargs["rank"], kwargs["num_replicas"]
        if trainer is not None:
            self._adopt_model_packing(getattr(trainer.lightning_module, "config", None))
        # Settings that starve a rank's loader fail here, on every rank alike, rather than once the loop has started.
        if stage == "fit" and self.shards is not None:
            assign_shards(existing_shards(self.shards), dp_rank=self.dp_rank, dp_size=self.dp_size,
                          num_workers=self.num_workers)
        if self.val_shards is not None and stage in ("fit", "validate"):
            assign_shards(existing_shards(self.val_shards), dp_rank=self.dp_rank, dp_size=self.dp_size)

    def _adopt_model_packing(self, config: Any) -> None:
        """Pack as the model's encoders expect (else shapes fail deep in a forward): its packing, when the layout
        or the model's config says it, after checking this data module's sizes against it."""
        model = self.omni_layout.packing if self.omni_layout is not None else None
        if model is None and isinstance(config, ReferenceMLLMConfig):
            model = config.packing()
        if model is None:
            return
        expected = {"patch_size": model.patch_size, "vision_merge": model.vision_merge,
                    "audio_downsample": model.audio_downsample}
        for name, value in expected.items():
            if getattr(self.packing, name) != value:
                raise ValueError(f"{type(self).__name__}({name}={getattr(self.packing, name)}) but the model expects "
                                 f"{name}={value}: set {name}={value} on the data module")
        self.packing = model

    def stream(self, shards: str | list[str], *, dp_rank: int | None = None, dp_size: int | None = None,
               num_workers: int | None = None, max_batches: int | None = None) -> ShardStream:
        """The stream of one data-parallel rank (this process's rank unless given)."""
        return ShardStream(
            existing_shards(shards),
            dp_rank=self.dp_rank if dp_rank is None else dp_rank,
            dp_size=self.dp_size if dp_size is None else dp_size,
            batch_size=self.batch_size,
            num_workers=self.num_workers if num_workers is None else num_workers,
            seed=self.seed,
            packing=self.packing,
            max_batches=max_batches,
        )

    @override
    def train_dataloader(self) -> ResumableLoader:
        return ResumableLoader(
            StatefulDataLoader(self.stream(self.shards), batch_size=None, num_workers=self.num_workers)
        )

    @override
    def val_dataloader(self) -> Any:
        if self.val_shards is None:
            return []
        stream = self.stream(self.val_shards, num_workers=0, max_batches=self.val_batches)
        return StatefulDataLoader(stream, batch_size=None, num_workers=0)
