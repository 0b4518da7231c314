"""Dialogue samples -> token ids with media placeholder runs in place and a target mask, via the tokenizer's own chat
template (pure logic: no torch, no process groups, no Lightning).

Three record forms are read by :func:`parse_dialogue`:

* LLaVA: ``{"image": "a.jpg" | [...], "video": ..., "conversations": [{"from": "human", "value": "<image>..."}]}``
  (roles human, gpt, system). Images without any ``<image>`` marker go to the start of the first user turn, as
  LLaVA's own preprocessing puts them. A video-only record whose text has ``<image>`` but no ``<video>`` markers uses
  ``<image>`` as the video's marker, as LLaVA-NeXT-Video and LLaVA-Video-178K write it.
* LLaMA-Factory multimodal ShareGPT: ``{"messages": [{"role": "user", "content": "<image>..."}], "images": [...],
  "videos": [...], "audios": [...]}``; ``from``/``value`` keys, human/gpt roles and a ``conversations`` column are
  tolerated as LLaMA-Factory tolerates them. ``<image>``, ``<video>``, ``<audio>`` markers, same rules per modality.
* Typed content parts, as Hugging Face chat templates take them: ``{"messages": [{"role": "user", "content":
  [{"type": "image", "image": "a.jpg"}, {"type": "text", "text": "..."}]}]}`` (a content may be a plain string,
  whose ``<image>`` is then just text).

Markers become typed parts, so the chat template writes its own wrappers around each media item (Qwen2-VL:
``<|vision_start|><|image_pad|><|vision_end|>``). :func:`render_dialogue` renders with the template, expands each
item's single placeholder token to the item's token count, and marks the assistant turns as targets;
:func:`render_caption` lays out image-text pairs that have no dialogue at all.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "MODALITIES",
    "Dialogue",
    "MediaRef",
    "Message",
    "RenderedDialogue",
    "parse_dialogue",
    "render_caption",
    "render_dialogue",
]

MODALITIES = ("image", "video", "audio")

_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}
_LLAVA, _SHAREGPT, _TYPED = "LLaVA", "ShareGPT", "typed-parts"
# The same test transformers applies before it tracks a template's assistant spans (chat_template_utils.py).
_GENERATION = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


@dataclass(frozen=True)
class MediaRef:
    """One media item of a sample: its modality and its path or member name exactly as the sample gives it."""

    modality: str
    source: str


@dataclass(frozen=True)
class Message:
    """One turn: its role (system, user, assistant) and its typed content parts, as HF chat templates take them:
    ``{"type": "text", "text": ...}`` or ``{"type": m, m: source}`` for a media item of modality ``m``."""

    role: str
    parts: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Dialogue:
    """A parsed sample: its turns and its media items, in the order their parts appear in the turns."""

    messages: tuple[Message, ...]
    media: tuple[MediaRef, ...]


@dataclass(frozen=True)
class RenderedDialogue:
    """A tokenized sample: ``input_ids`` (int64 ``[T]``) with each media item's placeholder expanded in place to its
    token count, ``targets`` (bool ``[T]``, True on the tokens the loss trains on), the media in placeholder order,
    and the ``[start, end)`` run of each item's placeholders in ``input_ids``."""

    input_ids: np.ndarray
    targets: np.ndarray
    media: tuple[MediaRef, ...]
    placeholder_spans: tuple[tuple[int, int], ...]


# ---------------------------------------------------------------------------------------------------------- parsing


