"""Decoded samples, and packing them into the micro-batches the models consume (layout: :mod:`omni_lightning.batch`).

:func:`sample_layout` reads a sample's sizes (each media item's, through its modality's rules) once, for everything
that needs them before or instead of pixels: the packable check, the LLM length, the reorder plan's cost features.
:func:`pack_samples` then builds the batch: each sample's token sequence with its placeholders in place, the
encoders' inputs item after item, labels on the text that follows text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_lightning.balance.cost import work_features
from omni_lightning.batch import IGNORE_INDEX, MediaShape, Modality, PackedBatch, PackingSpec, input_key
from omni_lightning.modalities import DEFAULT_PACKING

__all__ = ["DecodedSample", "SampleLayout", "check_packable", "pack_samples", "sample_features", "sample_layout"]


@dataclass(init=False)
class DecodedSample:
    """One sample after decoding: text ids and its media by modality.

    ``media["image"]`` holds uint8 ``[H, W, 3]`` arrays, ``media["video"]`` uint8 ``[frames, H, W, 3]`` arrays,
    ``media["audio"]`` ``[frames, n_mels]`` mel arrays, and any other modality its own items. ``images`` and ``mel``
    are shorthands: given, they fill ``media["image"]`` and ``media["audio"]``; read, they are those entries.
    """

    key: str
    tokens: np.ndarray
    meta: dict[str, Any]
    media: dict[str, list[Any]]

    def __init__(self, key: str, tokens: np.ndarray, images: Sequence[np.ndarray] = (), mel: np.ndarray | None = None,
                 meta: dict[str, Any] | None = None, *, media: dict[str, Sequence[Any]] | None = None) -> None:
        self.key, self.tokens, self.meta = key, tokens, dict(meta or {})
        self.media = {name: list(items) for name, items in (media or {}).items() if len(items)}
        if len(images):
            self.media.setdefault("image", []).extend(images)
        if mel is not None:
            self.media.setdefault("audio", []).append(mel)

    @property
    def images(self) -> list[np.ndarray]:
        return self.media.get("image", [])

    @property
    def mel(self) -> np.ndarray | None:
        clips = self.media.get("audio", [])
        return clips[0] if clips else None

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "media" not in state:  # pickled by release 0.1 (carried samples in its checkpoints' loader states)
            state = dict(state)
            images, mel, meta = state.pop("images"), state.pop("mel"), state.get("meta", {})
            # 0.1 appended a video's frames to the images; its metadata says how many images there were.
            n_images = len(meta.get("images", images)) if int(meta.get("video_frames", 0)) else len(images)
            media: dict[str, list[Any]] = {}
            if n_images:
                media["image"] = list(images[:n_images])
            if len(images) > n_images:
                media["video"] = [np.stack(images[n_images:])]
            if mel is not None:
                media["audio"] = [mel]
            state["media"] = media
        self.__dict__.update(state)


@dataclass(frozen=True)
class SampleLayout:
    """A sample's sizes as the packing reads them: each media item in sequence order with its modality and size,
    each encoder's items (stem tokens), and the length of its LLM sequence."""

    media: list[tuple[Modality, Any, MediaShape]]
    items: dict[str, list[int]]
    llm_tokens: int


def sample_layout(sample: DecodedSample, spec: PackingSpec = DEFAULT_PACKING) -> SampleLayout:
    """The sample's :class:`SampleLayout`; ``ValueError`` naming the sample if it cannot be packed by ``spec``."""
    try:
        return _layout(sample, spec)
    except ValueError as error:
        raise ValueError(f"sample {sample.key}: {error}") from None


def _layout(sample: DecodedSample, spec: PackingSpec) -> SampleLayout:
    if unknown := sorted(set(sample.media) - set(spec.modality_names)):
        raise ValueError(f"modality {', '.join(map(repr, unknown))} has no encoder in this model (it encodes "
                         f"{list(spec.modality_names)})")
    media, items, placeholders = [], {}, 0
    for modality in spec.modalities:
        for index, item in enumerate(sample.media.get(modality.name, ())):
            try:
                shape = modality.shape(item, spec)
            except ValueError as error:
                raise ValueError(f"{modality.name} {index}: {error}") from None
            media.append((modality, item, shape))
            items.setdefault(modality.encoder, []).extend(modality.item_tokens(shape, spec))
            placeholders += sum(spec.placeholders(modality, shape))
    return SampleLayout(media, items, 1 + placeholders + len(sample.tokens))


def sample_features(sample: DecodedSample, encoders: Sequence[str], spec: PackingSpec = DEFAULT_PACKING) -> np.ndarray:
    """The cost features of a decoded sample (:func:`~omni_lightning.balance.cost.work_features`)."""
    layout = sample_layout(sample, spec)
    return work_features(encoders, layout.items, [layout.llm_tokens])


def check_packable(sample: DecodedSample, spec: PackingSpec = DEFAULT_PACKING) -> None:
    """Raise ``ValueError`` naming the sample if :func:`pack_samples` could not pack it (cheap: shapes only)."""
    sample_layout(sample, spec)
    roles = spec.roles
    if len(sample.tokens) == 0 or np.isin(sample.tokens, roles.special_ids).any() or int(np.min(sample.tokens)) < 0:
        raise ValueError(f"sample {sample.key}: text must be non-empty, with no negative ids and none of the token "
                         f"roles' ids {roles.special_ids.tolist()} (byte text starts at {roles.first_free_id})")


def pack_samples(samples: list[DecodedSample], spec: PackingSpec = DEFAULT_PACKING) -> PackedBatch:
    """Pack ``samples`` into one micro-batch (layout: :mod:`omni_lightning.batch`); also ``keys`` (sample keys) and
    ``num_samples``."""
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    roles = spec.roles
    ids: list[torch.Tensor] = []
    inputs: dict[str, list[list[np.ndarray]]] = {fmt.name: [[] for _ in fmt.inputs] for fmt in spec.encoders}
    for sample in samples:
        check_packable(sample, spec)
        sequence = [torch.tensor([roles.bos])]
        for modality, item, shape in sample_layout(sample, spec).media:
            sequence.append(torch.full((sum(spec.placeholders(modality, shape)),), roles.placeholder(modality.name)))
            for rows, built in zip(inputs[modality.encoder], modality.build(item, spec), strict=True):
                rows.append(built)
        sequence.append(torch.from_numpy(sample.tokens.astype(np.int64)))
        ids.append(torch.cat(sequence))
    lengths = torch.tensor([len(x) for x in ids])
    input_ids = torch.cat(ids)
    labels = torch.cat([torch.cat([x[1:], torch.tensor([IGNORE_INDEX])]) for x in ids])
    # A label is the next token when that token is text; placeholders, BOS and padding are never targets.
    special = torch.from_numpy(roles.special_ids)
    labels = torch.where(torch.isin(labels, special), torch.full_like(labels, IGNORE_INDEX), labels)
    batch: PackedBatch = {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": torch.cat([torch.arange(n) for n in lengths.tolist()]),
        "cu_seqlens": torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32),
    }
    for fmt in spec.encoders:
        for name, rows, empty in zip(fmt.input_names, inputs[fmt.name], fmt.empty(spec), strict=True):
            batch[input_key(fmt.name, name)] = torch.from_numpy(np.concatenate(rows) if rows else empty)
    batch.update(keys=[s.key for s in samples], num_samples=len(samples))
    return batch
