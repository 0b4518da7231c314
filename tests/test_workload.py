"""Workload specs: parsing, validation, distributions and the shapes ``sample_metadata`` draws."""

from __future__ import annotations

import math
from collections import Counter
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_lightning.balance.workload import (
    WORKLOADS_DIR,
    Distribution,
    SampleMeta,
    WorkloadSpec,
    available_workloads,
    load_workload,
    min_llm_tokens,
    sample_metadata,
)

PRESETS = ["omni_mix", "text_heavy", "video_heavy", "vlm_dynres"]
REPO = Path(__file__).resolve().parents[1]
# The shared specs live next to the checkout (../shared) or, in some copies, inside it.
SHARED_DIRS = [REPO.parent / "shared" / "workloads", REPO / "shared" / "workloads"]
seeds = st.integers(min_value=0, max_value=2**32 - 1)


@cache
def preset(name: str) -> WorkloadSpec:
    return load_workload(name)


def write_spec(tmp_path: Path, text: str, name: str = "bad.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_presets_are_bundled() -> None:
    assert set(PRESETS) <= set(available_workloads())


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_by_name_and_path(name: str) -> None:
    by_name = load_workload(name)
    by_path = load_workload(WORKLOADS_DIR / f"{name}.yaml")
    assert by_name == by_path
    assert by_name.name == name
    assert math.isclose(sum(m.weight for m in by_name.modalities.values()), 1.0)
    assert set(by_name.merge) == {"image", "video", "audio"}


@pytest.mark.parametrize("name", PRESETS)
def test_bundled_preset_matches_shared_copy(name: str) -> None:
    shared = next((d for d in SHARED_DIRS if d.is_dir()), None)
    if shared is None:
        pytest.skip("no shared/workloads directory next to this checkout")
    assert (WORKLOADS_DIR / f"{name}.yaml").read_bytes() == (shared / f"{name}.yaml").read_bytes()


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(FileNotFoundError, match="omni_mix"):
        load_workload("no_such_workload")


DISTRIBUTIONS = [
    {"dist": "lognormal", "mu": 5.0, "sigma": 2.0, "min": 8, "max": 300},
    {"dist": "lognormal", "mu": 1.0, "sigma": 0.5},
    {"dist": "uniform", "low": 1.5, "high": 30},
    {"dist": "uniform_int", "low": 4, "high": 7},
    {"dist": "choice", "values": [1, 2, 4], "p": [0.8, 0.15, 0.05]},
    {"dist": "choice", "values": [3, 9]},
    {"dist": "const", "value": 256},
]


@pytest.mark.parametrize("raw", DISTRIBUTIONS, ids=lambda raw: raw["dist"])
@settings(max_examples=30, deadline=None)
@given(seed=seeds)
def test_distribution_samples_within_bounds(raw: dict, seed: int) -> None:
    dist = Distribution.parse(raw)
    low, high = dist.bounds
    rng = np.random.default_rng(seed)
    values = [dist.sample(rng) for _ in range(50)]
    assert all(low <= v <= high for v in values)
    if raw["dist"] == "uniform_int":
        assert all(v == int(v) for v in values)
    if raw["dist"] == "choice":
        assert set(values) <= set(map(float, raw["values"]))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"dist": "poisson", "lam": 3}, "unknown distribution 'poisson'"),
        ({"dist": "lognormal", "mu": 1.0}, r"missing parameter\(s\) \['sigma'\]"),
        ({"dist": "uniform", "low": 1, "high": 2, "hgih": 3}, r"unknown parameter\(s\) \['hgih'\]"),
        ({"dist": "lognormal", "mu": 1, "sigma": 1, "min": 10, "max": 5}, "min=10.0 > max=5.0"),
        ({"dist": "lognormal", "mu": 1, "sigma": -1}, "sigma=-1.0 must be >= 0"),
        ({"dist": "uniform", "low": 3, "high": 2}, "low=3.0 > high=2.0"),
        ({"dist": "uniform_int", "low": 1.5, "high": 2}, "low must be an integer"),
        ({"dist": "choice", "values": [1, 2], "p": [0.5, 0.4]}, "sums to 0.9, not 1"),
        ({"dist": "choice", "values": [1, 2], "p": [1.0]}, "one per value"),
        ({"dist": "choice", "values": []}, "non-empty"),
        ({"dist": "const", "value": "big"}, "value must be a number"),
        ([1, 2], "expected a mapping"),
    ],
)
def test_bad_distribution_names_the_problem(raw: object, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^somewhere\.field: .*{message}"):
        Distribution.parse(raw, "somewhere.field")


VALID_TEXT = "  text:\n    weight: 1\n    text_tokens: {dist: const, value: 10}\n"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("modalities:\n  smell:\n    weight: 1\n", r"modalities\.smell: unknown modality"),
        ("modalities:\n  text:\n    text_tokens: {dist: const, value: 3}\n", r"modalities\.text: missing .*weight"),
        ("modalities:\n  text:\n    weight: -1\n    text_tokens: {dist: const, value: 3}\n", r"weight=-1.0 must be"),
        (
            "modalities:\n  image:\n    weight: 1\n    text_tokens: {dist: const, value: 3}\n"
            "    patches: {dist: const, value: 64}\n",
            r"modalities\.image: missing field\(s\) \['images'\]",
        ),
        (
            "modalities:\n  video:\n    weight: 1\n    text_tokens: {dist: const, value: 3}\n"
            "    frames: {dist: const, value: 4}\n",
            r"\['patches_per_frame'\]",
        ),
        ("modalities:\n  audio:\n    weight: 1\n    text_tokens: {dist: const, value: 3}\n", r"\['seconds'\]"),
        (
            "modalities:\n  text:\n    weight: 1\n    text_tokens: {dist: const, value: 3}\n"
            "    seconds: {dist: const, value: 3}\n",
            r"modalities\.text: unknown field\(s\) \['seconds'\]",
        ),
        (
            "modalities:\n  text:\n    weight: 1\n    text_tokens: {dist: gauss, value: 3}\n",
            r"modalities\.text\.text_tokens: unknown distribution 'gauss'",
        ),
        (
            "modalities:\n  image:\n    weight: 1\n    text_tokens: {dist: const, value: 3}\n"
            "    images: {dist: uniform_int, low: 0, high: 2}\n    patches: {dist: const, value: 64}\n",
            r"modalities\.image\.images: can be 0",
        ),
        (
            "modalities:\n  text:\n    weight: 1\n    text_tokens: {dist: uniform, low: -5, high: 3}\n",
            r"text_tokens: can be negative",
        ),
        ("merge: {image: 2}\nmodalities:\n" + VALID_TEXT, r"merge\.image=2: vision merge must be 1 .* or 4"),
        ("merge: {video: 3}\nmodalities:\n" + VALID_TEXT, r"merge\.video=3"),
        ("merge: {audio: 0}\nmodalities:\n" + VALID_TEXT, r"merge\.audio=0 must be a positive integer"),
        ("merge: {audio: 2.5}\nmodalities:\n" + VALID_TEXT, r"merge\.audio must be an integer"),
        ("merge: {text: 4}\nmodalities:\n" + VALID_TEXT, r"merge has unknown modality\(ies\) \['text'\]"),
        ("name: x\n", "modalities must be a non-empty mapping"),
        ("colour: red\nmodalities:\n" + VALID_TEXT, r"unknown top-level key\(s\) \['colour'\]"),
        ("modalities: [\n", "not valid YAML"),
        ("- 1\n- 2\n", "expected a mapping"),
    ],
)
def test_bad_spec_names_file_and_field(tmp_path: Path, body: str, message: str) -> None:
    path = write_spec(tmp_path, body)
    with pytest.raises(ValueError, match=message) as info:
        load_workload(path)
    assert str(path) in str(info.value)


