"""The joint pipeline's model of a reorder group's plan, and the plan the group's planner keeps under it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_lightning.balance import reorder
from omni_lightning.balance.joint_group import joint_group_time, joint_step_times
from omni_lightning.balance.reorder import GroupPlan, ReorderConfig, exchange_cost, plan_reorder_group
from omni_lightning.balance.reshard import LinkCost


def test_a_step_is_its_llm_1f1b_plus_the_least_its_encoders_take_side_by_side() -> None:
    llm = np.array([3.0, 5.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0])
    encoder = np.array([0.0, 8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    members = [[[0, 1, 2], [3, 4, 5, 6, 7]]]  # one rank, two steps of two micro-batches
    times = joint_step_times(members, llm, encoder, pp=2, micro_batches=2, encoder_peers=2)
    # 1F1B: the work and pp - 1 of the largest micro-batch (its largest sample, 5, or an even share), over pp; a
    # stage's LLM work split over its 2 peers; each sample's encoders on one of the 4 (stage, peer) ranks.
    first = (9.0 + 5.0) / 2 / 2 + 8.0  # its largest encoder sample
    second = (6.0 + 3.0) / 2 / 2 + 5.0 / 4  # an even share, on both counts
    np.testing.assert_allclose(times, [[first, second]])
    assert joint_group_time(times) == times.max(axis=0).sum()


def test_huge_samples_of_one_step_stall_it_once_and_spread_over_steps_stall_each() -> None:
    llm, encoder = np.ones(4), np.array([10.0, 10.0, 0.0, 0.0])
    for peers in (1, 2):
        kept = joint_group_time(joint_step_times([[[0, 1], [2, 3]]], llm, encoder, pp=2, micro_batches=2,
                                                 encoder_peers=peers))
        apart = joint_group_time(joint_step_times([[[0, 2], [1, 3]]], llm, encoder, pp=2, micro_batches=2,
                                                  encoder_peers=peers))
        assert np.isclose(apart - kept, 10.0)


def _members(plan: GroupPlan) -> list[list[list[int]]]:
    return [[[s for mb in step for s in mb] for step in rank] for rank in plan.micro_batches]


def _reads(n_ranks: int, steps: int, per_step: int, huge_per_rank: int) -> tuple[np.ndarray, ...]:
    """Each rank reads ``per_step`` samples a step of equal tokens; its first ``huge_per_rank``, all read in step 0,
    carry a huge image (encoder cost 40, LLM cost 2 against 1 for the text samples)."""
    per_rank = steps * per_step
    owners = np.repeat(np.arange(n_ranks), per_rank)
    huge = np.tile(np.arange(per_rank) < huge_per_rank, n_ranks)
    llm = np.where(huge, 2.0, 1.0)
    return llm + np.where(huge, 40.0, 0.0), llm, np.full(owners.size, 10), owners, huge


def test_the_joint_pipeline_keeps_a_groups_huge_images_in_the_step_that_read_them() -> None:
    """Balanced on the sum of costs, the group's plan deals the eight huge images out over its four steps, which
    under the joint pipeline stalls every step; balanced step by step, they stay in step 0 and stall that one."""
    costs, llm, tokens, owners, huge = _reads(n_ranks=2, steps=4, per_step=6, huge_per_rank=4)
    config = ReorderConfig(steps=4, micro_batches=3, pp=2, encoder_peers=2)

    def steps_with_huge(plan: GroupPlan) -> set[int]:
        return {k for rank in plan.micro_batches for k, step in enumerate(rank) for mb in step for s in mb if huge[s]}

    summed = plan_reorder_group(costs, tokens, owners, np.zeros_like(owners), n_ranks=2, config=config, seed=0,
                                epoch=0, group_index=0)
    joint = plan_reorder_group(costs, tokens, owners, np.zeros_like(owners), n_ranks=2, config=config, seed=0,
                               epoch=0, group_index=0, micro_batch_costs=llm)
    assert steps_with_huge(summed) == {0, 1, 2, 3}
    assert steps_with_huge(joint) == {0}

    def modelled(plan: GroupPlan) -> float:
        return joint_group_time(joint_step_times(_members(plan), llm, costs - llm, pp=2, micro_batches=3,
                                                 encoder_peers=2))

    assert modelled(joint) < 0.6 * modelled(summed)


def _placed(plan: GroupPlan) -> list[int]:
    return sorted(s for rank in plan.micro_batches for step in rank for mb in step for s in mb)


@settings(deadline=None, max_examples=60)
@given(seed=st.integers(0, 10_000), n_ranks=st.integers(1, 4), steps=st.integers(1, 4), per_rank=st.integers(0, 24),
       micro_batches=st.integers(1, 4), pp=st.integers(2, 4), peers=st.integers(1, 4),
       budget=st.one_of(st.none(), st.integers(200, 500)), priced=st.booleans())
def test_the_kept_plan_is_never_longer_in_the_model_than_the_groups_own(
    seed: int, n_ranks: int, steps: int, per_rank: int, micro_batches: int, pp: int, peers: int, budget: int | None,
    priced: bool,
) -> None:
    """Whatever the mix, the plan kept under the joint pipeline places every sample once within the token budget,
    every rank derives it alike whichever rank's micro-batches it searched, and it takes no longer in the model
    (its exchange included, per unit of work placed) than the group's balanced plan would."""
    rng = np.random.default_rng(seed)
    n = n_ranks * per_rank
    llm = rng.lognormal(0.0, 1.0, n)
    costs = llm + np.where(rng.random(n) < 0.2, rng.lognormal(2.0, 1.0, n), 0.0)
    tokens, owners = rng.integers(1, 200, n), np.repeat(np.arange(n_ranks), per_rank)
    nbytes = rng.integers(0, 1000, n)
    link = LinkCost(bandwidth=1e3, latency=1.0, flops_per_s=1.0) if priced else None
    config = ReorderConfig(steps=steps, micro_batches=micro_batches, token_budget=budget, pp=pp,
                           pipeline_order="search", link=link, encoder_peers=peers, search_evaluations=2_000)

    def plan(searched_rank: int | None) -> GroupPlan:
        return plan_reorder_group(costs, tokens, owners, nbytes, n_ranks=n_ranks, config=config, seed=seed, epoch=1,
                                  group_index=0, micro_batch_costs=llm, searched_rank=searched_rank)

    kept = plan(None)
    assert sorted(_placed(kept) + kept.leftover) == list(range(n))
    if budget is not None:
        assert all(tokens[mb].sum() <= budget for rank in kept.micro_batches for step in rank for mb in step)

    def samples(of: GroupPlan) -> list[list[list[int]]]:
        return [[sorted(s for mb in step for s in mb) for step in rank] for rank in of.micro_batches]

    for rank in range(n_ranks):
        assert samples(plan(rank)) == samples(kept)

    def modelled(of: GroupPlan) -> float:
        times = joint_step_times(_members(of), llm, costs - llm, pp=pp, micro_batches=micro_batches,
                                 encoder_peers=peers)
        added = 0.0 if link is None else exchange_cost(of, owners, nbytes, link)
        placed = costs.sum() - costs[of.leftover].sum()
        return joint_group_time(times + added) * (costs.sum() / placed if placed > 0 else 1.0)

    bins = reorder._balanced_bins(costs, tokens, owners, nbytes, n_ranks=n_ranks, config=config, seed=seed,
                                  epoch=1, group_index=0)
    group_plan = reorder._split(bins, costs, llm, tokens, owners, nbytes, config)
    assert modelled(kept) <= modelled(group_plan) * 1.01 + 1e-9
