"""Decoded samples, and packing them into the micro-batches the models consume (layout: :mod:`omni_lightning.batch`).

:func:`sample_layout` reads a sample's sizes (each media item's, through its modality's rules) once, for everything
that needs them before or instead of pixels: the packable check, the LLM length, the reorder plan's cost features.
:func:`pack_samples` then builds the batch: each sample's token sequence with its placeholders in place, the
encoders' inputs item after item, labels on the text that follows text.

A sample comes in one of two forms. *Prefix* samples (the synthetic shards, captions under the byte tokenizer) hold
text ids alone; packing lays them out as ``[BOS]``, each media item's placeholders, the text, and trains on the
text. *Rendered* samples (a dialogue or a caption through a tokenizer's template) hold the whole sequence, each
media item's placeholder run already in place, with ``targets`` marking the tokens the loss trains on and
``media_order`` the items in the order of their runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_lightning.balance.cost import work_features
from omni_lightning.batch import IGNORE_INDEX, MediaShape, Modality, PackedBatch, PackingSpec, input_key, media_key
from omni_lightning.data.position import SampleSource
from omni_lightning.modalities import DEFAULT_PACKING

__all__ = ["DATA_COUNTS", "DecodedSample", "SampleLayout", "check_packable", "data_counts", "empty_batch",
           "pack_samples", "sample_features", "sample_layout"]

# What went into a step, as logged under data/ (summed over the data-parallel ranks).
DATA_COUNTS = ("samples", "images", "video_frames", "audio_clips", "text_tokens", "loss_tokens", "skipped")


@dataclass(init=False)
class DecodedSample:
    """One sample after decoding: text ids and its media by modality.

    ``media["image"]`` holds uint8 ``[H, W, 3]`` arrays, ``media["video"]`` uint8 ``[frames, H, W, 3]`` arrays,
    ``media["audio"]`` ``[frames, n_mels]`` mel arrays, and any other modality its own items. ``images`` and ``mel``
    are shorthands: given, they fill ``media["image"]`` and ``media["audio"]``; read, they are those entries.
    With ``targets`` (bool, one per token) the sample is rendered: ``tokens`` is its whole sequence and
    ``media_order`` lists ``(modality, index)`` in the order of the placeholder runs (see the module's docstring).
    ``source`` is where a shard stream read it (what a rank-independent loader position records).
    """

    key: str
    tokens: np.ndarray
    meta: dict[str, Any]
    media: dict[str, list[Any]]
    targets: np.ndarray | None = None
    media_order: tuple[tuple[str, int], ...] | None = None
    source: SampleSource | None = None

    def __init__(self, key: str, tokens: np.ndarray, images: Sequence[np.ndarray] = (), mel: np.ndarray | None = None,
                 meta: dict[str, Any] | None = None, *, media: dict[str, Sequence[Any]] | None = None,
                 targets: np.ndarray | None = None, media_order: Sequence[tuple[str, int]] | None = None,
                 source: SampleSource | None = None) -> None:
        self.key, self.tokens, self.meta, self.source = key, tokens, dict(meta or {}), source
        self.targets = None if targets is None else np.asarray(targets, dtype=bool)
        self.media_order = None if media_order is None else tuple((m, int(i)) for m, i in media_order)
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
    by_name = {modality.name: modality for modality in spec.modalities}
    every = [(m.name, index) for m in spec.modalities for index in range(len(sample.media.get(m.name, ())))]
    order = every if sample.targets is None else list(sample.media_order or ())
    if sorted(order) != sorted(every):
        raise ValueError(f"media order {order} does not list each of its media items {every} once")
    media, items, placeholders = [], {}, 0
    for name, index in order:
        modality = by_name[name]
        try:
            shape = modality.shape(sample.media[name][index], spec)
        except ValueError as error:
            raise ValueError(f"{name} {index}: {error}") from None
        media.append((modality, sample.media[name][index], shape))
        items.setdefault(modality.encoder, []).extend(modality.item_tokens(shape, spec))
        placeholders += spec.media_placeholders(modality, shape)
    llm_tokens = len(sample.tokens) if sample.targets is not None else 1 + placeholders + len(sample.tokens)
    return SampleLayout(media, items, llm_tokens)


def sample_features(sample: DecodedSample, encoders: Sequence[str], spec: PackingSpec = DEFAULT_PACKING) -> np.ndarray:
    """The cost features of a decoded sample (:func:`~omni_lightning.balance.cost.work_features`)."""
    layout = sample_layout(sample, spec)
    return work_features(encoders, layout.items, [layout.llm_tokens])


def check_packable(sample: DecodedSample, spec: PackingSpec = DEFAULT_PACKING) -> None:
    """Raise ``ValueError`` naming the sample if :func:`pack_samples` could not pack it (cheap: shapes only)."""
    layout = sample_layout(sample, spec)
    roles = spec.roles
    if sample.targets is not None:
        _check_rendered(sample, layout, spec)
    elif len(sample.tokens) == 0 or np.isin(sample.tokens, roles.special_ids).any() or int(np.min(sample.tokens)) < 0:
        raise ValueError(f"sample {sample.key}: text must be non-empty, with no negative ids and none of the token "
                         f"roles' ids {roles.special_ids.tolist()} (byte text starts at {roles.first_free_id})")


def _check_rendered(sample: DecodedSample, layout: SampleLayout, spec: PackingSpec) -> None:
    """A rendered sample's placeholder tokens must be exactly its items' runs, in order: one more or one fewer and
    the encoder outputs would land on the wrong tokens (or fail the forward)."""
    tokens, targets = sample.tokens, sample.targets
    assert targets is not None
    if len(tokens) == 0 or len(targets) != len(tokens) or int(np.min(tokens)) < 0:
        raise ValueError(f"sample {sample.key}: a rendered sample needs non-empty, non-negative ids and one target "
                         f"flag per token ({len(tokens)} ids, {len(targets)} flags)")
    if not targets.any():
        raise ValueError(f"sample {sample.key}: no token to train on (no assistant turn or an empty caption)")
    expected = np.concatenate([np.full(spec.media_placeholders(m, shape), spec.roles.placeholder(m.name))
                               for m, _, shape in layout.media] or [np.zeros(0, dtype=np.int64)])
    ids = np.unique([i for _, i in spec.roles.placeholders])
    found = tokens[np.isin(tokens, ids)]
    if not np.array_equal(found, expected):
        raise ValueError(f"sample {sample.key}: its {len(found)} placeholder tokens do not match its media "
                         f"{[(m.name, shape) for m, _, shape in layout.media]} ({len(expected)} expected in order)")
    if targets[np.isin(tokens, ids)].any():
        raise ValueError(f"sample {sample.key}: a placeholder token is marked as a target")


def pack_samples(samples: list[DecodedSample], spec: PackingSpec = DEFAULT_PACKING) -> PackedBatch:
    """Pack ``samples`` into one micro-batch (layout: :mod:`omni_lightning.batch`); also ``keys`` (sample keys),
    ``sources`` (where each was read, :class:`~omni_lightning.data.position.SampleSource`), ``num_samples``, and
    the media lists of the encoders whose outputs the model assembles."""
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    roles = spec.roles
    ids: list[torch.Tensor] = []
    inputs: dict[str, list[list[np.ndarray]]] = {fmt.name: [[] for _ in fmt.inputs] for fmt in spec.encoders}
    media: dict[str, list[tuple[str, MediaShape]]] = {name: [] for name in spec.assembled_encoders}
    trained: list[torch.Tensor] = []
    for sample in samples:
        check_packable(sample, spec)
        layout = sample_layout(sample, spec)
        for modality, item, shape in layout.media:
            for rows, built in zip(inputs[modality.encoder], modality.build(item, spec), strict=True):
                rows.append(built)
            if modality.encoder in media:
                media[modality.encoder].append((modality.name, shape))
        if sample.targets is not None:
            ids.append(torch.from_numpy(sample.tokens.astype(np.int64)))
            trained.append(torch.from_numpy(sample.targets))
            continue
        sequence = [torch.tensor([roles.bos])] if roles.bos is not None else []
        for modality, _item, shape in layout.media:
            sequence.append(torch.full((spec.media_placeholders(modality, shape),), roles.placeholder(modality.name)))
        sequence.append(torch.from_numpy(sample.tokens.astype(np.int64)))
        ids.append(torch.cat(sequence))
        # The text trains; placeholders, BOS and padding never do.
        trained.append(~torch.isin(ids[-1], torch.from_numpy(roles.special_ids)))
    lengths = torch.tensor([len(x) for x in ids])
    input_ids = torch.cat(ids)
    # A label is the next token where that token trains.
    labels = torch.cat([torch.cat([torch.where(t[1:], x[1:], IGNORE_INDEX), torch.tensor([IGNORE_INDEX])])
                        for x, t in zip(ids, trained, strict=True)])
    batch: PackedBatch = {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": torch.cat([torch.arange(n) for n in lengths.tolist()]),
        "cu_seqlens": torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32),
    }
    for fmt in spec.encoders:
        for name, rows, empty in zip(fmt.input_names, inputs[fmt.name], fmt.empty(spec), strict=True):
            batch[input_key(fmt.name, name)] = torch.from_numpy(np.concatenate(rows) if rows else empty)
    batch.update({media_key(name): listed for name, listed in media.items()})
    batch.update(keys=[s.key for s in samples], sources=[s.source for s in samples], num_samples=len(samples))
    return batch


def empty_batch(spec: PackingSpec = DEFAULT_PACKING) -> PackedBatch:
    """A micro-batch of one filler token, no loss and no media: it still runs every module (all ranks issue the
    same collectives) but adds nothing to the step."""
    batch: PackedBatch = {"input_ids": torch.tensor([spec.roles.filler]), "labels": torch.tensor([IGNORE_INDEX]),
                          "position_ids": torch.zeros(1, dtype=torch.long),
                          "cu_seqlens": torch.tensor([0, 1], dtype=torch.int32), "keys": [], "sources": [],
                          "num_samples": 0}
    for fmt in spec.encoders:
        for name, empty in zip(fmt.input_names, fmt.empty(spec), strict=True):
            batch[input_key(fmt.name, name)] = torch.from_numpy(empty)
    batch.update({media_key(name): [] for name in spec.assembled_encoders})
    return batch


def data_counts(samples: Sequence[DecodedSample], batches: Sequence[PackedBatch], spec: PackingSpec,
                skipped: int = 0) -> dict[str, int]:
    """What ``samples`` (packed into ``batches``) put into a step: the :data:`DATA_COUNTS`, ``skipped`` given."""
    placeholder_ids = np.unique([i for _, i in spec.roles.placeholders])
    text = 0
    for sample in samples:
        text += int((~np.isin(sample.tokens, placeholder_ids)).sum()) if sample.targets is not None else len(
            sample.tokens)
    return {
        "samples": len(samples),
        "images": sum(len(s.media.get("image", ())) for s in samples),
        "video_frames": sum(int(np.shape(v)[0]) for s in samples for v in s.media.get("video", ())),
        "audio_clips": sum(len(s.media.get("audio", ())) for s in samples),
        "text_tokens": text,
        "loss_tokens": sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches),
        "skipped": skipped,
    }
