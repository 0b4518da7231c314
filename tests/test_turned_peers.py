"""Peers that hold the same samples split their encoder items by LPT; each data-parallel replica turns the peers'
labels by its index, so that the replicas' largest items do not all land on one peer position, whose data-parallel
group the resharder balances over."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_lightning.balance.pipeline_order import split_items
from omni_lightning.balance.reshard import plan_resharding


@settings(max_examples=80, deadline=None)
@given(costs=st.lists(st.floats(0.01, 100.0), max_size=24), peers=st.integers(1, 8), replica=st.integers(0, 63))
def test_a_replica_s_split_is_the_same_split_under_other_labels(costs: list[float], peers: int,
                                                                replica: int) -> None:
    plain, turned = split_items(np.array(costs), peers), split_items(np.array(costs), peers, replica)
    assert (turned == (plain + replica) % peers).all()
    load = np.bincount(turned, weights=costs, minlength=peers)
    assert (load == np.roll(np.bincount(plain, weights=costs, minlength=peers), replica)).all()


def test_replicas_put_their_largest_items_on_every_peer_position() -> None:
    costs = np.array([1.0, 9.0, 2.0, 1.0, 3.0])
    largest = [int(split_items(costs, 4, replica)[1]) for replica in range(8)]
    assert np.bincount(largest, minlength=4).tolist() == [2, 2, 2, 2]


@pytest.mark.parametrize("replicas", [2, 4, 8])
def test_turned_labels_let_the_resharder_spread_the_largest_items(replicas: int) -> None:
    """Every replica holds one large image and two small ones, split over 2 peers: with the labels as LPT leaves
    them, one peer position's group holds every large image and the resharder cannot lower its busiest rank; turned,
    each position's group holds half of them and splits them over the ranks that have none."""
    costs = np.array([8.0, 1.0, 1.0])

    def busiest(turn: bool) -> float:
        peer = [split_items(costs, 2, replica if turn else 0) for replica in range(replicas)]
        worst = 0.0
        for position in range(2):
            mine = [np.flatnonzero(p == position) for p in peer]
            items = np.concatenate([costs[m] for m in mine])
            owners = np.concatenate([np.full(m.size, r) for r, m in enumerate(mine)])
            plan = plan_resharding(items, owners, n_ranks=replicas, enc_sp=2)
            worst = max(worst, float(plan.rank_cost.max()))
        return worst

    assert busiest(turn=False) == 8.0
    assert busiest(turn=True) <= 5.0
