"""Pricing the encoder resharder's plan from a job's first steps: the fit (pure), matching forwards with the slowest
rank's work on wall clocks (pure), and the calibrator on a gloo world and through the strategy (what the plan gave
each rank timed, one set of prices on every rank after)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning_runs import LEARNING_RATE, fit

from omni_lightning import OmniModule, ReferenceMLLM, ReferenceMLLMConfig
from omni_lightning.balance.calibration import (
    fit_module_prices,
    forward_price_error,
    paced_by_slowest,
    training_passes,
    unmeasured_modules,
)
from omni_lightning.balance.cost import CostModel, ModuleCost
from omni_lightning.balance.reshard import gain_beyond_price_error
from omni_lightning.runtime import calibration
from omni_lightning.runtime.calibration import ResharderCalibrator
from omni_lightning.runtime.optim import freeze_parts
from omni_lightning.runtime.reshard import Resharder

FLOPS = CostModel(vision=ModuleCost(3e5, 40.0), audio=ModuleCost(5e5, 60.0), llm=ModuleCost(1e6, 200.0))
# Forward seconds per training FLOP each module "measures" (vision far cheaper per FLOP than the LLM, as on CPUs).
RATES = {"vision": 4e-12, "audio": 9e-12, "llm": 1e-11}


def _rows(rng: np.random.Generator, name: str, n: int, *, noise: float = 0.0) -> np.ndarray:
    """``n`` forwards of module ``name`` over random work (in ``FLOPS``' units), timed at ``RATES[name]`` (times
    ``1 +- noise``)."""
    work = rng.uniform(1e8, 1e10, n)
    return np.column_stack([work, RATES[name] * work * (1 + noise * rng.uniform(-1, 1, n))])


def test_each_module_is_priced_at_its_measured_seconds_per_unit_of_training() -> None:
    """Forwards timed at known rates give each module's prices times its rate and the training factor."""
    rng = np.random.default_rng(0)
    records = {name: _rows(rng, name, 12) for name in FLOPS.modules}
    prices = fit_module_prices(records, prices=FLOPS, train_per_forward=3.0)
    for name in FLOPS.modules:
        assert prices.module(name).linear == pytest.approx(3.0 * RATES[name] * FLOPS.module(name).linear, rel=1e-9)
        assert prices.module(name).quadratic == pytest.approx(3.0 * RATES[name] * FLOPS.module(name).quadratic,
                                                              rel=1e-9)


def test_an_encoder_without_timed_work_is_priced_at_the_llms_rate() -> None:
    """No records, only dummy forwards (no work: a rank without items), or no measurable time: its prices at the
    LLM's measured rate, so that the plan's units stay one, and it is named unmeasured."""
    rng = np.random.default_rng(1)
    llm = _rows(rng, "llm", 6)
    dummies = np.array([[0.0, 0.01], [0.0, 0.02]])
    untimed = _rows(rng, "audio", 3) * np.array([1.0, 0.0])
    prices = fit_module_prices({"llm": llm, "vision": dummies, "audio": untimed}, prices=FLOPS)
    for name in ("vision", "audio"):
        assert prices.module(name).linear == pytest.approx(3.0 * RATES["llm"] * FLOPS.module(name).linear, rel=1e-9)
    assert unmeasured_modules({"llm": llm, "vision": dummies, "audio": untimed}, FLOPS.modules) == ["vision", "audio"]
    # Dummy forwards beside timed work are left out: they would price work that is not there.
    vision = np.concatenate([_rows(rng, "vision", 4), dummies])
    assert fit_module_prices({"llm": llm, "vision": vision}, prices=FLOPS).vision.linear == pytest.approx(
        3.0 * RATES["vision"] * FLOPS.vision.linear, rel=1e-9)
    assert unmeasured_modules({"llm": llm, "vision": vision}, FLOPS.modules) == ["audio"]


