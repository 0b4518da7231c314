"""Pricing the encoder resharder's plan from a job's first steps: the fit (pure) and the calibrator on a gloo world
(items held home while it measures, one set of prices on every rank after, the plan gathering again)."""

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
from lightning_runs import fit

from omni_lightning.balance.calibration import fit_module_prices
from omni_lightning.balance.cost import CostModel, ModuleCost
from omni_lightning.balance.reshard import CPU_GLOO
from omni_lightning.runtime import calibration, reshard
from omni_lightning.runtime.calibration import ResharderCalibrator
from omni_lightning.runtime.reshard import Resharder

FLOPS = CostModel(vision=ModuleCost(3e5, 40.0), audio=ModuleCost(5e5, 60.0), llm=ModuleCost(1e6, 200.0))
# Forward seconds per training FLOP each module "measures" (vision far cheaper per FLOP than the LLM, as on CPUs).
RATES = {"vision": 4e-12, "audio": 9e-12, "llm": 1e-11}


def _rows(rng: np.random.Generator, name: str, n: int, *, llm_share: float = 1.0, noise: float = 0.0) -> np.ndarray:
    """``n`` forwards of module ``name`` over random work, timed at ``RATES[name]`` (times ``1 +- noise``)."""
    linear = rng.integers(16, 4096, n).astype(np.float64)
    quadratic = linear ** 2 / rng.integers(1, 4, n) if name != "llm" else linear * (linear + 1) / 2
    cost = FLOPS.module(name)
    share = llm_share if name == "llm" else 1.0
    seconds = RATES[name] * (cost.linear * linear + cost.quadratic * quadratic) * share
    return np.column_stack([linear, quadratic, seconds * (1 + noise * rng.uniform(-1, 1, n))])


@pytest.mark.parametrize("llm_share", [1.0, 0.25])
def test_each_module_is_priced_at_its_measured_seconds_per_unit_of_training(llm_share: float) -> None:
    """Forwards timed at known rates give each module's FLOP prices times its rate and the training factor; a rank
    running a quarter of the LLM's work (tp x cp = 4) is scaled to the whole micro-batch's."""
    rng = np.random.default_rng(0)
    records = {name: _rows(rng, name, 12, llm_share=llm_share) for name in FLOPS.modules}
    prices = fit_module_prices(records, flops=FLOPS, llm_share=llm_share, train_per_forward=3.0)
    for name in FLOPS.modules:
        assert prices.module(name).linear == pytest.approx(3.0 * RATES[name] * FLOPS.module(name).linear, rel=1e-9)
        assert prices.module(name).quadratic == pytest.approx(3.0 * RATES[name] * FLOPS.module(name).quadratic,
                                                              rel=1e-9)


def test_an_encoder_without_timed_work_is_priced_at_the_llms_rate() -> None:
    """No records, only dummy forwards (no work: a rank without items), or no measurable time: FLOPs at the LLM's
    measured rate, so that the plan's units stay one."""
    rng = np.random.default_rng(1)
    llm = _rows(rng, "llm", 6)
    dummies = np.array([[0.0, 0.0, 0.01], [0.0, 0.0, 0.02]])
    untimed = _rows(rng, "audio", 3) * np.array([1.0, 1.0, 0.0])
    prices = fit_module_prices({"llm": llm, "vision": dummies, "audio": untimed}, flops=FLOPS)
    for name in ("vision", "audio"):
        assert prices.module(name).linear == pytest.approx(3.0 * RATES["llm"] * FLOPS.module(name).linear, rel=1e-9)
    # Dummy forwards beside timed work are left out: they would price work that is not there.
    vision = np.concatenate([_rows(rng, "vision", 4), dummies])
    assert fit_module_prices({"llm": llm, "vision": vision}, flops=FLOPS).vision.linear == pytest.approx(
        3.0 * RATES["vision"] * FLOPS.vision.linear, rel=1e-9)


