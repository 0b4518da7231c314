"""The built-in modalities: images and video through the vision encoder, audio through the audio encoder.

An image is an ``[H, W, 3]`` uint8 array cut into ``patch_size`` pixel patches, the four patches of each 2x2 merge
window adjacent (so the encoder merges them with a reshape); an image tiled at any resolution is ``[tiles, H, W, 3]``,
each tile an encoder item. A video is ``[F, H, W, 3]``: every ``temporal_patch_size``
consecutive frames form one temporal patch (the last frame repeats to fill the last one), each temporal slice one
attention item, so with a temporal patch of 1 every frame is encoded as an image is; an image then fills a temporal
patch with copies of itself, as Qwen2-VL does. A clip is a log-mel spectrogram ``[frames, n_mels]`` whose frames are
a multiple of the audio downsampling. :func:`packing_spec` builds a :class:`~omni_lightning.batch.PackingSpec` of
these, plus any further modalities and encoders a user adds.

Under LLaVA-OneVision's any-resolution layout (:class:`~omni_lightning.batch.AnyResolution`), an image comes as its
tiles with its own size (:class:`~omni_lightning.batch.SizedMedia`, as the data module's reader decodes it), each
tile an encoder item of one tower-sized patch grid, and its placeholders are as many as the model assembles the
tiles' outputs into (:data:`ANY_RESOLUTION_IMAGE`); a video's frames are items of the same grid, pooled 2x2 with
one newline (:data:`POOLED_VIDEO`). The counts are those of ``LlavaOnevisionProcessor``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from omni_lightning.batch import (
    BYTE_ROLES,
    AnyResolution,
    EncoderFormat,
    EncoderInput,
    MediaShape,
    Modality,
    PackingSpec,
    PendingMedia,
    TokenRoles,
    media_shape,
    media_source_size,
)

__all__ = ["ANY_RESOLUTION_IMAGE", "AUDIO", "AUDIO_ENCODER", "DEFAULT_PACKING", "IMAGE", "POOLED_VIDEO", "VIDEO",
           "VISION_ENCODER", "best_canvas", "packing_spec", "patchify"]

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


# ------------------------------------------------------------------------ LLaVA-OneVision's any-resolution layout


def best_canvas(height: int, width: int, pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The any-resolution canvas ``(height, width)`` for an image: the pinpoint keeping the most of its pixels once
    fitted inside, then the one wasting least (transformers' ``select_best_resolution``, same arithmetic)."""
    best, most_kept, least_wasted = pinpoints[0], 0, math.inf
    for canvas_h, canvas_w in pinpoints:
        scale = min(canvas_w / width, canvas_h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = canvas_w * canvas_h - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (canvas_h, canvas_w), kept, wasted
    return best


def _layout(spec: PackingSpec) -> AnyResolution:
    if spec.any_resolution is None:
        raise ValueError("this modality follows an any-resolution layout, which the packing does not have "
                         "(PackingSpec.any_resolution)")
    return spec.any_resolution


def _tower_grid(rows: int, cols: int, spec: PackingSpec, what: str) -> None:
    side = _layout(spec).tile // spec.patch_size
    if (rows, cols) != (side, side):
        raise ValueError(f"{what} of {rows}x{cols} patches, but the model's vision tower sees {side}x{side} "
                         f"({_layout(spec).tile}-pixel tiles in {spec.patch_size}-pixel patches): read the data with "
                         "the checkpoint's own processor")


def _tiled_image_shape(image: Any, spec: PackingSpec) -> MediaShape:
    """``(tiles, rows, cols, height, width)``: the tiles' patch grid and the image's own size."""
    shape, source = media_shape(image), media_source_size(image)
    if len(shape) != 4 or shape[3] != _CHANNELS or shape[0] < 1 or len(source) != 2 or min(source) < 1:
        raise ValueError(f"an any-resolution image must be its tiles [tiles >= 1, height, width, 3] with its own "
                         f"(height, width), as the data module's reader decodes it; got shape {list(shape)} and "
                         f"size {list(source)}")
    tiles, (rows, cols), (height, width) = shape[0], _grid(shape[1], shape[2], spec, "an image tile"), source
    _tower_grid(rows, cols, spec, "an image tile")
    layout = _layout(spec)
    canvas_h, canvas_w = best_canvas(height, width, layout.pinpoints)
    alone = 1 + (canvas_h // layout.tile) * (canvas_w // layout.tile)
    if tiles not in (1, alone):
        raise ValueError(f"a {height}x{width} image has {tiles} tiles, but the model's image_grid_pinpoints give it "
                         f"1 (sharing its sample) or {alone} (alone): read the data with the checkpoint's processor")
    return tiles, rows, cols, height, width


def _tiled_image_tokens(shape: MediaShape, spec: PackingSpec) -> int:
    """LLaVA-OneVision's image features (``pack_image_features``; ``LlavaOnevisionProcessor`` counts the same): the
    whole image's tile, then the canvas' tiles as one map unpadded to the image's aspect, scaled down where it
    exceeds ``max_tiles`` tiles by more than 10%, a newline after each row. A tile sharing its sample: one newline."""
    tiles, rows, cols, height, width = shape
    if tiles == 1:
        return rows * cols + 1
    layout = _layout(spec)
    canvas_h, canvas_w = best_canvas(height, width, layout.pinpoints)
    current_h, current_w = rows * (canvas_h // layout.tile), cols * (canvas_w // layout.tile)
    if width / height > current_w / current_h:  # padded above and below
        current_h -= 2 * ((current_h - int(round(height * (current_w / width), 7))) // 2)
    else:
        current_w -= 2 * ((current_w - int(round(width * (current_h / height), 7))) // 2)
    ratio = math.sqrt(current_h * current_w / (layout.max_tiles * rows * cols))
    if ratio > 1.1:
        current_h, current_w = int(current_h // ratio), int(current_w // ratio)
    return rows * cols + current_h * (current_w + 1)


def _tower_video_shape(video: Any, spec: PackingSpec) -> MediaShape:
    frames, rows, cols = _video_shape(video, spec)
    if spec.temporal_patch_size != 1:
        raise ValueError(f"pooled video frames are encoded one by one, not in temporal patches of "
                         f"{spec.temporal_patch_size}")
    _tower_grid(rows, cols, spec, "a video frame")
    return frames, rows, cols


def _pooled_video_tokens(shape: MediaShape, spec: PackingSpec) -> int:
    """Each frame's features pooled 2x2 (bilinear, sides rounded up), then one newline for the whole video."""
    frames, rows, cols = shape
    return frames * -(-rows // 2) * -(-cols // 2) + 1


IMAGE = Modality(name="image", encoder="vision", shape=_image_shape, item_tokens=_image_items, build=_image_inputs)
VIDEO = Modality(name="video", encoder="vision", shape=_video_shape, item_tokens=_video_items, build=_video_inputs)
AUDIO = Modality(name="audio", encoder="audio", shape=_audio_shape, item_tokens=_clip_items, build=_clip_inputs)
ANY_RESOLUTION_IMAGE = Modality(name="image", encoder="vision", shape=_tiled_image_shape, item_tokens=_image_items,
                                build=_image_inputs, assembled_tokens=_tiled_image_tokens)
POOLED_VIDEO = Modality(name="video", encoder="vision", shape=_tower_video_shape, item_tokens=_video_items,
                        build=_video_inputs, assembled_tokens=_pooled_video_tokens)


def packing_spec(*, patch_size: int = 14, vision_merge: int = 4, temporal_patch_size: int = 1,
                 audio_downsample: int = 4, roles: TokenRoles = BYTE_ROLES, extra_modalities: Sequence[Modality] = (),
                 extra_encoders: Sequence[EncoderFormat] = (), any_resolution: AnyResolution | None = None
                 ) -> PackingSpec:
    """The packing of images, video and audio (in that order in a sequence), then ``extra_modalities``; a built-in
    modality the roles have no placeholder for (a tokenizer without audio tokens) is left out. With
    ``any_resolution`` images and video follow LLaVA-OneVision's layout (:data:`ANY_RESOLUTION_IMAGE`,
    :data:`POOLED_VIDEO`), which encodes every patch (``vision_merge=1``)."""
    if any_resolution is not None and vision_merge != 1:
        raise ValueError(f"vision_merge={vision_merge}: the any-resolution layout encodes every patch (merge 1)")
    image, video = (IMAGE, VIDEO) if any_resolution is None else (ANY_RESOLUTION_IMAGE, POOLED_VIDEO)
    builtin = tuple(m for m in (image, video, AUDIO) if roles.has_placeholder(m.name))
    return PackingSpec(modalities=(*builtin, *extra_modalities),
                       encoders=(VISION_ENCODER, AUDIO_ENCODER, *extra_encoders), roles=roles, patch_size=patch_size,
                       vision_merge=vision_merge, temporal_patch_size=temporal_patch_size,
                       audio_downsample=audio_downsample, any_resolution=any_resolution)


DEFAULT_PACKING = packing_spec()
