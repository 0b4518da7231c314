"""Pack decoded multimodal samples into one micro-batch the reference MLLM consumes.

A sample's token layout is ``[BOS] [IMAGE] * vision_tokens [AUDIO] * audio_tokens text...``: one placeholder per
merged vision token (images, then video frames) and per downsampled audio frame. Samples are packed back to back;
``cu_seqlens`` delimits them and positions restart at 0 in each. The loss is taken on text positions only:
a label is the next token when that token is text, ``IGNORE_INDEX`` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omni_lightning.models.config import AUDIO_ID, BOS_ID, FIRST_TEXT_ID, IMAGE_ID
from omni_lightning.models.mllm import IGNORE_INDEX

__all__ = ["DecodedSample", "check_packable", "pack_samples", "patchify"]


@dataclass
class DecodedSample:
    """One sample after decoding: text ids, images/frames as uint8 HWC arrays, and mel frames."""

    key: str
    tokens: np.ndarray
    images: list[np.ndarray] = field(default_factory=list)
    mel: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def patchify(image: np.ndarray, patch_size: int, merge: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """uint8 ``[H, W, 3]`` -> normalised patches ``[h*w, 3*p*p]``, (row, col) positions, and the grid ``(h, w)``.

    With ``merge=4`` the four patches of each 2x2 window are made adjacent, so the encoder can merge them with
    a reshape.
    """
    height, width, channels = image.shape
    if height % patch_size or width % patch_size:
        raise ValueError(f"image of {height}x{width} pixels is not a whole number of {patch_size}-pixel patches")
    rows, cols = height // patch_size, width // patch_size
    window = 2 if merge == 4 else 1
    if rows % window or cols % window:
        raise ValueError(f"a {rows}x{cols}-patch grid cannot be merged 2x2: both sides must be even")
    pixels = torch.from_numpy(np.array(image, dtype=np.float32)).div_(127.5).sub_(1.0)
    # [rows, p, cols, p, C] -> [rows, cols, C, p, p]: one vector per patch in (C, p, p) order.
    patches = pixels.view(rows, patch_size, cols, patch_size, channels).permute(0, 2, 4, 1, 3).reshape(rows, cols, -1)
    grid = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), dim=-1)

    def windowed(x: torch.Tensor) -> torch.Tensor:
        x = x.view(rows // window, window, cols // window, window, x.shape[-1]).permute(0, 2, 1, 3, 4)
        return x.reshape(rows * cols, -1)

    return windowed(patches), windowed(grid), (rows, cols)


def check_packable(
    sample: DecodedSample, *, patch_size: int = 14, vision_merge: int = 4, audio_downsample: int = 4
) -> None:
    """Raise ``ValueError`` naming the sample if :func:`pack_samples` could not pack it (cheap: shapes only)."""
    window = 2 if vision_merge == 4 else 1
    for index, image in enumerate(sample.images):
        height, width = image.shape[:2]
        if height % patch_size or width % patch_size:
            raise ValueError(f"sample {sample.key}: image {index} of {height}x{width} pixels is not a whole number "
                             f"of {patch_size}-pixel patches")
        if (height // patch_size) % window or (width // patch_size) % window:
            raise ValueError(f"sample {sample.key}: image {index}'s patch grid cannot be merged 2x2 (odd side)")
    if sample.mel is not None and (sample.mel.shape[0] == 0 or sample.mel.shape[0] % audio_downsample):
        raise ValueError(f"sample {sample.key}: {sample.mel.shape[0]} mel frames is not a positive multiple of "
                         f"{audio_downsample}")
    if len(sample.tokens) == 0 or int(np.min(sample.tokens)) < FIRST_TEXT_ID:
        raise ValueError(f"sample {sample.key}: text must be non-empty with ids >= {FIRST_TEXT_ID}")


def pack_samples(
    samples: list[DecodedSample], *, patch_size: int = 14, vision_merge: int = 4, audio_downsample: int = 4
) -> dict[str, Any]:
    """Pack ``samples`` into one micro-batch (see the module docstring for the layout).

    Returns a dict of ``input_ids``, ``labels``, ``position_ids`` (``[tokens]``), ``cu_seqlens``
    (int32 ``[n + 1]``), ``vision_patches``, ``vision_positions``, ``vision_grids``, ``audio_mels``,
    ``audio_lengths``, plus ``keys`` (sample keys) and ``num_samples``.
    """
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    ids: list[torch.Tensor] = []
    patches: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    grids: list[tuple[int, int]] = []
    mels: list[torch.Tensor] = []
    n_mels = 0
    for sample in samples:
        check_packable(sample, patch_size=patch_size, vision_merge=vision_merge, audio_downsample=audio_downsample)
        vision_tokens = 0
        for image in sample.images:
            item_patches, item_positions, grid = patchify(image, patch_size, vision_merge)
            patches.append(item_patches)
            positions.append(item_positions)
            grids.append(grid)
            vision_tokens += grid[0] * grid[1] // vision_merge
        audio_tokens = 0
        if sample.mel is not None:
            frames, n_mels = sample.mel.shape
            mels.append(torch.from_numpy(sample.mel.astype(np.float32)))
            audio_tokens = frames // audio_downsample
        text = torch.from_numpy(sample.tokens.astype(np.int64))
        ids.append(
            torch.cat(
                [
                    torch.tensor([BOS_ID]),
                    torch.full((vision_tokens,), IMAGE_ID),
                    torch.full((audio_tokens,), AUDIO_ID),
                    text,
                ]
            )
        )
    lengths = torch.tensor([len(x) for x in ids])
    input_ids = torch.cat(ids)
    labels = torch.cat(
        [torch.cat([x[1:], torch.tensor([IGNORE_INDEX])]) for x in ids]
    )
    labels = torch.where(labels >= FIRST_TEXT_ID, labels, torch.full_like(labels, IGNORE_INDEX))
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": torch.cat([torch.arange(n) for n in lengths.tolist()]),
        "cu_seqlens": torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32),
        "vision_patches": torch.cat(patches) if patches else torch.zeros(0, 3 * patch_size * patch_size),
        "vision_positions": torch.cat(positions) if positions else torch.zeros(0, 2, dtype=torch.long),
        "vision_grids": torch.tensor(grids, dtype=torch.long).view(-1, 2),
        "audio_mels": torch.cat(mels) if mels else torch.zeros(0, n_mels),
        "audio_lengths": torch.tensor([m.shape[0] for m in mels], dtype=torch.long),
        "keys": [s.key for s in samples],
        "num_samples": len(samples),
    }