def test_minimal_spec_defaults(tmp_path: Path) -> None:
    spec = load_workload(write_spec(tmp_path, "modalities:\n" + VALID_TEXT, "tiny_text.yaml"))
    assert spec.name == "tiny_text"
    assert spec.description == ""
    assert spec.merge == {"image": 1, "video": 1, "audio": 1}
    assert min_llm_tokens(spec) == 2


def test_llm_tokens_formula() -> None:
    meta = SampleMeta(
        modality="image",
        text_tokens=10,
        images=((4, 6), (2, 2)),
        video_frames=3,
        video_grid=(8, 4),
        audio_frames=12,
        merge=(("image", 4), ("video", 1), ("audio", 4)),
    )
    assert meta.vision_patches == 24 + 4 + 3 * 32
    assert meta.llm_tokens == 1 + 10 + (6 + 1) + 3 * 32 + 3
    assert meta.merge_factor("video") == 1
    assert meta.merge_dict == {"audio": 4, "image": 4, "video": 1}


def test_sample_meta_json_round_trip() -> None:
    meta = SampleMeta(modality="audio", text_tokens=5, audio_frames=8, merge=(("audio", 4),))
    data = meta.to_json()
    assert data["merge"] == {"audio": 4, "image": 1, "video": 1}
    assert data["llm_tokens"] == 1 + 5 + 2
    assert set(data) == {
        "modality",
        "text_tokens",
        "images",
        "video_frames",
        "video_grid",
        "audio_frames",
        "merge",
        "vision_patches",
        "llm_tokens",
    }
    assert SampleMeta.from_json({**data, "class_id": 3}) == meta
    assert hash(meta) == hash(SampleMeta.from_json(data))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"text_tokens": -1}, "text_tokens=-1"),
        ({"text_tokens": 2.5}, "text_tokens must be an integer"),
        ({"modality": "smell"}, "modality 'smell'"),
        ({"images": [[3, 4]]}, r"images\[0\]=\(3, 4\) cannot be merged 2x2"),
        ({"images": [[0, 4]]}, "positive sides"),
        ({"images": [[2]]}, r"\(h, w\) pair"),
        ({"images": "2x2"}, "list of"),
        ({"video_frames": 2, "video_grid": [5, 4]}, "video_grid=.* cannot be merged 2x2"),
        ({"video_frames": 0, "video_grid": [2, 2]}, r"must be \(0, 0\) without video"),
        ({"video_frames": -3}, "video_frames=-3"),
        ({"audio_frames": 6}, "multiple of the audio merge 4"),
        ({"merge": {"image": 3, "video": 4, "audio": 4}}, "vision merge must be 1"),
        ({"merge": {"smell": 1}}, "unknown modality"),
        ({"llm_tokens": 999}, "llm_tokens=999 disagrees"),
    ],
)
def test_sample_meta_from_json_rejects_nonsense(change: dict, message: str) -> None:
    data = SampleMeta(
        modality="image", text_tokens=4, images=((2, 2),), merge=(("image", 4), ("video", 4), ("audio", 4))
    ).to_json()
    with pytest.raises(ValueError, match=message):
        SampleMeta.from_json({**data, **change})


