"""A user's own data module, unrelated to webdataset: what ``--data.class_path`` must accept."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
from torch.utils.data import DataLoader, IterableDataset

from omni_lightning.datamodules.collate import DecodedSample, pack_samples


class _RandomMultimodal(IterableDataset):
    def __init__(self, dp_rank: int, samples_per_batch: int) -> None:
        self.dp_rank = dp_rank
        self.samples_per_batch = samples_per_batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        step = 0
        while True:
            rng = np.random.default_rng([self.dp_rank, step])
            yield pack_samples([
                DecodedSample(
                    f"{self.dp_rank}-{step}-{i}",
                    rng.integers(4, 256, 10).astype(np.int32),
                    [rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)] if i % 2 == 0 else [],
                    rng.standard_normal((8, 80)).astype(np.float16) if i % 3 == 0 else None,
                )
                for i in range(self.samples_per_batch)
            ])
            step += 1


class RandomMultimodalDataModule(pl.LightningDataModule):
    """Random image/audio/text samples; the data-parallel rank comes from the strategy, as Lightning documents."""

    def __init__(self, samples_per_batch: int = 2) -> None:
        super().__init__()
        self.samples_per_batch = samples_per_batch
        self.dp_rank = 0

    def setup(self, stage: str) -> None:
        self.dp_rank = self.trainer.strategy.distributed_sampler_kwargs["rank"]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_RandomMultimodal(self.dp_rank, self.samples_per_batch), batch_size=None)
