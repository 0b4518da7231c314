"""Media bytes to model arrays, the way each Hugging Face processor does it, and media sizes from headers alone.

The balancing planner needs every sample's size before any pixel or sample is decoded, so each modality has a
header reader (:func:`image_size`, :func:`audio_duration`, :func:`video_info`) whose answer the decoder then honours:

* images: ``smart_resize(*image_size(b), ...)`` is the grid :func:`decode_image` returns; :func:`normalize` and
  :func:`patchify` then give exactly the ``pixel_values`` rows of transformers' Qwen2-VL image processor. Under
  LLaVA-OneVision's any-resolution tiling (a policy with a ``tile``), :func:`tile_count` of the header size is the
  number of tiles :func:`decode_tiles` returns, which :func:`normalize` turns into that processor's ``pixel_values``;
* audio: :func:`mel_frames` of :func:`audio_duration` is the row count of ``log_mel(decode_audio(b))``, Whisper's
  log-mel features cut to the clip's real length;
* video: :func:`sample_frame_indices` of :func:`video_info` says which frames :func:`decode_video` returns, all on
  one ``smart_resize`` grid.

Every failure to read or decode is a ``ValueError`` naming the problem, whatever the underlying library raised
(Pillow alone raises ``OSError``, ``SyntaxError``, ``struct.error``, ``DecompressionBombError``...), so a loader can
drop a bad sample with one ``except``. Pure: numpy and Pillow; PyAV and soundfile are imported on first use.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from omni_lightning.modalities import best_canvas

__all__ = [
    "AudioPolicy",
    "ImagePolicy",
    "VideoPolicy",
    "audio_duration",
    "decode_audio",
    "decode_image",
    "decode_video",
    "grid_thw",
    "image_size",
    "log_mel",
    "mel_frames",
    "normalize",
    "patchify",
    "sample_frame_indices",
    "smart_resize",
    "video_info",
]

_MAX_ASPECT = 200


# ---------------------------------------------------------------------------------------------------------- images


@dataclass(frozen=True)
class ImagePolicy:
    """How images become whole patch grids for a model."""

    patch_size: int = 14  # pixels per patch side
    merge: int = 2  # merge side (Qwen: 2x2 patches -> 1 token), so factor = patch_size * merge
    min_pixels: int = 56 * 56
    max_pixels: int = 14 * 14 * 4 * 1280
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resample: int = 3  # PIL.Image.BICUBIC
    # LLaVA-OneVision's any-resolution tiling: tile side in pixels and the (height, width) canvases an image may get.
    tile: int | None = None
    pinpoints: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.patch_size < 1 or self.merge < 1:
            raise ValueError(f"patch_size and merge must be >= 1, got {self.patch_size} and {self.merge}")
        if self.tile is not None:
            if self.tile < self.factor:
                raise ValueError(f"tile={self.tile} is smaller than one {self.factor}-pixel merge group")
            if not self.pinpoints or any(h < 1 or w < 1 or h % self.tile or w % self.tile for h, w in self.pinpoints):
                raise ValueError(f"image_grid_pinpoints {list(self.pinpoints)} must be whole multiples of the tile "
                                 f"side {self.tile}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels} and {self.max_pixels}")
        if len(self.mean) != 3 or len(self.std) != 3:
            raise ValueError(f"mean and std need 3 channels, got {self.mean} and {self.std}")

    @property
    def factor(self) -> int:
        """Side lengths are multiples of this: one merged token covers ``factor x factor`` pixels."""
        return self.patch_size * self.merge

    @property
    def tiled(self) -> bool:
        return self.tile is not None

    @property
    def tile_crop(self) -> int:
        """The side of a tile the encoder sees: whole merge groups, as a patch convolution without padding drops
        the rest (SigLIP's 14-pixel patches see 378 of a 384-pixel tile)."""
        assert self.tile is not None
        return self.tile - self.tile % self.factor

    def frame_size(self, height: int, width: int) -> tuple[int, int]:
        """The size a video frame (or an untiled image) of ``height x width`` is resized to."""
        if self.tile is not None:
            return self.tile, self.tile
        return smart_resize(height, width, factor=self.factor, min_pixels=self.min_pixels,
                            max_pixels=self.max_pixels)

    @classmethod
    def from_image_processor(cls, processor: Any) -> ImagePolicy:
        """The policy of a Qwen2-VL / Qwen2.5-VL style HF image processor (or a processor holding one).

        transformers 5 keeps the pixel bounds only in ``size`` (``shortest_edge`` = min pixels, ``longest_edge`` =
        max pixels, despite the names) and leaves the ``min_pixels`` / ``max_pixels`` attributes ``None``; 4.x set
        both. Either is read. A value the processor lacks keeps this class's default.
        """
        ip = getattr(processor, "image_processor", processor)
        size = getattr(ip, "size", None)
        kwargs: dict[str, Any] = {}
        for field, value in (
            ("patch_size", getattr(ip, "patch_size", None)),
            ("merge", getattr(ip, "merge_size", None)),
            ("min_pixels", _first(_size_get(size, "shortest_edge"), _size_get(size, "min_pixels"),
                                  getattr(ip, "min_pixels", None))),
            ("max_pixels", _first(_size_get(size, "longest_edge"), _size_get(size, "max_pixels"),
                                  getattr(ip, "max_pixels", None))),
        ):
            if value is not None:
                kwargs[field] = int(value)
        for field, attr in (("mean", "image_mean"), ("std", "image_std")):
            value = getattr(ip, attr, None)
            if value is not None:
                kwargs[field] = _three(value, attr)
        if (value := getattr(ip, "rescale_factor", None)) is not None:
            kwargs["rescale"] = float(value)
        if (value := getattr(ip, "resample", None)) is not None:
            kwargs["resample"] = _pil_filter(value)
        if pinpoints := getattr(ip, "image_grid_pinpoints", None):
            height, width = _size_get(size, "height"), _size_get(size, "width")
            if height is None or height != width:
                raise ValueError(f"any-resolution tiling needs a square tile size, the image processor has {size}")
            kwargs["tile"] = int(height)
            kwargs["pinpoints"] = tuple((int(h), int(w)) for h, w in pinpoints)
        return cls(**kwargs)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _size_get(size: Any, key: str) -> Any:
    # HF stores `size` as a plain dict (4.x, JSON configs) or a SizeDict (5.x), whose missing keys read as None.
    if size is None:
        return None
    if isinstance(size, dict):
        return size.get(key)
    return getattr(size, key, None)


def _three(value: Any, name: str) -> tuple[float, float, float]:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3:
        raise ValueError(f"{name} needs 3 channels, got {value!r}")
    return values[0], values[1], values[2]


_FILTERS = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}


