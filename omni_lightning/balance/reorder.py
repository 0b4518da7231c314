"""Decentralized grouped reordering: a balanced (rank, step, micro-batch) plan for a group of buffered samples.

Every data-parallel rank buffers the samples of its next ``steps`` steps. The ranks of a *reorder group* all-gather
small integer metadata of those samples, and each rank runs :func:`plan_reorder_group` on the same inputs, so all
of them derive the same plan without a coordinator. Only payloads that the plan moves travel, once.

The plan minimises the largest predicted cost of any (rank, step): longest-processing-time-first (LPT) over the
``ranks x steps`` bins, subject to a token budget per micro-batch, then LPT again to split each bin into
micro-batches. With pipeline parallelism, ``ReorderConfig.pipeline_order`` shapes them for 1F1B: DistTrain's order
of LPT's even micro-batches, or a split towards the cost profile whose 1F1B step is shortest (light micro-batches
where the pipeline fills and drains, :mod:`omni_lightning.balance.pipeline_order`), optionally refined by a local
search on a 1F1B replay of the predicted costs. Bins of one step are finally matched to the ranks that already hold
most of their payload bytes, which keeps the exchange small. With ``ReorderConfig.link`` the exchange is priced too
(each rank's payload bytes out and in, and the collective, on the group's first step, which waits for it), and the
plan falls back to keeping every sample where it was read when balancing would not pay for its exchange.

Under the joint encoder-LLM pipeline a step's cost is not the sum of its samples' costs: the stages' encoder
insertions run side by side, so a few huge images cost one step about what one of them does, and spread over all the
group's steps they stall every step. There plans are compared on a model of the joint pipeline's step
(:mod:`~omni_lightning.balance.joint_group`), and a second plan, each step balanced on the samples read for it,
competes with the group's.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from omni_lightning.balance.budget import WorkBudget
from omni_lightning.balance.joint_group import joint_group_time, joint_step_times
from omni_lightning.balance.pipeline_order import (
    lpt_split,
    one_f_one_b_makespans,
    order_for_1f1b,
    refine_for_1f1b,
    split_to_profile,
)
from omni_lightning.balance.reshard import LinkCost

__all__ = [
    "ReorderConfig",
    "exchange_cost",
    "GroupPlan",
    "plan_reorder_group",
    "plan_in_place",
    "reorder_group_ranks",
    "lower_bound",
    "PipelineOrder",
    "PIPELINE_ORDERS",
    "STEP_LOCAL_MIN_GAIN",
]


PipelineOrder = Literal["disttrain", "ramp", "search"]
PIPELINE_ORDERS: tuple[str, ...] = ("disttrain", "ramp", "search")
_NEIGHBOURS = 4  # swap partners priced per sample of the heavier bin, on either side of the ideal cost
STEP_LOCAL_MIN_GAIN = 0.02
"""How much shorter, under the joint pipeline's model, the step-by-step plan must be to replace the group's."""


@dataclass(frozen=True)
class ReorderConfig:
    """Shape of one planning group.

    Args:
        steps: optimizer steps planned together (the group of G steps each rank buffers).
        micro_batches: micro-batches per step on every rank (gradient accumulation or pipeline micro-batches).
        token_budget: most LLM tokens one micro-batch may hold (``None``: unlimited).
        pp: pipeline stages; with ``pp > 1`` the micro-batches of each step are shaped and ordered for 1F1B.
        pipeline_order: how, with ``pp > 1``: ``"disttrain"``, LPT's even micro-batches in DistTrain's order
            (:func:`~omni_lightning.balance.pipeline_order.order_for_1f1b`); ``"ramp"``, LPT towards the 1F1B
            cost profile (:func:`~omni_lightning.balance.pipeline_order.split_to_profile`), which shortens the
            bubble where samples are small enough to shape micro-batches, where it spills no more samples and its
            step is shorter than DistTrain's (else DistTrain's); ``"search"``, that refined by a local search over
            moves of samples and of micro-batches on the 1F1B step
            (:func:`~omni_lightning.balance.pipeline_order.refine_for_1f1b`; up to about a second per rank-step at
            pp 8 with 32 micro-batches: little over the ramp where a micro-batch holds many samples, several
            percent of the step where it holds a few).
        forward_share: the share of a micro-batch's cost its forward takes, for the ramp and the search (1/3 in
            FLOPs: the backward computes input and weight gradients; a measured step gives the real share).
        link: what moving payload bytes between the group's ranks costs, in the units of the sample costs
            (``LinkCost.flops_per_s`` converts seconds into them); ``None`` prices compute alone.
        balance_evaluations: most candidate exchanges the balancing of the bins may price for the whole group
            (a :class:`~omni_lightning.balance.budget.WorkBudget`: every rank stops at the same plan).
        search_evaluations: most candidates the 1F1B search may evaluate for one rank-step
            (:func:`~omni_lightning.balance.pipeline_order.refine_for_1f1b`).
        encoder_peers: under the joint pipeline, the ranks of a stage that share a micro-batch's encoder items
            out between them (its tensor- and context-parallel peers), for the model that compares plans
            (:func:`~omni_lightning.balance.joint_group.joint_step_times`).
    """

    steps: int
    micro_batches: int = 1
    token_budget: int | None = None
    pp: int = 1
    pipeline_order: PipelineOrder = "disttrain"
    forward_share: float = 1 / 3
    link: LinkCost | None = None
    balance_evaluations: int = 4_000_000
    search_evaluations: int = 2_000_000
    encoder_peers: int = 1

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batches", "pp", "encoder_peers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"token_budget={self.token_budget} must be positive or None")
        if not 0.0 < self.forward_share < 1.0:
            raise ValueError(f"forward_share={self.forward_share} must be strictly between 0 and 1")
        if self.pipeline_order not in PIPELINE_ORDERS:
            raise ValueError(f"pipeline_order={self.pipeline_order!r} must be one of {PIPELINE_ORDERS}")
        for name in ("balance_evaluations", "search_evaluations"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 0")


@dataclass
class GroupPlan:
    """Where every buffered sample goes.

    ``micro_batches[rank][step][m]`` lists sample ids (positions in the gathered metadata arrays) in the order to
    pack them (planned with ``searched_rank``, the other ranks' micro-batches hold the right samples but were not
    searched); ``step_cost[rank, step]`` is the predicted cost of that rank's step; ``leftover`` are ids that did
    not fit any micro-batch's token budget and wait for the next group. ``evaluations`` counts the candidates
    the plan's searches evaluated (bounded by the config's budgets).
    """

    micro_batches: list[list[list[list[int]]]]
    step_cost: np.ndarray
    leftover: list[int]
    samples_moved: int
    bytes_moved: int
    evaluations: int = 0

    @property
    def imbalance(self) -> float:
        """max / mean predicted (rank, step) cost."""
        mean = float(self.step_cost.mean())
        return float(self.step_cost.max()) / mean if mean > 0 else 1.0


def lower_bound(costs: np.ndarray, n_bins: int) -> float:
    """No assignment of these samples to ``n_bins`` bins can have a smaller maximum bin cost."""
    return max(float(costs.sum()) / n_bins, float(costs.max(initial=0.0)))


def reorder_group_ranks(dp_size: int, group_size: int | None) -> list[list[int]]:
    """Data-parallel ranks split into reorder groups of ``group_size`` consecutive ranks (``None``: all of them).

    Consecutive data-parallel ranks share a node first (ParallelDims puts data parallelism outside TP and CP), so
    the payload exchange stays inside a node or a few neighbouring ones.
    """
    size = dp_size if group_size is None else group_size
    if size < 1 or dp_size % size:
        raise ValueError(f"reorder group size {group_size} must divide the data-parallel size {dp_size}")
    return [list(range(start, start + size)) for start in range(0, dp_size, size)]


def plan_reorder_group(
    costs: np.ndarray,
    tokens: np.ndarray,
    owners: np.ndarray,
    nbytes: np.ndarray,
    *,
    n_ranks: int,
    config: ReorderConfig,
    seed: int,
    epoch: int,
    group_index: int,
    micro_batch_costs: np.ndarray | None = None,
    searched_rank: int | None = None,
) -> GroupPlan:
    """Plan one reorder group; a pure function, identical on every rank given the same gathered inputs.

    Args:
        costs: predicted cost of each sample (what is balanced over ranks and steps).
        tokens: LLM tokens of each sample (what the micro-batch budget limits).
        owners: the rank (0..n_ranks-1 within the group) that holds each sample's payload now.
        nbytes: payload size of each sample, for the movement counters.
        n_ranks: ranks in the reorder group.
        config: steps, micro-batches, token budget and pipeline degree.
        seed, epoch, group_index: break ties among equal costs reproducibly, differently per group.
        micro_batch_costs: the cost of each sample that a step's micro-batches balance and are ordered by
            (default ``costs``). Under a joint encoder-LLM pipeline that is the LLM's cost: the pipeline's shape
            is set by each micro-batch's LLM work, while its encoder work is spread over all the stages.
        searched_rank: with ``pipeline_order="search"``, search the micro-batches of this rank only (``None``:
            every rank's). Which samples each rank trains, and which are left over, do not depend on the search, so
            a rank that plans its group only to train its own part need not search the others' (a rank-step's
            search costs about a second at pp 8 with 32 micro-batches); theirs keep the split, unsearched.

    Under the joint pipeline (``pp > 1`` with ``micro_batch_costs``) the group's plan competes with one that
    balances each step on its own reads, both priced on
    :func:`~omni_lightning.balance.joint_group.joint_step_times` (their exchange included, per unit of the work
    they place, as samples left over wait for the next group); the second replaces the first where it is shorter
    by more than :data:`STEP_LOCAL_MIN_GAIN`. Its balancing shares the first's budget, and only the plan kept is
    searched. The choice depends on which samples each rank-step holds, never on a search, so every rank makes it
    alike.
    """
    costs = np.asarray(costs, dtype=np.float64)
    split_costs = costs if micro_batch_costs is None else np.asarray(micro_batch_costs, dtype=np.float64)
    if split_costs.shape != costs.shape:
        raise ValueError(f"micro_batch_costs has shape {split_costs.shape}, costs {costs.shape}: one per sample")
    tokens = np.asarray(tokens, dtype=np.int64)
    if searched_rank is not None and not 0 <= searched_rank < n_ranks:
        raise ValueError(f"searched_rank={searched_rank} is not a rank of the reorder group (0..{n_ranks - 1})")
    budget = config.token_budget
    if budget is not None and tokens.size and int(tokens.max()) > budget:
        raise ValueError(
            f"a sample of {int(tokens.max())} tokens exceeds the micro-batch token budget {budget}; apply the "
            "max_seq_len policy (truncate/drop/error) before planning"
        )
    owners = np.asarray(owners, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.int64)
    total = float(costs.sum())
    joint = config.pp > 1 and micro_batch_costs is not None

    def priced(members: list[list[list[int]]], leftover: list[int]) -> float:
        """The group's time, its exchange included, per unit of the work it trains: samples a plan leaves over
        wait for the next group, which then takes longer."""
        if joint:
            times = joint_step_times(members, split_costs, costs - split_costs, pp=config.pp,
                                     micro_batches=config.micro_batches, encoder_peers=config.encoder_peers)
        else:
            times = np.array([[costs[step].sum() for step in rank] for rank in members]).reshape(n_ranks, -1)
        if config.link is not None:
            times = times + exchange_cost(_one_batch_a_step(members), owners, nbytes, config.link)
        placed = total - float(costs[leftover].sum())
        return joint_group_time(times) * (total / placed if placed > 0 else 1.0)

    bins = _balanced_bins(costs, tokens, owners, nbytes, n_ranks=n_ranks, config=config, seed=seed, epoch=epoch,
                          group_index=group_index)
    if joint and config.steps > 1:
        local = _step_local_bins(costs, tokens, owners, nbytes, n_ranks=n_ranks, config=config, seed=seed,
                                 epoch=epoch, group_index=group_index)
        # The model leaves out the resharder and where a sample's items go: the step-by-step plan must win beyond
        # that. Only the plan kept is split into micro-batches.
        if priced(local.members, local.leftover) * (1 + STEP_LOCAL_MIN_GAIN) < priced(bins.members, bins.leftover):
            bins = replace(local, evaluations=local.evaluations + bins.evaluations)
        else:
            bins.evaluations += local.evaluations
    balanced = _split(bins, costs, split_costs, tokens, owners, nbytes, config)
    if config.link is None:
        return _searched(balanced, split_costs, tokens, config, searched_rank)
    # Ranks step together, so a group lasts the sum over its steps of the slowest rank's step. A plan that moves
    # samples must beat keeping each where it was read by more than 1%; one that moves none (bins matched to the
    # ranks that hold them) must still be no slower than the naive split, which can arrange a rank's own samples
    # over its steps better than bins packed for the whole group do.
    home = plan_in_place(costs, tokens, owners, n_ranks=n_ranks, config=config)
    home_time = priced(_step_members(home), home.leftover)
    balanced_time = priced(_step_members(balanced), balanced.leftover)
    if home_time <= balanced_time * 1.01 if balanced.samples_moved else home_time < balanced_time:
        return home
    return _searched(balanced, split_costs, tokens, config, searched_rank)


@dataclass
class _Bins:
    """The samples each ``[rank][step]`` trains, before their split into micro-batches; those that fit nowhere;
    the balancing evaluations spent."""

    members: list[list[list[int]]]
    leftover: list[int]
    evaluations: int


def _step_members(plan: GroupPlan) -> list[list[list[int]]]:
    return [[[s for mb in step for s in mb] for step in rank] for rank in plan.micro_batches]


def _one_batch_a_step(members: list[list[list[int]]]) -> GroupPlan:
    """``members`` as a plan of one micro-batch a step, for what depends only on which samples a rank trains."""
    return GroupPlan([[[step] for step in rank] for rank in members], np.zeros(0), [], 0, 0)


def _balanced_bins(costs: np.ndarray, tokens: np.ndarray, owners: np.ndarray, nbytes: np.ndarray, *, n_ranks: int,
                   config: ReorderConfig, seed: int, epoch: int, group_index: int) -> _Bins:
    """LPT over the group's ``ranks x steps`` bins, each matched to the rank holding most of its payload bytes."""
    n_bins = n_ranks * config.steps
    capacity = None if config.token_budget is None else config.token_budget * config.micro_batches
    tie_break = np.random.default_rng([seed, epoch, group_index]).permutation(costs.size)
    # Descending cost; the seeded permutation decides among equal costs.
    order = tie_break[np.argsort(-costs[tie_break], kind="stable")]
    balance_budget = WorkBudget(config.balance_evaluations)
    members, leftover = _assign_bins(order, costs, tokens, n_bins, capacity, owners, n_ranks, balance_budget)
    # Bins of a step are interchangeable: give each to the rank that already holds most of its payload bytes.
    matched: list[list[list[int]]] = [[[] for _ in range(config.steps)] for _ in range(n_ranks)]
    for step in range(config.steps):
        step_bins = list(range(step * n_ranks, (step + 1) * n_ranks))
        for b, rank in zip(step_bins, _match_bins_to_ranks(step_bins, members, owners, nbytes, n_ranks), strict=True):
            matched[rank][step] = members[b]
    return _Bins(matched, leftover, balance_budget.used)