def _show(value: Any) -> str:
    """A short repr for error messages: a fuzzed record can hold megabytes."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _text(value: Any) -> dict[str, Any]:
    return {"type": "text", "text": value}


def _finish(parts: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """Drop empty text parts (the gaps between adjacent markers), keeping one if the turn would be left empty, so the
    template still writes the turn."""
    kept = [p for p in parts if p["type"] != "text" or p["text"]]
    return tuple(kept) if kept else (_text(""),)


def _role_and_content(turn: Any, i: int, form: str) -> tuple[str, Any]:
    if not isinstance(turn, Mapping):
        raise ValueError(f"{form} record: turn {i} is a {type(turn).__name__}, not a mapping")
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    if role is None:
        raise ValueError(f"{form} record: turn {i} has no 'role' (or 'from')")
    if not isinstance(role, str) or role not in _ROLES:
        raise ValueError(f"{form} record: turn {i} has unknown role {_show(role)} (known: {', '.join(_ROLES)})")
    if content is None:
        raise ValueError(f"{form} record: turn {i} has no 'content' (or 'value')")
    return _ROLES[role], content


def _sources(record: Mapping[str, Any], form: str) -> dict[str, list[str]]:
    """The media paths of a marker-form record per modality; a LLaVA record keys them singular, ShareGPT plural."""
    out: dict[str, list[str]] = {}
    for m in MODALITIES:
        key = m if m in record else f"{m}s"
        value = record.get(key)
        items = [] if value is None else [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
            raise ValueError(f"{form} record: {key!r} must be a path or a list of non-empty path strings, "
                             f"got {_show(value)}")
        out[m] = items
    return out


def _parse_marked(record: Mapping[str, Any], turns: list[Any], form: str) -> tuple[list[Message], list[MediaRef]]:
    rows = [_role_and_content(turn, i, form) for i, turn in enumerate(turns)]
    for i, (role, content) in enumerate(rows):
        if not isinstance(content, str):
            raise ValueError(f"{form} record: turn {i} ({role}) text must be a string, got {_show(content)}")
    sources = _sources(record, form)
    markers = {f"<{m}>": m for m in MODALITIES}
    if (form == _LLAVA and sources["video"] and not sources["image"]
            and not any("<video>" in text for _, text in rows)):
        markers = {"<image>": "video", "<audio>": "audio"}
    marker_of = {m: marker for marker, m in markers.items()}
    split = re.compile("(" + "|".join(map(re.escape, markers)) + ")")
    # Each turn as pieces: str for text, (modality,) for a marker; split() puts the markers at odd indices.
    pieces: list[list[Any]] = [
        [(markers[p],) if k % 2 else p for k, p in enumerate(split.split(text))] for _, text in rows
    ]
    found = {m: sum(p == (m,) for turn in pieces for p in turn) for m in MODALITIES}
    prepend: list[tuple[str]] = []
    for m in MODALITIES:
        if found[m] == 0 and sources[m]:
            prepend += [(m,)] * len(sources[m])
        elif found[m] != len(sources[m]):
            raise ValueError(f"{form} record: {found[m]} {marker_of.get(m, f'<{m}>')} marker(s) in the text but "
                             f"{len(sources[m])} {m} item(s)")
    if prepend:
        first_user = next((i for i, (role, _) in enumerate(rows) if role == "user"), None)
        if first_user is None:
            raise ValueError(f"{form} record: media without markers but no user turn to put them in")
        pieces[first_user][:0] = prepend
    taken = dict.fromkeys(MODALITIES, 0)
    messages, media = [], []
    for (role, _), turn in zip(rows, pieces, strict=True):
        parts = []
        for piece in turn:
            if isinstance(piece, str):
                parts.append(_text(piece))
                continue
            m = piece[0]
            source = sources[m][taken[m]]
            taken[m] += 1
            parts.append({"type": m, m: source})
            media.append(MediaRef(m, source))
        messages.append(Message(role, _finish(parts)))
    return messages, media


def _parse_typed(turns: list[Any], form: str) -> tuple[list[Message], list[MediaRef]]:
    messages, media = [], []
    for i, turn in enumerate(turns):
        role, content = _role_and_content(turn, i, form)
        raw = [_text(content)] if isinstance(content, str) else content
        if not isinstance(raw, list):
            raise ValueError(f"{form} record: turn {i} content must be a string or a list of parts, got "
                             f"{_show(content)}")
        parts = []
        for j, part in enumerate(raw):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{form} record: turn {i} part {j} text must be a string, got "
                                     f"{_show(part.get('text'))}")
                parts.append(_text(part["text"]))
            elif isinstance(kind, str) and kind in MODALITIES:
                # HF processors also accept the path under "path" or "url".
                source = next((part[k] for k in (kind, "path", "url") if k in part), None)
                if not isinstance(source, str) or not source:
                    raise ValueError(f"{form} record: turn {i} part {j} ({kind}) needs a path string under "
                                     f"{kind!r}, got {_show(source)}")
                parts.append({"type": kind, kind: source})
                media.append(MediaRef(kind, source))
            else:
                raise ValueError(f"{form} record: turn {i} part {j} must be a mapping with 'type' one of "
                                 f"text, {', '.join(MODALITIES)}; got {_show(part)}")
        messages.append(Message(role, _finish(parts)))
    return messages, media


def parse_dialogue(record: Mapping[str, Any]) -> Dialogue:
    """Read one sample in the LLaVA, LLaMA-Factory ShareGPT or typed-parts form (module docstring) into a
    :class:`Dialogue`.

    Raises ``ValueError`` naming the problem and the form it detected for anything else: no dialogue list, an empty
    one, a turn that is not a mapping, an unknown role, non-string text, media paths that are not strings, marker and
    media counts that differ, no assistant turn.
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"a dialogue record must be a mapping, got {type(record).__name__}")
    keys = [k for k in ("conversations", "messages") if k in record]
    if len(keys) != 1:
        what = "both 'conversations' and 'messages'" if keys else "neither 'conversations' nor 'messages'"
        raise ValueError(f"record has {what}; keys: {_show(sorted(map(str, record)))}")
    turns = record[keys[0]]
    singular = [m for m in MODALITIES if m in record]
    plural = [f"{m}s" for m in MODALITIES if f"{m}s" in record]
    typed = isinstance(turns, list) and any(
        isinstance(t, Mapping) and isinstance(t.get("content", t.get("value")), list) for t in turns)
    form = _TYPED if typed else _LLAVA if keys[0] == "conversations" and not plural else _SHAREGPT
    if not isinstance(turns, list):
        raise ValueError(f"{form} record: {keys[0]!r} must be a list of turns, got {_show(turns)}")
    if not turns:
        raise ValueError(f"{form} record: empty dialogue")
    if singular and plural:
        raise ValueError(f"{form} record: both {singular} and {plural} media keys; which are the media?")
    if typed and (singular or plural):
        raise ValueError(f"{form} record: media keys {singular + plural} beside typed parts, which carry their media")
    messages, media = _parse_typed(turns, form) if typed else _parse_marked(record, turns, form)
    if not any(m.role == "assistant" for m in messages):
        raise ValueError(f"{form} record: no assistant turn (roles: {', '.join(m.role for m in messages)})")
    return Dialogue(tuple(messages), tuple(media))