def _pil_filter(value: Any) -> int:
    # PILImageResampling is an IntEnum; torchvision's InterpolationMode carries a lower-case name instead.
    if isinstance(value, int):
        return int(value)
    name = str(getattr(value, "value", value)).lower()
    if name not in _FILTERS:
        raise ValueError(f"resample {value!r} has no Pillow equivalent")
    return _FILTERS[name]


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides multiples of ``factor``, area in ``[min_pixels, max_pixels]``, aspect kept.

    The same arithmetic as ``transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize`` (Python's
    banker's ``round``, then floor/ceil rescaling), so token counts planned here are the model's. Raises
    ``ValueError`` for an aspect ratio above 200, as HF does, and for a non-positive side (where HF would divide by
    zero).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image sides must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > _MAX_ASPECT:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {_MAX_ASPECT}, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def fit_inside(height: int, width: int, canvas: tuple[int, int]) -> tuple[int, int]:
    """The size of the image scaled to fit ``canvas`` with its aspect kept (transformers' ``get_patch_output_size``)."""
    canvas_h, canvas_w = canvas
    scale_w, scale_h = canvas_w / width, canvas_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), canvas_h), canvas_w
    return canvas_h, min(math.ceil(width * scale_h), canvas_w)


def tile_count(height: int, width: int, policy: ImagePolicy, *, alone: bool) -> int:
    """Tiles of an image under any-resolution tiling: the whole image at tile size, then its canvas cut into tiles;
    one tile (the image padded square) where it shares its sample with other images, as LLaVA-OneVision does."""
    assert policy.tile is not None
    if height <= 0 or width <= 0:
        raise ValueError(f"image sides must be positive, got {height}x{width}")
    if not alone:
        return 1
    canvas_h, canvas_w = best_canvas(height, width, policy.pinpoints)
    return 1 + (canvas_h // policy.tile) * (canvas_w // policy.tile)


def decode_tiles(data: bytes, policy: ImagePolicy, *, alone: bool) -> np.ndarray:
    """Image bytes -> uint8 tiles ``[n, tile, tile, 3]`` of LLaVA-OneVision's image processor before rescaling.

    Alone in its sample: the image resized to one tile, then the image fitted into its :func:`best_canvas`
    (Pillow, ``policy.resample``), centred on black and cut into tiles row by row. Sharing its sample: padded
    square with the mean colour, then resized to one tile. Bad data is ``ValueError``, as :func:`decode_image`.
    """
    assert policy.tile is not None
    tile = policy.tile
    with _open_image(data) as image:
        try:
            image.load()
            rgb = _to_rgb(image)
        except Exception as e:  # truncated streams surface here, as OSError, SyntaxError, zlib errors...
            raise ValueError(f"image cannot be decoded: {type(e).__name__}: {e}") from e
    if not alone:
        pixels = np.array(rgb, dtype=np.uint8)
        height, width = pixels.shape[:2]
        side = max(height, width)
        square = np.empty((side, side, 3), dtype=np.uint8)
        square[:] = [int(m * 255) for m in policy.mean]
        top, left = (side - height) // 2 if height < side else 0, (side - width) // 2 if width < side else 0
        square[top : top + height, left : left + width] = pixels
        return np.array(Image.fromarray(square).resize((tile, tile), resample=policy.resample))[None]
    canvas_h, canvas_w = best_canvas(rgb.height, rgb.width, policy.pinpoints)
    fit_h, fit_w = fit_inside(rgb.height, rgb.width, (canvas_h, canvas_w))
    fitted = np.array(rgb.resize((fit_w, fit_h), resample=policy.resample), dtype=np.uint8)
    top, left = divmod(canvas_h - fit_h, 2), divmod(canvas_w - fit_w, 2)
    canvas = np.pad(fitted, ((top[0], top[0] + top[1]), (left[0], left[0] + left[1]), (0, 0)))
    tiles = [canvas[y : y + tile, x : x + tile] for y in range(0, canvas_h, tile) for x in range(0, canvas_w, tile)]
    whole = np.array(rgb.resize((tile, tile), resample=policy.resample), dtype=np.uint8)
    return np.stack([whole, *tiles])


def _open_image(data: bytes) -> Image.Image:
    """Parse the header only, refusing what Pillow's decompression-bomb limit refuses (even its warning band)."""
    if not data:
        raise ValueError("image cannot be read: no bytes")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ValueError(f"image refused as a decompression bomb: {e}") from e
    except Exception as e:  # Pillow's parsers raise many exception types for bad headers
        raise ValueError(f"image cannot be read: {type(e).__name__}: {e}") from e
    limit = Image.MAX_IMAGE_PIXELS
    # Pillow only warns between 1x and 2x its limit; a sample that size would still exhaust a loader's memory.
    if limit is not None and image.width * image.height > limit:
        raise ValueError(
            f"image refused as a decompression bomb: {image.width}x{image.height} pixels exceeds Pillow's limit of "
            f"{limit}"
        )
    return image


def image_size(data: bytes) -> tuple[int, int]:
    """``(height, width)`` from the image header, without decoding pixels.

    EXIF orientation is NOT applied, and :func:`decode_image` does not apply it either (as HF's processor does not
    when handed a ``PIL.Image``), so planned grids and decoded grids agree. A header that cannot be read, or an image
    beyond Pillow's decompression-bomb limit, is a ``ValueError``; pixel data is not checked, so a file with a good
    header and corrupt pixels passes here and fails in :func:`decode_image`.
    """
    with _open_image(data) as image:
        return image.height, image.width


def _to_rgb(image: Image.Image) -> Image.Image:
    # HF's convert_to_rgb: transparency is composited onto white, not dropped (PIL's plain convert drops it).
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def decode_image(data: bytes, policy: ImagePolicy) -> np.ndarray:
    """Image bytes -> uint8 RGB ``[H', W', 3]`` on the ``smart_resize`` grid of its header size.

    The steps of transformers' Qwen2-VL PIL image processor before rescaling: transparency composited onto white,
    RGB, then one Pillow resize with ``policy.resample``. ``H'`` and ``W'`` are multiples of ``policy.factor``.
    Truncated or corrupt data, decompression bombs and aspect ratios above 200 are ``ValueError``.
    """
    with _open_image(data) as image:
        height, width = smart_resize(image.height, image.width, factor=policy.factor,
                                     min_pixels=policy.min_pixels, max_pixels=policy.max_pixels)
        try:
            image.load()
            resized = _to_rgb(image).resize((width, height), resample=policy.resample)
        except Exception as e:  # truncated streams surface here, as OSError, SyntaxError, zlib errors...
            raise ValueError(f"image cannot be decoded: {type(e).__name__}: {e}") from e
    return np.array(resized, dtype=np.uint8)


def normalize(pixels: np.ndarray, policy: ImagePolicy) -> np.ndarray:
    """uint8 ``[..., 3]`` -> float32 ``(pixels * rescale - mean) / std``, channel-last.

    Rescaled in float64 and then cast, and normalised in float32, as HF's ``rescale`` and ``normalize`` do, so the
    result is bit-identical to theirs.
    """
    if pixels.shape[-1:] != (3,):
        raise ValueError(f"pixels must end in 3 channels, got shape {pixels.shape}")
    scaled = (pixels.astype(np.float64) * policy.rescale).astype(np.float32)
    return (scaled - np.asarray(policy.mean, dtype=np.float32)) / np.asarray(policy.std, dtype=np.float32)


def patchify(normalized: np.ndarray, patch_size: int, merge: int, temporal_patch_size: int = 2) -> np.ndarray:
    """HF Qwen2-VL's flattened ``pixel_values`` rows for one image ``[H, W, C]`` or video ``[T, H, W, C]``.

    Rows are ``C * temporal_patch_size * patch_size**2`` long and ordered merge-group by merge-group (the 2x2 patches
    one token covers are adjacent), as the vision tower expects. A still image is repeated to
    ``temporal_patch_size`` frames and a video's last frame repeated up to a multiple of it, as HF does; the grid
    that goes with the rows is :func:`grid_thw`.
    """
    frames = normalized[None] if normalized.ndim == 3 else normalized
    if frames.ndim != 4:
        raise ValueError(f"expected [H, W, C] or [T, H, W, C], got shape {normalized.shape}")
    t, h, w, c = frames.shape
    unit = patch_size * merge
    if h % unit or w % unit or t == 0:
        raise ValueError(f"{t} frames of {h}x{w} are not whole {unit}x{unit} merge groups")
    if pad := -t % temporal_patch_size:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        t += pad
    gt, gh, gw = t // temporal_patch_size, h // patch_size, w // patch_size
    patches = frames.reshape(gt, temporal_patch_size, gh // merge, merge, patch_size, gw // merge, merge, patch_size, c)
    # -> (grid_t, group_h, group_w, merge_h, merge_w, C, temporal, patch_h, patch_w), HF's row layout
    patches = patches.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return np.ascontiguousarray(patches.reshape(gt * gh * gw, c * temporal_patch_size * patch_size * patch_size),
                                dtype=np.float32)


def grid_thw(frames: int, height: int, width: int, patch_size: int,
             temporal_patch_size: int = 2) -> tuple[int, int, int]:
    """HF's ``image_grid_thw`` / ``video_grid_thw`` for :func:`patchify`'s rows: ``(t, h, w)`` in patches."""
    return -(-frames // temporal_patch_size), height // patch_size, width // patch_size


# ----------------------------------------------------------------------------------------------------------- audio


@dataclass(frozen=True)
class AudioPolicy:
    """Whisper-style log-mel features: the waveform rate and the STFT / mel-bank shape."""

    sampling_rate: int = 16000
    n_mels: int = 80
    n_fft: int = 400
    hop_length: int = 160

    def __post_init__(self) -> None:
        if min(self.sampling_rate, self.n_mels, self.n_fft, self.hop_length) < 1:
            raise ValueError(f"audio policy values must be positive: {self}")

    @classmethod
    def from_feature_extractor(cls, fe: Any) -> AudioPolicy:
        """The policy of a ``WhisperFeatureExtractor`` (or a processor holding one as ``feature_extractor``).

        Its ``dither`` is not carried over: :func:`log_mel` is undithered, which is the extractor's default.
        """
        fe = getattr(fe, "feature_extractor", fe)
        kwargs = {
            field: int(value)
            for field, attr in (("sampling_rate", "sampling_rate"), ("n_mels", "feature_size"), ("n_fft", "n_fft"),
                                ("hop_length", "hop_length"))
            if (value := getattr(fe, attr, None)) is not None
        }
        return cls(**kwargs)


def _soundfile() -> Any:
    import soundfile

    return soundfile


def audio_duration(data: bytes) -> tuple[int, int]:
    """``(frames, sampling_rate)`` from the audio header (``soundfile.info``), without decoding samples.

    ``ValueError`` when the header cannot be read or promises no samples.
    """
    if not data:
        raise ValueError("audio cannot be read: no bytes")
    try:
        info = _soundfile().info(io.BytesIO(data))
    except Exception as e:  # LibsndfileError, or RuntimeError/TypeError from odd containers
        raise ValueError(f"audio cannot be read: {e}") from e
    if info.frames <= 0 or info.samplerate <= 0:
        raise ValueError(f"audio has no samples ({info.frames} frames at {info.samplerate} Hz)")
    return int(info.frames), int(info.samplerate)


def decode_audio(data: bytes, policy: AudioPolicy) -> np.ndarray:
    """Audio bytes -> mono float32 waveform at ``policy.sampling_rate``.

    Channels are averaged (as HF's ``load_audio`` does). A clip at another rate is resampled by :func:`_resample`
    (a deterministic Kaiser-windowed-sinc polyphase filter in numpy, since neither scipy nor soxr is a dependency);
    its values therefore differ slightly from HF's soxr resampling, its length is the same,
    ``ceil(frames * target / rate)``. ``ValueError`` for unreadable data, no samples or non-finite samples. A file
    whose header promised more than it holds (a truncated MP3) decodes to what it holds: the caller compares that
    with the size it planned from :func:`audio_duration`.
    """
    if not data:
        raise ValueError("audio cannot be read: no bytes")
    sf = _soundfile()
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            rate = int(f.samplerate)
            samples = f.read(dtype="float32", always_2d=True)
    except Exception as e:  # LibsndfileError mid-stream (e.g. FLAC "lost sync" on truncation)
        raise ValueError(f"audio cannot be decoded: {e}") from e
    if samples.shape[0] == 0:
        raise ValueError("audio has no samples")
    if not np.isfinite(samples).all():
        raise ValueError("audio contains non-finite samples")
    channels = samples.T
    wave = channels.mean(axis=0) if channels.shape[0] > 1 else channels[0]
    if rate != policy.sampling_rate:
        wave = _resample(wave, rate, policy.sampling_rate)
    return np.ascontiguousarray(wave, dtype=np.float32)


_SINC_ZEROS = 16  # zero crossings of the sinc kept on each side
_KAISER_BETA = 8.6  # ~ -86 dB stop band
_ROLLOFF = 0.95  # pass band ends at 95% of the lower Nyquist, leaving the window a transition band


@functools.lru_cache(maxsize=16)
def _polyphase(up: int, down: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-phase filter taps (one row per output phase) and the input offsets they apply to."""
    cutoff = _ROLLOFF * min(1.0, up / down)  # in units of the input Nyquist
    half = _SINC_ZEROS / cutoff  # half-width in input samples
    taps = math.ceil(half)
    offsets = np.arange(-taps + 1, taps + 1)
    tau = np.arange(up)[:, None] / up - offsets[None, :]  # output time minus input sample time
    inside = np.abs(tau) < half
    window = np.where(inside, np.i0(_KAISER_BETA * np.sqrt(np.clip(1 - (tau / half) ** 2, 0, None))), 0.0)
    weights = cutoff * np.sinc(cutoff * tau) * window
    weights /= weights.sum(axis=1, keepdims=True)  # unit DC gain in every phase
    weights.setflags(write=False)
    offsets.setflags(write=False)
    return weights, offsets


def _resample(wave: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Band-limited resampling from ``rate`` to ``target`` Hz to ``ceil(len * target / rate)`` samples.

    Output sample ``n`` sits at input time ``n * rate / target``; it is a windowed-sinc (Kaiser) interpolation of the
    input around it, zero beyond the clip's ends, low-passed below the lower of the two Nyquist rates. The ratio is
    reduced to ``up / down`` so only ``up`` distinct filters exist (polyphase). Float64, deterministic.
    """
    g = math.gcd(rate, target)
    up, down = target // g, rate // g
    weights, offsets = _polyphase(up, down)
    n_out = -(-len(wave) * up // down)
    pad = len(offsets)
    padded = np.pad(wave.astype(np.float64), (pad, pad))
    out = np.empty(n_out, dtype=np.float64)
    chunk = max(1, (1 << 20) // pad)  # bound the gathered [chunk, taps] block to ~8 MB
    for start in range(0, n_out, chunk):
        pos = np.arange(start, min(n_out, start + chunk), dtype=np.int64) * down
        base, phase = pos // up, pos % up
        gathered = padded[base[:, None] + offsets[None, :] + pad]
        out[start:start + len(pos)] = np.einsum("ij,ij->i", gathered, weights[phase])
    return out


def mel_frames(num_samples: int, sampling_rate: int, policy: AudioPolicy) -> int:
    """Rows :func:`log_mel` gives for :func:`decode_audio` of a clip of ``num_samples`` at ``sampling_rate``.

    From header values alone: the resampled length ``ceil(num_samples * target / rate)``, then one frame per hop
    (Whisper drops the STFT's last frame). 0 means the clip is shorter than a hop, which :func:`log_mel` refuses.
    """
    if num_samples < 0 or sampling_rate <= 0:
        raise ValueError(f"need num_samples >= 0 and sampling_rate > 0, got {num_samples} and {sampling_rate}")
    g = math.gcd(sampling_rate, policy.sampling_rate)
    samples = -(-num_samples * (policy.sampling_rate // g) // (sampling_rate // g))
    return samples // policy.hop_length


def _hz_to_mel(freq: np.ndarray) -> np.ndarray:
    # Slaney's scale: linear below 1 kHz, logarithmic above (HF audio_utils.hertz_to_mel, mel_scale="slaney").
    logstep = 27.0 / np.log(6.4)
    log = 15.0 + np.log(np.maximum(freq, 1e-300) / 1000.0) * logstep
    return np.where(freq >= 1000.0, log, 3.0 * freq / 200.0)


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    logstep = np.log(6.4) / 27.0
    return np.where(mels >= 15.0, 1000.0 * np.exp(logstep * (mels - 15.0)), 200.0 * mels / 3.0)


@functools.lru_cache(maxsize=8)
def _mel_filters(sampling_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """WhisperFeatureExtractor's bank: Slaney mel scale and area norm, 0-8000 Hz (fixed by HF whatever the rate)."""
    bins = 1 + n_fft // 2
    mel_edges = np.linspace(_hz_to_mel(np.float64(0.0)), _hz_to_mel(np.float64(8000.0)), n_mels + 2)
    filter_freqs = _mel_to_hz(mel_edges)
    fft_freqs = np.linspace(0, sampling_rate // 2, bins)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]
    diff = np.diff(filter_freqs)
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = np.maximum(np.zeros(1), np.minimum(down, up))
    filters *= (2.0 / (filter_freqs[2:n_mels + 2] - filter_freqs[:n_mels]))[None, :]
    filters.setflags(write=False)
    return filters  # [bins, n_mels]


def log_mel(waveform: np.ndarray, policy: AudioPolicy) -> np.ndarray:
    """Whisper's log-mel features ``[len(waveform) // hop_length, n_mels]`` float32, not padded to 30 s.

    The numpy path of ``WhisperFeatureExtractor`` step for step (centred reflect-padded STFT with a periodic Hann
    window, power spectrum, Slaney mel bank, ``log10`` floored at 1e-10, last frame dropped), so it equals
    ``WhisperFeatureExtractor(...)(waveform, padding="longest")`` with rows and columns swapped.

    HF's default call pads the clip with silence to 30 s first. Frames whose window lies inside the clip are the same
    either way; the last frame (and the one HF drops) crosses the clip's end and sees reflected signal here, zeros
    there. Whisper's normalisation ``max(x, x.max() - 8) -> (x + 4) / 4`` takes the maximum over this clip's frames,
    where HF's padded call takes it over the padded array; the silent padding never raises it, so the two agree
    whenever the loudest frame lies inside the clip, and otherwise only the clamp floor moves slightly. Clips longer
    than 30 s are not truncated (HF truncates by default): split long audio before calling. ``ValueError`` for a
    waveform shorter than one hop, which has no frames.
    """
    wave = np.asarray(waveform, dtype=np.float32)
    if wave.ndim != 1:
        raise ValueError(f"waveform must be mono 1-D, got shape {wave.shape}")
    if len(wave) // policy.hop_length == 0:
        raise ValueError(f"waveform of {len(wave)} samples is shorter than one hop ({policy.hop_length}): no frames")
    n_fft, hop = policy.n_fft, policy.hop_length
    padded = np.pad(wave, n_fft // 2, mode="reflect").astype(np.float64)
    frames = np.lib.stride_tricks.sliding_window_view(padded, n_fft)[::hop]
    window = np.hanning(n_fft + 1)[:-1]
    # HF stores the STFT as complex64 before taking magnitudes; matching that keeps the result bit-identical.
    spectrum = np.fft.rfft(frames * window, axis=-1).astype(np.complex64)
    power = (np.abs(spectrum, dtype=np.float64) ** 2).T
    mel = np.maximum(1e-10, np.dot(_mel_filters(policy.sampling_rate, n_fft, policy.n_mels).T, power))
    logs = np.log10(mel).astype(np.float32)[:, :-1]
    logs = np.maximum(logs, logs.max() - 8.0)
    return np.ascontiguousarray(((logs + 4.0) / 4.0).T)


# ----------------------------------------------------------------------------------------------------------- video


@dataclass(frozen=True)
class VideoPolicy:
    """Which frames of a video a model sees: uniformly at ``fps``, between ``min_frames`` and ``max_frames``."""

    fps: float = 2.0
    max_frames: int = 32
    min_frames: int = 1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fps) and self.fps > 0):
            raise ValueError(f"fps must be positive, got {self.fps}")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(f"need 1 <= min_frames <= max_frames, got {self.min_frames} and {self.max_frames}")


def _av() -> Any:
    import av

    return av


def _open_video(data: bytes) -> tuple[Any, Any]:
    """The open container and its first video stream; ``ValueError`` when there is none."""
    if not data:
        raise ValueError("video cannot be read: no bytes")
    av = _av()
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception as e:  # av.FFmpegError subclasses, or OSError from the byte reader
        raise ValueError(f"video cannot be read: {type(e).__name__}: {e}") from e
    if not container.streams.video:
        container.close()
        raise ValueError("video has no video stream")
    return container, container.streams.video[0]


def _stream_info(container: Any, stream: Any) -> tuple[int, float, int, int]:
    try:
        return _read_stream_info(container, stream)
    except ValueError:
        raise
    except Exception as e:  # damaged headers leave PyAV attributes None or nonsensical
        raise ValueError(f"video header cannot be read: {type(e).__name__}: {e}") from e


def _read_stream_info(container: Any, stream: Any) -> tuple[int, float, int, int]:
    if stream.codec_context is None:
        raise ValueError(f"video stream cannot be read: no decoder for codec {stream.codec.name!r}")
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    if not (math.isfinite(fps) and fps > 0):
        raise ValueError("video has no frame rate")
    frames = int(stream.frames or 0)
    if frames <= 0:
        # Matroska/WebM and raw streams carry no frame count; the duration times the rate is what they promise.
        if stream.duration is not None and stream.time_base:
            seconds = float(stream.duration * stream.time_base)
        elif container.duration:
            seconds = container.duration / _av().time_base
        else:
            raise ValueError("video has neither a frame count nor a duration")
        frames = round(seconds * fps)
    height, width = int(stream.codec_context.height), int(stream.codec_context.width)
    if frames <= 0 or height <= 0 or width <= 0:
        raise ValueError(f"video header is empty: {frames} frames of {height}x{width}")
    return frames, fps, height, width


def video_info(data: bytes) -> tuple[int, float, int, int]:
    """``(frames, fps, height, width)`` of the first video stream, from container and stream metadata.

    No frame is decoded here (FFmpeg's stream probing may peek at a few packets). A stream without a frame count
    (Matroska, WebM) gets ``round(duration * fps)``. Rotation metadata is not applied, as EXIF is not for images.
    ``ValueError`` when the data is unreadable or holds no video stream.
    """
    container, stream = _open_video(data)
    with container:
        return _stream_info(container, stream)


def sample_frame_indices(total_frames: int, native_fps: float, policy: VideoPolicy,
                         temporal_patch_size: int = 1) -> np.ndarray:
    """Indices of the frames to keep: uniform at ``policy.fps``, deterministic, non-decreasing.

    HF Qwen2-VL's ``sample_frames`` rule: ``total / native_fps * fps`` frames, clamped to
    ``[min_frames, min(max_frames, total)]``, rounded down to a multiple of ``temporal_patch_size``, spread as
    ``floor(i * total / count)``. Unlike HF (which then divides by zero), a video with fewer frames than
    ``temporal_patch_size`` (or a ``max_frames`` below it) still gets ``temporal_patch_size`` indices, repeating
    frames, so every video fills at least one temporal patch.
    """
    if total_frames <= 0:
        raise ValueError(f"video has no frames (total_frames={total_frames})")
    if not (math.isfinite(native_fps) and native_fps > 0):
        raise ValueError(f"native_fps must be positive, got {native_fps}")
    if temporal_patch_size < 1:
        raise ValueError(f"temporal_patch_size must be >= 1, got {temporal_patch_size}")
    wanted = min(max(total_frames / native_fps * policy.fps, policy.min_frames), policy.max_frames, total_frames)
    count = max(temporal_patch_size, math.floor(wanted / temporal_patch_size) * temporal_patch_size)
    return np.arange(count, dtype=np.int64) * total_frames // count


def _decoded_frames(container: Any, stream: Any) -> Iterator[Any]:
    """The stream's frames in presentation order; stops (after draining the decoder) at the first corrupt packet."""
    av = _av()
    try:
        for packet in container.demux(stream):
            yield from packet.decode()
        return
    except av.FFmpegError:
        pass
    try:  # frames the decoder already holds are good; keep them
        yield from stream.codec_context.decode(None)
    except av.FFmpegError:
        return


def decode_video(data: bytes, policy: VideoPolicy, image: ImagePolicy, temporal_patch_size: int = 1) -> np.ndarray:
    """Video bytes -> uint8 ``[T, H', W', 3]``: the :func:`sample_frame_indices` frames of :func:`video_info`.

    Every frame is resized like an image (Pillow, ``image.resample``) to ONE ``smart_resize`` grid computed from the
    header size. Frames are decoded in order up to the last one wanted; a repeated index repeats its frame. When
    the data ends or turns corrupt early, the frames decoded so far are returned (``T`` below the planned count:
    the caller decides); when none was, or the header is unreadable, ``ValueError``. Decoding stops at the end of
    the bytes, so truncated input cannot hang.
    """
    container, stream = _open_video(data)
    with container:
        total, fps, height, width = _stream_info(container, stream)
        indices = sample_frame_indices(total, fps, policy, temporal_patch_size)
        grid_h, grid_w = image.frame_size(height, width)
        repeats = np.bincount(indices)
        out: list[np.ndarray] = []
        with contextlib.closing(_decoded_frames(container, stream)) as frames:
            try:
                for i, frame in enumerate(frames):
                    if i >= len(repeats):
                        break
                    if repeats[i]:
                        rgb = frame.to_image().resize((grid_w, grid_h), resample=image.resample)
                        out.extend([np.array(rgb, dtype=np.uint8)] * int(repeats[i]))
            except Exception as e:  # a frame that decodes but will not convert (odd pixel format): keep the rest
                if not out:
                    raise ValueError(f"video cannot be decoded: {type(e).__name__}: {e}") from e
    if not out:
        raise ValueError("video cannot be decoded: no frame decoded")
    frames = np.stack(out)
    return np.ascontiguousarray(frames[:, : image.tile_crop, : image.tile_crop]) if image.tiled else frames
