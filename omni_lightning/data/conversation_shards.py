"""Webdataset shards of conversations (the ``conversations`` layout of :mod:`omni_lightning.data.layouts`) from a
JSON or JSONL file of dialogues in any form :func:`~omni_lightning.data.conversations.parse_dialogue` reads and the
folder its media paths are relative to.

Media bytes are stored as they are (no re-encoding), one member per distinct file, ``KEY.{i}.{ext}``, and the
dialogue's media paths are rewritten to those member suffixes (``"images": ["0.jpg"]``), so the shard holds the
user's own record otherwise unchanged.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omni_lightning.data.conversations import MODALITIES, parse_dialogue
from omni_lightning.data.jsonl import write_shards

__all__ = ["conversations_to_shards"]

_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
# The top-level media fields of the LLaVA and ShareGPT forms, by modality.
_FIELDS = {"image": ("image", "images"), "video": ("video", "videos"), "audio": ("audio", "audios")}


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` of a JSON list or a JSONL file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON ({error})") from None
        if not isinstance(records, list):
            raise ValueError(f"{path}: a JSON file of conversations holds a list, not a {type(records).__name__}")
        yield from ((f"{path}[{i}]", record) for i, record in enumerate(records))
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error})") from None


def _rewritten(record: dict[str, Any], members: dict[str, str]) -> dict[str, Any]:
    """The record with every media path replaced by its member suffix."""
    out = dict(record)
    for fields in _FIELDS.values():
        for name in fields:
            if isinstance(out.get(name), str):
                out[name] = members[out[name]]
            elif isinstance(out.get(name), list):
                out[name] = [members[p] if isinstance(p, str) else p for p in out[name]]
    if isinstance(out.get("messages"), list):
        out["messages"] = [_rewritten_message(m, members) for m in out["messages"]]
    return out


def _rewritten_message(message: Any, members: dict[str, str]) -> Any:
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    parts = []
    for part in message["content"]:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MODALITIES and isinstance(part.get(kind), str):
            part = {**part, kind: members[part[kind]]}
        parts.append(part)
    return {**message, "content": parts}


def _sample(record: Any, key: str, root: Path, seen: set[str]) -> dict[str, Any]:
    """One dialogue as a webdataset sample: its media files as members, its record with their suffixes."""
    dialogue = parse_dialogue(record)
    if key in seen or not _KEY.match(key):
        raise ValueError(f"id {key!r} is repeated or not made of letters, digits, - and _")
    seen.add(key)
    members: dict[str, str] = {}
    sample: dict[str, Any] = {"__key__": key}
    for ref in dialogue.media:
        if ref.source not in members:
            file = root / ref.source
            if not file.is_file():
                raise ValueError(f"{ref.modality} {ref.source!r} is not a file under {root}")
            members[ref.source] = f"{len(members)}{file.suffix.lower()}"
            sample[members[ref.source]] = file.read_bytes()
    sample["json"] = json.dumps(_rewritten(record, members), ensure_ascii=False).encode("utf-8")
    return sample


def conversations_to_shards(source: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                            media_root: str | os.PathLike[str] | None = None, samples_per_shard: int = 64,
                            prefix: str = "train") -> list[str]:
    """Write ``out_dir/{prefix}-{i:06d}.tar`` from the dialogues of ``source`` (``.json`` list or ``.jsonl``) and
    the media under ``media_root`` (default: ``source``'s folder); returns the shard paths. A record that does not
    parse, a missing media file or a bad id stops the conversion naming the record."""
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard={samples_per_shard} must be at least 1")
    source = Path(source)
    root = Path(media_root) if media_root is not None else source.parent
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()

    def samples() -> Iterator[dict[str, Any]]:
        for index, (where, record) in enumerate(_records(source)):
            try:
                yield _sample(record, str(record.get("id", f"{index:08d}")) if isinstance(record, dict) else "",
                              root, seen)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None

    paths = write_shards(samples(), out, prefix=prefix, samples_per_shard=samples_per_shard)
    if not paths:
        raise ValueError(f"{source}: no conversations")
    return paths
