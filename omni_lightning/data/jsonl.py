"""Convert a JSONL manifest with an image (and mel) folder into the webdataset shards OmniDataModule streams.

One line per sample::

    {"id": "cat-001", "text": "A cat on a mat.", "images": ["cats/001.jpg"], "audio": "mels/001.npy"}

``text`` is required; ``images`` (paths to anything PIL opens) and ``audio`` (a float ``[frames, n_mels]`` mel
spectrogram saved with ``numpy.save``) are optional and relative to ``root`` (the manifest's folder by default);
``id`` defaults to the line number. Images are resized, keeping their aspect ratio, to whole 2x2-mergeable patch
grids with at most ``max_side`` pixels a side; mel clips are cut to a multiple of the audio merge (4 frames). The
text is tokenized here (bytes by default), so the metadata the loader balances with is exact. A line that cannot
be converted stops the conversion with its line number and the reason: fix the manifest, then rerun.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from webdataset import TarWriter

from omni_lightning.balance.workload import SampleMeta
from omni_lightning.data.streaming import ByteTokenizer, Tokenizer
from omni_lightning.data.synthetic import npy_bytes, png_bytes

__all__ = ["jsonl_to_shards", "write_shard", "write_shards"]

_MERGE = (("audio", 4), ("image", 4), ("video", 4))
# webdataset splits a member name at its first dot, and keys become file names inside the tar.
_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _resized(path: Path, patch_size: int, max_side: int) -> np.ndarray:
    """RGB pixels resized to a grid of whole patches, both sides even (2x2 merge), longest side <= max_side."""
    with Image.open(path) as image:
        rgb = image.convert("RGB")
    unit = 2 * patch_size
    scale = min(1.0, max_side / max(rgb.size))
    width, height = (max(unit, round(side * scale / unit) * unit) for side in rgb.size)
    return np.asarray(rgb.resize((width, height), Image.Resampling.BICUBIC))


def _sample(record: dict[str, Any], key: str, root: Path, *, patch_size: int, max_side: int, n_mels: int,
            tokenizer: Tokenizer) -> dict[str, Any]:
    if not isinstance(record.get("text"), str) or not record["text"]:
        raise ValueError("'text' must be a non-empty string")
    tokens = np.asarray(tokenizer.encode(record["text"]), dtype=np.int32)
    images = [_resized(root / name, patch_size, max_side) for name in record.get("images", [])]
    sample: dict[str, Any] = {"__key__": key}
    for i, pixels in enumerate(images):
        sample[f"img{i}.png"] = png_bytes(pixels)
    frames = 0
    if record.get("audio"):
        mel = np.load(root / record["audio"], allow_pickle=False)
        if mel.ndim != 2 or mel.shape[1] != n_mels:
            raise ValueError(f"{record['audio']}: a mel spectrogram must be [frames, {n_mels}], got {mel.shape}")
        frames = mel.shape[0] - mel.shape[0] % 4
        if frames == 0:
            raise ValueError(f"{record['audio']}: fewer than 4 mel frames")
        sample["mel.npy"] = npy_bytes(mel[:frames].astype(np.float16))
    modality = "image" if images else "audio" if frames else "text"
    grids = tuple((p.shape[0] // patch_size, p.shape[1] // patch_size) for p in images)
    meta = SampleMeta(modality, len(tokens), images=grids, audio_frames=frames, merge=_MERGE)
    sample["json"] = json.dumps(meta.to_json()).encode()
    sample["tokens.npy"] = npy_bytes(tokens)
    return sample


def _records(manifest: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with manifest.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{manifest}:{number}: not JSON ({error})") from None


def write_shard(path: Path, samples: list[dict[str, Any]]) -> None:
    """Write under a temporary name and rename, so an interrupted conversion leaves no shard that looks whole."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as stream, TarWriter(stream, encoder=False, mtime=0) as writer:
            for sample in samples:
                writer.write(sample)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_shards(samples: Iterable[dict[str, Any]], out_dir: Path, *, prefix: str, samples_per_shard: int
                 ) -> list[str]:
    """Write ``samples`` as ``out_dir/{prefix}-{i:06d}.tar`` shards of ``samples_per_shard`` each (the last may
    hold fewer), each through :func:`write_shard`; returns their paths."""
    paths: list[str] = []
    pending: list[dict[str, Any]] = []

    def flush() -> None:
        paths.append(str(out_dir / f"{prefix}-{len(paths):06d}.tar"))
        write_shard(Path(paths[-1]), pending)
        pending.clear()

    for sample in samples:  # one shard's samples in memory at a time
        pending.append(sample)
        if len(pending) == samples_per_shard:
            flush()
    if pending:
        flush()
    return paths


def jsonl_to_shards(
    manifest: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    samples_per_shard: int = 64,
    patch_size: int = 14,
    max_side: int = 448,
    n_mels: int = 80,
    tokenizer: Tokenizer | None = None,
    prefix: str = "train",
) -> list[str]:
    """Write ``out_dir/{prefix}-{i:06d}.tar`` shards from a JSONL manifest (see the module docstring); returns
    their paths."""
    if samples_per_shard < 1 or max_side < 2 * patch_size:
        raise ValueError(f"samples_per_shard={samples_per_shard} must be >= 1 and max_side={max_side} at least "
                         f"one 2x2 patch window ({2 * patch_size} pixels)")
    manifest = Path(manifest)
    base = Path(root) if root is not None else manifest.parent
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or ByteTokenizer()
    seen: set[str] = set()

    def samples() -> Iterator[dict[str, Any]]:
        for number, record in _records(manifest):
            key = str(record.get("id", f"line{number:06d}"))
            if key in seen or not _KEY.match(key):
                raise ValueError(f"{manifest}:{number}: id {key!r} is repeated or not made of letters, digits, - "
                                 "and _")
            seen.add(key)
            try:
                yield _sample(record, key, base, patch_size=patch_size, max_side=max_side, n_mels=n_mels,
                              tokenizer=tokenizer)
            except (OSError, ValueError) as error:
                raise ValueError(f"{manifest}:{number} (id {key}): {error}") from None

    paths = write_shards(samples(), out, prefix=prefix, samples_per_shard=samples_per_shard)
    if not paths:
        raise ValueError(f"{manifest}: no samples")
    return paths
