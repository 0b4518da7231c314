"""Calibrating the joint pipeline's item plan from timed actions: the fit (pure), the action log, the features."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_lightning.balance.calibration import fit_joint_calibration
from omni_lightning.balance.cost import (
    CostModel,
    ModuleCost,
    feature_matrix,
    fit_cost_model,
    fit_cost_model_to_features,
)
from omni_lightning.balance.workload import SampleMeta
from omni_lightning.batch import BYTE_ROLES
from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.modalities import DEFAULT_PACKING
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.flops import reference_cost_model
from omni_lightning.parallel.timing import ActionLog
from omni_lightning.runtime import calibration
from omni_lightning.runtime.calibration import JointCalibrator, micro_batch_features

# The byte tokens' roles (ids 0-3) and their first text id.
FIRST_TEXT_ID = BYTE_ROLES.first_free_id

MERGE = (("audio", 4), ("image", 4), ("video", 4))
FLOPS = reference_cost_model(ReferenceMLLMConfig.tiny())
# "Measured" prices: encoders far slower next to the LLM than FLOPs say, and attention dearer per pair.
TRUE = CostModel(vision=ModuleCost(2e-6, 4e-9), audio=ModuleCost(3e-6, 1e-8), llm=ModuleCost(1e-6, 2e-10))
TEXT = FIRST_TEXT_ID  # the first text id of byte tokens


def _metas(rng: np.random.Generator, n: int) -> list[list[SampleMeta]]:
    """``n`` micro-batches of two samples each: an image sample and a text or audio one, of random sizes."""
    groups = []
    for _ in range(n):
        side = 2 * int(rng.integers(1, 12))
        image = SampleMeta("image", int(rng.integers(4, 200)), images=((side, 2 * int(rng.integers(1, 12))),),
                           merge=MERGE)
        other = (SampleMeta("audio", int(rng.integers(4, 50)), audio_frames=4 * int(rng.integers(2, 60)), merge=MERGE)
                 if rng.random() < 0.5 else SampleMeta("text", int(rng.integers(4, 400)), merge=MERGE))
        groups.append([image, other])
    return groups


def _actions(features: np.ndarray, stage_shares: np.ndarray, owner: np.ndarray, *, forward: float,
             encoder_forward: float, llm_share: float = 1.0) -> list[list[tuple[str, int, float]]]:
    """What ranks priced by ``TRUE`` would record: each stage its share of every micro-batch's LLM work (a rank
    ``llm_share`` of it), the encoder work of micro-batch ``m`` on rank ``owner[m]``, and some G actions."""
    coefficients = TRUE.coefficients
    llm = features[:, 4:] @ coefficients[4:] * llm_share
    encoder = features[:, :4] @ coefficients[:4]
    ranks = []
    for s, share in enumerate(stage_shares):
        rank = []
        for m in range(features.shape[0]):
            rank += [("F", m, llm[m] * share * forward), ("B", m, llm[m] * share * (1 - forward)), ("G", m, 5.0)]
            if owner[m] == s:
                rank += [("E", m, encoder[m] * encoder_forward), ("EB", m, encoder[m] * (1 - encoder_forward))]
        ranks.append(rank)
    return ranks


def test_fit_to_features_equals_the_fit_to_samples() -> None:
    rng = np.random.default_rng(0)
    groups = _metas(rng, 12)
    seconds = [float(TRUE.costs(g).sum()) for g in groups]
    by_samples = fit_cost_model(list(zip(groups, seconds, strict=True)))
    by_features = fit_cost_model_to_features(np.stack([feature_matrix(g).sum(axis=0) for g in groups]), seconds)
    assert by_features == by_samples
    np.testing.assert_allclose(by_features.coefficients, TRUE.coefficients, rtol=1e-6)
    with pytest.raises(ValueError, match=r"must be \[measurements=3, 6\]"):
        fit_cost_model_to_features(np.ones((3, 5)), [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="finite and non-negative"):
        fit_cost_model_to_features(-np.ones((6, 6)), [1.0] * 6)
    with pytest.raises(ValueError, match="at least 6 measurements"):
        fit_cost_model_to_features(np.ones((3, 6)), [1.0] * 3)


@pytest.mark.parametrize("llm_share", [1.0, 0.25])
def test_joint_calibration_recovers_the_measured_figures(llm_share: float) -> None:
    """Actions priced by a known model give back that model, the forward shares and each stage's share; a rank that
    runs a quarter of its stage (tp x cp = 4) is scaled up to the whole stage's work."""
    rng = np.random.default_rng(1)
    features = np.stack([feature_matrix(g).sum(axis=0) for g in _metas(rng, 16)])
    shares = np.array([0.3, 0.25, 0.2, 0.25])
    actions = _actions(features, shares, rng.integers(0, 4, 16), forward=0.4, encoder_forward=0.3,
                       llm_share=llm_share)
    figures = fit_joint_calibration(features, actions, flops=FLOPS, llm_share=llm_share)
    np.testing.assert_allclose(figures.cost_model.coefficients, TRUE.coefficients, rtol=1e-6)
    assert figures.forward_share == pytest.approx(0.4)
    assert figures.encoder_forward_share == pytest.approx(0.3)
    np.testing.assert_allclose(figures.stage_shares, shares)


