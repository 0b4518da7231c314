"""Cost model: FLOP coefficients from the config (checked against hand counts), features, NNLS calibration."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from functools import cache
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_lightning.balance.cost import (
    DEFAULT_ENCODERS,
    CostModel,
    ModuleCost,
    feature_matrix,
    feature_names,
    fit_cost_model,
    sample_features,
)
from omni_lightning.balance.cost_fit import _nnls
from omni_lightning.balance.workload import SampleMeta, load_workload, sample_metadata
from omni_lightning.models.config import AudioEncoderConfig, LLMConfig, ReferenceMLLMConfig, VisionEncoderConfig
from omni_lightning.models.flops import reference_cost_model

MERGE = (("audio", 4), ("image", 4), ("video", 4))


def text(tokens: int) -> SampleMeta:
    return SampleMeta(modality="text", text_tokens=tokens, merge=MERGE)


def image(*grids: tuple[int, int], tokens: int = 10) -> SampleMeta:
    return SampleMeta(modality="image", text_tokens=tokens, images=grids, merge=MERGE)


def video(frames: int, grid: tuple[int, int], tokens: int = 10) -> SampleMeta:
    return SampleMeta(modality="video", text_tokens=tokens, video_frames=frames, video_grid=grid, merge=MERGE)


def audio(frames: int, tokens: int = 10) -> SampleMeta:
    return SampleMeta(modality="audio", text_tokens=tokens, audio_frames=frames, merge=MERGE)


TINY = reference_cost_model(ReferenceMLLMConfig.tiny())


def _from_coefficients(coefficients: np.ndarray) -> CostModel:
    """The vision, audio and LLM cost model with these six coefficients."""
    names = ("vision", "audio", "llm")
    return CostModel(**{name: ModuleCost(*coefficients[2 * i : 2 * i + 2]) for i, name in enumerate(names)})


def _cost(model: CostModel, meta: SampleMeta) -> SimpleNamespace:
    """A sample's predicted cost per module, with the encoders' sum and the total."""
    cost = model.sample_cost(meta)
    return SimpleNamespace(**cost, encoder=cost["vision"] + cost["audio"], total=sum(cost.values()))


# --- coefficients from the config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config", [ReferenceMLLMConfig(), ReferenceMLLMConfig.tiny(), ReferenceMLLMConfig.tiny(moe=True)]
)
def test_from_config_coefficients_are_positive(config: ReferenceMLLMConfig) -> None:
    coefficients = reference_cost_model(config).coefficients
    assert coefficients.shape == (len(feature_names(DEFAULT_ENCODERS)),)
    assert (coefficients > 0).all()


def test_llm_linear_matches_hand_count_and_moe_adds_router_and_experts() -> None:
    llm = LLMConfig(vocab_size=256, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=128)
    dense = reference_cost_model(ReferenceMLLMConfig(llm=llm))
    # Forward multiply-adds per token, written out: head_dim 8, so q and o are 64x64, k and v 64x32 (GQA).
    q, k, v, o = 64 * 64, 64 * 32, 64 * 32, 64 * 64
    swiglu = 64 * 128 + 64 * 128 + 128 * 64  # w1, w3, w2
    head = 64 * 256
    assert dense.llm.linear == 3 * 2 * (4 * (q + k + v + o + swiglu) + head)
    # Per pair and layer: QK^T and AV over 8 heads x 8 channels.
    assert dense.llm.quadratic == 3 * 2 * 4 * (8 * 8 + 8 * 8)

    moe_llm = dataclasses.replace(llm, moe_every=2, n_experts=4, moe_top_k=2)
    moe = reference_cost_model(ReferenceMLLMConfig(llm=moe_llm))
    # Layers 1 and 3 are MoE: a 64x4 router, and two experts instead of one SwiGLU.
    assert moe.llm.linear - dense.llm.linear == 3 * 2 * 2 * (64 * 4 + (2 - 1) * swiglu)
    assert moe.llm.quadratic == dense.llm.quadratic
    assert (moe.vision, moe.audio) == (dense.vision, dense.audio)


def test_encoder_coefficients_match_hand_count() -> None:
    config = ReferenceMLLMConfig(
        vision=VisionEncoderConfig(patch_size=2, in_channels=3, dim=16, n_layers=3, n_heads=2, mlp_ratio=2.0, merge=4),
        audio=AudioEncoderConfig(n_mels=10, dim=8, n_layers=2, n_heads=2, mlp_ratio=4.0),
        llm=LLMConfig(dim=32, n_heads=4, n_kv_heads=2),
    )
    model = reference_cost_model(config)
    # Vision per patch: patch embed 12->16 (its input is data: forward + weight gradient only), per layer qkv
    # 16->48, proj 16->16, MLP 16->32->16; projector 64->32->32 on a quarter of the patches.
    block = 16 * 48 + 16 * 16 + 16 * 32 + 32 * 16
    assert model.vision.linear == 2 * 2 * (12 * 16) + 3 * 2 * (3 * block + (64 * 32 + 32 * 32) / 4)
    assert model.vision.quadratic == 3 * 2 * 3 * 2 * 16
    # Audio per downsampled frame: conv1 (3 taps, 10->8) at two outputs (data input), conv2 (3 taps, 8->8),
    # per layer qkv 8->24, proj 8->8, MLP 8->32->8; projector 8->32->32.
    block = 8 * 24 + 8 * 8 + 8 * 32 + 32 * 8
    assert model.audio.linear == 2 * 2 * (2 * 3 * 10 * 8) + 3 * 2 * (3 * 8 * 8 + 2 * block + 8 * 32 + 32 * 32)
    assert model.audio.quadratic == 3 * 2 * 2 * 2 * 8


# --- features and per-sample costs --------------------------------------------------------------------------


def test_features_of_each_modality() -> None:
    assert sample_features(text(9)).tolist() == [0, 0, 0, 0, 10, 55]
    assert sample_features(image((4, 6), (2, 2), tokens=1)).tolist() == [28, 24**2 + 4**2, 0, 0, 9, 45]
    assert sample_features(video(3, (4, 4), tokens=1)).tolist() == [48, 3 * 16**2, 0, 0, 14, 105]
    assert sample_features(audio(40, tokens=1)).tolist() == [0, 0, 10, 100, 12, 78]


@pytest.mark.parametrize("name", ["omni_mix", "vlm_dynres", "video_heavy", "text_heavy"])
def test_features_agree_with_sample_meta(name: str) -> None:
    rng = np.random.default_rng(1)
    metas = [sample_metadata(load_workload(name), rng, length_scale=0.2) for _ in range(200)]
    features = feature_matrix(metas)
    assert features[:, 0].tolist() == [m.vision_patches for m in metas]
    assert features[:, 4].tolist() == [m.llm_tokens for m in metas]
    assert features[:, 2].tolist() == [m.audio_frames / 4 for m in metas]


def test_more_text_costs_more_llm() -> None:
    short, long = _cost(TINY, text(100)), _cost(TINY, text(200))
    assert long.llm > short.llm > 0
    # The causal attention term makes twice the text cost more than twice as much.
    assert long.llm > 2 * short.llm - TINY.llm.linear


def test_text_only_has_no_encoder_cost() -> None:
    cost = _cost(TINY, text(500))
    assert cost.vision == cost.audio == cost.encoder == 0
    assert cost.total == cost.llm


def test_vision_cost_grows_quadratically_with_patches_per_image() -> None:
    two_small, one_large = _cost(TINY, image((8, 8), (8, 8))), _cost(TINY, image((8, 16)))
    # Same patches and LLM tokens; only the attention pairs differ (2 * 64**2 vs 128**2).
    assert two_small.llm == one_large.llm
    assert one_large.vision - two_small.vision == pytest.approx(TINY.vision.quadratic * (128**2 - 2 * 64**2))
    assert two_small.vision < one_large.vision
    grids = [(2 * s, 2 * s) for s in (2, 4, 8, 16)]
    vision = [_cost(TINY, image(g)).vision for g in grids]
    patches = [g[0] * g[1] for g in grids]
    assert vision == pytest.approx([TINY.vision.linear * n + TINY.vision.quadratic * n * n for n in patches])


def test_video_frames_cost_like_that_many_images() -> None:
    frames = _cost(TINY, video(6, (10, 12)))
    images = _cost(TINY, image(*[(10, 12)] * 6))
    assert frames == images
    assert frames.vision > 0 and frames.audio == 0


def test_audio_cost_counts_downsampled_frames() -> None:
    cost = _cost(TINY, audio(400))
    assert cost.audio == TINY.audio.linear * 100 + TINY.audio.quadratic * 100**2
    assert cost.vision == 0


def test_costs_vectorised_equals_per_sample() -> None:
    rng = np.random.default_rng(2)
    metas = [sample_metadata(load_workload("omni_mix"), rng, length_scale=0.3) for _ in range(300)]
    costs = TINY.costs(metas)
    assert costs.shape == (300, 3)
    expected = [[c.vision, c.audio, c.llm] for c in (_cost(TINY, m) for m in metas)]
    np.testing.assert_allclose(costs, expected, rtol=1e-12)
    assert [TINY.total_cost(m) for m in metas] == pytest.approx(costs.sum(axis=1).tolist(), rel=1e-12)
    np.testing.assert_allclose(feature_matrix(metas) @ TINY.coefficients, costs.sum(axis=1), rtol=1e-12)
    assert TINY.costs([]).shape == (0, 3)


def test_costs_of_100k_samples_take_well_under_a_second() -> None:
    rng = np.random.default_rng(3)
    metas = [sample_metadata(load_workload("omni_mix"), rng, length_scale=0.2) for _ in range(200)] * 500
    start = time.perf_counter()
    costs = TINY.costs(metas)
    assert time.perf_counter() - start < 1.0
    assert costs.shape == (100_000, 3)


def test_module_costs_are_validated_and_overridable() -> None:
    for bad in (-1.0, math.nan, math.inf, "1", True):
        with pytest.raises(ValueError):
            ModuleCost(linear=bad, quadratic=0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ModuleCost"):
        CostModel(vision=ModuleCost(1, 0), audio=ModuleCost(1, 0), llm=(1, 0))  # type: ignore[arg-type]
    free_vision = TINY.replace(vision=ModuleCost(0, 0))
    assert _cost(free_vision, image((8, 8))).vision == 0
    assert free_vision.llm == TINY.llm


# --- calibration ----------------------------------------------------------------------------------------------


@cache
def measured_steps(seed: int = 0, steps: int = 200) -> tuple[tuple[SampleMeta, ...], ...]:
    """Random steps of 1-6 omni_mix samples: the samples one rank processed in one step."""
    rng = np.random.default_rng(seed)
    spec = load_workload("omni_mix")
    return tuple(
        tuple(sample_metadata(spec, rng, length_scale=0.25) for _ in range(int(rng.integers(1, 7))))
        for _ in range(steps)
    )


def step_times(model: CostModel, steps: tuple[tuple[SampleMeta, ...], ...], noise: float = 0.0) -> list[float]:
    rng = np.random.default_rng(4)
    return [float(model.costs(s).sum() * (1 + noise * rng.standard_normal())) for s in steps]


def test_fit_recovers_config_coefficients() -> None:
    steps = measured_steps()
    true = reference_cost_model(ReferenceMLLMConfig.tiny()).coefficients * 1e-12  # seconds at 1 TFLOP/s
    model = _from_coefficients(true)
    exact = fit_cost_model(list(zip(steps, step_times(model, steps), strict=True)))
    np.testing.assert_allclose(exact.coefficients, true, rtol=1e-6)
    noisy = fit_cost_model(list(zip(steps, step_times(model, steps, noise=1e-6), strict=True)))
    np.testing.assert_allclose(noisy.coefficients, true, rtol=1e-2)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(min_value=-2.0, max_value=2.0), min_size=6, max_size=6))
def test_fit_recovers_random_positive_coefficients(log_factors: list[float]) -> None:
    # Around the config's proportions, each coefficient scaled by up to 100x either way.
    true = TINY.coefficients * 1e-12 * 10.0 ** np.array(log_factors)
    model = _from_coefficients(true)
    steps = measured_steps()
    fitted = fit_cost_model(list(zip(steps, step_times(model, steps), strict=True)))
    np.testing.assert_allclose(fitted.coefficients, true, rtol=1e-3)


def test_fit_only_the_named_modules() -> None:
    steps = measured_steps()
    llm_only = CostModel(vision=ModuleCost(0, 0), audio=ModuleCost(0, 0), llm=ModuleCost(2e-6, 3e-9))
    fitted = fit_cost_model(list(zip(steps, step_times(llm_only, steps), strict=True)), modules=["llm"])
    np.testing.assert_allclose(fitted.coefficients, llm_only.coefficients, rtol=1e-6)
    text_steps = [((text(n), text(3 * n)), float(n)) for n in range(1, 10)]
    assert fit_cost_model(text_steps, modules=("llm",)).vision == ModuleCost(0, 0)


def test_fit_warns_when_the_features_cannot_separate_coefficients(caplog: pytest.LogCaptureFixture) -> None:
    # Every image 16x16: patches and pairs are proportional, so vision linear and quadratic are not identifiable.
    steps = [((image(*[(16, 16)] * k, tokens=5 * k * k),), float(k)) for k in range(1, 8)]
    with caplog.at_level(logging.WARNING, logger="omni_lightning.balance.cost_fit"):
        model = fit_cost_model(steps, modules=("vision", "llm"))
    assert "do not determine" in caplog.text
    predicted = [model.costs(s).sum() for s, _ in steps]
    assert predicted == pytest.approx([t for _, t in steps], rel=1e-6)  # still fits the measured shapes


@pytest.mark.parametrize(
    ("measurements", "kwargs", "match"),
    [
        ([((text(5),), 1.0)] * 5, {}, "at least 6 measurements"),
        ([((text(5),), 1.0)], {"modules": ("llm",)}, "at least 2 measurements"),
        ([((text(5),), 1.0)] * 5 + [((text(5),), math.nan)], {}, "finite"),
        ([((text(5),), 1.0)] * 5 + [((text(5),), math.inf)], {}, "finite"),
        ([((text(5),), 1.0)] * 5 + [((text(5),), -0.5)], {}, "negative"),
        ([((text(5),), 1.0)] * 5 + [((), 1.0)], {}, "no samples"),
        ([((text(5),), 1.0)] * 5 + [((text(5),), 1.0, 2.0)], {}, "pair"),
        ([((text(5),), "1")] * 6, {}, "finite number"),
        ([((text(k),), 0.0) for k in range(1, 7)], {}, "zero"),
        ([((text(k),), 1.0) for k in range(1, 7)], {}, "vision or audio"),
        ([((text(k),), 1.0) for k in range(1, 7)], {"modules": ("llm", "llm")}, "distinct"),
        ([((text(k),), 1.0) for k in range(1, 7)], {"modules": ("decoder",)}, "distinct"),
        ([((text(k),), 1.0) for k in range(1, 7)], {"modules": ()}, "distinct"),
    ],
)
def test_fit_rejects_bad_input(measurements: list, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fit_cost_model(measurements, **kwargs)


def brute_force_nnls(a: np.ndarray, b: np.ndarray) -> float:
    """Smallest residual over every support set whose unconstrained solution is non-negative."""
    best = np.linalg.norm(b)
    for size in range(1, a.shape[1] + 1):
        for support in map(list, itertools.combinations(range(a.shape[1]), size)):
            x = np.linalg.lstsq(a[:, support], b, rcond=None)[0]
            if (x >= 0).all():
                best = min(best, np.linalg.norm(a[:, support] @ x - b))
    return best


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=0, max_value=2**32 - 1),
    st.integers(min_value=1, max_value=12),
    st.integers(min_value=1, max_value=6),
    st.booleans(),
)
def test_nnls_is_optimal(seed: int, rows: int, cols: int, duplicate_column: bool) -> None:
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((rows, cols)), rng.standard_normal(rows)
    if duplicate_column:
        a[:, 0] = a[:, -1]
    x = _nnls(a, b)
    assert (x >= 0).all()
    assert np.linalg.norm(a @ x - b) <= brute_force_nnls(a, b) + 1e-9
