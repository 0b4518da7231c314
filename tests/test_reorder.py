"""Grouped reordering plans: completeness, budgets, determinism, 1F1B order, locality and balance quality."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_lightning.balance.reorder import (
    ReorderConfig,
    balance_groups,
    lower_bound,
    order_for_1f1b,
    plan_balance_group,
    plan_naive,
)


def _inputs(seed: int, n_ranks: int, per_rank: int, sigma: float = 1.0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    n = n_ranks * per_rank
    costs = rng.lognormal(0.0, sigma, n)
    tokens = rng.integers(1, 200, n)
    owners = np.repeat(np.arange(n_ranks), per_rank)
    return costs, tokens, owners, tokens * 4


def _placed(plan) -> list[int]:
    return [s for rank in plan.micro_batches for step in rank for mb in step for s in mb]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n_ranks=st.integers(1, 6),
    steps=st.integers(1, 4),
    micro_batches=st.integers(1, 3),
    per_rank=st.integers(0, 40),
    budget=st.one_of(st.none(), st.integers(200, 1200)),
    pp=st.integers(1, 3),
)
def test_every_sample_once_and_no_budget_exceeded(
    seed: int, n_ranks: int, steps: int, micro_batches: int, per_rank: int, budget: int | None, pp: int
) -> None:
    costs, tokens, owners, nbytes = _inputs(seed, n_ranks, per_rank)
    config = ReorderConfig(steps=steps, micro_batches=micro_batches, token_budget=budget, pp=pp)
    plan = plan_balance_group(costs, tokens, owners, nbytes, n_ranks=n_ranks, config=config, seed=seed, epoch=0,
                              group_index=0)
    placed = _placed(plan)
    assert sorted(placed + plan.leftover) == list(range(costs.size))
    assert len(plan.micro_batches) == n_ranks
    for rank_plan in plan.micro_batches:
        assert len(rank_plan) == steps
        for step in rank_plan:
            assert len(step) == micro_batches
            for mb in step:
                assert budget is None or tokens[mb].sum() <= budget
    assert plan.step_cost.shape == (n_ranks, steps)
    assert plan.step_cost.sum() == pytest.approx(costs[placed].sum())
    moved = [s for r, rank_plan in enumerate(plan.micro_batches) for step in rank_plan for mb in step for s in mb
             if owners[s] != r]
    assert plan.samples_moved == len(moved)
    assert plan.bytes_moved == int(nbytes[moved].sum()) if moved else plan.bytes_moved == 0
    if budget is None:
        assert plan.leftover == []


def test_plan_is_a_pure_function_of_its_inputs() -> None:
    costs, tokens, owners, nbytes = _inputs(3, 8, 64)
    config = ReorderConfig(steps=4, micro_batches=2, token_budget=4000, pp=2)
    kwargs = {"n_ranks": 8, "config": config, "seed": 5, "epoch": 1, "group_index": 2}
    first = plan_balance_group(costs, tokens, owners, nbytes, **kwargs)
    again = plan_balance_group(costs.copy(), tokens.copy(), owners.copy(), nbytes.copy(), **kwargs)
    assert first.micro_batches == again.micro_batches
    np.testing.assert_array_equal(first.step_cost, again.step_cost)


def test_equal_costs_break_ties_by_seed_and_group() -> None:
    n = 64
    costs, tokens, owners = np.ones(n), np.ones(n, dtype=np.int64), np.repeat(np.arange(4), 16)
    config = ReorderConfig(steps=4)

    def plan(group_index: int) -> list:
        return plan_balance_group(costs, tokens, owners, tokens, n_ranks=4, config=config, seed=0, epoch=0,
                                  group_index=group_index).micro_batches

    assert plan(0) == plan(0)
    assert plan(0) != plan(1)


def test_bins_go_to_the_ranks_that_hold_their_payloads() -> None:
    """Two samples per rank that LPT keeps together: matching hands each bin to its owner, so nothing moves."""
    costs = np.array([8.0, 1.0, 6.0, 3.0, 5.0, 4.0, 7.0, 2.0])  # every rank's pair sums to 9
    owners = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    tokens = np.ones(costs.size, dtype=np.int64)
    plan = plan_balance_group(costs, tokens, owners, tokens * 100, n_ranks=4, config=ReorderConfig(steps=1), seed=0,
                              epoch=0, group_index=0)
    assert [sorted(owners[s] for s in rank[0][0]) for rank in plan.micro_batches] == [[0, 0], [1, 1], [2, 2], [3, 3]]
    assert plan.samples_moved == 0 and plan.bytes_moved == 0
    assert plan.imbalance == pytest.approx(1.0)


def test_balanced_plan_beats_the_naive_split_and_nears_the_bound() -> None:
    costs, tokens, owners, nbytes = _inputs(11, 8, 64 * 16, sigma=0.8)
    config = ReorderConfig(steps=64, micro_batches=2, token_budget=None)
    plan = plan_balance_group(costs, tokens, owners, nbytes, n_ranks=8, config=config, seed=0, epoch=0, group_index=0)
    naive = plan_naive(costs, owners, n_ranks=8, config=config)
    bound = lower_bound(costs, 8 * 64)
    assert plan.step_cost.max() <= 1.05 * bound
    assert naive.max() > 1.3 * plan.step_cost.max()
    # Samples meet bins of their own rank where LPT allows: most payloads stay home.
    assert plan.samples_moved < 0.25 * costs.size


def test_a_sample_over_the_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the micro-batch token budget 100"):
        plan_balance_group(np.ones(2), np.array([50, 101]), np.zeros(2, dtype=np.int64), np.ones(2), n_ranks=1,
                           config=ReorderConfig(steps=1, token_budget=100), seed=0, epoch=0, group_index=0)


def test_1f1b_order() -> None:
    costs = [5.0, 1.0, 4.0, 2.0, 3.0, 6.0]
    # smallest first; the next pp-1 smallest (2, 3) end the step, lightest last; the rest ascending between.
    assert [costs[i] for i in order_for_1f1b(costs, pp=3)] == [1.0, 4.0, 5.0, 6.0, 3.0, 2.0]
    assert [costs[i] for i in order_for_1f1b(costs, pp=1)] == sorted(costs)
    assert order_for_1f1b([], pp=2) == []


def test_balance_groups() -> None:
    assert balance_groups(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert balance_groups(4, None) == [[0, 1, 2, 3]]
    assert balance_groups(4, 1) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="must divide the data-parallel size 6"):
        balance_groups(6, 4)


@pytest.mark.parametrize(("name", "value"), [("steps", 0), ("micro_batches", 0), ("pp", 0), ("token_budget", 0)])
def test_bad_config(name: str, value: int) -> None:
    with pytest.raises(ValueError, match=name):
        ReorderConfig(**{"steps": 1, name: value})