@pytest.mark.parametrize(("records", "kwargs", "message"), [
    ({"vision": np.ones((2, 3))}, {}, "the LLM's timed forwards carry no work"),
    ({"llm": np.zeros((3, 3))}, {}, "the LLM's timed forwards carry no work"),
    ({"llm": np.ones((2, 3)), "video": np.ones((1, 3))}, {}, r"records of module\(s\) \['video'\]"),
    ({"llm": -np.ones((2, 3))}, {}, "llm: seconds and features must be finite and the seconds non-negative"),
    ({"llm": np.full((2, 3), np.nan)}, {}, "must be finite"),
    ({"llm": np.ones((2, 3))}, {"llm_share": 0.0}, r"llm_share=0.0 must be in \(0, 1\]"),
    ({"llm": np.ones((2, 3))}, {"train_per_forward": 0.0}, "train_per_forward=0.0 must be positive"),
])
def test_malformed_records_are_rejected_by_name(records: dict[str, np.ndarray], kwargs: dict[str, float],
                                                message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_module_prices(records, flops=FLOPS, **kwargs)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-3, 1e3), noise=st.floats(0.0, 0.5))
def test_prices_follow_the_clock_and_not_the_order_of_the_records(seed: int, scale: float, noise: float) -> None:
    """A clock k times slower prices every module k times higher; shuffled records price the same; the prices are
    positive and keep each module's FLOP shape (quadratic over linear)."""
    rng = np.random.default_rng(seed)
    records = {name: _rows(rng, name, int(rng.integers(1, 9)), noise=noise) for name in FLOPS.modules}
    prices = fit_module_prices(records, flops=FLOPS)
    slower = fit_module_prices({n: r * np.array([1.0, 1.0, scale]) for n, r in records.items()}, flops=FLOPS)
    shuffled = fit_module_prices({n: rng.permutation(r) for n, r in records.items()}, flops=FLOPS)
    np.testing.assert_allclose(slower.coefficients, prices.coefficients * scale, rtol=1e-9)
    np.testing.assert_allclose(shuffled.coefficients, prices.coefficients, rtol=1e-9)
    assert (prices.coefficients > 0).all() and np.isfinite(prices.coefficients).all()
    for name in FLOPS.modules:
        flops = FLOPS.module(name)
        assert prices.module(name).quadratic / prices.module(name).linear == pytest.approx(
            flops.quadratic / flops.linear, rel=1e-9)


