"""Webdataset samples in the layouts people already have, read as they are, decided sample by sample.

- ``pairs``: image-text pairs as image-text collection tools write them: ``KEY.jpg`` (``jpeg``, ``png``, ``webp``)
  with ``KEY.txt`` and/or ``KEY.json``; the caption is the json key configured (``caption_key``), else the ``txt``
  member, else the json's ``caption``.
- ``conversations``: a ``json`` member holding a dialogue (``conversations`` or ``messages``, in any form
  :func:`~omni_lightning.data.conversations.parse_dialogue` reads) whose media fields name members by their suffix
  (``"images": ["0.jpg"]`` for ``KEY.0.jpg``; also videos and audio clips).
- ``synthetic``: the project's own shards (:func:`~omni_lightning.data.streaming.decode_sample`).

A referenced member that is missing, a media member nothing references, a member whose header cannot be read, or a
sample no rule recognises raises ``ValueError`` naming it: the stream counts and logs it as a bad sample.

Reading plans from headers alone: each media item is a :class:`~omni_lightning.batch.PendingMedia` holding its
bytes and the shape it will decode to (an image's resized grid, a video's sampled frames, a clip's mel frames), which
is what the loader's plan prices and what the placeholders are counted from. Only the rank that trains a sample
decodes it, after the plan (:meth:`SampleReader.decode`). Headers can lie: a decoded video up to
:data:`VIDEO_FRAME_TOLERANCE` of its planned frames short (at least one temporal patch) is padded with its last frame,
an audio clip up to :data:`AUDIO_FRAME_TOLERANCE` short (at least one audio token) with its last mel frame, and
longer ones are trimmed to the plan; anything further off, or an image of another size, is a bad sample.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
from jinja2 import TemplateError

from omni_lightning.batch import PackingSpec, PendingMedia, SizedMedia
from omni_lightning.data.conversations import (
    MediaRef,
    RenderedDialogue,
    parse_dialogue,
    render_caption,
    render_dialogue,
)
from omni_lightning.data.media import (
    audio_duration,
    decode_audio,
    decode_image,
    decode_tiles,
    decode_video,
    image_size,
    log_mel,
    mel_frames,
    sample_frame_indices,
    tile_count,
    video_info,
)
from omni_lightning.data.packing import DecodedSample
from omni_lightning.data.processor import DataProcessor
from omni_lightning.data.streaming import decode_sample

__all__ = ["AUDIO_FRAME_TOLERANCE", "LAYOUTS", "Layout", "LayoutNeedsProcessor", "SampleReader",
           "VIDEO_FRAME_TOLERANCE", "detect_layout"]

Layout = Literal["auto", "pairs", "conversations", "synthetic"]
LAYOUTS = ("auto", "pairs", "conversations", "synthetic")
SUFFIXES = {"image": ("jpg", "jpeg", "png", "webp"), "video": ("mp4", "webm", "mkv", "mov", "avi"),
            "audio": ("wav", "flac", "mp3", "ogg")}
# How far a decoded item may fall short of the size its header promised and still be padded to it.
VIDEO_FRAME_TOLERANCE = 0.1
AUDIO_FRAME_TOLERANCE = 0.02
_SYNTHETIC_MEMBER = re.compile(r"^(tokens\.npy|video\.npy|mel\.npy|img\d+\.png)$")


class LayoutNeedsProcessor(RuntimeError):
    """The data holds samples its data module cannot render (a dialogue without a chat template): a setting to fix,
    not a bad sample to skip, so it stops the job."""


def _modality_of(member: str) -> str | None:
    suffix = member.rsplit(".", 1)[-1].lower()
    return next((m for m, suffixes in SUFFIXES.items() if suffix in suffixes), None)


def _members(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if not k.startswith("__")}


def _json(raw: Mapping[str, Any], key: str) -> Any:
    try:
        return json.loads(raw["json"])
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"sample {key}: its json member is not JSON ({error})") from None


def detect_layout(raw: Mapping[str, Any]) -> Literal["pairs", "conversations", "synthetic"]:
    """Which layout rule recognises a raw sample (its members); ``ValueError`` naming them when none does."""
    key, members = raw.get("__key__", "?"), _members(raw)
    record = _json(raw, key) if "json" in members else None
    if isinstance(record, dict) and ("conversations" in record or "messages" in record):
        return "conversations"
    if any(_SYNTHETIC_MEMBER.match(m) for m in members) or (isinstance(record, dict) and "text_tokens" in record):
        return "synthetic"
    if any(m in SUFFIXES["image"] for m in members) and ({"txt", "json"} & set(members)):
        return "pairs"
    raise ValueError(f"sample {key}: no layout recognises its members {sorted(members)} (image-text pairs need an "
                     f"image ({'/'.join(SUFFIXES['image'])}) with txt or json; conversations a json with "
                     "'conversations' or 'messages')")


def _text(value: Any, key: str, member: str) -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"sample {key}: {member} is not UTF-8 ({error})") from None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"sample {key}: {member} is empty or not text")
    return value


@dataclass(frozen=True)
class SampleReader:
    """Turns raw webdataset samples into :class:`DecodedSample` s for a model's packing, by their layout."""

    processor: DataProcessor
    spec: PackingSpec
    layout: Layout = "auto"
    caption_key: str | None = None
    legacy_tokenizer: Any = None  # the 0.1 ``tokenizer=`` of synthetic ``txt`` members

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} must be one of {LAYOUTS}")
        layout, image = self.spec.any_resolution, self.processor.image
        if layout is not None and (image.tile, image.pinpoints) != (layout.tile, layout.pinpoints):
            raise ValueError(f"the model tiles images into {layout.tile}-pixel tiles on the canvases "
                             f"{[list(p) for p in layout.pinpoints]}, but the processor at {self.processor.source} has "
                             f"tile={image.tile} and canvases {[list(p) for p in image.pinpoints]}: read the data with "
                             "the checkpoint's own processor")

    def __call__(self, raw: Mapping[str, Any]) -> DecodedSample:
        layout = detect_layout(raw) if self.layout == "auto" else self.layout
        if layout == "synthetic":
            return decode_sample(dict(raw), patch_size=self.spec.patch_size, tokenizer=self.legacy_tokenizer)
        if layout == "pairs":
            return self._pair(raw)
        return self._conversation(raw)

    # ------------------------------------------------------------------------------------------------ layouts
    def _pair(self, raw: Mapping[str, Any]) -> DecodedSample:
        key, members = raw.get("__key__", "?"), _members(raw)
        images = sorted(m for m in members if m in SUFFIXES["image"])
        if not images:
            raise ValueError(f"sample {key}: an image-text pair without an image member")
        record = _json(raw, key) if "json" in members else {}
        if self.caption_key is not None:
            if not isinstance(record, dict) or self.caption_key not in record:
                raise ValueError(f"sample {key}: its json has no caption key {self.caption_key!r}")
            caption = _text(record[self.caption_key], key, f"json[{self.caption_key!r}]")
        elif "txt" in members:
            caption = _text(members["txt"], key, "txt")
        elif isinstance(record, dict) and "caption" in record:
            caption = _text(record["caption"], key, "json['caption']")
        else:
            raise ValueError(f"sample {key}: no caption (no txt member, no 'caption' in its json; set caption_key)")
        refs = [MediaRef("image", m) for m in images]
        media = {"image": [self._plan(members[m], "image", key, m, alone=len(images) == 1) for m in images]}
        if self.processor.is_bytes:  # the prefix layout: [BOS] placeholders caption
            return DecodedSample(key, self.processor.encode(caption), media=media)
        rendered = render_caption(caption, self.processor.tokenizer, refs, self._placeholder_ids(refs),
                                  self._tokens_per_item(refs, media), bos_id=self.processor.roles.bos,
                                  eos_id=self.processor.roles.eos)
        return self._rendered(key, rendered, media)

    def _conversation(self, raw: Mapping[str, Any]) -> DecodedSample:
        key, members = raw.get("__key__", "?"), _members(raw)
        if not self.processor.has_chat_template:
            raise LayoutNeedsProcessor(
                f"sample {key} is a conversation, which is rendered with a tokenizer's chat template: pass "
                f"OmniDataModule(processor=PATH) with a tokenizer that has one (now: {self.processor.source})")
        try:
            dialogue = parse_dialogue(_json(raw, key))
        except ValueError as error:
            raise ValueError(f"sample {key}: {error}") from None
        referenced = [ref.source for ref in dialogue.media]
        if missing := [s for s in referenced if s not in members]:
            raise ValueError(f"sample {key}: its dialogue names members {missing} that the sample does not have "
                             f"(it has {sorted(members)})")
        if unreferenced := sorted(m for m in members if _modality_of(m) and m not in referenced):
            raise ValueError(f"sample {key}: media members {unreferenced} are not referenced by its dialogue")
        media: dict[str, list[Any]] = {}
        alone = sum(ref.modality == "image" for ref in dialogue.media) == 1
        for ref in dialogue.media:
            media.setdefault(ref.modality, []).append(self._plan(members[ref.source], ref.modality, key, ref.source,
                                                                 alone=alone))
        try:
            rendered = render_dialogue(dialogue, self.processor.tokenizer, self._placeholder_ids(dialogue.media),
                                       self._tokens_per_item(dialogue.media, media))
        except TemplateError as error:  # templates refuse dialogues they cannot render (roles must alternate, ...)
            raise ValueError(f"sample {key}: the chat template refuses it ({error})") from None
        return self._rendered(key, rendered, media)

    # ------------------------------------------------------------------------------------------------ helpers
    def _plan(self, data: bytes, modality: str, key: str, member: str, *, alone: bool = True) -> PendingMedia:
        """One media member with the shape it will decode to, read from its header alone (``alone``: the only
        image of its sample, which any-resolution tiling cuts into tiles)."""
        if not self.processor.is_bytes:
            try:
                self.processor.placeholder(modality)  # names the tokens looked for where the tokenizer has none
            except ValueError as error:
                raise ValueError(f"sample {key}: {member}: {error}") from None
        if modality not in self.spec.modality_names:
            raise ValueError(f"sample {key}: modality {modality!r} ({member}) has no encoder in this model (it "
                             f"encodes {list(self.spec.modality_names)})")
        processor = self.processor
        try:
            source: tuple[int, ...] = ()
            if modality == "image" and processor.image.tiled:
                crop, source = processor.image.tile_crop, image_size(data)
                shape: tuple[int, ...] = (tile_count(*source, processor.image, alone=alone), crop, crop, 3)
            elif modality == "image":
                shape = (*self._grid(*image_size(data)), 3)
            elif modality == "video":
                frames, fps, height, width = video_info(data)
                count = len(sample_frame_indices(frames, fps, processor.video, self.spec.temporal_patch_size))
                shape = (count, *self._grid(height, width), 3)
            else:
                samples, rate = audio_duration(data)
                frames = mel_frames(samples, rate, processor.audio)
                shape = (frames - frames % self.spec.audio_downsample, processor.audio.n_mels)
        except ValueError as error:
            raise ValueError(f"sample {key}: {member} cannot be read ({error})") from None
        if shape[0] == 0:
            raise ValueError(f"sample {key}: {member} is shorter than one {modality} token ({shape})")
        return PendingMedia(data, shape, member, source)

    def _grid(self, height: int, width: int) -> tuple[int, int]:
        image = self.processor.image
        if image.tiled:  # video frames: one tile's crop
            return image.tile_crop, image.tile_crop
        return image.frame_size(height, width)

    def decode(self, sample: DecodedSample) -> DecodedSample:
        """``sample`` with its pending media decoded and fitted to their planned shapes (see the module's docstring);
        ``ValueError`` naming the sample and the member where decoding fails or is too far off the plan."""
        if not any(isinstance(item, PendingMedia) for items in sample.media.values() for item in items):
            return sample
        media = {name: [self._decoded(item, name, sample.key) if isinstance(item, PendingMedia) else item
                        for item in items] for name, items in sample.media.items()}
        return replace(sample, media=media)

    def _decoded(self, item: PendingMedia, modality: str, key: str) -> np.ndarray | SizedMedia:
        processor = self.processor
        try:
            if modality == "image" and processor.image.tiled:
                crop = processor.image.tile_crop
                array = decode_tiles(item.data, processor.image, alone=item.shape[0] > 1)[:, :crop, :crop]
            elif modality == "image":
                array = decode_image(item.data, processor.image)
            elif modality == "video":
                array = decode_video(item.data, processor.video, processor.image, self.spec.temporal_patch_size)
            else:
                array = log_mel(decode_audio(item.data, processor.audio), processor.audio)
        except ValueError as error:
            raise ValueError(f"sample {key}: {item.member} cannot be decoded ({error})") from None
        planned = item.shape
        if array.shape[1:] != planned[1:] or (modality == "image" and array.shape != planned):
            raise ValueError(f"sample {key}: {item.member} decodes to shape {list(array.shape)}, its header "
                             f"promised {list(planned)}")
        if modality == "image" and processor.image.tiled:
            # The tiles keep the image's own size, which the model's layout of their outputs needs: from the bytes'
            # header, as the payload exchange moves a pending item's bytes and shape only.
            return SizedMedia(array, image_size(item.data))
        if modality == "image" or len(array) == planned[0]:
            return array
        unit = self.spec.temporal_patch_size if modality == "video" else self.spec.audio_downsample
        tolerance = VIDEO_FRAME_TOLERANCE if modality == "video" else AUDIO_FRAME_TOLERANCE
        short = planned[0] - len(array)
        if short > max(unit, math.ceil(tolerance * planned[0])):
            raise ValueError(f"sample {key}: {item.member} decodes to {len(array)} frames, {short} fewer than the "
                             f"{planned[0]} its header promised")
        if short < 0:
            return array[: planned[0]]
        return np.concatenate([array, np.repeat(array[-1:], short, axis=0)])

    def _placeholder_ids(self, refs: Sequence[MediaRef]) -> dict[str, int]:
        return {m: self.processor.placeholder(m) for m in dict.fromkeys(ref.modality for ref in refs)}

    def _tokens_per_item(self, refs: Sequence[MediaRef], media: Mapping[str, list[Any]]) -> list[int]:
        """Each item's placeholder count, in reference order: what its encoder outputs for its size."""
        by_name, seen, counts = {m.name: m for m in self.spec.modalities}, {}, []
        for ref in refs:
            index = seen[ref.modality] = seen.get(ref.modality, -1) + 1
            modality = by_name[ref.modality]
            counts.append(self.spec.media_placeholders(modality, modality.shape(media[ref.modality][index], self.spec)))
        return counts

    def _rendered(self, key: str, rendered: RenderedDialogue, media: dict[str, list[Any]]) -> DecodedSample:
        seen: dict[str, int] = {}
        order = []
        for ref in rendered.media:
            seen[ref.modality] = seen.get(ref.modality, -1) + 1
            order.append((ref.modality, seen[ref.modality]))
        return DecodedSample(key, rendered.input_ids, media=media, targets=rendered.targets, media_order=order)
