"""The joint pipeline's schedule-aware item plan and its step-time model (pure: no process groups)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_lightning.balance.pipeline_order import (
    assign_encoder_items,
    joint_1f1b_makespans,
    joint_1f1b_orders,
    lpt_ranks,
    one_f_one_b_makespans,
)
from omni_lightning.sim import Action, replay_pipeline


def _encoder_matrix(owner: np.ndarray, micro_batch: np.ndarray, costs: np.ndarray, pp: int, m: int) -> np.ndarray:
    work = np.zeros((pp, m))
    np.add.at(work, (owner, micro_batch), costs)
    return work


def _lpt_plan(llm: np.ndarray, micro_batch: np.ndarray, costs: np.ndarray, pp: int) -> np.ndarray:
    """What JointEncoders did before the plan saw the schedule (``share_items``): LPT per micro-batch in run
    order over the step's running loads, stage 0 spared the last ``pp`` micro-batches."""
    owner, loads, m = np.zeros(costs.size, dtype=np.int64), np.zeros(pp), llm.size
    for j in range(m):
        items = np.flatnonzero(micro_batch == j)
        ranks = np.arange(1 if j >= m - pp and pp < m and pp > 1 else 0, pp)
        owner[items] = lpt_ranks(costs[items], loads, ranks)
    return owner


@pytest.mark.parametrize(("pp", "m"), [(4, 8), (2, 3), (3, 2), (4, 32)])
@pytest.mark.parametrize("uneven", [False, True])
def test_joint_makespans_match_the_replay(pp: int, m: int, uneven: bool) -> None:
    """The vectorised model and the replay of the same action orders agree, assignment by assignment, with the
    LLM split evenly over the stages or by given shares."""
    rng = np.random.default_rng(m)
    llm, encoder = rng.lognormal(0.0, 1.0, (3, m)), rng.lognormal(-1.0, 1.0, (3, pp, m))
    weights = rng.uniform(0.5, 2.0, pp) if uneven else np.ones(pp)
    shares = weights / weights.sum()
    spans = joint_1f1b_makespans(llm, encoder, forward_share=0.4, encoder_forward_share=0.3,
                                 stage_shares=weights if uneven else None)
    orders = joint_1f1b_orders(pp, m)
    for k in range(3):
        actions = []
        for s, order in enumerate(orders):
            seconds = {"F": llm[k] * 0.4 * shares[s], "B": llm[k] * 0.6 * shares[s]}
            actions.append([Action(kind, j, 0.0 if kind == "G" else seconds[kind][j] if kind in seconds
                                   else encoder[k, s, j] * (0.3 if kind == "E" else 0.7)) for kind, j in order])
        assert spans[k] == pytest.approx(replay_pipeline(actions).makespan)


def test_a_stage_with_more_llm_work_gets_less_encoder_work() -> None:
    """The first stage also embeds: told so, the plan gives it less encoder work than with equal stages, and its
    step is no longer in the model that knows."""
    rng = np.random.default_rng(1)
    m, pp = 32, 4
    llm = rng.lognormal(0.0, 0.2, m)
    micro_batch = rng.integers(0, m, 96)
    costs = rng.pareto(1.5, 96) * 0.05
    heavy_first = np.array([1.3, 1.0, 1.0, 1.0])
    equal, aware = (assign_encoder_items(llm, micro_batch, costs, pp, stage_shares=shares)
                    for shares in (None, heavy_first))
    first_stage_work = [float(costs[plan == 0].sum()) for plan in (equal, aware)]
    assert first_stage_work[1] < 0.8 * first_stage_work[0]
    spans = [float(joint_1f1b_makespans(llm, _encoder_matrix(plan, micro_batch, costs, pp, m),
                                        stage_shares=heavy_first)[0]) for plan in (equal, aware)]
    assert spans[1] <= spans[0] * (1 + 1e-9)
    with pytest.raises(ValueError, match="positive, finite share for each of the 4 pipeline stages"):
        assign_encoder_items(llm, micro_batch, costs, pp, stage_shares=np.array([1.0, 1.0, 1.0]))


