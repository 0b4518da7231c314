"""A user's own data module, unrelated to webdataset: what ``--data.class_path`` must accept."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
from torch.utils.data import DataLoader, IterableDataset

from omni_lightning import OmniDataModule
from omni_lightning.data.packing import DecodedSample, pack_samples


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


class _InMemorySamples(IterableDataset):
    """A user's own sample source: decoded samples made in memory, dealt out by data-parallel rank, with a
    position for exact resume."""

    def __init__(self, dp_rank: int, dp_size: int, count: int) -> None:
        self.dp_rank, self.dp_size, self.count = dp_rank, dp_size, count
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]

    def __iter__(self) -> Iterator[DecodedSample]:
        while True:
            index = self.dp_rank + self.dp_size * (self.position % self.count)
            self.position += 1
            rng = np.random.default_rng(index)
            side = 2 * int(rng.integers(1, 5 if index % 4 else 9))  # every fourth sample has a large image
            yield DecodedSample(f"mem-{index}", rng.integers(4, 256, int(rng.integers(4, 24))).astype(np.int32),
                                [rng.integers(0, 256, (side * 14, side * 14, 3), dtype=np.uint8)])


class InMemoryOmniData(OmniDataModule):
    """OmniDataModule over a source that is not shards: only :meth:`train_samples` is the user's."""

    def __init__(self, samples_per_step: int = 4, count: int = 64) -> None:
        super().__init__(shards=None, samples_per_step=samples_per_step, group_steps=2)
        self.count = count

    def train_samples(self) -> IterableDataset:
        return _InMemorySamples(self.dp_rank, self.dp_size, self.count)