# -------------------------------------------------------------------------------------------------------- rendering


def _counts(tokens_per_item: Sequence[int], media: Sequence[MediaRef]) -> list[int]:
    counts = [operator.index(n) for n in tokens_per_item]
    if len(counts) != len(media) or any(n < 1 for n in counts):
        raise ValueError(f"tokens_per_item must hold one positive count per media item: {len(media)} item(s), "
                         f"got {counts}")
    return counts


def _placeholders(tokenizer: Any, placeholder_ids: Mapping[str, int], media: Sequence[MediaRef],
                  texts: Sequence[str]) -> dict[int, str]:
    """Placeholder id -> modality, after checking that every item's modality has one and that no text spells one
    (a user typing ``<|image_pad|>`` would otherwise become a phantom item)."""
    ids = {m: operator.index(i) for m, i in placeholder_ids.items()}
    missing = sorted({r.modality for r in media} - ids.keys())
    if missing:
        raise ValueError(f"no placeholder id for modality {', '.join(missing)} (placeholder_ids: {dict(ids)})")
    if len(set(ids.values())) != len(ids):
        raise ValueError(f"placeholder ids must differ per modality, got {dict(ids)}")
    for m, i in ids.items():
        added = getattr(tokenizer, "added_tokens_decoder", {}).get(i)
        spelled = added.content if added is not None else tokenizer.decode([i])
        # Refuse rather than escape: a literal placeholder in the text is nearly always a preprocessing bug (markers
        # inserted twice), and an escape would feed the model text its tokenizer never produces.
        for text in texts:
            if spelled and spelled in text:
                raise ValueError(f"a text contains the {m} placeholder token {spelled!r}, which would read as a "
                                 f"phantom {m} item: {_show(text)}")
    return {i: m for m, i in ids.items()}