def test_from_json_requires_keys() -> None:
    with pytest.raises(ValueError, match=r"missing key\(s\) \['merge'\]"):
        SampleMeta.from_json(
            {
                "modality": "text",
                "text_tokens": 1,
                "images": [],
                "video_frames": 0,
                "video_grid": [0, 0],
                "audio_frames": 0,
            }
        )


@pytest.mark.parametrize("name", PRESETS)
@settings(max_examples=20, deadline=None)
@given(seed=seeds)
def test_samples_are_valid_and_merge4_grids_even(name: str, seed: int) -> None:
    spec = preset(name)
    rng = np.random.default_rng(seed)
    for _ in range(30):
        meta = sample_metadata(spec, rng)
        assert meta.modality in spec.modalities
        assert meta.text_tokens >= 1
        assert meta.merge_dict == spec.merge
        grids = list(meta.images) + ([meta.video_grid] if meta.video_frames else [])
        for h, w in grids:
            assert h >= 1 and w >= 1
        for h, w in meta.images:
            assert spec.merge["image"] != 4 or (h % 2 == 0 and w % 2 == 0)
        if meta.video_frames:
            h, w = meta.video_grid
            assert spec.merge["video"] != 4 or (h % 2 == 0 and w % 2 == 0)
        assert meta.audio_frames % spec.merge["audio"] == 0
        assert SampleMeta.from_json(meta.to_json()) == meta