@pytest.mark.parametrize(("records", "kwargs", "message"), [
    ({"vision": np.ones((2, 2))}, {}, "the LLM's timed forwards carry no work"),
    ({"llm": np.zeros((3, 2))}, {}, "the LLM's timed forwards carry no work"),
    ({"llm": np.ones((2, 2)), "video": np.ones((1, 2))}, {}, r"records of module\(s\) \['video'\]"),
    ({"llm": -np.ones((2, 2))}, {}, "llm: work and seconds must be finite and non-negative"),
    ({"llm": np.full((2, 2), np.nan)}, {}, "must be finite"),
    ({"llm": np.ones((2, 2))}, {"train_per_forward": 0.0}, r"train_per_forward=0.0 \(vision\) must be positive"),
    ({"llm": np.ones((2, 2))}, {"train_per_forward": {"llm": 3.0, "vision": 1.0}},
     r"no factor for module\(s\) \['audio'\]"),
    ({"llm": np.ones((2, 2))}, {"train_per_forward": {"llm": 3.0, "vision": 1.0, "audio": -1.0}},
     r"train_per_forward=-1.0 \(audio\) must be positive"),
])
def test_malformed_records_are_rejected_by_name(records: dict[str, np.ndarray], kwargs: dict[str, float],
                                                message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_module_prices(records, prices=FLOPS, **kwargs)


def test_each_module_is_priced_by_its_own_training_factor() -> None:
    """A frozen encoder's training is its forward (factor 1): it is priced at its measured forward rate alone, the
    modules that train in full at three times theirs."""
    rng = np.random.default_rng(2)
    records = {name: _rows(rng, name, 5) for name in FLOPS.modules}
    prices = fit_module_prices(records, prices=FLOPS, train_per_forward={"vision": 1.0, "audio": 3.0, "llm": 3.0})
    full = fit_module_prices(records, prices=FLOPS)
    assert prices.vision.linear == pytest.approx(full.vision.linear / 3.0, rel=1e-12)
    assert (prices.audio, prices.llm) == (full.audio, full.llm)


@pytest.mark.parametrize(("parameters", "inputs_need_gradient", "passes"), [
    ([(10, True), (30, True)], False, 3.0),  # everything trains: forward, gradient through it, weight gradients
    ([(10, False), (30, False)], False, 1.0),  # a frozen encoder: its inputs are data, no backward at all
    ([(10, False), (30, False)], True, 2.0),  # a frozen LLM under a training encoder: the gradient runs through
    ([(30, False), (10, True)], False, 1.5),  # only the last quarter trains (a projector): back through it alone
    ([(10, False), (30, True)], True, 2.75),  # frozen embeddings, gradients arriving from a training encoder
    ([], True, 2.0),
    ([], False, 1.0),
])
def test_training_passes_count_the_backward_that_runs(parameters: list[tuple[int, bool]],
                                                      inputs_need_gradient: bool, passes: float) -> None:
    assert training_passes(parameters, inputs_need_gradient=inputs_need_gradient) == pytest.approx(passes)


@settings(max_examples=80, deadline=None)
@given(parameters=st.lists(st.tuples(st.integers(0, 10**6), st.booleans()), max_size=12),
       index=st.integers(0, 11), inputs_need_gradient=st.booleans())
def test_training_passes_lie_between_a_forward_and_a_full_training_pass_and_grow_with_what_trains(
        parameters: list[tuple[int, bool]], index: int, inputs_need_gradient: bool) -> None:
    passes = training_passes(parameters, inputs_need_gradient=inputs_need_gradient)
    assert 1.0 <= passes <= 3.0 + 1e-12
    assert training_passes(parameters, inputs_need_gradient=True) >= passes - 1e-12
    if parameters:
        more = list(parameters)
        more[index % len(more)] = (more[index % len(more)][0], True)
        assert training_passes(more, inputs_need_gradient=inputs_need_gradient) >= passes - 1e-12


def test_a_models_frozen_parts_set_its_modules_training_passes_and_flops() -> None:
    """On the tiny reference model: with the vision tower frozen (its projector still trains) vision's factor is one
    plus twice its projector's share of its parameters, and its training FLOPs shrink to match; the audio encoder and
    the LLM train in full. With every encoder and projector frozen, the LLM's gradient no longer runs back into its
    inputs, where its embeddings are frozen too."""
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    full = model.cost_model()
    assert model.training_passes() == {"vision": 3.0, "audio": 3.0, "llm": 3.0}
    freeze_parts(model, ["vision"], model.encoder_names)
    share = (sum(p.numel() for p in model.vision.projector.parameters())
             / sum(p.numel() for p in model.vision.parameters()))
    passes = model.training_passes()
    assert passes["vision"] == pytest.approx(1.0 + 2 * share) and share < 0.5
    assert (passes["audio"], passes["llm"]) == (3.0, 3.0)
    flops = model.cost_model()
    assert flops.vision.linear == pytest.approx(full.vision.linear * passes["vision"] / 3.0, rel=1e-12)
    assert flops.vision.quadratic == pytest.approx(full.vision.quadratic * passes["vision"] / 3.0, rel=1e-12)
    assert (flops.audio, flops.llm) == (full.audio, full.llm)
    freeze_parts(model, ["audio", "projector"], model.encoder_names)
    assert model.training_passes()["vision"] == 1.0 == model.training_passes()["audio"]
    assert model.training_passes()["llm"] == pytest.approx(3.0)
    embeddings = model.llm.tok_embeddings.weight.numel() / sum(p.numel() for p in model.llm.parameters())
    model.llm.tok_embeddings.weight.requires_grad_(False)
    assert model.training_passes()["llm"] == pytest.approx(3.0 - 2 * embeddings)


def test_a_modules_cost_model_counts_what_it_will_freeze_before_it_is_built() -> None:
    """``OmniModule.cost_model()`` before ``configure_model`` (what the strategy hands the loader and the resharder)
    prices the parts ``freeze`` names as frozen, as the built model will be."""
    frozen = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    freeze_parts(frozen, ["vision"], frozen.encoder_names)
    assert OmniModule(ReferenceMLLMConfig.tiny(), freeze=["vision"]).cost_model() == frozen.cost_model()
    assert OmniModule(ReferenceMLLMConfig.tiny()).cost_model() == ReferenceMLLM(ReferenceMLLMConfig.tiny()).cost_model()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-3, 1e3), noise=st.floats(0.0, 0.5))
