"""Encoder work plan for long-short sequence parallelism (pure; no process groups).

In one micro-batch step every rank of an encoder group holds some encoder items (images, video frames, audio
clips), and their cost is nothing like the LLM cost of the same samples. The plan decides, identically on every
rank from all-gathered item sizes, where each item is encoded:

* a *long* item, one that costs more than a threshold (the rank's fair share of the step, or a fraction of it when
  that balances better), is split across the fewest consecutive ranks (a power of two up to ``enc_sp``, aligned
  inside one SP group) that bring each share under the threshold, on the block whose busiest member is least
  loaded (Ulysses: each member does ``1 / degree`` of it);
* every other (*short*) item goes whole to one rank, longest first onto the least-loaded rank (LPT), on top of
  the long items' shares.

The long/short boundary is relative to the step's own fair share, so it adapts to the workload: a text-heavy step
splits nothing, a step with a huge image or long clip splits it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

__all__ = ["EncoderPlan", "plan_encoder_work", "encoder_lower_bound"]


@dataclass
class EncoderPlan:
    """Where each item is encoded.

    ``rank_of[i]`` is the rank that encodes item ``i`` whole, or ``-1`` if it is split; a split item runs on ranks
    ``sp_start[i] .. sp_start[i] + sp_degree[i] - 1`` (``sp_degree`` is 1 for a whole item). ``rank_cost`` is each
    rank's predicted encoder cost; ``moved`` counts items that leave the rank that loaded them (a split item
    counts once).
    """

    rank_of: np.ndarray
    sp_start: np.ndarray
    sp_degree: np.ndarray
    rank_cost: np.ndarray
    moved: int

    @property
    def imbalance(self) -> float:
        """max / mean predicted encoder cost over the ranks."""
        mean = float(self.rank_cost.mean())
        return float(self.rank_cost.max()) / mean if mean > 0 else 1.0

    @property
    def items_split(self) -> int:
        return int(np.count_nonzero(self.sp_degree > 1))


def encoder_lower_bound(costs: np.ndarray, n_ranks: int, enc_sp: int) -> float:
    """No plan can give a rank less than this: the mean load, or the largest item shared by its SP group."""
    return max(float(costs.sum()) / n_ranks, float(costs.max(initial=0.0)) / enc_sp)


def plan_encoder_work(
    costs: np.ndarray, owners: np.ndarray, *, n_ranks: int, enc_sp: int = 1, reshard: bool = True
) -> EncoderPlan:
    """Plan one step of encoder work for an encoder group of ``n_ranks`` ranks.

    Args:
        costs: predicted encoder cost of each item (``CostModel`` vision or audio module cost of its length).
        owners: the rank that loaded each item (where its LLM tokens live).
        n_ranks: ranks in the encoder group.
        enc_sp: sequence-parallel degree; SP groups are ``enc_sp`` consecutive ranks (``n_ranks`` must be a multiple).
        reshard: ``False`` is the baseline without resharding: every rank encodes what it loaded.
    """
    costs = np.asarray(costs, dtype=np.float64)
    owners = np.asarray(owners, dtype=np.int64)
    if enc_sp < 1 or n_ranks % enc_sp:
        raise ValueError(f"enc_sp={enc_sp} must be positive and divide the encoder group size {n_ranks}")
    rank_of = owners.copy()
    sp_start = np.full(costs.size, -1, dtype=np.int64)
    sp_degree = np.ones(costs.size, dtype=np.int64)
    load = np.zeros(n_ranks)
    if not reshard:
        np.add.at(load, owners, costs)
        return EncoderPlan(rank_of, sp_start, sp_degree, load, 0)

    fair_share = float(costs.sum()) / n_ranks
    # Descending cost; ties by item index, so every rank orders identically.
    order = np.lexsort((np.arange(costs.size), -costs)).tolist()
    # Splitting costs communication, so split as little as balance allows: try split thresholds from the fair
    # share down, and keep the first plan whose peak is within 1% of the lowest.
    candidates = [_plan_with_threshold(costs, owners, order, n_ranks, enc_sp, fair_share / 2**k)
                  for k in range(0, 4 if enc_sp > 1 else 1)]
    best = min(float(plan.rank_cost.max()) for plan in candidates)
    return next(plan for plan in candidates if plan.rank_cost.max() <= best * 1.01)


def _plan_with_threshold(
    costs: np.ndarray, owners: np.ndarray, order: list[int], n_ranks: int, enc_sp: int, threshold: float
) -> EncoderPlan:
    """Split every item costlier than ``threshold`` over the fewest aligned ranks that bring its shares under it
    (at most ``enc_sp``), then place the whole items by LPT."""
    rank_of = owners.copy()
    sp_start = np.full(costs.size, -1, dtype=np.int64)
    sp_degree = np.ones(costs.size, dtype=np.int64)
    load = np.zeros(n_ranks)
    for item in order:
        if enc_sp == 1 or costs[item] <= threshold:
            break
        degree = 2
        while degree < enc_sp and costs[item] / degree > threshold:
            degree *= 2
        # Aligned blocks of ``degree`` consecutive ranks lie inside one SP group (degree divides enc_sp).
        block = int(np.argmin(load.reshape(-1, degree).max(axis=1)))
        sp_start[item], sp_degree[item], rank_of[item] = block * degree, degree, -1
        load[block * degree : (block + 1) * degree] += costs[item] / degree

    heap = [(load[r], r) for r in range(n_ranks)]
    heapq.heapify(heap)
    for item in order:
        if sp_degree[item] > 1:
            continue
        # Least-loaded rank; among equal loads, the one that already holds the item, so it need not travel.
        current, rank = heapq.heappop(heap)
        if rank != owners[item] and load[owners[item]] <= current:
            heap.remove((load[owners[item]], owners[item]))
            heapq.heapify(heap)
            heapq.heappush(heap, (current, rank))
            rank = int(owners[item])
        rank_of[item] = rank
        load[rank] += costs[item]
        heapq.heappush(heap, (load[rank], rank))
    split = sp_degree > 1
    moved = int(np.count_nonzero((rank_of != owners) & ~split)) + int(np.count_nonzero(split))
    return EncoderPlan(rank_of, sp_start, sp_degree, load, moved)
