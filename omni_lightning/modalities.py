"""The built-in modalities: images and video through the vision encoder, audio through the audio encoder.

An image is an ``[H, W, 3]`` uint8 array cut into ``patch_size`` pixel patches, the four patches of each 2x2 merge
window adjacent (so the encoder merges them with a reshape); an image tiled at any resolution is ``[tiles, H, W, 3]``,
each tile an encoder item. A video is ``[F, H, W, 3]``: every ``temporal_patch_size``
consecutive frames form one temporal patch (the last frame repeats to fill the last one), each temporal slice one
attention item, so with a temporal patch of 1 every frame is encoded as an image is; an image then fills a temporal
patch with copies of itself, as Qwen2-VL does. A clip is a log-mel spectrogram ``[frames, n_mels]`` whose frames are
a multiple of the audio downsampling. :func:`packing_spec` builds a :class:`~omni_lightning.batch.PackingSpec` of
these, plus any further modalities and encoders a user adds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from omni_lightning.batch import (
    BYTE_ROLES,
    EncoderFormat,
    EncoderInput,
    MediaShape,
    Modality,
    PackingSpec,
    PendingMedia,
    TokenRoles,
    media_shape,
)

__all__ = ["AUDIO", "AUDIO_ENCODER", "DEFAULT_PACKING", "IMAGE", "VIDEO", "VISION_ENCODER", "packing_spec", "patchify"]

_CHANNELS = 3


def _patch_width(spec: PackingSpec) -> tuple[int, ...]:
    return (_CHANNELS * spec.temporal_patch_size * spec.patch_size * spec.patch_size,)


def _pairs(spec: PackingSpec) -> tuple[int, ...]:
    return (2,)


def _no_width(spec: PackingSpec) -> tuple[int, ...]:
    return ()


def _data_width(spec: PackingSpec) -> tuple[int, ...]:
    return (0,)  # the mel width is the data's: a batch without clips has none


def _one(spec: PackingSpec) -> int:
    return 1


def _vision_merge(spec: PackingSpec) -> int:
    return spec.vision_merge


def _audio_downsample(spec: PackingSpec) -> int:
    return spec.audio_downsample


def _patches_per_item(per_item: Mapping[str, np.ndarray], spec: PackingSpec) -> np.ndarray:
    return np.asarray(per_item["grids"], dtype=np.int64).reshape(-1, 2).prod(axis=1)


def _tokens_per_clip(per_item: Mapping[str, np.ndarray], spec: PackingSpec) -> np.ndarray:
    return np.asarray(per_item["lengths"], dtype=np.int64).reshape(-1) // spec.audio_downsample


VISION_ENCODER = EncoderFormat(
    name="vision",
    inputs=(EncoderInput("patches", per_item=False, dtype="float32", trailing=_patch_width),
            EncoderInput("positions", per_item=False, dtype="int64", trailing=_pairs),
            EncoderInput("grids", per_item=True, dtype="int64", trailing=_pairs)),
    item_tokens=_patches_per_item, rows_per_token=_one, tokens_per_output=_vision_merge,
)
AUDIO_ENCODER = EncoderFormat(
    name="audio",
    inputs=(EncoderInput("mels", per_item=False, dtype="float32", trailing=_data_width),
            EncoderInput("lengths", per_item=True, dtype="int64", trailing=_no_width)),
    item_tokens=_tokens_per_clip, rows_per_token=_audio_downsample, tokens_per_output=_one,
)


def _grid(height: int, width: int, spec: PackingSpec, what: str) -> tuple[int, int]:
    patch = spec.patch_size
    if height % patch or width % patch:
        raise ValueError(f"{what} of {height}x{width} pixels is not a whole number of {patch}-pixel patches")
    rows, cols = height // patch, width // patch
    window = 2 if spec.vision_merge == 4 else 1
    if rows % window or cols % window:
        raise ValueError(f"{what}'s {rows}x{cols}-patch grid cannot be merged 2x2: both sides must be even")
    return rows, cols


def patchify(frames: np.ndarray, spec: PackingSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint8 ``[T, H, W, 3]`` (one temporal patch) -> normalised patches ``[h*w, 3*T*p*p]`` in ``(C, T, p, p)``
    order, their (row, col) positions ``[h*w, 2]`` and the grid ``[1, 2]``, merge windows adjacent."""
    steps, height, width, channels = frames.shape
    rows, cols = _grid(height, width, spec, "an image")
    patch = spec.patch_size
    if spec.pixel_mean == spec.pixel_std == (0.5, 0.5, 0.5):
        pixels = np.asarray(frames, dtype=np.float32) / 127.5 - 1.0
    else:  # as Hugging Face's image processors compute it: rescale in float64, normalise in float32
        rescaled = (np.asarray(frames, dtype=np.float64) * (1 / 255)).astype(np.float32)
        pixels = (rescaled - np.asarray(spec.pixel_mean, np.float32)) / np.asarray(spec.pixel_std, np.float32)
    # [T, rows, p, cols, p, C] -> [rows, cols, C, T, p, p]: one vector per patch.
    patches = pixels.reshape(steps, rows, patch, cols, patch, channels).transpose(1, 3, 5, 0, 2, 4)
    patches = patches.reshape(rows, cols, -1)
    grid = np.stack(np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij"), axis=-1)
    window = 2 if spec.vision_merge == 4 else 1

    def windowed(x: np.ndarray) -> np.ndarray:
        x = x.reshape(rows // window, window, cols // window, window, x.shape[-1]).transpose(0, 2, 1, 3, 4)
        return np.ascontiguousarray(x.reshape(rows * cols, -1))

    return windowed(patches), windowed(grid).astype(np.int64), np.array([[rows, cols]], dtype=np.int64)


def _decoded(item: Any) -> np.ndarray:
    if isinstance(item, PendingMedia):
        raise ValueError(f"media {item.member or '(unnamed)'} is not decoded yet: decode pending media after the plan, "
                         "before packing")
    return np.asarray(item)


def _image_shape(image: Any, spec: PackingSpec) -> MediaShape:
    shape = media_shape(image)
    if len(shape) == 4 and shape[3] == _CHANNELS and shape[0] >= 1:  # tiles of one image (any-resolution)
        return (shape[0], *_grid(shape[1], shape[2], spec, "an image tile"))
    if len(shape) != 3 or shape[2] != _CHANNELS:
        raise ValueError(f"an image must be [height, width, 3] (or [tiles >= 1, height, width, 3]), got shape "
                         f"{list(shape)}")
    return _grid(shape[0], shape[1], spec, "an image")


def _image_inputs(image: Any, spec: PackingSpec) -> tuple[np.ndarray, ...]:
    image = _decoded(image)
    if image.ndim == 4:  # each tile is an encoder item of its own, as the model encodes it
        pieces = [_image_inputs(tile, spec) for tile in image]
        return tuple(np.concatenate(parts) for parts in zip(*pieces, strict=True))
    frames = np.broadcast_to(image, (spec.temporal_patch_size, *image.shape))
    return patchify(frames, spec)


def _video_shape(video: Any, spec: PackingSpec) -> MediaShape:
    shape = media_shape(video)
    if len(shape) != 4 or shape[3] != _CHANNELS or shape[0] < 1:
        raise ValueError(f"a video must be [frames >= 1, height, width, 3], got shape {list(shape)}")
    return (shape[0], *_grid(shape[1], shape[2], spec, "a video frame"))


def _video_inputs(video: Any, spec: PackingSpec) -> tuple[np.ndarray, ...]:
    frames = _decoded(video)
    step = spec.temporal_patch_size
    padded = -(-frames.shape[0] // step) * step
    if padded > frames.shape[0]:  # the last temporal patch repeats the last frame
        frames = np.concatenate([frames, np.repeat(frames[-1:], padded - frames.shape[0], axis=0)])
    pieces = [patchify(frames[start : start + step], spec) for start in range(0, padded, step)]
    return tuple(np.concatenate(parts) for parts in zip(*pieces, strict=True))


def _audio_shape(mel: Any, spec: PackingSpec) -> MediaShape:
    shape = media_shape(mel)
    if len(shape) != 2:
        raise ValueError(f"a mel spectrogram must be [frames, n_mels], got shape {list(shape)}")
    frames = shape[0]
    if frames == 0 or frames % spec.audio_downsample:
        raise ValueError(f"{frames} mel frames is not a positive multiple of {spec.audio_downsample}")
    return (frames,)


def _image_items(shape: MediaShape, spec: PackingSpec) -> list[int]:
    return [shape[0] * shape[1]] if len(shape) == 2 else [shape[1] * shape[2]] * shape[0]


def _video_items(shape: MediaShape, spec: PackingSpec) -> list[int]:
    return [shape[1] * shape[2]] * -(-shape[0] // spec.temporal_patch_size)


def _clip_items(shape: MediaShape, spec: PackingSpec) -> list[int]:
    return [shape[0] // spec.audio_downsample]


def _clip_inputs(mel: Any, spec: PackingSpec) -> tuple[np.ndarray, ...]:
    mel = _decoded(mel)
    return np.asarray(mel, dtype=np.float32), np.array([mel.shape[0]], dtype=np.int64)


IMAGE = Modality(name="image", encoder="vision", shape=_image_shape, item_tokens=_image_items, build=_image_inputs)
VIDEO = Modality(name="video", encoder="vision", shape=_video_shape, item_tokens=_video_items, build=_video_inputs)
AUDIO = Modality(name="audio", encoder="audio", shape=_audio_shape, item_tokens=_clip_items, build=_clip_inputs)


def packing_spec(*, patch_size: int = 14, vision_merge: int = 4, temporal_patch_size: int = 1,
                 audio_downsample: int = 4, roles: TokenRoles = BYTE_ROLES, extra_modalities: Sequence[Modality] = (),
                 extra_encoders: Sequence[EncoderFormat] = ()) -> PackingSpec:
    """The packing of images, video and audio (in that order in a sequence), then ``extra_modalities``; a built-in
    modality the roles have no placeholder for (a tokenizer without audio tokens) is left out."""
    builtin = tuple(m for m in (IMAGE, VIDEO, AUDIO) if roles.has_placeholder(m.name))
    return PackingSpec(modalities=(*builtin, *extra_modalities),
                       encoders=(VISION_ENCODER, AUDIO_ENCODER, *extra_encoders), roles=roles, patch_size=patch_size,
                       vision_merge=vision_merge, temporal_patch_size=temporal_patch_size,
                       audio_downsample=audio_downsample)


DEFAULT_PACKING = packing_spec()