def _expand(ids: np.ndarray, targets: np.ndarray, media: tuple[MediaRef, ...], modality_of: Mapping[int, str],
            counts: Sequence[int]) -> RenderedDialogue:
    """Check one placeholder per media item, in order, then repeat each to its item's token count."""
    at = np.flatnonzero(np.isin(ids, list(modality_of)))
    found = [modality_of[int(ids[p])] for p in at]
    expected = [r.modality for r in media]
    if found != expected:
        for m in dict.fromkeys(expected + found):
            if found.count(m) != expected.count(m):
                raise ValueError(f"the rendered dialogue has {found.count(m)} {m} placeholder token(s) for "
                                 f"{expected.count(m)} {m} item(s): the chat template drops, repeats or adds them")
        raise ValueError(f"placeholders render in the order {found}, the media are {expected}")
    repeat = np.ones(len(ids), dtype=np.int64)
    repeat[at] = counts
    targets = targets.copy()
    targets[at] = False  # a placeholder stands for encoder output, which is never a next-token target
    starts = np.cumsum(repeat) - repeat
    spans = tuple((int(starts[p]), int(starts[p]) + n) for p, n in zip(at, counts, strict=True))
    return RenderedDialogue(np.repeat(ids, repeat), np.repeat(targets, repeat), media, spans)


def _assistant_spans(tokenizer: Any, messages: list[dict[str, Any]], template: str,
                     rendered: str) -> list[tuple[int, int]]:
    """The character span each assistant turn's content occupies in ``rendered``.

    Searching for the content would be fooled by short texts (an assistant "a" matches inside "<|im_start|>
    assistant"), so the dialogue is rendered once more with each assistant text replaced by a numbered sentinel: the
    sentinel render is wrappers W0 S0 W1 S1 ... Wn, and since the template wrote the same wrappers around the real
    texts, ``rendered`` must read W0 X0 W1 X1 ... Wn with each Xi the text as given (or trimmed, for templates that
    trim). A template that reorders, repeats or rewrites the texts fails this check: give it a generation region.
    """
    texts = [p["text"] for m in messages if m["role"] == "assistant" for p in m["content"]]
    tag = "\ue000omni"  # private-use characters: no template or sample text uses them, checked below anyway
    while tag in template or any(tag in p.get("text", "") for m in messages for p in m["content"]):
        tag += "\ue000"
    probe, n = [], 0
    for m in messages:
        if m["role"] == "assistant":
            content = []
            for _ in m["content"]:
                content.append(_text(f"{tag}{n}\ue001"))
                n += 1
            m = {**m, "content": content}
        probe.append(m)
    probed = tokenizer.apply_chat_template(probe, chat_template=template, tokenize=False)
    pieces = re.split(re.escape(tag) + "(\\d+)\ue001", probed)
    wrappers, order = pieces[::2], [int(k) for k in pieces[1::2]]
    unfit = ValueError("the chat template reorders, repeats, drops or rewrites the assistant text, so its targets "
                       "cannot be located; give the template a {% generation %} region around assistant content")
    if order != list(range(len(texts))) or not rendered.startswith(wrappers[0]):
        raise unfit
    spans, pos = [], len(wrappers[0])
    for k, text in enumerate(texts):
        after = wrappers[k + 1]
        last = k == len(texts) - 1
        for written in dict.fromkeys((text, text.strip(), text.rstrip(), text.lstrip())):
            end = pos + len(written)
            if (rendered.startswith(written, pos) and rendered.startswith(after, end)
                    and (not last or end + len(after) == len(rendered))):
                break
        else:
            raise unfit
        spans.append((pos, end))
        pos = end + len(after)
    # One span per turn: from its first text's start to its last text's end.
    out, k = [], 0
    for m in messages:
        if m["role"] == "assistant":
            out.append((spans[k][0], spans[k + len(m["content"]) - 1][1]))
            k += len(m["content"])
    return out