def test_small_items_also_go_less_to_a_stage_with_more_llm_work() -> None:
    """Items too small to be placed on the model are spread by LPT: with stage shares a stage's LLM work above the
    mean counts as load, micro-batch by micro-batch, so the first stage takes fewer of them all through the step."""
    rng = np.random.default_rng(2)
    m, pp = 16, 4
    llm = np.full(m, 8.0)
    micro_batch = np.repeat(np.arange(m), 8)
    costs = rng.uniform(0.01, 0.03, micro_batch.size)  # all far below the "large" threshold
    equal, aware = (assign_encoder_items(llm, micro_batch, costs, pp, stage_shares=shares)
                    for shares in (None, np.array([1.2, 1.0, 1.0, 1.0])))
    head = micro_batch < m // 2  # not only at the end: the excess is charged as each micro-batch is placed
    for part in (head, ~head):
        assert costs[part & (aware == 0)].sum() < 0.5 * costs[part & (equal == 0)].sum()


def test_without_encoder_work_the_joint_model_is_1f1b() -> None:
    llm = np.random.default_rng(0).lognormal(0.0, 1.0, (2, 12))
    assert joint_1f1b_makespans(llm, np.zeros((2, 4, 12))) == pytest.approx(one_f_one_b_makespans(llm, 4))


@pytest.mark.parametrize("seed", range(4))
def test_large_images_move_to_where_the_schedule_has_room(seed: int) -> None:
    """32 micro-batches of uneven LLM cost and 80 images of long-tailed cost (a few worth a stage's share of a
    micro-batch): moving the large ones off the ranks LPT gave them shortens the modelled step, by a good part of
    what the encoder insertions add to 1F1B's."""
    rng = np.random.default_rng(seed)
    m, pp = 32, 4
    llm = rng.lognormal(0.0, 0.2, m)
    micro_batch = rng.integers(0, m, 80)
    costs = rng.pareto(1.5, 80) * 0.05
    plan = assign_encoder_items(llm, micro_batch, costs, pp)
    planned, lpt = (float(joint_1f1b_makespans(llm, _encoder_matrix(o, micro_batch, costs, pp, m))[0])
                    for o in (plan, _lpt_plan(llm, micro_batch, costs, pp)))
    llm_only = float(one_f_one_b_makespans(llm, pp)[0])
    assert planned - llm_only < 0.9 * (lpt - llm_only)


def test_nothing_to_move() -> None:
    """No large item, or none with a choice of rank (stage 0 is spared the last micro-batches): LPT's plan."""
    assert assign_encoder_items(np.ones(8), np.arange(8), np.full(8, 1e-4), 4).tolist() == [3, 2, 1, 0, 3, 2, 1, 3]
    assert assign_encoder_items(np.ones(3), np.array([1, 2]), np.array([5.0, 5.0]), 2).tolist() == [1, 1]
    assert assign_encoder_items(np.ones(3), np.zeros(0, dtype=np.int64), np.zeros(0), 2).size == 0


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(1, 4), m=st.integers(1, 12), seed=st.integers(0, 2**16), items=st.integers(0, 30))
def test_plan_is_complete_deterministic_spares_stage0_and_no_slower_than_lpt(pp: int, m: int, seed: int,
                                                                          items: int) -> None:
    rng = np.random.default_rng(seed)
    llm = rng.lognormal(0.0, 0.5, m)
    micro_batch = rng.integers(0, m, items)
    costs = rng.lognormal(-1.5, 1.5, items)  # long-tailed: a few items worth whole micro-batches
    owner = assign_encoder_items(llm, micro_batch, costs, pp)
    assert owner.shape == (items,) and ((owner >= 0) & (owner < pp)).all()
    assert np.array_equal(owner, assign_encoder_items(llm.copy(), micro_batch.copy(), costs.copy(), pp))
    if pp > 1 and m > pp:
        assert not (owner[micro_batch >= m - pp] == 0).any()
    planned, lpt = (float(joint_1f1b_makespans(llm, _encoder_matrix(o, micro_batch, costs, pp, m))[0])
                    for o in (owner, _lpt_plan(llm, micro_batch, costs, pp)))
    assert planned <= lpt * (1 + 1e-9)
