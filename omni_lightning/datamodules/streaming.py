"""Streaming webdataset shards per data-parallel rank, with a resumable position.

Each data-parallel rank reads its own shards (``shards[dp_rank::dp_size]``, then ``[worker::num_workers]`` inside a
loader worker), shuffles their order per epoch with a seed every rank derives the same way, decodes samples and
packs them into micro-batches. The stream is endless (epochs follow one another), so every rank always has a next
batch and no rank can leave a collective early; training length is set by ``max_steps``.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info
from webdataset.tariterators import tarfile_samples

from omni_lightning.datamodules.collate import DecodedSample, pack_samples

__all__ = ["ShardStream", "decode_sample", "assign_shards"]


def assign_shards(shards: list[str], *, dp_rank: int, dp_size: int, num_workers: int = 1) -> list[list[str]]:
    """The shard list of every loader worker of one data-parallel rank.

    Raises ``ValueError`` if some worker would get no shard: it would end its stream at once and its rank would
    fall out of step with the others.
    """
    needed = dp_size * max(num_workers, 1)
    if len(shards) < needed:
        raise ValueError(
            f"{len(shards)} shards cannot feed {dp_size} data-parallel ranks x {max(num_workers, 1)} loader workers:"
            f" write at least {needed} shards or lower num_workers"
        )
    mine = shards[dp_rank::dp_size]
    return [mine[w :: max(num_workers, 1)] for w in range(max(num_workers, 1))]


def decode_sample(raw: dict[str, Any]) -> DecodedSample:
    """Decode one webdataset sample written by ``make_synthetic_shards`` (or in the same format)."""
    key = raw.get("__key__", "?")
    try:
        meta = json.loads(raw["json"])
        tokens = np.load(io.BytesIO(raw["tokens.npy"]))
        images = [
            np.asarray(Image.open(io.BytesIO(raw[f"img{i}.png"])).convert("RGB")) for i in range(len(meta["images"]))
        ]
    except KeyError as missing:
        raise ValueError(f"sample {key}: member {missing} is missing") from None
    if "video.npy" in raw:
        images.extend(np.load(io.BytesIO(raw["video.npy"])))
    mel = np.load(io.BytesIO(raw["mel.npy"])) if "mel.npy" in raw else None
    return DecodedSample(key=key, tokens=tokens, images=images, mel=mel, meta=meta)


class ShardStream(IterableDataset):
    """Endless stream of packed micro-batches for one data-parallel rank.

    Its position (``epoch``, ``consumed`` samples of that epoch, per loader worker) is exposed through
    ``state_dict``/``load_state_dict``, which ``torchdata``'s ``StatefulDataLoader`` calls inside each worker, so a
    resumed run continues with exactly the samples that follow the checkpoint. With ``max_batches`` the stream is
    a bounded pass from the start instead (validation): every rank yields the same number of batches.
    """

    def __init__(
        self,
        shards: list[str],
        *,
        dp_rank: int,
        dp_size: int,
        batch_size: int,
        num_workers: int = 0,
        seed: int = 0,
        shuffle_shards: bool = True,
        pack_kwargs: dict[str, int] | None = None,
        max_batches: int | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        self.worker_shards = assign_shards(shards, dp_rank=dp_rank, dp_size=dp_size, num_workers=num_workers)
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle_shards = shuffle_shards
        self.pack_kwargs = pack_kwargs or {}
        self.max_batches = max_batches
        self._epoch = 0
        self._consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"dp_rank": self.dp_rank, "dp_size": self.dp_size, "epoch": self._epoch, "consumed": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["dp_rank"], state["dp_size"]) != (self.dp_rank, self.dp_size):
            raise ValueError(
                f"loader state of data-parallel rank {state['dp_rank']}/{state['dp_size']} cannot resume rank "
                f"{self.dp_rank}/{self.dp_size}: each rank streams different shards"
            )
        self._epoch, self._consumed = int(state["epoch"]), int(state["consumed"])

    def epoch_shards(self, worker: int, epoch: int) -> list[str]:
        """Shard order of one worker in one epoch: a permutation seeded by (seed, dp rank, worker, epoch)."""
        shards = list(self.worker_shards[worker])
        if self.shuffle_shards:
            order = np.random.default_rng([self.seed, self.dp_rank, worker, epoch]).permutation(len(shards))
            shards = [shards[i] for i in order]
        return shards

    def iter_samples(self, worker: int = 0) -> Iterator[DecodedSample]:
        """Decoded samples from the current position on, epoch after epoch; advances the position."""
        while True:
            raw_stream = tarfile_samples({"url": url} for url in self.epoch_shards(worker, self._epoch))
            for index, raw in enumerate(raw_stream):
                if index < self._consumed:
                    continue  # fast-forward to the resumed position without decoding
                self._consumed += 1
                yield decode_sample(raw)
            if self._consumed == 0:
                raise ValueError(f"the shards of data-parallel rank {self.dp_rank} hold no samples")
            self._epoch, self._consumed = self._epoch + 1, 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.max_batches is not None:
            # A bounded pass (validation) starts over each time and yields the same count on every rank.
            self._epoch, self._consumed = 0, 0
        info = get_worker_info()
        samples = self.iter_samples(info.id if info is not None else 0)
        produced = 0
        while self.max_batches is None or produced < self.max_batches:
            yield pack_samples([next(samples) for _ in range(self.batch_size)], **self.pack_kwargs)
            produced += 1