@pytest.mark.parametrize("name", PRESETS)
@settings(max_examples=20, deadline=None)
@given(seed=seeds, max_llm_tokens=st.integers(min_value=3, max_value=600), scale=st.sampled_from([0.05, 0.3, 1.0]))
def test_max_llm_tokens_is_respected(name: str, seed: int, max_llm_tokens: int, scale: float) -> None:
    spec = preset(name)
    rng = np.random.default_rng(seed)
    for _ in range(20):
        meta = sample_metadata(spec, rng, length_scale=scale, max_llm_tokens=max_llm_tokens)
        assert meta.llm_tokens <= max_llm_tokens
        assert meta.text_tokens >= 1


def test_cut_samples_keep_text_when_media_fits() -> None:
    # Unbounded, most omni_mix samples exceed 300 tokens; capped ones should fill the budget, not collapse to 1.
    spec = preset("omni_mix")
    rng = np.random.default_rng(0)
    metas = [sample_metadata(spec, rng, max_llm_tokens=300) for _ in range(300)]
    assert sum(m.llm_tokens == 300 for m in metas) > 100


def test_max_llm_tokens_too_small() -> None:
    with pytest.raises(ValueError, match="max_llm_tokens=2 is too small"):
        sample_metadata(preset("omni_mix"), np.random.default_rng(0), max_llm_tokens=2)


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf])
def test_bad_length_scale(scale: float) -> None:
    with pytest.raises(ValueError, match="length_scale"):
        sample_metadata(preset("omni_mix"), np.random.default_rng(0), length_scale=scale)


def test_length_scale_shrinks_sizes_not_counts(tmp_path: Path) -> None:
    path = write_spec(
        tmp_path,
        "merge: {video: 4, audio: 4}\nmodalities:\n"
        "  video:\n    weight: 1\n    text_tokens: {dist: const, value: 400}\n"
        "    frames: {dist: const, value: 12}\n    patches_per_frame: {dist: const, value: 1024}\n"
        "  audio:\n    weight: 1\n    text_tokens: {dist: const, value: 400}\n"
        "    seconds: {dist: const, value: 2.01}\n",
        "scaled.yaml",
    )
    spec = load_workload(path)
    rng = np.random.default_rng(0)
    for _ in range(40):
        meta = sample_metadata(spec, rng, length_scale=0.25)
        assert meta.text_tokens == 100
        if meta.modality == "video":
            h, w = meta.video_grid
            assert meta.video_frames == 12
            assert 0.5 * 256 <= h * w <= 1.5 * 256
            assert 0.5 / 1.5 <= w / h <= 2 * 1.5
        else:
            assert meta.audio_frames == 52  # round(2.01 s * 0.25 * 100) = 50, rounded up to a multiple of 4


def draw_many(seed: int, n: int = 20) -> list[SampleMeta]:
    rng = np.random.default_rng(seed)
    return [sample_metadata(preset("omni_mix"), rng, length_scale=0.1, max_llm_tokens=128) for _ in range(n)]


@settings(max_examples=20, deadline=None)
@given(seed=seeds)
def test_determinism(seed: int) -> None:
    assert draw_many(seed) == draw_many(seed)


def test_different_seeds_differ() -> None:
    assert draw_many(1) != draw_many(2)


@pytest.mark.parametrize("name", PRESETS)
def test_modality_frequencies_follow_weights(name: str) -> None:
    spec = preset(name)
    rng = np.random.default_rng(123)
    draws = 2000
    counts = Counter(sample_metadata(spec, rng, length_scale=0.01).modality for _ in range(draws))
    for modality, body in spec.modalities.items():
        assert abs(counts[modality] / draws - body.weight) < 0.04, (modality, counts)