def test_prices_follow_the_clock_and_not_the_order_of_the_records(seed: int, scale: float, noise: float) -> None:
    """A clock k times slower prices every module k times higher; shuffled records price the same; the prices are
    positive and keep each module's shape (quadratic over linear)."""
    rng = np.random.default_rng(seed)
    records = {name: _rows(rng, name, int(rng.integers(1, 9)), noise=noise) for name in FLOPS.modules}
    prices = fit_module_prices(records, prices=FLOPS)
    slower = fit_module_prices({n: r * np.array([1.0, scale]) for n, r in records.items()}, prices=FLOPS)
    shuffled = fit_module_prices({n: rng.permutation(r) for n, r in records.items()}, prices=FLOPS)
    np.testing.assert_allclose(slower.coefficients, prices.coefficients * scale, rtol=1e-9)
    np.testing.assert_allclose(shuffled.coefficients, prices.coefficients, rtol=1e-9)
    assert (prices.coefficients > 0).all() and np.isfinite(prices.coefficients).all()
    for name in FLOPS.modules:
        flops = FLOPS.module(name)
        assert prices.module(name).quadratic / prices.module(name).linear == pytest.approx(
            flops.quadratic / flops.linear, rel=1e-9)


def test_on_a_wall_clock_each_forward_is_matched_with_the_slowest_ranks_work() -> None:
    """Rank 1 encodes twice rank 0's image, and both ranks' forwards take rank 1's time (rank 0 waits for it in
    FSDP's gathers): matched with the largest work, the fit reads the true rate instead of 4/3 of it."""
    seconds = RATES["vision"] * 2e9
    ranks = [{"vision": np.array([[1e9, seconds]]), "llm": np.array([[1e9, 1e-2]])},
             {"vision": np.array([[2e9, seconds]]), "llm": np.array([[1e9, 1e-2]]), "audio": np.array([[0.0, 1e-3]])}]
    paced = paced_by_slowest(ranks)
    np.testing.assert_array_equal(paced[0]["vision"], [[2e9, seconds]])
    np.testing.assert_array_equal(paced[1]["vision"], [[2e9, seconds]])
    assert "audio" not in paced[0] and paced[1]["audio"].tolist() == [[0.0, 1e-3]]  # rows differ: kept as they were
    merged = {name: np.concatenate([rank[name] for rank in paced if name in rank]) for name in ("vision", "llm")}
    assert fit_module_prices(merged, prices=FLOPS).vision.linear == pytest.approx(
        3.0 * RATES["vision"] * FLOPS.vision.linear, rel=1e-9)
    raw = {name: np.concatenate([rank[name] for rank in ranks]) for name in ("vision", "llm")}
    assert fit_module_prices(raw, prices=FLOPS).vision.linear == pytest.approx(
        4 / 3 * 3.0 * RATES["vision"] * FLOPS.vision.linear, rel=1e-9)


