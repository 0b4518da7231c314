"""omni_lightning.data.media against transformers' own processors, plus header/decoder agreement and bad input.

Images are compared bit-exactly with ``Qwen2VLImageProcessorPil`` (the torchvision backend is not installed here);
log-mel features exactly with ``WhisperFeatureExtractor``'s numpy path and within 1e-5 with its default (torch STFT)
call. Media are written in memory: PNG/JPEG with Pillow, WAV/FLAC/MP3 with soundfile, MP4/MKV with PyAV.
"""

from __future__ import annotations

import contextlib
import io
import signal
import struct
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
import soundfile as sf
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from omni_lightning.data.media import (
    AudioPolicy,
    ImagePolicy,
    VideoPolicy,
    audio_duration,
    best_canvas,
    decode_audio,
    decode_image,
    decode_tiles,
    decode_video,
    grid_thw,
    image_size,
    log_mel,
    mel_frames,
    normalize,
    patchify,
    sample_frame_indices,
    smart_resize,
    tile_count,
    video_info,
)

torch.set_num_threads(1)
hf_qwen = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
hf_whisper = pytest.importorskip("transformers.models.whisper.feature_extraction_whisper")

# No example database: it would write .hypothesis/ into the repository.
FAST = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def no_hang(seconds: int = 5) -> Iterator[None]:
    """Fail instead of hanging: decoders fed truncated data must return or raise promptly."""

    def _alarm(signum: int, frame: object) -> None:
        raise TimeoutError(f"took over {seconds} s")

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_module_is_pure() -> None:
    """Loader workers import it: no torch or Lightning, and the heavy media libraries only when first used (of this
    package, only the modalities' numpy rules: the any-resolution canvas the tiles and the placeholders share)."""
    import ast

    import omni_lightning.data.media as media

    tree = ast.parse(Path(media.__file__).read_text())
    top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    own = {node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module
           and node.module.startswith("omni_lightning")}
    top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module
            and node.module not in own}
    assert top <= {"__future__", "contextlib", "functools", "io", "math", "collections", "dataclasses", "typing",
                   "numpy", "PIL"}
    assert own <= {"omni_lightning.modalities"}
    lazy = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} - top
    assert lazy == {"av", "soundfile"}


# ---------------------------------------------------------------------------------------------------------- images


