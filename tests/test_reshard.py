"""Encoder work plan: every item placed once, long items split inside SP groups, adaptivity, balance."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_lightning.balance.reshard import encoder_lower_bound, plan_encoder_work


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), groups=st.integers(1, 4), enc_sp=st.sampled_from([1, 2, 4]),
       items=st.integers(0, 60))
def test_every_item_is_encoded_exactly_once(seed: int, groups: int, enc_sp: int, items: int) -> None:
    n_ranks = groups * enc_sp
    rng = np.random.default_rng(seed)
    costs = rng.lognormal(0.0, 1.5, items)
    owners = rng.integers(0, n_ranks, items)
    plan = plan_encoder_work(costs, owners, n_ranks=n_ranks, enc_sp=enc_sp)
    whole = plan.sp_degree == 1
    assert ((plan.rank_of >= 0) == whole).all()
    for item in np.flatnonzero(~whole):
        start, degree = plan.sp_start[item], plan.sp_degree[item]
        assert degree <= enc_sp and enc_sp % degree == 0 and start % degree == 0  # inside one SP group
    # Shares add up: the ranks' costs are exactly the items' costs.
    assert plan.rank_cost.sum() == pytest.approx(costs.sum())
    if items:
        assert plan.rank_cost.max() >= encoder_lower_bound(costs, n_ranks, enc_sp) - 1e-9


def test_plan_is_identical_for_identical_inputs() -> None:
    rng = np.random.default_rng(0)
    costs, owners = rng.lognormal(0, 1, 50), rng.integers(0, 8, 50)
    first = plan_encoder_work(costs, owners, n_ranks=8, enc_sp=4)
    again = plan_encoder_work(costs.copy(), owners.copy(), n_ranks=8, enc_sp=4)
    np.testing.assert_array_equal(first.rank_of, again.rank_of)
    np.testing.assert_array_equal(first.sp_start, again.sp_start)


def test_a_huge_item_is_split_and_small_ones_are_not() -> None:
    costs = np.array([80.0] + [1.0] * 20)  # fair share (100 / 4 = 25) is far below the big item
    owners = np.zeros(21, dtype=np.int64)
    plan = plan_encoder_work(costs, owners, n_ranks=4, enc_sp=4)
    assert plan.sp_degree[0] == 4 and plan.items_split == 1
    assert plan.rank_cost.max() == pytest.approx(25.0)  # 80 / 4 + the small items evening out the rest
    no_sp = plan_encoder_work(costs, owners, n_ranks=4, enc_sp=1)
    assert no_sp.rank_cost.max() == pytest.approx(80.0)


def test_text_heavy_step_splits_nothing_and_keeps_items_home() -> None:
    costs = np.ones(8)
    owners = np.arange(8) % 4
    plan = plan_encoder_work(costs, owners, n_ranks=4, enc_sp=2)
    assert plan.items_split == 0 and plan.moved == 0
    assert plan.imbalance == pytest.approx(1.0)


def test_without_resharding_every_rank_encodes_what_it_loaded() -> None:
    costs, owners = np.array([5.0, 1.0, 1.0]), np.array([0, 1, 1])
    plan = plan_encoder_work(costs, owners, n_ranks=2, reshard=False)
    assert plan.rank_cost.tolist() == [5.0, 2.0] and plan.moved == 0


def test_enc_sp_must_divide_the_group() -> None:
    with pytest.raises(ValueError, match="enc_sp=3 must be positive and divide the encoder group size 4"):
        plan_encoder_work(np.ones(2), np.zeros(2, dtype=np.int64), n_ranks=4, enc_sp=3)