def test_the_price_error_is_how_far_the_fitted_rates_miss_the_timed_forwards() -> None:
    """Forwards at one rate per module: no error. A per-call constant (every forward 1 ms more, whatever its work)
    is spread over the work by the ratio, and what it misses is the error; records without work are left out."""
    rng = np.random.default_rng(2)
    records = {name: _rows(rng, name, 8) for name in FLOPS.modules}
    assert forward_price_error(records, FLOPS.modules) == pytest.approx(0.0, abs=1e-12)
    work = np.array([1e9, 3e9])
    constant = {"llm": np.column_stack([work, 1e-11 * work + 1e-3]), "vision": np.array([[0.0, 5.0]])}
    rate = (1e-11 * work.sum() + 2e-3) / work.sum()
    missed = np.abs(1e-11 * work + 1e-3 - rate * work).sum()
    assert forward_price_error(constant, FLOPS.modules) == pytest.approx(missed / (1e-11 * work.sum() + 2e-3))
    with pytest.raises(ValueError, match="the LLM's timed forwards carry no work"):
        forward_price_error({"vision": records["vision"]}, FLOPS.modules)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-3, 1e3), noise=st.floats(0.0, 0.5))
def test_the_price_error_follows_the_noise_and_not_the_clock(seed: int, scale: float, noise: float) -> None:
    """Within twice the records' relative noise, and the same on a clock k times slower."""
    rng = np.random.default_rng(seed)
    records = {name: _rows(rng, name, int(rng.integers(1, 9)), noise=noise) for name in FLOPS.modules}
    error = forward_price_error(records, FLOPS.modules)
    assert 0.0 <= error <= 2 * noise / (1 - noise) + 1e-12
    slower = {n: r * np.array([1.0, scale]) for n, r in records.items()}
    assert forward_price_error(slower, FLOPS.modules) == pytest.approx(error, rel=1e-9, abs=1e-15)


