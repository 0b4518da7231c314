"""Planners stop by a deterministic work budget: the same inputs stop at the same plan, within the count."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_lightning.balance import reorder
from omni_lightning.balance.budget import WorkBudget
from omni_lightning.balance.pipeline_order import assign_encoder_items, refine_for_1f1b, split_to_profile


def _few_giants(seed: int, n: int, giants: int) -> tuple[np.ndarray, np.ndarray]:
    """Many tiny samples and a few whose cost is far above a bin's share (the adversarial case of issue 25)."""
    rng = np.random.default_rng(seed)
    costs = rng.lognormal(0.0, 0.3, n)
    costs[rng.choice(n, giants, replace=False)] *= 2000.0
    tokens = np.maximum(1, (costs / costs.max() * 4000).astype(np.int64)) + rng.integers(1, 20, n)
    return costs, tokens


def test_work_budget_counts_and_refuses() -> None:
    budget = WorkBudget(10)
    assert budget.take(4) and budget.take(6) and budget.exhausted
    assert not budget.take(1) and budget.used == 10 and budget.left == 0
    with pytest.raises(ValueError, match="limit"):
        WorkBudget(-1)


@pytest.mark.parametrize("limits", [(0, 0), (5_000, 20_000), (4_000_000, 2_000_000)])
def test_same_inputs_stop_at_the_same_plan_within_the_budget(limits: tuple[int, int]) -> None:
    costs, tokens = _few_giants(0, 6000, 12)
    owners = np.arange(costs.size) % 8
    config = reorder.ReorderConfig(steps=2, micro_batches=8, token_budget=16384, pp=4, pipeline_order="search",
                                   balance_evaluations=limits[0], search_evaluations=limits[1])
    plans = [reorder.plan_reorder_group(costs, tokens, owners, np.zeros(costs.size), n_ranks=8, config=config,
                                        seed=1, epoch=0, group_index=0) for _ in range(2)]
    assert plans[0].micro_batches == plans[1].micro_batches
    assert plans[0].evaluations == plans[1].evaluations
    # Bounded: the balancing's budget once, the search's once per rank-step.
    assert plans[0].evaluations <= limits[0] + 8 * 2 * limits[1]
    placed = sorted(s for rank in plans[0].micro_batches for step in rank for mb in step for s in mb)
    assert placed + plans[0].leftover == sorted(placed + plans[0].leftover)
    assert len(set(placed) | set(plans[0].leftover)) == costs.size


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), limit=st.integers(0, 50_000), n=st.integers(40, 600))
def test_the_1f1b_search_never_exceeds_its_budget(seed: int, limit: int, n: int) -> None:
    costs, tokens = _few_giants(seed, n, max(1, n // 50))
    batches, _, _ = split_to_profile(list(range(n)), costs, tokens, pp=4, micro_batches=8)
    runs = []
    for _ in range(2):
        budget = WorkBudget(limit)
        runs.append((refine_for_1f1b(batches, costs, tokens, pp=4, budget=budget), budget.used))
    assert runs[0] == runs[1]
    assert runs[0][1] <= limit
    assert sorted(s for b in runs[0][0] for s in b) == sorted(s for b in batches for s in b)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), limit=st.integers(0, 5_000))
def test_the_joint_item_plan_never_exceeds_its_budget(seed: int, limit: int) -> None:
    rng = np.random.default_rng(seed)
    m, pp = 8, 4
    llm = rng.uniform(1.0, 2.0, m)
    micro_batch = rng.integers(0, m, 300)
    items = rng.lognormal(-3.0, 1.5, 300)
    runs = []
    for _ in range(2):
        budget = WorkBudget(limit)
        runs.append((assign_encoder_items(llm, micro_batch, items, pp, budget=budget).tolist(), budget.used))
    assert runs[0] == runs[1]
    assert runs[0][1] <= limit
    owner = np.array(runs[0][0])
    assert ((owner >= 0) & (owner < pp)).all()
    assert (owner[micro_batch >= m - pp] != 0).all()  # the first stage spares the last pp micro-batches