def test_an_encoder_the_steps_did_not_run_is_priced_from_flops_at_the_measured_rate() -> None:
    """Text-only steps fit the LLM; the encoders keep their FLOP ratios to it, in the LLM's seconds per FLOP, so
    the plan's units stay one; with no encoder pass timed, the encoders' forward share is FLOPs' third."""
    rng = np.random.default_rng(2)
    features = np.stack([feature_matrix([SampleMeta("text", int(rng.integers(4, 400)), merge=MERGE)]).sum(axis=0)
                         for _ in range(8)])
    figures = fit_joint_calibration(features, _actions(features, np.full(2, 0.5), np.zeros(8, dtype=int),
                                                       forward=0.4, encoder_forward=0.3), flops=FLOPS)
    model = figures.cost_model
    rate = (features[:, 4:] @ TRUE.coefficients[4:]).sum() / (features[:, 4:] @ FLOPS.coefficients[4:]).sum()
    np.testing.assert_allclose(model.coefficients[:4], FLOPS.coefficients[:4] * rate, rtol=1e-9)
    assert figures.encoder_forward_share == pytest.approx(1 / 3)
    # Three micro-batches with images and clips cannot fit both encoders' four coefficients: FLOPs again.
    features = np.stack([feature_matrix(g).sum(axis=0) for g in _metas(rng, 40)])
    features = features[(features[:, 2] > 0)][:3]
    few = fit_joint_calibration(features, _actions(features, np.full(2, 0.5), np.zeros(3, dtype=int), forward=0.4,
                                                   encoder_forward=0.3), flops=FLOPS)
    rate = (features[:, 4:] @ TRUE.coefficients[4:]).sum() / (features[:, 4:] @ FLOPS.coefficients[4:]).sum()
    np.testing.assert_allclose(few.cost_model.coefficients[:4], FLOPS.coefficients[:4] * rate, rtol=1e-9)


def _text_micro_batches(rng: np.random.Generator, n: int) -> np.ndarray:
    """Features of ``n`` text-only micro-batches of one to four sequences of random lengths."""
    return np.stack([feature_matrix([SampleMeta("text", int(rng.integers(8, 400)), merge=MERGE)
                                     for _ in range(int(rng.integers(1, 5)))]).sum(axis=0) for _ in range(n)])


def test_a_coefficient_the_measurements_zero_takes_the_priors_shape() -> None:
    """Times that grow faster with attention pairs than any positive per-token cost explains (noise on a few steps)
    drive the per-token coefficient to zero; with FLOPs as the prior the LLM keeps FLOPs' ratio of the two, scaled to
    the measured seconds, so a micro-batch of many short sequences is not priced as nearly free."""
    features = _text_micro_batches(np.random.default_rng(3), 8)
    tokens, pairs = features[:, 4], features[:, 5]
    seconds = (1e-8 * pairs - 2e-8 * tokens).tolist()
    assert min(seconds) > 0
    free = fit_cost_model_to_features(features, seconds, modules=["llm"])
    assert free.llm.linear == 0 and free.llm.quadratic > 0
    shaped = fit_cost_model_to_features(features, seconds, modules=["llm"], prior=FLOPS)
    assert shaped.llm.linear > 0
    assert shaped.llm.quadratic / shaped.llm.linear == pytest.approx(FLOPS.llm.quadratic / FLOPS.llm.linear)
    flops_seconds = features[:, 4:] @ FLOPS.coefficients[4:]
    scale = float(flops_seconds @ np.asarray(seconds) / (flops_seconds @ flops_seconds))  # least squares, one unknown
    np.testing.assert_allclose(shaped.llm.linear, scale * FLOPS.llm.linear, rtol=1e-9)
    with pytest.raises(ValueError, match="the prior's modules"):
        fit_cost_model_to_features(features, seconds, modules=["llm"], prior=CostModel(llm=FLOPS.llm))


