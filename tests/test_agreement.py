"""Ranks that compute a plan redundantly provably agree: a digest of the integer plan is all-gathered before the
plan's first collective, and a disagreement stops every rank at once with an error naming the plan and the ranks
(never a hang). Figures fitted from measurements are fitted once and broadcast. Each check is shown failing by
perturbing one rank's inputs; the planners themselves stop by counts, never by a clock."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from lightning_runs import RecordRun, fit

from omni_lightning.balance.calibration import JointCalibration
from omni_lightning.balance.cost import ModuleCost
from omni_lightning.balance.digest import plan_digest
from omni_lightning.data.packing import DecodedSample
from omni_lightning.data.reorder_stream import ReorderedStream, ReorderSettings
from omni_lightning.modalities import DEFAULT_PACKING
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.flops import reference_cost_model
from omni_lightning.parallel.agreement import PlanDisagreement, check_plans_agree
from omni_lightning.runtime import calibration
from omni_lightning.runtime.reshard import Resharder

ROOT = Path(__file__).resolve().parents[1]
COST = reference_cost_model(ReferenceMLLMConfig.tiny())


# ------------------------------------------------------------------------------------------------------ pure
def test_digest_sees_values_order_and_lengths_and_refuses_floats() -> None:
    base = plan_digest([[1, 2], [3]])
    assert base == plan_digest([np.array([1, 2]), (3,)])
    assert len({base, plan_digest([[1], [2, 3]]), plan_digest([[2, 1], [3]]), plan_digest([[1, 2], [4]])}) == 4
    assert plan_digest([[], 1]) == plan_digest([np.zeros(0, dtype=np.int64), 1])
    with pytest.raises(TypeError, match="takes integers"):
        plan_digest([[0.5]])


def test_calibration_figures_travel_as_one_vector() -> None:
    figures = JointCalibration(COST.replace(vision=ModuleCost(2.0, 3.0)), 0.3, 0.4, (0.5, 0.25, 0.25))
    back = JointCalibration.from_array(figures.to_array(), COST.modules)
    assert back == figures


def test_planners_stop_by_counts_not_by_a_clock() -> None:
    """Redundant planners must reach the same result on every rank; a time budget would cut them off at different
    points on a busy and an idle machine. Nothing in balance/ reads a clock."""
    for path in sorted((ROOT / "omni_lightning" / "balance").glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
                    for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
        assert not imported & {"time", "datetime"}, f"{path.name} imports a clock"


# ------------------------------------------------------------------------------------------- the check itself
def _disagree(rank: int, world: int) -> None:
    digest = 7 if rank != 2 else 8
    expected = r"the test plan differs .*ranks \[0, 1\] computed .*ranks \[2\] computed"
    with pytest.raises(PlanDisagreement, match=expected):
        check_plans_agree("test plan", digest, dist.group.WORLD, device=torch.device("cpu"))
    check_plans_agree("test plan", 7, dist.group.WORLD, device=torch.device("cpu"))  # the group still works


@pytest.mark.distributed
def test_every_rank_stops_when_one_disagrees() -> None:
    run_distributed(_disagree, 3)


# --------------------------------------------------------------------------------------- the loader's reorder
class _Loader:
    def __init__(self, records: list[DecodedSample]) -> None:
        self.records, self.position = records, 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]

    def __iter__(self) -> Any:
        while True:
            self.position += 1
            yield self.records[(self.position - 1) % len(self.records)]


def _reorder_with_other_costs(rank: int, world: int) -> None:
    rng = np.random.default_rng(rank)
    images = [rng.integers(0, 256, (28 * (1 + i % 3), 28, 3), dtype=np.uint8) for i in range(6)]
    records = [DecodedSample(f"{rank}-{i}", np.arange(5, 9 + 7 * i), images=[images[i]] if i % 2 else [])
               for i in range(6)]
    # Rank 1 prices the vision encoder 1000x higher: as if its arithmetic went another way.
    cost = COST if rank == 0 else COST.replace(vision=ModuleCost(COST.vision.linear * 1e3, COST.vision.quadratic))
    stream = ReorderedStream(_Loader(records), group=dist.group.WORLD, group_index=0, cost_model=cost,
                             settings=ReorderSettings(samples_per_step=3, group_steps=2), packing=DEFAULT_PACKING)
    with pytest.raises(PlanDisagreement, match="loader's reordering plan differs"):
        next(iter(stream))


@pytest.mark.distributed
def test_reorder_plans_that_differ_stop_before_the_exchange() -> None:
    run_distributed(_reorder_with_other_costs, 2)


# ----------------------------------------------------------------------------------------- encoder resharding
def _reshard_with_other_costs(rank: int, world: int) -> None:
    costs = {"vision": COST.vision, "audio": COST.audio}
    if rank == 1:  # to rank 1 images cost nothing: it sees no reason to move any
        costs["vision"] = ModuleCost(0.0, 0.0)
    resharder = Resharder(dist.group.WORLD, {}, costs)
    # Rank 0 loaded every large item: resharding moves some, and the two ranks plan the moves differently.
    lengths = {"vision": torch.tensor([64, 64, 16, 4] if rank == 0 else [4]), "audio": torch.tensor([8])}
    with pytest.raises(PlanDisagreement, match="encoder resharding plan differs"):
        resharder.plan(lengths, {"vision": 4, "audio": 1})


@pytest.mark.distributed
def test_encoder_plans_that_differ_stop_before_the_exchange() -> None:
    run_distributed(_reshard_with_other_costs, 2)


# -------------------------------------------------------------------------------------- the joint pipeline
class SwapStagesOnRank1(pl.Callback):
    """Rank 1's item plan hands each item to the other stage: as if its arithmetic had gone another way; stage 0
    still plans as before. (The first step's micro-batches hold an audio clip.)"""

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 0:
            joint = module.step.runner.source
            plan = joint._plan

            def swapped(micro_batches: list[dict[str, Any]]) -> None:
                plan(micro_batches)
                for items in (i for m in joint._items for i in joint._items[m]):
                    items.owner = 1 - items.owner

            joint._plan = swapped


@pytest.mark.distributed
def test_joint_item_plans_that_differ_stop_every_pipeline_rank(tmp_path: Path, tiny_shards: str,
                                                               seed_checkpoint: Path) -> None:
    with pytest.raises(Exception, match="joint pipeline's item plan differs"):
        fit(tmp_path, tiny_shards, seed_checkpoint, layout={"pp": 2, "dp_shard": 1, "pp_microbatches": 4},
            devices=2, max_steps=3, callbacks=[RecordRun(tmp_path), SwapStagesOnRank1()])
    assert not (tmp_path / "losses.json").exists()  # the first step stopped before its first transfer


# ------------------------------------------------------------------------------------------ calibration
class _Joint:
    tp_group = dp_group = None
    tp = 1


def _fit_differently(rank: int, world: int, monkeypatch_fit: bool) -> None:
    calibrator = calibration.JointCalibrator(_Joint(), dist.group.WORLD, steps=1, clock=lambda: 0.0, flops=COST)
    mine = JointCalibration(COST.replace(vision=ModuleCost(1.0 + rank, 2.0)), 0.3 + rank / 10, 0.4, (0.5, 0.5))
    calibration.fit_joint_calibration = lambda *args, **kwargs: mine  # each rank's own arithmetic
    figures = calibrator._fitted_once(np.zeros((1, 6)), [[], []])
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, figures.to_array().tolist())
    assert everyone[0] == everyone[1] and figures.forward_share == pytest.approx(0.3)  # rank 0's, everywhere


@pytest.mark.distributed
def test_calibrated_figures_are_fitted_once_and_broadcast() -> None:
    run_distributed(_fit_differently, 2, True)