class _FakeClock:
    """A clock that a timed block advances by what the test says the work took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _calibrate_on_a_world(rank: int, world_size: int) -> None:
    costs = {"vision": FLOPS.vision, "audio": FLOPS.audio}
    resharder = Resharder(dist.group.WORLD, {}, costs, llm=FLOPS.llm, enc_sp=2, min_gain=0.0)
    clock = _FakeClock()
    with pytest.raises(ValueError, match="calibration steps=0 must be at least 1"):
        ResharderCalibrator(resharder, steps=0, clock=clock)
    with pytest.raises(ValueError, match="the resharder calibrates against the LLM's measured time"):
        ResharderCalibrator(Resharder(dist.group.WORLD, {}, costs), steps=1, clock=clock)
    calibrator = ResharderCalibrator(resharder, steps=2, clock=clock, skip=1)
    rng = np.random.default_rng(rank)
    lengths = {"vision": torch.tensor([4096] if rank == 0 else [16, 16, 64 * rank]),
               "audio": torch.tensor([32] if rank == 1 else [], dtype=torch.int64)}
    tokens = 64 + 32 * rank
    for batch in range(3):
        # Measured batches plan as before: rank 0's huge image is split, small items move.
        steps = resharder.plan(lengths, {"vision": 4, "audio": 4}, (tokens, tokens * (tokens + 1) // 2))
        assert calibrator.measuring == (batch >= 1)
        # What the plan gave each rank to encode is all the items' work, once.
        work = torch.tensor([steps["vision"].work, steps["audio"].work], dtype=torch.float64)
        dist.all_reduce(work)
        vision = [4096] + [16, 16, 64, 16, 16, 128, 16, 16, 192][: 3 * (world_size - 1)]
        assert work[0].item() == pytest.approx(sum(FLOPS.vision.linear * n + FLOPS.vision.quadratic * n**2
                                                   for n in vision), rel=1e-12)
        assert work[1].item() == pytest.approx(FLOPS.audio.linear * 32 + FLOPS.audio.quadratic * 32**2, rel=1e-12)
        assert steps["vision"].items_split == 1
        for name, done in (("vision", steps["vision"].work), ("audio", steps["audio"].work),
                           ("llm", calibrator.llm_work(tokens, tokens * (tokens + 1) // 2))):
            with calibrator.timed(name, done):
                clock.now += RATES[name] * done * (1 + 0.1 * rng.uniform())
        calibrator.end_batch()
    assert calibrator.calibrated and resharder.link is None
    coefficients = torch.as_tensor(resharder.prices.coefficients)
    everyone = [torch.empty_like(coefficients) for _ in range(world_size)]
    dist.all_gather(everyone, coefficients)
    assert all(torch.equal(other, everyone[0]) for other in everyone)  # one set of prices, to the bit
    # The prices miss the forwards by less than their 10% noise; a plan must now gain what that error cannot
    # account for on either peak, (1 + 0.1) / (1 - 0.1) - 1 at most.
    gains = [None] * world_size
    dist.all_gather_object(gains, resharder.min_gain)
    assert len(set(gains)) == 1 and 0.0 < gains[0] <= gain_beyond_price_error(0.1)
    for index, name in ((0, "vision"), (2, "audio"), (4, "llm")):  # each at its timed rate, within the 10% noise
        rate = coefficients[index].item() / FLOPS.module(name).linear / 3.0
        assert RATES[name] <= rate <= 1.1 * RATES[name], (name, rate)


@pytest.mark.distributed
def test_the_calibrator_times_what_the_plan_gave_each_rank_then_every_rank_plans_from_one_set_of_prices() -> None:
    run_distributed(_calibrate_on_a_world, 4)


def _price_an_unmeasured_encoder_later(rank: int, world_size: int) -> None:
    costs = {"vision": FLOPS.vision, "audio": FLOPS.audio}
    resharder = Resharder(dist.group.WORLD, {}, costs, llm=FLOPS.llm, min_gain=0.0)
    calibrator = ResharderCalibrator(resharder, steps=1, clock=(clock := _FakeClock()), skip=0)
    images = {"vision": torch.tensor([256, 256, 256, 256] if rank == 0 else [], dtype=torch.int64),
              "audio": torch.tensor([32], dtype=torch.int64)}
    tokens = (64, 64 * 65 // 2)
    work = calibrator.llm_work(*tokens)
    # Batch 0 holds no image: vision is priced at the LLM's rate, and its items stay home.
    for name, done in (("audio", FLOPS.audio.linear * 32 + FLOPS.audio.quadratic * 32**2), ("llm", work)):
        with calibrator.timed(name, done):
            clock.now += RATES[name] * done
    calibrator.end_batch()
    assert resharder.unmeasured == {"vision"} and not calibrator.calibrated
    assert calibrator.measures("vision") and not calibrator.measures("llm") and not calibrator.measures("audio")
    steps = resharder.plan(images, {"vision": 4, "audio": 4}, tokens)
    assert steps["vision"].items_moved == 0
    # Batch 1 times the images where they are: priced from then on, and they spread over the ranks.
    with calibrator.timed("vision", steps["vision"].work):
        clock.now += RATES["vision"] * float(FLOPS.vision(images["vision"].double(), images["vision"].double() ** 2)
                                             .sum())
    calibrator.end_batch()
    assert calibrator.calibrated and not resharder.unmeasured
    rate = resharder.prices.vision.linear / FLOPS.vision.linear / 3.0
    assert rate == pytest.approx(RATES["vision"], rel=1e-9)
    steps = resharder.plan(images, {"vision": 4, "audio": 4}, tokens)
    assert steps["vision"].items_moved == world_size - 1


@pytest.mark.distributed
def test_an_encoder_the_first_batches_did_not_time_keeps_its_items_home_until_it_is_timed() -> None:
    """Priced at the LLM's rate, a rare encoder's huge items can look many times costlier than they are and be split
    or moved where that does not pay: they stay home until a later batch has timed the encoder on its own items."""
    run_distributed(_price_an_unmeasured_encoder_later, 4)


def _refit_only_what_was_timed_since(rank: int, world_size: int) -> None:
    resharder = Resharder(dist.group.WORLD, {}, {"vision": FLOPS.vision, "audio": FLOPS.audio}, llm=FLOPS.llm,
                          min_gain=0.0)
    calibrator = ResharderCalibrator(resharder, steps=1, clock=(clock := _FakeClock()), skip=0)
    fits = []
    fit = calibrator._calibrate
    calibrator._calibrate = lambda: (fits.append(calibrator.seen), fit())  # type: ignore[method-assign]

    def batch(timed: dict[str, float]) -> None:
        for name, done in timed.items():
            with calibrator.timed(name, done):
                clock.now += RATES[name] * done
        calibrator.end_batch()

    audio = FLOPS.audio.linear * 32 + FLOPS.audio.quadratic * 32**2
    batch({"audio": audio, "llm": calibrator.llm_work(64, 64 * 65 // 2)})  # fitted after it: vision unmeasured
    assert fits == [1] and resharder.unmeasured == {"vision"}
    batch({"audio": audio})  # the refit due after batch 2 has nothing new to price: skipped on every rank
    assert fits == [1] and resharder.unmeasured == {"vision"}
    # Only rank 1 times an image in batch 3: every rank refits after batch 4, when the next one is due.
    batch({"vision": float(FLOPS.vision(256, 256**2))} if rank == 1 else {})
    batch({})
    assert fits == [1, 4] and calibrator.calibrated and not resharder.unmeasured


@pytest.mark.distributed
def test_the_prices_are_fitted_again_only_once_some_rank_timed_an_unmeasured_encoder() -> None:
    """Refitting gathers every record over the world: where no rank timed a module the last fit left unmeasured,
    the ranks agree (one all-reduced count) that a refit would price nothing new, and skip it alike."""
    run_distributed(_refit_only_what_was_timed_since, 2)


class _RecordPrices(pl.Callback):
    """Each rank writes its resharder's prices after every training batch."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.rows = out_dir, []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.rows.append(module.step.source.resharder.prices.coefficients.tolist())
        (self.out_dir / f"prices_rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))


@pytest.mark.distributed
def test_a_job_times_its_first_batches_and_plans_from_their_prices_on_every_rank(
        tmp_path: Path, tiny_shards: str, seed_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the strategy: batch 0 is left out, batch 1 timed (each rank's encoders and LLM forward); at the end
    of its forward every rank prices its plan alike from the records of both ranks, for batch 2 on. An encoder of
    which neither rank held an item is timed again in batch 2 and priced after it, from every record so far. The
    vision tower is frozen: it is priced at about its forward's measured rate, the rest at three times theirs."""
    fitted, fits = calibration.fit_module_prices, []

    def keep_records(records: dict[str, np.ndarray], **kwargs: Any) -> CostModel:
        fits.append(records)  # rank 0 fits
        np.savez(tmp_path / f"records{len(fits)}.npz", **records)
        return fitted(records, **kwargs)

    monkeypatch.setattr(calibration, "fit_module_prices", keep_records)
    module = OmniModule(ReferenceMLLMConfig.tiny(), learning_rate=LEARNING_RATE, init_checkpoint=str(seed_checkpoint),
                        freeze=["vision"])
    fit(tmp_path, tiny_shards, seed_checkpoint, layout={"dp_shard": 2, "link_cost": "auto",
                                                        "reshard_calibration_steps": 1},
        devices=2, max_steps=4, callbacks=[_RecordPrices(tmp_path)], module=module)
    ranks = [json.loads((tmp_path / f"prices_rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    frozen = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    freeze_parts(frozen, ["vision"], frozen.encoder_names)
    passes = frozen.training_passes()
    assert passes["vision"] < 1.5
    first = np.load(tmp_path / "records1.npz")
    for name in ("vision", "audio", "llm"):  # one micro-batch of each rank, each forward over work timed
        assert first[name].shape[0] <= 2 and (first[name] > 0).all(), name
    assert first["llm"].shape == (2, 2)
    unmeasured = [name for name in ("vision", "audio") if not first[name].size]
    n_fits = 2 if unmeasured else 1
    assert len(list(tmp_path.glob("records*.npz"))) == n_fits
    assert ranks[0][0] != ranks[0][1] and ranks[0][n_fits] == ranks[0][-1]  # FLOPs, then seconds from batch 1 on
    for k in range(1, n_fits + 1):
        records = np.load(tmp_path / f"records{k}.npz")
        if k == 2:  # batch 2 timed only what batch 1 left unmeasured
            assert records["llm"].shape == (2, 2)
            assert all(records[name].shape == first[name].shape for name in ("vision", "audio")
                       if name not in unmeasured)
        rates = {name: rows[rows[:, 0] > 0, 1].sum() / rows[rows[:, 0] > 0, 0].sum()
                 for name in ("vision", "audio", "llm") if (rows := records[name])[:, 0].any()}
        for index, name in ((0, "vision"), (2, "audio"), (4, "llm")):
            rate = rates.get(name, rates["llm"])
            assert ranks[0][k][index] == pytest.approx(ranks[0][0][index] * passes[name] * rate, rel=1e-9), name