def test_the_joint_calibration_never_prices_a_token_or_pair_at_zero() -> None:
    """The joint pipeline's fit (which CI once saw give the LLM zero seconds per token on two timed steps) keeps both
    of the LLM's coefficients positive on the same times."""
    features = _text_micro_batches(np.random.default_rng(4), 8)
    llm = 1e-8 * features[:, 5] - 2e-8 * features[:, 4]
    stage = [action for m in range(8) for action in (("F", m, llm[m] / 6), ("B", m, llm[m] / 3))]
    figures = fit_joint_calibration(features, [stage, stage], flops=FLOPS)
    assert figures.cost_model.llm.linear > 0 and figures.cost_model.llm.quadratic > 0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), noise=st.floats(0.0, 0.5), micro_batches=st.integers(6, 16))
def test_fitted_modules_never_keep_one_coefficient_at_zero(seed: int, noise: float, micro_batches: int) -> None:
    """Whatever the noise on the times, each fitted module's two coefficients are both positive or both zero where
    the prior's are positive; times that a positive model explains exactly are explained exactly, by that model where
    the features determine it."""
    rng = np.random.default_rng(seed)
    features = np.stack([feature_matrix(g).sum(axis=0) for g in _metas(rng, micro_batches)])
    modules = [name for i, name in enumerate(FLOPS.modules) if features[:, 2 * i].any()]
    exact = features @ TRUE.coefficients
    noisy = (exact * rng.uniform(1 - noise, 1 + noise, exact.size)).tolist()
    fitted = fit_cost_model_to_features(features, noisy, modules=modules, prior=FLOPS)
    for name in modules:
        coefficients = np.array([fitted.module(name).linear, fitted.module(name).quadratic])
        assert (coefficients > 0).all() or not coefficients.any(), (name, coefficients)
    explained = fit_cost_model_to_features(features, exact.tolist(), modules=modules, prior=FLOPS)
    np.testing.assert_allclose(features @ explained.coefficients, exact, rtol=1e-6)
    if np.linalg.matrix_rank(features / np.maximum(features.max(axis=0), 1)) == 2 * len(modules):
        np.testing.assert_allclose(explained.coefficients, TRUE.coefficients, rtol=1e-6)


def test_joint_calibration_rejects_malformed_records() -> None:
    features = np.ones((4, 6))
    with pytest.raises(ValueError, match=r"must be \[micro-batches, 6\]"):
        fit_joint_calibration(np.ones((4, 5)), [[("F", 0, 1.0)]], flops=FLOPS)
    with pytest.raises(ValueError, match="recorded F of micro-batch 4, but features describe 4"):
        fit_joint_calibration(features, [[("F", 4, 1.0)]], flops=FLOPS)
    with pytest.raises(ValueError, match="every stage must have recorded LLM time"):
        fit_joint_calibration(features, [[("F", 0, 1.0)], [("E", 0, 1.0)]], flops=FLOPS)
    with pytest.raises(ValueError, match=r"llm_share=0 must be in \(0, 1\]"):
        fit_joint_calibration(features, [[("F", 0, 1.0)]], flops=FLOPS, llm_share=0)


def test_action_log_takes_nested_actions_and_waits_out_of_the_enclosing_one() -> None:
    """A forward that first encodes lists the encoding before itself; a backward whose hook sends gradients lists
    them after itself; each action's seconds are its own, without what ran or waited inside it."""
    now = [0.0]

    def advance(seconds: float) -> None:
        now[0] += seconds

    log = ActionLog(lambda: now[0])
    with log.timed("F", 3):
        with log.timed("E", 5):
            advance(2.0)
            with log.waiting():
                advance(7.0)
        advance(1.0)
    with log.timed("B", 3, after_nested=False):
        advance(4.0)
        with log.timed("G", 3):
            advance(0.5)
    assert log.actions == [("E", 5, 2.0), ("F", 3, 1.0), ("B", 3, 4.0), ("G", 3, 0.5)]