def encode(pixels: np.ndarray, fmt: str = "PNG", **kwargs: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def random_pixels(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def smooth_pixels(height: int, width: int) -> np.ndarray:
    """A gradient: JPEG keeps it recognisable, unlike noise."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], -1).astype(np.uint8)


def palette_with_transparency() -> bytes:
    image = Image.fromarray(random_pixels((23, 31), seed=3) % 16).convert("P")
    image.putpalette([v for i in range(16) for v in (i * 16, 255 - i * 16, 128)])
    buf = io.BytesIO()
    image.save(buf, format="PNG", transparency=5)
    return buf.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose valid header claims ``width x height`` but whose pixel data is a few bytes."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", zlib.compress(b"\x00" * 10))
            + png_chunk(b"IEND", b""))


def hf_processor(**kwargs: object) -> object:
    return hf_qwen.Qwen2VLImageProcessorPil(**kwargs)


IMAGE_CASES = {
    "tiny 3x5 (below min_pixels)": (lambda: encode(random_pixels((3, 5, 3))), {}),
    "non-square 37x100": (lambda: encode(random_pixels((37, 100, 3), 1)), {}),
    "large vs max_pixels": (lambda: encode(random_pixels((900, 1300, 3), 2)), {"max_pixels": 28 * 28 * 16}),
    "small vs min_pixels": (lambda: encode(random_pixels((20, 30, 3), 3)), {"min_pixels": 28 * 28 * 40}),
    "RGBA PNG": (lambda: encode(random_pixels((45, 61, 4), 4)), {}),
    "LA PNG": (lambda: encode(random_pixels((29, 40, 2), 5)), {}),
    "grayscale PNG": (lambda: encode(random_pixels((50, 33), 6)), {}),
    "palette PNG with transparency": (palette_with_transparency, {}),
    "JPEG": (lambda: encode(smooth_pixels(64, 80), "JPEG", quality=90), {}),
    "patch 16, CLIP-free mean/std, bilinear": (
        lambda: encode(random_pixels((70, 50, 3), 7)),
        {"patch_size": 16, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2},
    ),
}


@pytest.mark.parametrize("case", list(IMAGE_CASES))
def test_pixel_values_equal_hf_qwen2_vl(case: str) -> None:
    """Exact equality, not a tolerance: the same Pillow calls, then HF's float64-rescale / float32-normalise order."""
    make, kwargs = IMAGE_CASES[case]
    data = make()
    processor = hf_processor(**kwargs)
    policy = ImagePolicy.from_image_processor(processor)
    expected = processor(Image.open(io.BytesIO(data)), return_tensors="np")

    pixels = decode_image(data, policy)
    rows = patchify(normalize(pixels, policy), policy.patch_size, policy.merge, processor.temporal_patch_size)

    assert pixels.dtype == np.uint8 and pixels.shape[2] == 3
    assert pixels.shape[0] % policy.factor == 0 and pixels.shape[1] % policy.factor == 0
    # The header alone predicts the grid the decoder returns.
    height, width = image_size(data)
    assert smart_resize(height, width, factor=policy.factor, min_pixels=policy.min_pixels,
                        max_pixels=policy.max_pixels) == pixels.shape[:2]
    assert rows.dtype == expected["pixel_values"].dtype == np.float32
    np.testing.assert_array_equal(rows, expected["pixel_values"])
    thw = grid_thw(1, *pixels.shape[:2], policy.patch_size, processor.temporal_patch_size)
    np.testing.assert_array_equal([thw], expected["image_grid_thw"])


def _llava_onevision(tile: int, pinpoints: list[list[int]]) -> object:
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    return LlavaOnevisionImageProcessorPil(size={"height": tile, "width": tile}, image_grid_pinpoints=pinpoints)


# Small tiles and a few canvases: wide, tall and square images each pick another one.
_PINPOINTS = [[56, 56], [56, 112], [112, 56], [112, 112], [56, 168], [168, 56]]


@FAST
@given(height=st.integers(1, 260), width=st.integers(1, 260), seed=st.integers(0, 3),
       fmt=st.sampled_from(["PNG", "JPEG"]), with_alpha=st.booleans())
def test_any_resolution_tiles_equal_hf_llava_onevision(height: int, width: int, seed: int, fmt: str,
                                                      with_alpha: bool) -> None:
    """Exact equality with LLaVA-OneVision's PIL image processor: alone in a sample (the whole image, then its
    canvas in tiles) and beside other images (padded square with the mean colour, one tile); the header alone
    predicts the tile count."""
    from transformers.image_processing_utils import select_best_resolution

    processor = _llava_onevision(56, _PINPOINTS)
    policy = ImagePolicy.from_image_processor(processor)
    channels = 4 if with_alpha and fmt == "PNG" else 3
    data = encode(random_pixels((height, width, channels), seed), fmt)
    image = Image.open(io.BytesIO(data))
    assert best_canvas(height, width, policy.pinpoints) == select_best_resolution((height, width), _PINPOINTS)
    for alone, images in ((True, [image]), (False, [[image, image]])):
        expected = processor(images=images, return_tensors="np")["pixel_values"][0]
        tiles = decode_tiles(data, policy, alone=alone)
        assert tiles.dtype == np.uint8 and len(tiles) == tile_count(*image_size(data), policy, alone=alone)
        np.testing.assert_array_equal(normalize(tiles, policy).transpose(0, 3, 1, 2), expected[: len(tiles)])


def test_any_resolution_policy_needs_square_tiles_on_its_canvases() -> None:
    policy = ImagePolicy.from_image_processor(_llava_onevision(384, [[384, 768], [768, 768]]))
    assert (policy.tile, policy.pinpoints, policy.tile_crop) == (384, ((384, 768), (768, 768)), 364)
    assert policy.frame_size(1080, 1920) == (384, 384)
    with pytest.raises(ValueError, match="whole multiples of the tile side 384"):
        ImagePolicy(tile=384, pinpoints=((384, 700),))
    with pytest.raises(ValueError, match="needs a square tile size"):
        ImagePolicy.from_image_processor(SimpleNamespace(size={"height": 384, "width": 336},
                                                         image_grid_pinpoints=[[384, 336]]))


@FAST
@given(height=st.integers(1, 40_000), width=st.integers(1, 40_000), factor=st.sampled_from([14, 16, 28, 32, 56]),
       min_pixels=st.integers(1, 2_000_000), max_pixels=st.integers(1, 20_000_000))
def test_smart_resize_equals_hf(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> None:
    try:
        expected = hf_qwen.smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError:
        with pytest.raises(ValueError, match="aspect ratio"):
            smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
        return
    assert smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels) == expected


def test_smart_resize_refuses_extreme_aspect_and_empty_sides() -> None:
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200, got 201"):
        smart_resize(1, 201, factor=28, min_pixels=1, max_pixels=10**9)
    assert smart_resize(1, 200, factor=28, min_pixels=1, max_pixels=10**9) == hf_qwen.smart_resize(1, 200, 28, 1, 10**9)
    with pytest.raises(ValueError, match="positive"):
        smart_resize(0, 5, factor=28, min_pixels=1, max_pixels=10**9)
    with pytest.raises(ValueError, match="aspect ratio"):
        decode_image(encode(random_pixels((1, 250, 3))), ImagePolicy())


def test_from_image_processor_reads_transformers_4_and_5_layouts() -> None:
    v5 = ImagePolicy.from_image_processor(hf_processor(min_pixels=1234, max_pixels=99_999, merge_size=3))
    assert (v5.min_pixels, v5.max_pixels, v5.merge, v5.patch_size, v5.resample) == (1234, 99_999, 3, 14, 3)
    assert v5.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    # A full processor (image_processor attribute), a 4.x-style object, and one that lacks everything.
    assert ImagePolicy.from_image_processor(SimpleNamespace(image_processor=hf_processor(max_pixels=5000))).max_pixels \
        == 5000
    v4 = SimpleNamespace(min_pixels=100, max_pixels=200_000, size={"min_pixels": 100, "max_pixels": 200_000},
                         patch_size=16, merge_size=2, image_mean=0.5, image_std=[0.25, 0.25, 0.25],
                         rescale_factor=1 / 127.5, resample=SimpleNamespace(value="bilinear"))
    assert ImagePolicy.from_image_processor(v4) == ImagePolicy(16, 2, 100, 200_000, (0.5,) * 3, (0.25,) * 3,
                                                               1 / 127.5, 2)
    assert ImagePolicy.from_image_processor(SimpleNamespace()) == ImagePolicy()


def test_normalize_is_rescale_then_standardise() -> None:
    policy = ImagePolicy(mean=(0.1, 0.2, 0.3), std=(0.5, 0.25, 2.0))
    pixels = random_pixels((4, 6, 3))
    out = normalize(pixels, policy)
    assert out.dtype == np.float32 and out.shape == pixels.shape
    np.testing.assert_allclose(out, (pixels / 255 - np.array(policy.mean)) / np.array(policy.std), atol=1e-6)


def test_patchify_video_layout_and_padding() -> None:
    """[T, H, W, C]: last frame repeated to a whole temporal patch; a 1-frame video equals the still image."""
    patch, merge, tps = 2, 2, 2
    video = np.random.default_rng(0).standard_normal((3, 8, 12, 3)).astype(np.float32)
    rows = patchify(video, patch, merge, tps)
    t, gh, gw = grid_thw(3, 8, 12, patch, tps)
    assert (t, gh, gw) == (2, 4, 6) and rows.shape == (t * gh * gw, 3 * tps * patch * patch)
    padded = np.concatenate([video, video[-1:]])
    expected = [
        padded[ti * tps:(ti + 1) * tps, (bh * merge + mh) * patch:(bh * merge + mh + 1) * patch,
               (bw * merge + mw) * patch:(bw * merge + mw + 1) * patch].transpose(3, 0, 1, 2).ravel()
        for ti in range(t) for bh in range(gh // merge) for bw in range(gw // merge)
        for mh in range(merge) for mw in range(merge)
    ]
    np.testing.assert_array_equal(rows, np.stack(expected))
    np.testing.assert_array_equal(patchify(video[0], patch, merge, tps), patchify(video[:1], patch, merge, tps))
    with pytest.raises(ValueError, match="merge groups"):
        patchify(video[:, :6], patch, merge, tps)


def test_image_size_reads_the_header_only() -> None:
    data = png_claiming(640, 480)
    assert image_size(data) == (480, 640)
    with pytest.raises(ValueError, match="cannot be decoded"):
        decode_image(data, ImagePolicy())


def test_exif_orientation_is_not_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    data = encode(smooth_pixels(40, 90), "JPEG", exif=exif.tobytes())
    assert image_size(data) == (40, 90)
    policy = ImagePolicy(min_pixels=28 * 28, max_pixels=28 * 28 * 100)
    assert decode_image(data, policy).shape[:2] == smart_resize(40, 90, factor=28, min_pixels=policy.min_pixels,
                                                                max_pixels=policy.max_pixels)


def _bad_images() -> dict[str, bytes]:
    png, jpeg = encode(random_pixels((40, 50, 3))), encode(smooth_pixels(40, 50), "JPEG")
    corrupt = bytearray(png)
    corrupt[len(png) // 2:len(png) // 2 + 64] = bytes(64)
    return {
        "empty": b"",
        "random bytes": random_pixels((500,), 9).tobytes(),
        "truncated PNG": png[: len(png) // 2],
        "truncated JPEG": jpeg[: len(jpeg) // 2],
        "PNG header only": png[:40],
        "JPEG header only": jpeg[:120],
        "zeroed PNG data": bytes(corrupt),
        "bomb beyond 2x Pillow's limit": png_claiming(100_000, 100_000),
        "bomb in Pillow's warning band": png_claiming(10_000, 10_000),
    }


@pytest.mark.parametrize("name", list(_bad_images()))
def test_bad_images_are_value_errors(name: str) -> None:
    data = _bad_images()[name]
    with no_hang(), warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with pytest.raises(ValueError, match="cannot be read|cannot be decoded|decompression bomb"):
            decode_image(data, ImagePolicy())
        if "bomb" in name or name in ("empty", "random bytes", "PNG header only"):
            with pytest.raises(ValueError, match="cannot be read|decompression bomb"):
                image_size(data)


@FAST
@given(data=st.data())
def test_mutated_images_decode_or_raise_value_error(data: st.DataObject) -> None:
    original = data.draw(st.sampled_from([encode(random_pixels((30, 20, 3))), encode(smooth_pixels(30, 20), "JPEG"),
                                          encode(random_pixels((30, 20, 4)), "WEBP"), encode(random_pixels((9, 7)),
                                                                                             "GIF")]))
    blob = bytearray(original[: data.draw(st.integers(0, len(original)))])
    for _ in range(data.draw(st.integers(0, 4))):
        if blob:
            blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    policy = ImagePolicy(min_pixels=28 * 28, max_pixels=28 * 28 * 4)
    with no_hang():
        try:
            pixels = decode_image(bytes(blob), policy)
        except ValueError:
            return
    assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3
    assert pixels.shape[0] % 28 == 0 and pixels.shape[1] % 28 == 0


# ----------------------------------------------------------------------------------------------------------- audio


def audio_bytes(wave: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, wave, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def noise(samples: int, seed: int = 0, channels: int | None = None) -> np.ndarray:
    shape = (samples,) if channels is None else (samples, channels)
    return (np.random.default_rng(seed).standard_normal(shape) * 0.1).astype(np.float32)


def whisper(n_mels: int = 80) -> object:
    return hf_whisper.WhisperFeatureExtractor(feature_size=n_mels)


@pytest.mark.parametrize(("samples", "n_mels"), [(400, 80), (160 * 37, 80), (16000 * 2 + 77, 80),
                                                 (16000 + 5, 128)])
def test_log_mel_equals_whisper_feature_extractor(samples: int, n_mels: int) -> None:
    fe = whisper(n_mels)
    policy = AudioPolicy.from_feature_extractor(fe)
    assert policy == AudioPolicy(n_mels=n_mels)
    wave = noise(samples, seed=samples)
    ours = log_mel(wave, policy)
    assert ours.dtype == np.float32 and ours.shape == (samples // 160, n_mels)
    # The numpy path HF falls back to without torch: bit-identical.
    np.testing.assert_array_equal(ours, fe._np_extract_fbank_features(wave[None], "cpu")[0].T)
    # The public call, unpadded: padding="longest" on one clip pads nothing; HF's STFT is torch's here.
    out = fe(wave, sampling_rate=16000, padding="longest", return_attention_mask=True, return_tensors="np")
    np.testing.assert_allclose(ours, out["input_features"][0].T, rtol=0, atol=1e-5)
    assert out["attention_mask"].sum() == ours.shape[0] == mel_frames(samples, 16000, policy)


def test_log_mel_differs_from_30s_padded_features_only_at_the_clip_end() -> None:
    fe, samples = whisper(), 16000 + 30
    t = np.arange(samples) / 16000
    # Loudest mid-clip, so both maxima (hence Whisper's max - 8 clamp) come from frames inside the clip.
    wave = ((0.1 + 0.3 * np.hanning(samples)) * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    ours = log_mel(wave, AudioPolicy())
    # HF's default call pads with silence to 30 s; its numpy path on that padded clip:
    padded = fe._np_extract_fbank_features(np.pad(wave, (0, fe.n_samples - samples))[None], "cpu")[0].T
    assert padded.shape == (3000, 80)
    whole = (samples - 200) // 160 + 1  # frames whose window ends inside the clip
    assert whole == len(ours) - 1
    np.testing.assert_allclose(ours[:whole], padded[:whole], rtol=0, atol=1e-6)
    assert np.abs(ours[whole:] - padded[whole:len(ours)]).max() > 1e-3  # the window that crosses the end


def test_decode_audio_same_rate_matches_hf_soundfile_steps() -> None:
    """HF's _load_audio_soundfile minus soxr (absent here): float32 read, channels averaged."""
    stereo = noise(3000, channels=3)
    data = audio_bytes(stereo, 16000, subtype="FLOAT")
    samples, _ = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    np.testing.assert_array_equal(decode_audio(data, AudioPolicy()), samples.T.mean(axis=0))
    assert audio_duration(data) == (3000, 16000)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_resampling_keeps_a_tone_and_the_planned_length(rate: int) -> None:
    samples = rate // 2 + 13
    tone = np.sin(2 * np.pi * 440 * np.arange(samples) / rate).astype(np.float32)
    wave = decode_audio(audio_bytes(tone, rate, subtype="FLOAT"), AudioPolicy())
    assert wave.dtype == np.float32 and len(wave) == -(-samples * 16000 // rate)
    expected = np.sin(2 * np.pi * 440 * np.arange(len(wave)) / 16000)
    np.testing.assert_allclose(wave[200:-200], expected[200:-200], atol=1e-3)
    np.testing.assert_array_equal(wave, decode_audio(audio_bytes(tone, rate, subtype="FLOAT"), AudioPolicy()))


def test_resampling_removes_what_the_target_rate_cannot_hold() -> None:
    alias = np.sin(2 * np.pi * 12000 * np.arange(44100) / 44100).astype(np.float32)
    assert np.abs(decode_audio(audio_bytes(alias, 44100, subtype="FLOAT"), AudioPolicy())[500:-500]).max() < 1e-3


@settings(FAST, max_examples=25)
@given(rate=st.sampled_from([8000, 11025, 16000, 22050, 44100, 48000]), samples=st.integers(1, 40_000),
       fmt=st.sampled_from(["WAV", "FLAC"]), channels=st.integers(1, 2))
def test_mel_frames_from_the_header_match_the_features(rate: int, samples: int, fmt: str, channels: int) -> None:
    data = audio_bytes(noise(samples, channels=channels), rate, fmt)
    frames, header_rate = audio_duration(data)
    assert (frames, header_rate) == (samples, rate)
    policy = AudioPolicy()
    planned = mel_frames(frames, header_rate, policy)
    wave = decode_audio(data, policy)
    if planned == 0:
        with pytest.raises(ValueError, match="shorter than one hop"):
            log_mel(wave, policy)
    else:
        assert log_mel(wave, policy).shape == (planned, 80)


def test_mp3_round_trip() -> None:
    """This libsndfile writes MP3 with an exact-length (LAME/Xing) header, so the header count holds."""
    data = audio_bytes(noise(16_096, channels=2), 22050, "MP3")
    frames, rate = audio_duration(data)
    assert (frames, rate) == (16_096, 22050)
    wave = decode_audio(data, AudioPolicy())
    assert log_mel(wave, AudioPolicy()).shape[0] == mel_frames(frames, rate, AudioPolicy())


def _bad_audio() -> dict[str, bytes]:
    wav, flac = audio_bytes(noise(8000), 16000), audio_bytes(noise(8000), 16000, "FLAC")
    return {
        "empty": b"",
        "random bytes": random_pixels((400,), 5).tobytes(),
        "truncated WAV header": wav[:20],
        "truncated FLAC": flac[: len(flac) // 2],
        "zero-length WAV": audio_bytes(np.zeros(0, np.float32), 16000),
        "an image": encode(random_pixels((8, 8, 3))),
    }


def test_truncated_mp3_decodes_shorter_than_its_header_promises() -> None:
    """Its header keeps the full length; the caller compares what decodes with what it planned from it."""
    mp3 = audio_bytes(noise(16000), 16000, "MP3")
    promised, _ = audio_duration(mp3[: len(mp3) // 2])
    assert 0 < len(decode_audio(mp3[: len(mp3) // 2], AudioPolicy())) < promised


@pytest.mark.parametrize("name", list(_bad_audio()))
def test_bad_audio_is_value_error(name: str) -> None:
    data = _bad_audio()[name]
    with no_hang(), pytest.raises(ValueError, match="cannot be read|cannot be decoded|no samples|truncated"):
        decode_audio(data, AudioPolicy())
    if name != "truncated FLAC":  # its header is intact; decoding finds the damage
        with pytest.raises(ValueError, match="cannot be read|no samples"):
            audio_duration(data)


@FAST
@given(data=st.data())
def test_mutated_audio_decodes_consistently_or_raises_value_error(data: st.DataObject) -> None:
    fmt = data.draw(st.sampled_from(["WAV", "FLAC", "MP3"]))
    original = audio_bytes(noise(4000, channels=2), 22050, fmt)
    blob = bytearray(original[: data.draw(st.integers(0, len(original)))])
    for _ in range(data.draw(st.integers(0, 4))):
        if blob:
            blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    with no_hang():
        try:
            wave = decode_audio(bytes(blob), AudioPolicy())
        except ValueError:
            return
        frames, rate = audio_duration(bytes(blob))
    assert wave.dtype == np.float32 and wave.ndim == 1 and np.isfinite(wave).all()
    # At most what the header promises (a cut MP3 keeps its full length in the header); the caller checks it.
    assert len(wave) <= -(-frames * 16000 // rate)


def test_truncated_wav_is_a_shorter_clip_the_header_agrees_with() -> None:
    """libsndfile sizes a WAV's data chunk by the bytes present, so header and decoder agree on the shorter clip."""
    wav = audio_bytes(noise(8000), 16000)
    cut = wav[: len(wav) // 2]
    frames, _ = audio_duration(cut)
    assert 0 < frames < 8000 and len(decode_audio(cut, AudioPolicy())) == frames


def test_log_mel_refuses_what_has_no_frames() -> None:
    with pytest.raises(ValueError, match="shorter than one hop"):
        log_mel(np.zeros(159, np.float32), AudioPolicy())
    with pytest.raises(ValueError, match="mono"):
        log_mel(np.zeros((2, 400), np.float32), AudioPolicy())


# ----------------------------------------------------------------------------------------------------------- video


def video_bytes(path: Path, codec: str = "libx264", frames: int = 12, height: int = 32, width: int = 48,
                fps: int = 6, fmt: str = "mp4", faststart: bool = False) -> bytes:
    """Frame i has red = 20 * i, so a decoded frame tells which one it is."""
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), "w", format=fmt, options=options) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            rgb = np.zeros((height, width, 3), np.uint8)
            rgb[..., 0] = 20 * i
            rgb[:, : (4 * i) % width, 1] = 255
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(stream.encode())
    return path.read_bytes()


@pytest.fixture(scope="module")
def mp4(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return video_bytes(tmp_path_factory.mktemp("video") / "clip.mp4")


@pytest.fixture(scope="module")
def faststart(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """moov (the index) before the frames, as streaming encoders write it: a cut keeps the header."""
    return video_bytes(tmp_path_factory.mktemp("video") / "fast.mp4", faststart=True)


SMALL = ImagePolicy(min_pixels=28 * 28, max_pixels=28 * 28 * 4)


@pytest.mark.parametrize(("codec", "fmt"), [("libx264", "mp4"), ("mpeg4", "mp4"), ("libx264", "matroska")])
def test_video_info_and_decode(tmp_path: Path, codec: str, fmt: str) -> None:
    data = video_bytes(tmp_path / f"clip.{fmt}", codec=codec, fmt=fmt)
    assert video_info(data) == (12, 6.0, 32, 48)  # Matroska stores no count: duration * fps gives it
    policy = VideoPolicy(fps=2.0, max_frames=32)
    indices = sample_frame_indices(12, 6.0, policy, temporal_patch_size=2)
    np.testing.assert_array_equal(indices, [0, 3, 6, 9])
    with no_hang():
        frames = decode_video(data, policy, SMALL, temporal_patch_size=2)
    grid = smart_resize(32, 48, factor=28, min_pixels=SMALL.min_pixels, max_pixels=SMALL.max_pixels)
    assert frames.dtype == np.uint8 and frames.shape == (4, *grid, 3)
    np.testing.assert_allclose(frames[..., 0].mean(axis=(1, 2)), 20 * indices, atol=8)


def test_video_frames_normalise_and_patchify_like_images(mp4: bytes) -> None:
    frames = decode_video(mp4, VideoPolicy(fps=1.0), SMALL, temporal_patch_size=2)
    rows = patchify(normalize(frames, SMALL), SMALL.patch_size, SMALL.merge, 2)
    t, h, w = grid_thw(len(frames), *frames.shape[1:3], SMALL.patch_size, 2)
    assert rows.shape == (t * h * w, 3 * 2 * 14 * 14)


def test_video_shorter_than_a_temporal_patch_repeats_its_frame(tmp_path: Path) -> None:
    data = video_bytes(tmp_path / "one.mp4", frames=1)
    assert video_info(data)[0] == 1
    frames = decode_video(data, VideoPolicy(), SMALL, temporal_patch_size=2)
    assert len(frames) == 2
    np.testing.assert_array_equal(frames[0], frames[1])


def hf_sample_count(total: int, fps: float, policy: VideoPolicy, tps: int) -> int:
    """transformers' Qwen2VLVideoProcessor.sample_frames count (its module needs torchvision, so transcribed)."""
    max_frames = (min(policy.max_frames, total) // tps) * tps
    count = min(max(total / fps * policy.fps, policy.min_frames), max_frames, total)
    return int(count // tps * tps)


@FAST
@given(total=st.integers(1, 5000), fps=st.floats(1.0, 120.0), target=st.floats(0.1, 8.0),
       max_frames=st.integers(1, 64), min_frames=st.integers(1, 8), tps=st.integers(1, 3))
def test_sample_frame_indices(total: int, fps: float, target: float, max_frames: int, min_frames: int,
                              tps: int) -> None:
    policy = VideoPolicy(fps=target, max_frames=max(max_frames, min_frames), min_frames=min_frames)
    indices = sample_frame_indices(total, fps, policy, tps)
    count = len(indices)
    assert count % tps == 0 and count >= tps
    assert indices.dtype == np.int64 and indices[0] == 0 and indices[-1] < total and np.all(np.diff(indices) >= 0)
    if (expected := hf_sample_count(total, fps, policy, tps)) > 0:
        assert count == expected
        assert np.all(np.diff(indices) > 0)  # fewer picks than frames: no repeats
    else:
        assert count == tps  # HF would divide by zero here
    np.testing.assert_array_equal(indices, sample_frame_indices(total, fps, policy, tps))


def test_sample_frame_indices_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="no frames"):
        sample_frame_indices(0, 30.0, VideoPolicy())
    with pytest.raises(ValueError, match="native_fps"):
        sample_frame_indices(10, 0.0, VideoPolicy())
    with pytest.raises(ValueError, match="min_frames"):
        VideoPolicy(min_frames=5, max_frames=2)


def test_truncated_mp4_raises_or_returns_fewer_frames(mp4: bytes, faststart: bytes) -> None:
    policy = VideoPolicy(fps=6.0)
    for cut in (len(mp4) // 2, len(mp4) // 3, 100):  # moov at the end: the index is gone
        with no_hang(), pytest.raises(ValueError, match="cannot be read|no video stream"):
            decode_video(mp4[:cut], policy, SMALL)
    assert video_info(faststart[: len(faststart) * 3 // 4]) == (12, 6.0, 32, 48)
    returned = []
    for cut in range(300, len(faststart), 97):
        with no_hang():
            try:
                returned.append(len(decode_video(faststart[:cut], policy, SMALL)))
            except ValueError as e:
                assert "cannot be" in str(e) or "no video stream" in str(e)
    assert returned and all(0 < n < 12 for n in returned)


@settings(FAST, max_examples=30)
@given(data=st.data())
def test_mutated_video_decodes_or_raises_value_error(faststart: bytes, data: st.DataObject) -> None:
    blob = bytearray(faststart[: data.draw(st.integers(0, len(faststart)))])
    for _ in range(data.draw(st.integers(0, 6))):
        if blob:
            blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    with no_hang():
        try:
            frames = decode_video(bytes(blob), VideoPolicy(fps=6.0), SMALL)
        except ValueError:
            return
    assert frames.dtype == np.uint8 and frames.ndim == 4 and 1 <= len(frames) <= 32


@pytest.mark.parametrize("data", [b"", b"\x00" * 64, random_pixels((2000,), 11).tobytes()],
                         ids=["empty", "zeros", "random"])
def test_unreadable_video_is_value_error(data: bytes) -> None:
    with no_hang(), pytest.raises(ValueError, match="cannot be read|no video stream"):
        video_info(data)
    with no_hang(), pytest.raises(ValueError, match="cannot be read|no video stream"):
        decode_video(data, VideoPolicy(), SMALL)


def test_audio_only_container_has_no_video_stream() -> None:
    with pytest.raises(ValueError, match="no video stream"):
        video_info(audio_bytes(noise(1600), 16000))