def render_dialogue(dialogue: Dialogue, tokenizer: Any, placeholder_ids: Mapping[str, int],
                    tokens_per_item: Sequence[int], *, chat_template: str | None = None) -> RenderedDialogue:
    """Render ``dialogue`` with the tokenizer's chat template (or ``chat_template``) into a :class:`RenderedDialogue`.

    The ids are exactly ``tokenizer.apply_chat_template(messages, tokenize=True)``, then each media item's single
    placeholder token (``placeholder_ids[modality]``, which the template writes for its part) is expanded in place
    to ``tokens_per_item[i]`` copies.

    Targets: where the template has a ``{% generation %}`` region, exactly the tokens transformers' assistant-token
    mask marks (``return_assistant_tokens_mask``: every token overlapping a region). Without one: every token
    overlapping an assistant turn's content, plus the token holding the first character the template writes after
    it (its end-of-turn token, ``<|im_end|>`` in ChatML), so a region around content and end token gives the same
    mask. The content is located by character offsets in the rendered string (:func:`_assistant_spans`), never by
    tokenizing pieces, since BPE merges across piece boundaries. Placeholders are never targets.

    Raises ``TypeError`` for a tokenizer without offsets (not a fast tokenizer): a setup error, not a bad sample.
    Raises ``ValueError`` for a sample this cannot render: a text spelling a placeholder token, a template that does
    not write exactly one placeholder per media item in order, missing placeholder ids or counts, and (without a
    generation region) media parts in an assistant turn, whose targets only a region defines.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(f"render_dialogue needs a fast (tokenizers-backed) tokenizer for character offsets, got "
                        f"{type(tokenizer).__name__}")
    counts = _counts(tokens_per_item, dialogue.media)
    texts = [p["text"] for m in dialogue.messages for p in m.parts if p.get("type") == "text"]
    modality_of = _placeholders(tokenizer, placeholder_ids, dialogue.media, texts)
    template = tokenizer.get_chat_template(chat_template)
    messages = [{"role": m.role, "content": [dict(p) for p in m.parts]} for m in dialogue.messages]
    if _GENERATION.search(template):
        out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids = np.asarray(out["input_ids"], dtype=np.int64)
        targets = np.asarray(out["assistant_masks"], dtype=bool)
        return _expand(ids, targets, dialogue.media, modality_of, counts)
    for m in messages:
        if m["role"] == "assistant" and (not m["content"] or any(p.get("type") != "text" for p in m["content"])):
            raise ValueError("an assistant turn holds a media part or no part at all; without a {% generation %} "
                             "region in the chat template its targets are undefined")
    rendered = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    # What apply_chat_template(tokenize=True) does with the rendered string, plus the offsets.
    encoded = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    offsets = np.asarray(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    targets = np.zeros(len(ids), dtype=bool)
    for start, end in _assistant_spans(tokenizer, messages, template, rendered):
        stop = min(end + 1, len(rendered))  # one character past the content: the end-of-turn token's first
        targets |= (offsets[:, 0] < stop) & (offsets[:, 1] > start)
    return _expand(ids, targets, dialogue.media, modality_of, counts)


def render_caption(text: str, tokenizer: Any, media: Sequence[MediaRef], placeholder_ids: Mapping[str, int],
                   tokens_per_item: Sequence[int], *, bos_id: int | None, eos_id: int | None) -> RenderedDialogue:
    """Lay out an image-text pair without markers or turns: ``[bos] + each item's placeholder run + caption tokens
    + [eos]`` (``None`` leaves bos or eos out). Targets are the caption tokens and eos.

    Raises ``ValueError`` for a non-string caption, a caption spelling or tokenizing to a placeholder token, and
    missing placeholder ids or counts.
    """
    if not isinstance(text, str):
        raise ValueError(f"a caption must be a string, got {_show(text)}")
    media = tuple(media)
    counts = _counts(tokens_per_item, media)
    modality_of = _placeholders(tokenizer, placeholder_ids, media, [text])
    caption = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    if any(t in modality_of for t in caption):
        raise ValueError(f"the caption tokenizes to a placeholder token: {_show(text)}")
    id_of = {m: i for i, m in modality_of.items()}
    head = ([] if bos_id is None else [operator.index(bos_id)]) + [id_of[r.modality] for r in media]
    tail = caption + ([] if eos_id is None else [operator.index(eos_id)])
    ids = np.asarray(head + tail, dtype=np.int64)
    targets = np.arange(len(ids)) >= len(head)
    return _expand(ids, targets, media, modality_of, counts)