def _step_local_bins(costs: np.ndarray, tokens: np.ndarray, owners: np.ndarray, nbytes: np.ndarray, *,
                     n_ranks: int, config: ReorderConfig, seed: int, epoch: int, group_index: int) -> _Bins:
    """Each step balanced over the ranks on its own samples: each rank's reads in arrival order, cut into
    ``steps`` runs of about equal tokens, as they were read step by step. It keeps the mix of samples the reads
    gave each step, which under the joint pipeline can beat spreading the group's largest samples over all its
    steps (see :mod:`~omni_lightning.balance.joint_group`). The steps share the balancing budget of one group."""
    read_step = np.zeros(costs.size, dtype=np.int64)
    for rank in range(n_ranks):
        mine = np.flatnonzero(owners == rank)
        before = np.cumsum(tokens[mine]) - tokens[mine]
        read_step[mine] = before * config.steps // max(int(tokens[mine].sum()), 1)
    one_step = replace(config, steps=1, balance_evaluations=config.balance_evaluations // config.steps)
    members: list[list[list[int]]] = [[] for _ in range(n_ranks)]
    leftover: list[int] = []
    evaluations = 0
    for step in range(config.steps):
        ids = np.flatnonzero(read_step == step)
        part = _balanced_bins(costs[ids], tokens[ids], owners[ids], nbytes[ids], n_ranks=n_ranks, config=one_step,
                              seed=seed, epoch=epoch, group_index=group_index)
        for rank in range(n_ranks):
            members[rank].append(ids[part.members[rank][0]].tolist())
        leftover.extend(ids[part.leftover].tolist())
        evaluations += part.evaluations
    return _Bins(members, leftover, evaluations)


def _split(bins: _Bins, costs: np.ndarray, split_costs: np.ndarray, tokens: np.ndarray, owners: np.ndarray,
           nbytes: np.ndarray, config: ReorderConfig) -> GroupPlan:
    """Each rank-step of ``bins`` split into micro-batches (in their 1F1B run order, not yet searched)."""
    n_ranks = len(bins.members)
    plan: list[list[list[list[int]]]] = [[] for _ in range(n_ranks)]
    step_cost = np.zeros((n_ranks, config.steps))
    leftover = list(bins.leftover)
    moved = moved_bytes = 0
    for rank, rank_steps in enumerate(bins.members):
        for step, members in enumerate(rank_steps):
            split, spilled = _split_bin(members, split_costs, tokens, config)
            plan[rank].append(split)
            leftover.extend(spilled)
            placed = [s for mb in split for s in mb]
            step_cost[rank, step] = costs[placed].sum() if placed else 0.0
            away = [s for s in placed if owners[s] != rank]
            moved += len(away)
            moved_bytes += int(nbytes[away].sum()) if away else 0
    return GroupPlan(plan, step_cost, sorted(leftover), moved, moved_bytes, bins.evaluations)


def _searched(plan: GroupPlan, split_costs: np.ndarray, tokens: np.ndarray, config: ReorderConfig,
              searched_rank: int | None) -> GroupPlan:
    """``plan`` with its micro-batches refined by the 1F1B search (``pipeline_order="search"``): every rank's, or
    ``searched_rank``'s only, each rank-step spending at most ``config.search_evaluations``."""
    if config.pp <= 1 or config.pipeline_order != "search":
        return plan
    for rank, rank_steps in enumerate(plan.micro_batches):
        if searched_rank not in (None, rank):
            continue
        for step, batches in enumerate(rank_steps):
            budget = WorkBudget(config.search_evaluations)
            rank_steps[step] = refine_for_1f1b(batches, split_costs, tokens, pp=config.pp,
                                               forward_share=config.forward_share,
                                               token_budget=config.token_budget, budget=budget)
            plan.evaluations += budget.used
    return plan


def exchange_cost(plan: GroupPlan, owners: np.ndarray, nbytes: np.ndarray, link: LinkCost) -> np.ndarray:
    """What ``plan``'s payload exchange costs each rank, as a ``(ranks, steps)`` addition to its step costs: the
    bytes it sends and receives and the one collective (on every rank once anything moves), all on the group's
    first step, which cannot start before the exchange is done."""
    n_ranks, steps = len(plan.micro_batches), len(plan.micro_batches[0]) if plan.micro_batches else 0
    added = np.zeros((n_ranks, steps))
    if not steps:
        return added
    owners, nbytes = np.asarray(owners, dtype=np.int64), np.asarray(nbytes, dtype=np.float64)
    through = np.zeros(n_ranks)  # bytes through each rank's link, out and in
    for rank, rank_steps in enumerate(plan.micro_batches):
        for samples in (s for step in rank_steps for mb in step for s in mb):
            if owners[samples] != rank:
                through[rank] += nbytes[samples]
                through[owners[samples]] += nbytes[samples]
    if through.any():
        added[:, 0] = link.cost(through, 1)
    return added


def _assign_bins(
    order: np.ndarray,
    costs: np.ndarray,
    tokens: np.ndarray,
    n_bins: int,
    capacity: int | None,
    owners: np.ndarray,
    n_ranks: int,
    budget: WorkBudget,
) -> tuple[list[list[int]], list[int]]:
    """LPT of samples (given in descending cost order) over ``n_bins`` bins of ``capacity`` tokens.

    Samples worth more than a quarter of a bin's fair share go one by one to the least-loaded bin that fits
    (exact LPT, a heap). The many small ones that follow go in vectorised rounds: each round hands the next
    largest samples to the bins still below the fair share, the largest to the least loaded, except that a
    sample goes to a bin of its own rank (bin ``b`` belongs to rank ``b % n_ranks``) when the round has one (a bin
    takes several samples a round where its room under the fair share holds several of the round's largest): the
    samples of a round are of similar size, so this keeps payloads home at almost no cost in balance. That keeps
    LPT's behaviour where it matters and plans a 512-rank group in a fraction of the time. The refinement after
    it spends at most ``budget``.
    """
    bin_load = np.zeros(n_bins)
    bin_tokens = np.zeros(n_bins, dtype=np.int64)
    assigned_bin = np.full(costs.size, -1, dtype=np.int64)
    fair_share = float(costs.sum()) / n_bins
    n_large = int(np.count_nonzero(costs[order] > fair_share / 4))
    heap = [(0.0, b) for b in range(n_bins)]
    retry: list[int] = []
    for sample in order[:n_large].tolist():
        rejected = []
        while heap:
            load, b = heapq.heappop(heap)
            if capacity is None or bin_tokens[b] + tokens[sample] <= capacity:
                assigned_bin[sample] = b
                bin_load[b] = load + costs[sample]
                bin_tokens[b] += tokens[sample]
                heapq.heappush(heap, (bin_load[b], b))
                break
            rejected.append((load, b))
        else:
            retry.append(sample)
        for item in rejected:
            heapq.heappush(heap, item)

    pending = order[n_large:]
    while pending.size:
        by_load = np.argsort(bin_load, kind="stable")
        below = by_load[bin_load[by_load] < fair_share]
        targets = below if below.size else by_load
        # Each target takes as many of the next samples as fit under the fair share at the round's largest one
        # (at least one): few bins below the share, as where a few samples are giants, then take many a round.
        per = 1 if not below.size else max(1, int((fair_share - bin_load[targets].max()) // costs[pending[0]]))
        targets = np.tile(targets, per)[: pending.size]
        chunk, pending = pending[: targets.size], pending[targets.size :]
        targets = _pair_with_home_bins(chunk, targets, owners, n_ranks)
        # Samples of a round sharing a bin must fit together: each is checked with those before it in its bin.
        fits = (np.ones(chunk.size, dtype=bool) if capacity is None
                else bin_tokens[targets] + _running_totals(targets, tokens[chunk]) <= capacity)
        assigned_bin[chunk[fits]] = targets[fits]
        np.add.at(bin_load, targets[fits], costs[chunk[fits]])  # a bin may take several samples a round
        np.add.at(bin_tokens, targets[fits], tokens[chunk[fits]])
        if not fits.all():
            misfits = chunk[~fits]
            if fits.any():
                pending = np.concatenate([misfits, pending])  # loads moved: other bins come up next round
            else:
                retry.extend(misfits.tolist())  # the round is stuck: settle these one by one below

    leftover = []
    for sample in retry:  # any bin with room, least loaded first
        room = np.flatnonzero(bin_tokens + tokens[sample] <= capacity) if capacity is not None else np.arange(n_bins)
        if room.size == 0:
            leftover.append(sample)
            continue
        b = int(room[np.argmin(bin_load[room])])
        assigned_bin[sample] = b
        bin_load[b] += costs[sample]
        bin_tokens[b] += tokens[sample]
    placed = order[assigned_bin[order] >= 0]
    # Group by bin, keeping the descending cost order inside each bin (a stable sort by bin).
    by_bin = placed[np.argsort(assigned_bin[placed], kind="stable")]
    bounds = np.searchsorted(assigned_bin[by_bin], np.arange(n_bins + 1))
    members = [by_bin[bounds[b] : bounds[b + 1]].tolist() for b in range(n_bins)]
    for b in _refine(members, bin_load, bin_tokens, costs, tokens, capacity, budget):
        members[b].sort(key=lambda s: -costs[s])  # the refinement appended out of order
    return members, leftover


def _running_totals(bins: np.ndarray, values: np.ndarray) -> np.ndarray:
    """For each entry, the sum of ``values`` of the entries up to and including it that share its bin."""
    order = np.argsort(bins, kind="stable")
    ordered = values[order]
    running = np.cumsum(ordered)
    starts = np.flatnonzero(np.r_[True, bins[order][1:] != bins[order][:-1]]) if bins.size else np.zeros(0, int)
    before = np.repeat(running[starts] - ordered[starts], np.diff(np.r_[starts, bins.size]))
    totals = np.empty_like(running)
    totals[order] = running - before
    return totals


def _refine(
    members: list[list[int]],
    bin_load: np.ndarray,
    bin_tokens: np.ndarray,
    costs: np.ndarray,
    tokens: np.ndarray,
    capacity: int | None,
    budget: WorkBudget,
) -> set[int]:
    """Lower the peak: move a sample, or swap two, between the most- and the least-loaded bin while that helps.

    The rounds of :func:`_assign_bins` can overshoot by a small sample, and a bin filled with large samples alone
    can sit above the fair share; a move or swap that shifts about half the gap between the two bins fixes both.
    Lazy heaps keep each step O(log bins). It stops when ``budget`` cannot pay for the next exchange's
    evaluations (:func:`_best_exchange`), keeping what it has. Returns the bins it changed.
    """
    n_bins = bin_load.size
    version = [0] * n_bins
    highs = [(-bin_load[b], b, 0) for b in range(n_bins)]
    lows = [(bin_load[b], b, 0) for b in range(n_bins)]
    heapq.heapify(highs)
    heapq.heapify(lows)
    changed: set[int] = set()
    for _ in range(4 * n_bins):
        while highs[0][2] != version[highs[0][1]]:
            heapq.heappop(highs)
        while lows[0][2] != version[lows[0][1]]:
            heapq.heappop(lows)
        hi, lo = highs[0][1], lows[0][1]
        if hi == lo:
            return changed
        exchange = _best_exchange(members[hi], members[lo], bin_load[hi] - bin_load[lo], bin_tokens[lo],
                                  bin_tokens[hi], costs, tokens, capacity, budget)
        if exchange is None:
            return changed
        changed.update((hi, lo))
        out_of_hi, out_of_lo = exchange
        for sample in out_of_hi:
            members[hi].remove(sample)
            members[lo].append(sample)
        for sample in out_of_lo:
            members[lo].remove(sample)
            members[hi].append(sample)
        shift = costs[list(out_of_hi)].sum() - costs[list(out_of_lo)].sum()
        token_shift = int(tokens[list(out_of_hi)].sum() - tokens[list(out_of_lo)].sum())
        for b, sign in ((hi, -1), (lo, 1)):
            bin_load[b] += sign * shift
            bin_tokens[b] += sign * token_shift
            version[b] += 1
            heapq.heappush(highs, (-bin_load[b], b, version[b]))
            heapq.heappush(lows, (bin_load[b], b, version[b]))
    return changed


def _pair_with_home_bins(chunk: np.ndarray, targets: np.ndarray, owners: np.ndarray, n_ranks: int) -> np.ndarray:
    """Reorder ``targets`` (same length as ``chunk``) so that samples meet bins of their own rank where possible:
    the j-th sample of rank r in the chunk gets the j-th bin of rank r among the targets, if there is one; the
    others take the remaining bins in their original order."""
    sample_key = _rank_local_keys(owners[chunk], chunk.size)
    bin_key = _rank_local_keys(targets % n_ranks, chunk.size)
    by_key = np.argsort(bin_key, kind="stable")
    at = np.clip(np.searchsorted(bin_key[by_key], sample_key), 0, max(by_key.size - 1, 0))
    hit = bin_key[by_key][at] == sample_key
    paired = np.full(chunk.size, -1, dtype=np.int64)
    paired[hit] = targets[by_key[at[hit]]]
    free = np.ones(targets.size, dtype=bool)
    free[by_key[at[hit]]] = False
    paired[~hit] = targets[free][: int((~hit).sum())]
    return paired


def _rank_local_keys(ranks: np.ndarray, stride: int) -> np.ndarray:
    """``rank * stride + j`` for the j-th occurrence of each rank, in order."""
    order = np.argsort(ranks, kind="stable")
    sorted_ranks = ranks[order]
    starts = np.flatnonzero(np.r_[True, sorted_ranks[1:] != sorted_ranks[:-1]])
    occurrence = np.arange(ranks.size) - np.repeat(starts, np.diff(np.r_[starts, ranks.size]))
    keys = np.empty(ranks.size, dtype=np.int64)
    keys[order] = sorted_ranks * stride + occurrence
    return keys


def _split_bin(
    samples: list[int], costs: np.ndarray, tokens: np.ndarray, config: ReorderConfig
) -> tuple[list[list[int]], list[int]]:
    """One (rank, step) bin's micro-batches within the token budget, and any spill.

    LPT's even micro-batches; with ``pp > 1`` in their 1F1B run order: DistTrain's, or, unless ``pipeline_order``
    is DistTrain's, the split towards the 1F1B cost profile if that spills no more samples and its step is shorter
    (with one or two samples a micro-batch the ramp cannot be built and even ones do better)."""
    m = config.micro_batches
    if m == 1:  # the bin's token capacity is the micro-batch budget: everything fits, in cost order
        return [samples], []
    batches, loads, spilled = lpt_split(samples, costs, tokens, m, config.token_budget)
    if config.pp <= 1:
        return batches, spilled
    order = order_for_1f1b(loads, config.pp)
    batches, loads = [batches[i] for i in order], [loads[i] for i in order]
    if config.pipeline_order == "disttrain":
        return batches, spilled
    ramp, ramp_loads, ramp_spilled = split_to_profile(samples, costs, tokens, pp=config.pp, micro_batches=m,
                                                      forward_share=config.forward_share,
                                                      token_budget=config.token_budget)
    spans = one_f_one_b_makespans(np.array([loads, ramp_loads]), config.pp, forward_share=config.forward_share)
    if len(ramp_spilled) <= len(spilled) and spans[1] < spans[0]:
        return ramp, ramp_spilled
    return batches, spilled


def _match_bins_to_ranks(
    step_bins: list[int], members: list[list[int]], owners: np.ndarray, nbytes: np.ndarray, n_ranks: int
) -> list[int]:
    """Greedy maximum-weight matching of a step's bins to ranks by payload bytes already local.

    Only (bin, owner) pairs that hold bytes are ranked, so the cost grows with the samples, not with ranks**2.
    """
    rows = np.concatenate([np.full(len(members[b]), row, dtype=np.int64) for row, b in enumerate(step_bins)])
    samples = np.concatenate([np.asarray(members[b], dtype=np.int64) for b in step_bins])
    weight = np.bincount(rows * n_ranks + owners[samples], weights=nbytes[samples], minlength=len(step_bins) * n_ranks)
    assignment = [-1] * len(step_bins)
    taken = [False] * n_ranks
    nonzero = np.flatnonzero(weight)
    # Heaviest first; the stable sort leaves ties to the lower (bin, rank) pair, identically on every rank.
    for key in nonzero[np.argsort(-weight[nonzero], kind="stable")].tolist():
        row, rank = divmod(key, n_ranks)
        if assignment[row] == -1 and not taken[rank]:
            assignment[row], taken[rank] = rank, True
    free = iter(rank for rank in range(n_ranks) if not taken[rank])
    return [rank if rank != -1 else next(free) for rank in assignment]


def _best_exchange(
    high: list[int],
    low: list[int],
    gap: float,
    low_tokens: int,
    high_tokens: int,
    costs: np.ndarray,
    tokens: np.ndarray,
    capacity: int | None,
    budget: WorkBudget,
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The move (one sample high -> low) or swap (one each way) whose cost shift is nearest ``gap / 2``, among
    those that lower the peak (shift strictly between 0 and ``gap``) and respect the token capacity.

    Each sample of ``high`` is priced as a move and against the ``_NEIGHBOURS`` samples of ``low`` on either side of
    the cost that would shift exactly ``gap / 2`` (the nearest in cost, where the best swap is unless the token
    capacity rules it out): ``2 * _NEIGHBOURS + 1`` evaluations a sample instead of ``len(low) + 1``, so that bins of
    thousands of tiny samples cost a sort, not their product. ``None`` also when ``budget`` cannot pay for them.
    """
    hi = np.asarray(high, dtype=np.int64)
    lo = np.asarray(low, dtype=np.int64)
    if not budget.take(hi.size * (2 * _NEIGHBOURS + 1)):
        return None
    by_cost = np.lexsort((np.arange(lo.size), costs[lo]))  # ascending; ties by position in ``low``
    at = np.searchsorted(costs[lo[by_cost]], costs[hi] - gap / 2)
    # Column 0 is the move; the others the neighbours in cost (position -1: none).
    pos = at[:, None] + np.arange(-_NEIGHBOURS, _NEIGHBOURS)[None]
    valid = (pos >= 0) & (pos < lo.size)
    low_pos = np.where(valid, by_cost[np.clip(pos, 0, max(lo.size - 1, 0))] if lo.size else -1, -1)
    low_pos = np.concatenate([np.full((hi.size, 1), -1), low_pos], axis=1)
    valid = np.concatenate([np.ones((hi.size, 1), dtype=bool), valid], axis=1)
    y = np.where(low_pos >= 0, lo[np.maximum(low_pos, 0)] if lo.size else 0, -1)
    shift = costs[hi][:, None] - np.where(y >= 0, costs[np.maximum(y, 0)], 0.0)
    moved_tokens = tokens[hi][:, None] - np.where(y >= 0, tokens[np.maximum(y, 0)], 0)
    ok = valid & (shift > 0.0) & (shift < gap)
    if capacity is not None:
        ok &= (low_tokens + moved_tokens <= capacity) & (high_tokens - moved_tokens <= capacity)
    if not ok.any():
        return None
    x_pos = np.broadcast_to(np.arange(hi.size)[:, None], ok.shape)[ok]
    score = np.abs(shift - gap / 2)[ok]
    # The first of equal scores in the order of ``high``, the move before the swaps, then the order of ``low``.
    k = int(np.lexsort((low_pos[ok], x_pos, score))[0])
    x, y_best = int(hi[x_pos[k]]), int(y[ok][k])
    return (x,), () if y_best < 0 else (y_best,)


def plan_in_place(costs: np.ndarray, tokens: np.ndarray, owners: np.ndarray, *, n_ranks: int,
                  config: ReorderConfig) -> GroupPlan:
    """The naive split as a plan (what ``OmniDataModule(workload_balance="none")`` trains, and the baseline the
    balanced plan is measured against): each rank trains on its own samples in arrival order, its micro-batches
    filled one after another with ``ceil(samples / micro-batches)`` each (the same number where they divide), except
    that a micro-batch ends early before a sample that would overflow the token budget, and a sample that finds no
    micro-batch left waits for the next group."""
    costs = np.asarray(costs, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    owners = np.asarray(owners, dtype=np.int64)
    slots = config.steps * config.micro_batches
    micro: list[list[list[list[int]]]] = []
    leftover: list[int] = []
    step_cost = np.zeros((n_ranks, config.steps))
    for r in range(n_ranks):
        mine = np.flatnonzero(owners == r).tolist()
        per_slot = -(-len(mine) // slots) if mine else 0
        batches: list[list[int]] = [[] for _ in range(slots)]
        slot = used = 0
        for sample in mine:
            while slot < slots and (len(batches[slot]) >= per_slot or (
                    config.token_budget is not None and batches[slot] and used + tokens[sample] > config.token_budget)):
                slot, used = slot + 1, 0
            if slot == slots:
                leftover.append(sample)
                continue
            batches[slot].append(sample)
            used += int(tokens[sample])
        micro.append([batches[s * config.micro_batches : (s + 1) * config.micro_batches] for s in range(config.steps)])
        for s in range(config.steps):
            step_cost[r, s] = sum(costs[ids].sum() for ids in micro[r][s])
    return GroupPlan(micro, step_cost, leftover, 0, 0)