def test_micro_batch_features_are_the_sums_of_its_samples() -> None:
    rng = np.random.default_rng(3)
    metas = [SampleMeta("image", 30, images=((4, 6), (2, 2)), merge=MERGE),
             SampleMeta("audio", 12, audio_frames=4 * 25, merge=MERGE), SampleMeta("text", 77, merge=MERGE)]
    samples = [DecodedSample(str(i), rng.integers(TEXT, 256, meta.text_tokens),
                             [rng.integers(0, 256, (h * 14, w * 14, 3), dtype=np.uint8) for h, w in meta.images],
                             rng.standard_normal((meta.audio_frames, 80)).astype(np.float32) if meta.audio_frames
                             else None) for i, meta in enumerate(metas)]
    features = micro_batch_features(pack_samples(samples), DEFAULT_PACKING)
    np.testing.assert_array_equal(features, feature_matrix(metas).sum(axis=0))
    text_only = micro_batch_features(pack_samples(samples[2:]), DEFAULT_PACKING)
    np.testing.assert_array_equal(text_only, feature_matrix(metas[2:]).sum(axis=0))


class _Joint:
    """What JointCalibrator needs of JointEncoders: the model's packing, its (absent) tensor- and data-parallel
    peers, and calibrate."""

    def __init__(self) -> None:
        self.model: object = None  # only .packing is read (set by _calibrator)
        self.peers = self.dp_group = None
        self.calls: list[dict[str, object]] = []

    def calibrate(self, cost_model: CostModel, **shares: object) -> None:
        self.calls.append({"cost_model": cost_model, **shares})


def _calibrator(monkeypatch: pytest.MonkeyPatch, steps: int) -> tuple[JointCalibrator, _Joint]:
    """A calibrator for a 2-stage pipeline whose other stage records what this one does (no process group)."""
    monkeypatch.setattr(calibration.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(calibration.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(calibration.dist, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [obj, obj]))
    monkeypatch.setattr(calibration.dist, "broadcast", lambda tensor, src, group=None: None)  # rank 0 is the source
    joint = _Joint()
    joint.model = type("Model", (), {"packing": DEFAULT_PACKING})
    clock = iter(range(10**6))
    return JointCalibrator(joint, None, steps=steps, clock=lambda: float(next(clock)), flops=FLOPS), joint


def _step(calibrator: JointCalibrator, micro_batches: list[dict[str, object]], seconds: list[float]) -> bool:
    """One training step through the calibrator, timing a forward and a backward per micro-batch when measured;
    whether it was measured."""
    log = calibrator.begin_step()
    for m, duration in enumerate(seconds):
        if log is not None:
            log.actions += [("F", m, duration / 3), ("B", m, 2 * duration / 3)]
    calibrator.end_step(micro_batches)
    return log is not None


def test_calibrator_times_the_steps_after_the_first_then_calibrates_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 0 is not timed, steps 1 and 2 are, and after step 2 the fit of both steps' micro-batches (numbered one
    after the other) reaches the joint pipeline once; later steps are not timed."""
    calibrator, joint = _calibrator(monkeypatch, steps=2)
    rng = np.random.default_rng(4)
    micro = [pack_samples([DecodedSample(str(k), rng.integers(TEXT, 256, 10 + 37 * k))]) for k in range(3)]
    lengths = [np.diff(b["cu_seqlens"].numpy().astype(np.float64)) for b in micro]
    seconds = [float(TRUE.llm(x.sum(), (x * (x + 1) / 2).sum())) for x in lengths]
    measured = [_step(calibrator, micro, seconds) for _ in range(4)]
    assert measured == [False, True, True, False]
    (call,) = joint.calls
    # Two stages each record the whole micro-batch's time: the fit sees twice TRUE's LLM cost.
    assert call["cost_model"].llm.linear == pytest.approx(2 * TRUE.llm.linear, rel=1e-6)
    assert call["forward_share"] == pytest.approx(1 / 3) and call["stage_shares"] == pytest.approx((0.5, 0.5))


def test_a_calibration_that_cannot_fit_keeps_flops_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """One timed step of one micro-batch cannot determine the LLM's two coefficients: the job goes on in FLOPs."""
    calibrator, joint = _calibrator(monkeypatch, steps=1)
    micro = [pack_samples([DecodedSample("a", np.arange(TEXT, TEXT + 20))])]
    with caplog.at_level("WARNING"):
        assert [_step(calibrator, micro, [1.0]) for _ in range(3)] == [False, True, False]
    assert joint.calls == [] and "keeps planning items in FLOPs" in caplog.text