class _FakeClock:
    """A clock that a timed block advances by what the test says the work took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _calibrate_on_a_world(rank: int, world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gathers: list[int] = []
    gather = reshard.all_gather_single
    monkeypatch.setattr(reshard, "all_gather_single", lambda *a, **k: (gathers.append(1), gather(*a, **k)))
    resharder = Resharder(dist.group.WORLD, {}, {"vision": FLOPS.vision, "audio": FLOPS.audio}, llm=FLOPS.llm,
                          link=CPU_GLOO, traffic=None)
    clock = _FakeClock()
    with pytest.raises(ValueError, match="calibration steps=0 must be at least 1"):
        ResharderCalibrator(resharder, steps=0, clock=clock)
    with pytest.raises(ValueError, match="the resharder calibrates against the LLM's measured time"):
        ResharderCalibrator(Resharder(dist.group.WORLD, {}, {"vision": FLOPS.vision}), steps=1, clock=clock)
    calibrator = ResharderCalibrator(resharder, steps=2, clock=clock, skip=1)
    rng = np.random.default_rng(rank)
    for batch in range(3):
        # Rank 0 holds a huge image, which resharding would move at once: while the calibrator measures, it stays.
        lengths = {"vision": torch.tensor([4096] if rank == 0 else [16, 16]),
                   "audio": torch.tensor([], dtype=torch.int64)}
        steps = resharder.plan(lengths, {"vision": 4, "audio": 4}, (64, 64 * 65 // 2))
        assert all(step.exchange is None for step in steps.values()) and not gathers
        assert calibrator.measuring == (batch >= 1)
        for name, work in (("vision", (float(lengths["vision"].sum()), float((lengths["vision"] ** 2).sum()))),
                           ("llm", (float(64 + rank), float((64 + rank) * (65 + rank) // 2)))):
            with calibrator.timed(name, work):
                seconds = RATES[name] * (FLOPS.module(name).linear * work[0] + FLOPS.module(name).quadratic * work[1])
                clock.now += seconds * (1 + 0.1 * rng.uniform())
        calibrator.end_batch()
    assert calibrator.calibrated and not resharder.holding
    assert resharder.link is not None and resharder.link.flops_per_s == 1.0
    coefficients = torch.as_tensor(resharder.prices.coefficients)
    everyone = [torch.empty_like(coefficients) for _ in range(world_size)]
    dist.all_gather(everyone, coefficients)
    assert all(torch.equal(other, everyone[0]) for other in everyone)  # one set of prices, to the bit
    llm_rate = coefficients[4] / FLOPS.llm.linear / 3.0
    assert 1e-11 <= llm_rate <= 1.1e-11  # the LLM's timed rate, within the clock's 10% noise
    vision_rate = coefficients[0] / FLOPS.vision.linear / 3.0
    assert 4e-12 <= vision_rate <= 4.4e-12
    assert coefficients[2] / FLOPS.audio.linear == pytest.approx(float(coefficients[4] / FLOPS.llm.linear))
    resharder.plan({"vision": torch.tensor([4096] if rank == 0 else [16, 16]),
                    "audio": torch.tensor([], dtype=torch.int64)}, {"vision": 4, "audio": 4}, (64, 64 * 65 // 2))
    assert gathers  # planning again, over the group


@pytest.mark.distributed
def test_the_resharder_holds_items_home_while_measured_then_every_rank_plans_from_one_set_of_prices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    run_distributed(_calibrate_on_a_world, 3, monkeypatch)



class _RecordPrices(pl.Callback):
    """Each rank writes, after every training batch, whether its resharder still holds items home and its prices."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.rows = out_dir, []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        resharder = module.step.source.resharder
        self.rows.append({"holding": resharder.holding, "moved": module.step.encoder_stats.get("items_moved", 0.0),
                          "prices": resharder.prices.coefficients.tolist()})
        (self.out_dir / f"prices_rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))


@pytest.mark.distributed
def test_a_job_times_its_first_batches_and_plans_from_their_prices_on_every_rank(
        tmp_path: Path, tiny_shards: str, seed_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the strategy: batch 0 is left out, batch 1 timed (each rank's encoders and LLM forward, items home);
    at the end of its forward every rank prices its plan alike from the records of both ranks, and plans again from
    batch 2 on."""
    fitted = calibration.fit_module_prices

    def keep_records(records: dict[str, np.ndarray], **kwargs: Any) -> CostModel:
        np.savez(tmp_path / "records.npz", **records)  # rank 0 fits, once
        return fitted(records, **kwargs)

    monkeypatch.setattr(calibration, "fit_module_prices", keep_records)
    fit(tmp_path, tiny_shards, seed_checkpoint, layout={"dp_shard": 2, "link_cost": "auto",
                                                        "reshard_calibration_steps": 1},
        devices=2, max_steps=4, callbacks=[_RecordPrices(tmp_path)])
    ranks = [json.loads((tmp_path / f"prices_rank{r}.json").read_text()) for r in range(2)]
    assert [row["holding"] for row in ranks[0]] == [row["holding"] for row in ranks[1]] == [True, False, False, False]
    assert all(row["moved"] == 0 for row in ranks[0][:2])
    assert [row["prices"] for row in ranks[0]] == [row["prices"] for row in ranks[1]]
    assert ranks[0][0]["prices"] != ranks[0][1]["prices"] == ranks[0][-1]["prices"]  # FLOPs, then seconds
    records = np.load(tmp_path / "records.npz")
    assert records["llm"].shape == (2, 3) and (records["llm"] > 0).all()  # one micro-batch of each rank
    for name in ("vision", "audio"):
        assert records[name].shape == (2, 3) and (records[name][:, 2] > 0).all()
