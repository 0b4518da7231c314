"""Synthetic webdataset shards drawn from a workload spec, for tests, benchmarks and tiny end-to-end runs.

Each sample's shape comes from ``sample_metadata``; its content is cheap but learnable: the text follows an
arithmetic sequence set by a class id (with 5% noise), and images, video and mel spectrograms are coloured or
patterned by the same class, so a small model's loss falls and the media carry information about the text.

Sample members (webdataset keys): ``json`` (``SampleMeta.to_json()`` plus ``class_id``), ``tokens.npy`` (int32
text ids), ``img{i}.png`` (RGB, ``h*patch_size`` x ``w*patch_size`` pixels), ``video.npy`` (uint8
``[frames, H, W, 3]``) and ``mel.npy`` (float16 ``[audio_frames, n_mels]``).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from webdataset import TarWriter

from omni_lightning.balance.workload import (
    SampleMeta,
    WorkloadSpec,
    check_sampling_args,
    load_workload,
    sample_metadata,
)
from omni_lightning.batch import BYTE_ROLES

__all__ = ["NUM_CLASSES", "FIRST_TEXT_ID", "make_synthetic_shards"]

# Text ids start above the byte roles' (pad, bos, the placeholders).
FIRST_TEXT_ID = BYTE_ROLES.first_free_id
NUM_CLASSES = 8
TOKEN_NOISE = 0.05

# Distinct base colours per class; images and video frames are this colour plus a gradient and noise.
_CLASS_COLOURS = np.array(
    [
        [220, 60, 60],
        [60, 180, 75],
        [70, 90, 220],
        [230, 200, 40],
        [160, 60, 200],
        [40, 200, 210],
        [240, 130, 40],
        [120, 120, 120],
    ],
    dtype=np.int16,
)
# Sample keys must not contain dots (webdataset splits key and member at the first one) or path separators.
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]+$")


def npy_bytes(array: np.ndarray) -> bytes:
    """``array`` as the bytes of a ``.npy`` member."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def png_bytes(image: np.ndarray) -> bytes:
    """A uint8 ``[H, W, 3]`` image as the bytes of a ``.png`` member."""
    buffer = io.BytesIO()
    # Noisy pixels barely compress, so the fastest level costs little space and keeps big shards quick to write.
    Image.fromarray(image).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def _class_tokens(class_id: int, length: int, vocab_size: int, rng: np.random.Generator) -> np.ndarray:
    span = vocab_size - FIRST_TEXT_ID
    # t_0 = 4 + 7c mod span, t_{i+1} = 4 + (t_i - 4 + c + 1) mod span, in closed form.
    steps = class_id * 7 + np.arange(length, dtype=np.int64) * (class_id + 1)
    tokens = FIRST_TEXT_ID + steps % span
    noisy = rng.random(length) < TOKEN_NOISE
    tokens[noisy] = rng.integers(FIRST_TEXT_ID, vocab_size, size=int(noisy.sum()))
    return tokens.astype(np.int32)


def _class_image(class_id: int, height: int, width: int, phase: float, rng: np.random.Generator) -> np.ndarray:
    # A diagonal gradient (shifted by ``phase`` across video frames) gives the encoder some structure to see.
    ramp = (np.arange(height)[:, None] / height + np.arange(width)[None, :] / width + phase) % 1.0
    gradient = (ramp * 40 - 20).astype(np.int16)[..., None]
    noise = rng.integers(-8, 9, size=(height, width, 3), dtype=np.int16)
    return np.clip(_CLASS_COLOURS[class_id] + gradient + noise, 0, 255).astype(np.uint8)


def _class_mel(class_id: int, frames: int, n_mels: int, rng: np.random.Generator) -> np.ndarray:
    # Bands whose spacing and drift speed depend on the class, like a crude harmonic sound.
    t = np.arange(frames)[:, None]
    m = np.arange(n_mels)[None, :]
    pattern = np.sin(2 * math.pi * (m * (class_id + 1) / n_mels + t / (10.0 + 2 * class_id)))
    return (pattern + rng.normal(0.0, 0.1, size=(frames, n_mels))).astype(np.float16)


