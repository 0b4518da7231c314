"""Webdataset samples in the layouts people already have, read as they are, decided sample by sample.

- ``pairs``: image-text pairs as image-text collection tools write them: ``KEY.jpg`` (``jpeg``, ``png``, ``webp``)
  with ``KEY.txt`` and/or ``KEY.json``; the caption is the json key configured (``caption_key``), else the ``txt``
  member, else the json's ``caption``.
- ``conversations``: a ``json`` member holding a dialogue (``conversations`` or ``messages``, in any form
  :func:`~omni_lightning.data.conversations.parse_dialogue` reads) whose media fields name members by their suffix
  (``"images": ["0.jpg"]`` for ``KEY.0.jpg``; also videos and audio clips).
- ``synthetic``: the project's own shards (:func:`~omni_lightning.data.streaming.decode_sample`).

A referenced member that is missing, a media member nothing references, a member that cannot be decoded, or a
sample no rule recognises raises ``ValueError`` naming it: the stream counts and logs it as a bad sample.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from omni_lightning.batch import PackingSpec
from omni_lightning.data.conversations import (
    MediaRef,
    RenderedDialogue,
    parse_dialogue,
    render_caption,
    render_dialogue,
)
from omni_lightning.data.media import decode_audio, decode_image, decode_video, log_mel
from omni_lightning.data.packing import DecodedSample
from omni_lightning.data.processor import DataProcessor
from omni_lightning.data.streaming import decode_sample

__all__ = ["LAYOUTS", "Layout", "LayoutNeedsProcessor", "SampleReader", "detect_layout"]

Layout = Literal["auto", "pairs", "conversations", "synthetic"]
LAYOUTS = ("auto", "pairs", "conversations", "synthetic")
SUFFIXES = {"image": ("jpg", "jpeg", "png", "webp"), "video": ("mp4", "webm", "mkv", "mov", "avi"),
            "audio": ("wav", "flac", "mp3", "ogg")}
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
        media = {"image": [self._decode(members[m], "image", key, m) for m in images]}
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
        for ref in dialogue.media:
            media.setdefault(ref.modality, []).append(self._decode(members[ref.source], ref.modality, key, ref.source))
        rendered = render_dialogue(dialogue, self.processor.tokenizer, self._placeholder_ids(dialogue.media),
                                   self._tokens_per_item(dialogue.media, media))
        return self._rendered(key, rendered, media)

    # ------------------------------------------------------------------------------------------------ helpers
    def _decode(self, data: bytes, modality: str, key: str, member: str) -> np.ndarray:
        """One media member as the model's packing takes it."""
        if modality not in self.spec.modality_names:
            raise ValueError(f"sample {key}: modality {modality!r} ({member}) has no encoder in this model (it "
                             f"encodes {list(self.spec.modality_names)})")
        processor = self.processor
        try:
            if modality == "image":
                return decode_image(data, processor.image)
            if modality == "video":
                return decode_video(data, processor.video, processor.image, self.spec.temporal_patch_size)
            mel = log_mel(decode_audio(data, processor.audio), processor.audio)
        except ValueError as error:
            raise ValueError(f"sample {key}: {member} cannot be decoded ({error})") from None
        frames = len(mel) - len(mel) % self.spec.audio_downsample  # the stem downsamples whole groups of frames
        if frames == 0:
            raise ValueError(f"sample {key}: {member} is shorter than one audio token ({len(mel)} mel frames)")
        return mel[:frames]

    def _placeholder_ids(self, refs: Sequence[MediaRef]) -> dict[str, int]:
        return {m: self.processor.placeholder(m) for m in dict.fromkeys(ref.modality for ref in refs)}

    def _tokens_per_item(self, refs: Sequence[MediaRef], media: Mapping[str, list[Any]]) -> list[int]:
        """Each item's placeholder count, in reference order: what its encoder outputs for its size."""
        by_name, seen, counts = {m.name: m for m in self.spec.modalities}, {}, []
        for ref in refs:
            index = seen[ref.modality] = seen.get(ref.modality, -1) + 1
            modality = by_name[ref.modality]
            counts.append(sum(self.spec.placeholders(modality, modality.shape(media[ref.modality][index], self.spec))))
        return counts

    def _rendered(self, key: str, rendered: RenderedDialogue, media: dict[str, list[Any]]) -> DecodedSample:
        seen: dict[str, int] = {}
        order = []
        for ref in rendered.media:
            seen[ref.modality] = seen.get(ref.modality, -1) + 1
            order.append((ref.modality, seen[ref.modality]))
        return DecodedSample(key, rendered.input_ids, media=media, targets=rendered.targets, media_order=order)