def _synthetic_sample(
    key: str,
    meta: SampleMeta,
    rng: np.random.Generator,
    *,
    patch_size: int = 14,
    n_mels: int = 80,
    vocab_size: int = 256,
) -> dict[str, Any]:
    """One webdataset sample (``__key__`` str, every other member bytes) with the shape ``meta``.

    Draws the class id, then the token noise, images, video and mel from ``rng``, in that order. Arguments are
    checked by ``make_synthetic_shards``.
    """
    class_id = int(rng.integers(0, NUM_CLASSES))
    sample: dict[str, Any] = {
        "__key__": key,
        "json": json.dumps({**meta.to_json(), "class_id": class_id}).encode(),
        "tokens.npy": npy_bytes(_class_tokens(class_id, meta.text_tokens, vocab_size, rng)),
    }
    for i, (h, w) in enumerate(meta.images):
        sample[f"img{i}.png"] = png_bytes(_class_image(class_id, h * patch_size, w * patch_size, 0.0, rng))
    if meta.video_frames > 0:
        h, w = meta.video_grid
        video = np.stack(
            [
                _class_image(class_id, h * patch_size, w * patch_size, f / meta.video_frames, rng)
                for f in range(meta.video_frames)
            ]
        )
        sample["video.npy"] = npy_bytes(video)
    if meta.audio_frames > 0:
        sample["mel.npy"] = npy_bytes(_class_mel(class_id, meta.audio_frames, n_mels, rng))
    return sample


def make_synthetic_shards(
    out_dir: str | os.PathLike[str],
    *,
    workload: str | os.PathLike[str] | WorkloadSpec = "omni_mix",
    num_shards: int = 8,
    samples_per_shard: int = 32,
    seed: int = 0,
    length_scale: float = 1.0,
    max_llm_tokens: int | None = None,
    patch_size: int = 14,
    n_mels: int = 80,
    vocab_size: int = 256,
    prefix: str = "train",
) -> list[str]:
    """Write ``num_shards`` webdataset shards ``out_dir/{prefix}-{i:06d}.tar`` plus ``out_dir/{prefix}-index.json``.

    ``workload`` is a preset name, a YAML path or a loaded spec; ``length_scale`` and ``max_llm_tokens`` are passed
    to ``sample_metadata``. Shard ``i`` draws from its own generator seeded by ``(seed, i)``, so shards can be
    written independently and the same arguments give byte-identical files (fixed tar mtimes and owners). Each
    shard is written to a temporary name and renamed, so an interrupted run never leaves a truncated shard that
    looks complete. Returns the shard paths in order.
    """
    spec = workload if isinstance(workload, WorkloadSpec) else load_workload(workload)
    check_sampling_args(spec, length_scale=length_scale, max_llm_tokens=max_llm_tokens)
    _check_args(
        num_shards=num_shards,
        samples_per_shard=samples_per_shard,
        seed=seed,
        patch_size=patch_size,
        n_mels=n_mels,
        vocab_size=vocab_size,
        prefix=prefix,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[str] = []
    for shard in range(num_shards):
        rng = np.random.default_rng([seed, shard])
        path = out / f"{prefix}-{shard:06d}.tar"
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as stream, TarWriter(stream, encoder=False, mtime=0) as writer:
                for index in range(samples_per_shard):
                    meta = sample_metadata(spec, rng, length_scale=length_scale, max_llm_tokens=max_llm_tokens)
                    key = f"{prefix}-{shard:06d}-{index:06d}"
                    writer.write(
                        _synthetic_sample(key, meta, rng, patch_size=patch_size, n_mels=n_mels, vocab_size=vocab_size)
                    )
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        paths.append(str(path))

    index = {
        "workload": spec.name,
        "num_shards": num_shards,
        "samples_per_shard": samples_per_shard,
        "seed": seed,
        "length_scale": length_scale,
        "max_llm_tokens": max_llm_tokens,
        "patch_size": patch_size,
        "n_mels": n_mels,
        "vocab_size": vocab_size,
        "shards": [Path(p).name for p in paths],
        "samples": num_shards * samples_per_shard,
    }
    (out / f"{prefix}-index.json").write_text(json.dumps(index, indent=2) + "\n")
    return paths


def _check_args(
    *, num_shards: int, samples_per_shard: int, seed: int, patch_size: int, n_mels: int, vocab_size: int, prefix: str
) -> None:
    minimums = {
        "num_shards": (num_shards, 1),
        "samples_per_shard": (samples_per_shard, 1),
        "seed": (seed, 0),
        "patch_size": (patch_size, 1),
        "n_mels": (n_mels, 1),
        # Every class needs its own text ids beyond the reserved ones.
        "vocab_size": (vocab_size, FIRST_TEXT_ID + NUM_CLASSES + 1),
    }
    for name, (value, minimum) in minimums.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix={prefix!r} must be non-empty and use only letters, digits, '_' and '-'")
