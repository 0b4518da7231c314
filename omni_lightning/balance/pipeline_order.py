"""The 1F1B step of a pipeline's micro-batches as arrays: replayed, ordered, shaped, and with encoder work inserted.

Pure planning functions of the loader (:mod:`omni_lightning.balance.reorder`) and of the joint encoder-LLM pipeline
(:mod:`omni_lightning.runtime.joint`): step times of many cost vectors at once in the dependency model of
:func:`omni_lightning.sim.replay_pipeline`; DistTrain's micro-batch order; the cost profile whose 1F1B step is
shortest and a split of samples towards it; a local search over orders and samples; and the placement of encoder
items on the joint pipeline's insertions.
"""

from __future__ import annotations

import heapq
import math
from functools import lru_cache

import numpy as np
from numpy.typing import ArrayLike

from omni_lightning.balance.budget import WorkBudget
from omni_lightning.balance.pipeline_replay import waits_for

__all__ = [
    "order_for_1f1b",
    "search_1f1b_order",
    "refine_for_1f1b",
    "one_f_one_b_makespans",
    "one_f_one_b_profile",
    "split_to_profile",
    "lpt_split",
    "joint_1f1b_makespans",
    "joint_1f1b_orders",
    "assign_encoder_items",
    "lpt_ranks",
    "turned_peers",
    "split_items",
    "stage_shares_of",
    "JOINT_ITEM_EVALUATIONS",
]

# The joint item plan's default work budget: candidate plans replayed per step. Every pipeline rank replays each
# candidate over the step's whole program (4 actions per stage and micro-batch), so this bounds its planning at
# about 20,000 x 4 x pp x m array updates a step.
JOINT_ITEM_EVALUATIONS = 20_000


def order_for_1f1b(micro_batch_costs: list[float], pp: int) -> list[int]:
    """DistTrain's inter-micro-batch order for 1F1B: the smallest first, the ``pp - 1`` next smallest kept for the
    cool-down (descending, so the pipeline drains on the lightest work), the rest ascending in between.

    Returns indices into ``micro_batch_costs``.
    """
    ascending = sorted(range(len(micro_batch_costs)), key=lambda i: (micro_batch_costs[i], i))
    if len(ascending) <= 1:
        return ascending
    first, rest = ascending[0], ascending[1:]
    tail = rest[: pp - 1]
    middle = rest[pp - 1 :]
    return [first, *middle, *reversed(tail)]


def one_f_one_b_makespans(costs: np.ndarray, pp: int, *, forward_share: float = 1 / 3) -> np.ndarray:
    """Step times of 1F1B over ``pp`` equal stages for many orders at once (pure, vectorised over the rows).

    ``costs[k, j]`` is the cost of the micro-batch that order ``k`` runs ``j``-th; each stage runs a ``1 / pp``
    share of it, the forward ``forward_share`` of that and the backward the rest, transfers taking no time. Every
    action starts when its stage is free and its input is there (the forward of the stage before, the backward of
    the stage after), as :func:`omni_lightning.sim.replay_pipeline` replays a step.
    """
    costs = np.atleast_2d(np.asarray(costs, dtype=np.float64))
    steps = _OneFOneB.of(pp, costs.shape[1], forward_share)
    return steps.makespans(steps.ends(costs))


class _OneFOneB:
    """The 1F1B step of ``pp`` equal stages and ``m`` micro-batches as arrays, replayed for many cost vectors at
    once; and its critical paths, as the weight of each micro-batch's cost on them (see :func:`refine_for_1f1b`)."""

    def __init__(self, pp: int, m: int, forward_share: float) -> None:
        program = _program(_one_f_one_b_orders(pp, m))
        self.m = m
        forward = np.array([a[1] == "F" for a in program])
        self.micro_batch = np.array([a[2] for a in program], dtype=np.int64)
        # Each action's duration per unit of its micro-batch's cost; 1F1B has one dependency at most besides the
        # action before it on its stage (-1: none, the zero row of the end times).
        self.pp, self.share = pp, np.where(forward, forward_share, 1.0 - forward_share)
        self.weight = self.share / pp
        self.before = np.array([a[3] for a in program], dtype=np.int64)
        assert all(len(a[4]) <= 1 for a in program), "1F1B waits on one other stage at most"
        self.needs = np.array([a[4][0] if a[4] else -1 for a in program], dtype=np.int64)
        # Actions in waves that depend only on earlier waves (one per step of the longest chain), replayed a
        # wave at a time: far fewer array operations than one per action.
        level = np.zeros(len(program) + 1, dtype=np.int64)
        for i in range(len(program)):
            level[i] = 1 + max(level[self.before[i]], level[self.needs[i]])
        self.waves = [np.flatnonzero(level[:-1] == k) for k in range(1, int(level.max()) + 1)]

    @staticmethod
    @lru_cache(maxsize=64)
    def of(pp: int, m: int, forward_share: float) -> _OneFOneB:
        return _OneFOneB(pp, m, forward_share)

    def ends(self, costs: np.ndarray) -> np.ndarray:
        """End times ``[action + 1, k]`` for the cost vectors ``costs[k]`` (the last row stays 0: no action)."""
        # Rows of a contiguous transpose: each action reads its micro-batch's costs for every vector at once.
        # A stage's share of the cost, then the pass's: one fixed rounding, so near-ties between plans always break
        # the same way.
        per_stage = np.ascontiguousarray(costs.T) / self.pp
        end = np.zeros((self.micro_batch.size + 1, costs.shape[0]))
        for wave in self.waves:
            end[wave] = (np.maximum(end[self.before[wave]], end[self.needs[wave]])
                         + per_stage[self.micro_batch[wave]] * self.share[wave, None])
        return end

    @staticmethod
    def makespans(end: np.ndarray) -> np.ndarray:
        """Step times from :meth:`ends`."""
        return end.max(axis=0)

    def critical_paths(self, end: np.ndarray) -> np.ndarray:
        """For each column of ``end``, a longest path through the step as the weight ``[k, j]`` of micro-batch
        ``j``'s cost on it: the path's length is that row's dot product with the cost vector, for *any* costs."""
        columns = np.arange(end.shape[1])
        action = end[:-1].argmax(axis=0)  # the action that ends the step
        visited = []
        while (action >= 0).any():
            visited.append(action)
            before, need = self.before[action], self.needs[action]
            # Back along whichever input the action waited for last (its stage, or the stage it depends on); -1
            # (no action) stays -1.
            action = np.where(action < 0, -1, np.where(end[need, columns] > end[before, columns], need, before))
        on_path = np.stack(visited)
        hit = on_path >= 0
        cells = columns[None].repeat(on_path.shape[0], axis=0)[hit] * self.m + self.micro_batch[on_path[hit]]
        return np.bincount(cells, weights=self.weight[on_path[hit]], minlength=columns.size * self.m).reshape(
            columns.size, self.m)


def one_f_one_b_profile(pp: int, m: int, forward_share: float = 1 / 3) -> np.ndarray:
    """The shares of a step's cost, by run position, whose 1F1B step (:func:`one_f_one_b_makespans`) is the
    shortest found: light micro-batches first, rising over the ``pp - 1`` that fill the pipeline, a plateau, and a
    slow descent into the drain. Even micro-batches leave ``(pp - 1) / (m + pp - 1)`` of a stage's step idle; this
    profile takes out 10-45% of that (more with more micro-batches per stage).

    A step time is the longest path through the step, a maximum of functions linear in the costs, so it is convex
    in them: multiplicative subgradient descent on the simplex, the subgradient being a critical path's weights,
    from even shares, keeping the best. It uses only exactly rounded arithmetic (no ``exp``, whose last bits depend
    on the CPU's vector unit), so every rank of a mixed cluster computes the same profile, and so the same plan.
    Cached per shape; a read-only array of ``m`` shares summing to 1.
    """
    return _profile(int(pp), int(m), float(forward_share))


@lru_cache(maxsize=64)
def _profile(pp: int, m: int, forward_share: float, iterations: int = 1000) -> np.ndarray:
    shares = np.full(m, 1.0 / m)
    if pp > 1 and m > 1:
        steps = _OneFOneB.of(pp, m, forward_share)
        best, best_span = shares, np.inf
        for iteration in range(iterations):
            end = steps.ends(shares[None])
            span = float(steps.makespans(end)[0])
            if span < best_span:
                best, best_span = shares, span
            path = steps.critical_paths(end)[0]
            shares = shares * (1.0 - 0.5 / math.sqrt(1 + iteration) * (path / path.max()))
            shares = shares / math.fsum(shares.tolist())
        shares = best.copy()
    shares.flags.writeable = False  # cached: shared by every caller
    return shares


def split_to_profile(samples: list[int], costs: np.ndarray, tokens: np.ndarray, *, pp: int, micro_batches: int,
                     forward_share: float = 1 / 3, token_budget: int | None = None
                     ) -> tuple[list[list[int]], list[float], list[int]]:
    """``samples`` split into ``micro_batches`` micro-batches, in run order, towards the shares of
    :func:`one_f_one_b_profile` (pure, deterministic): :func:`lpt_split` with those shares."""
    shares = one_f_one_b_profile(pp, micro_batches, forward_share)
    return lpt_split(samples, costs, tokens, micro_batches, token_budget, shares=shares.tolist())


def lpt_split(samples: list[int], costs: np.ndarray, tokens: np.ndarray, m: int, budget: int | None, *,
              shares: list[float] | None = None) -> tuple[list[list[int]], list[float], list[int]]:
    """LPT of ``samples``, costliest first, over ``m`` micro-batches of at most ``budget`` tokens: each goes to the
    least-loaded micro-batch with room, or with ``shares`` (LPT for machines of unequal speed) to the one that
    holding it would fill least relative to its share. Returns the micro-batches, their costs and the samples none
    had room for.

    Samples worth more than a quarter of a micro-batch's fair share go one at a time (exact LPT). The many small
    ones that follow go in vectorised rounds, as :func:`omni_lightning.balance.reorder.plan_reorder_group` places
    them over bins: each round hands the next largest samples to the micro-batches in order of relative load, the
    largest to the least filled, and a sample that does not fit its micro-batch's tokens is settled one at a time
    after the rounds. So a bin of thousands of tiny samples costs a few array operations a round, not a Python
    scan of every micro-batch per sample.
    """
    ids = np.asarray(samples, dtype=np.int64)
    weight = np.ones(m) if shares is None else np.asarray(shares, dtype=np.float64)
    loads, used = np.zeros(m), np.zeros(m, dtype=np.int64)
    where = np.full(ids.size, -1, dtype=np.int64)
    # Descending cost, ties by position (a bin lists them by the balanced cost, which micro_batch_costs may differ
    # from).
    order = np.lexsort((np.arange(ids.size), -costs[ids])) if ids.size else np.zeros(0, dtype=np.int64)
    c, t = costs[ids].astype(np.float64), tokens[ids].astype(np.int64)
    large = int(np.count_nonzero(c[order] > float(c.sum()) / (4 * m)))
    spilled: list[int] = []

    def place_one(k: int) -> None:
        room = np.arange(m) if budget is None else np.flatnonzero(used + t[k] <= budget)
        if room.size == 0:
            spilled.append(int(ids[k]))  # the bin's total fits, its fragments do not
            return
        key = loads[room] if shares is None else (loads[room] + c[k]) / weight[room]
        target = int(room[np.lexsort((room, key))[0]])
        where[k], loads[target], used[target] = target, loads[target] + c[k], used[target] + t[k]

    for k in order[:large].tolist():
        place_one(k)
    level = float(c.sum()) / float(weight.sum())  # every micro-batch's fill when the bin is spread by the shares
    misfits: list[int] = []
    pending = order[large:]
    while pending.size:
        fill = loads / weight
        by_fill = np.lexsort((np.arange(m), fill))
        if budget is not None:  # micro-batches out of room for the next samples sit the round out
            by_fill = by_fill[used[by_fill] + int(t[pending[:m]].max()) <= budget]
            if not by_fill.size:
                misfits.extend(pending.tolist())
                break
        below = by_fill[fill[by_fill] < level]
        target = (below if below.size else by_fill)[: pending.size]
        chunk, pending = pending[: target.size], pending[target.size :]
        fits = np.ones(chunk.size, dtype=bool) if budget is None else used[target] + t[chunk] <= budget
        where[chunk[fits]] = target[fits]
        loads[target[fits]] += c[chunk[fits]]
        used[target[fits]] += t[chunk[fits]]
        misfits.extend(chunk[~fits].tolist())
    for k in misfits:
        place_one(k)
    batches: list[list[int]] = [[] for _ in range(m)]
    for k in order.tolist():
        if where[k] >= 0:
            batches[where[k]].append(int(ids[k]))
    return batches, loads.tolist(), spilled


def joint_1f1b_makespans(llm_costs: np.ndarray, encoder_costs: np.ndarray, *, forward_share: float = 1 / 3,
                         encoder_forward_share: float = 1 / 3, stage_shares: np.ndarray | None = None) -> np.ndarray:
    """Step times of the joint encoder-LLM pipeline's 1F1B for many encoder assignments at once (pure, vectorised).

    ``llm_costs[k, j]`` is the LLM cost of the ``j``-th micro-batch, split over the stages (evenly, or by
    ``stage_shares``, e.g. measured: the first stage also embeds, the last computes the loss) and into forward
    (``forward_share``) and backward as in :func:`one_f_one_b_makespans`; ``encoder_costs[k, s, j]`` the encoder
    work of that micro-batch that pipeline rank ``s`` does (forward ``encoder_forward_share`` of it), at the
    insertions :class:`omni_lightning.runtime.joint.JointEncoders` runs it at (:func:`joint_1f1b_orders`),
    with the dependencies of :func:`omni_lightning.sim.replay_pipeline`.
    """
    encoder = np.asarray(encoder_costs, dtype=np.float64)
    encoder = encoder[None] if encoder.ndim == 2 else encoder
    stage_shares = None if stage_shares is None else stage_shares_of(stage_shares, encoder.shape[1])
    llm = np.atleast_2d(np.asarray(llm_costs, dtype=np.float64))  # one row, or one per assignment
    program = _program(joint_1f1b_orders(encoder.shape[1], encoder.shape[2]))
    durations = _joint_durations(program, llm, encoder, forward_share, encoder_forward_share, stage_shares)
    return _replay(program, durations).max(axis=0)


def joint_1f1b_orders(pp: int, m: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Each rank's actions (kinds as in :class:`omni_lightning.sim.Action`) under the joint pipeline's 1F1B, in the
    order :class:`~omni_lightning.runtime.joint.JointEncoders` runs them: stage ``s > 0`` encodes its
    share of the first ``s + 1`` micro-batches before the step, and before its forward of ``j`` encodes its share of
    ``j + s + 1`` and backpropagates its share of ``j - pp``; stage 0 backpropagates its share of ``j - pp`` and
    encodes its share of ``j`` before its forward of ``j``, and sends the gradients of ``j`` (``G``) after its
    backward of ``j``; every rank backpropagates the shares left after the schedule."""
    orders = []
    for stage, llm in enumerate(_one_f_one_b_orders(pp, m)):
        ahead = stage + 1 if stage > 0 else 0
        order = [("E", j) for j in range(min(ahead, m))]
        for kind, j in llm:
            if kind == "B":
                order += [("B", j), ("G", j)] if stage == 0 else [("B", j)]
                continue
            if stage == 0:
                order += [("EB", j - pp)] if j >= pp else []
                order.append(("E", j))
            else:
                order += [("E", j + ahead)] if j + ahead < m else []
                order += [("EB", j - pp)] if j >= pp else []
            order.append(("F", j))
        orders.append(tuple(order + [("EB", j) for j in range(max(m - pp, 0), m)]))
    return tuple(orders)


def assign_encoder_items(llm_costs: np.ndarray, micro_batch: np.ndarray, item_costs: np.ndarray, pp: int, *,
                         forward_share: float = 1 / 3, encoder_forward_share: float = 1 / 3,
                         stage_shares: np.ndarray | None = None, large: float = 1 / 16,
                         max_rounds: int = 64, budget: WorkBudget | None = None) -> np.ndarray:
    """The pipeline rank that encodes each item of a joint-pipeline 1F1B step, chosen on the step's time (pure).

    Args:
        llm_costs: predicted LLM cost of each micro-batch, in run order (all stages together).
        micro_batch: the micro-batch of each item.
        item_costs: predicted encoder cost (forward and backward) of each item.
        pp: pipeline ranks.
        forward_share, encoder_forward_share: the forward's share of an LLM micro-batch's and of an item's cost.
        stage_shares: each stage's share of a micro-batch's LLM cost (``None``: equal), so that a stage with more
            LLM work (embedding, loss) is given less encoder work.
        large: items costing at least this share of a micro-batch's mean LLM cost on one stage are placed on the
            modelled step; the others by LPT.
        max_rounds: most moves of the descent.
        budget: most candidate plans the greedy placement and the descents may replay, together (default
            :data:`JOINT_ITEM_EVALUATIONS`): each replayed candidate spends one evaluation. Where the budget
            cannot pay, the greedy placement places the remaining large items by LPT and a descent stops with its
            best plan so far, so the cost is bounded whatever the number of large items, and every rank stops at
            the same plan.

    The step is modelled by :func:`joint_1f1b_makespans` (1F1B with the encoder insertions of
    :func:`joint_1f1b_orders`), which puts the insertions into the objective: an image too large for the slack of
    one stage goes where the schedule has room for it, which balancing encoder work alone does not see. Two plans
    are made, and the one with the shorter modelled step kept (LPT's on equal steps):

    * LPT over the step (each micro-batch in run order, its longest item first onto the rank with the least encoder
      work so far, :func:`lpt_ranks`: what ``share_items`` does; with ``stage_shares`` a stage's LLM work above
      the mean counts as work too);
    * the small items by LPT among themselves, then the large ones, heaviest first, each onto the rank where the
      modelled step is shortest (among equal steps, the least delay summed over all actions, as the step is flat
      while another item sets it; then the least encoder work, then the later stage).

    Each is then improved by steepest descent over moving one large item to another rank, while that shortens
    the modelled step. So the plan is never longer in the model than LPT's. Small items never move on the model's
    word: LPT spreads them evenly, which holds whatever the real costs are, while fitting them to the model would
    chase its error. Stage 0 gets none of the last ``pp`` micro-batches' items (it would backpropagate them after
    its last LLM backward). Deterministic, so every pipeline rank computes the same plan from the same batch.
    """
    llm = np.asarray(llm_costs, dtype=np.float64)
    micro_batch = np.asarray(micro_batch, dtype=np.int64)
    costs = np.asarray(item_costs, dtype=np.float64)
    if pp == 1 or costs.size == 0:
        return np.zeros(costs.size, dtype=np.int64)
    budget = WorkBudget(JOINT_ITEM_EVALUATIONS) if budget is None else budget
    model = _JointModel(llm, micro_batch, costs, pp, forward_share, encoder_forward_share, stage_shares)
    big = costs >= large * float(llm.mean()) / pp
    plans = [model.descend(model.lpt(np.ones(costs.size, dtype=bool)), big, max_rounds, budget),
             model.descend(model.greedy(model.lpt(~big), big, budget), big, max_rounds, budget)]
    spans = model.makespans(np.stack(plans))
    return plans[1] if spans[1] < spans[0] * (1 - 1e-9) else plans[0]


class _JointModel:
    """One step's costs under :func:`joint_1f1b_makespans`, and the plans :func:`assign_encoder_items` makes."""

    def __init__(self, llm: np.ndarray, micro_batch: np.ndarray, costs: np.ndarray, pp: int, forward_share: float,
                 encoder_forward_share: float, stage_shares: np.ndarray | None) -> None:
        self.llm, self.micro_batch, self.costs, self.pp = llm, micro_batch, costs, pp
        self.shares = {"forward_share": forward_share, "encoder_forward_share": encoder_forward_share,
                       "stage_shares": None if stage_shares is None else stage_shares_of(stage_shares, pp)}
        m = llm.size
        self.tail = m - pp if pp < m else m  # JointEncoders' rule: with no more micro-batches than stages, none
        self.program = _program(joint_1f1b_orders(pp, m))

    def ranks(self, j: int) -> np.ndarray:
        """The ranks that may encode items of micro-batch ``j``."""
        return np.arange(1 if j >= self.tail else 0, self.pp)

    def work(self, owners: np.ndarray, items: np.ndarray | None = None) -> np.ndarray:
        """Encoder work ``[plan, rank, micro-batch]`` of plans ``owners[plan, item]`` (only ``items``, a mask)."""
        owners = np.atleast_2d(owners)
        keep = np.ones(self.costs.size, dtype=bool) if items is None else items
        work = np.zeros((owners.shape[0], self.pp, self.llm.size))
        np.add.at(work, (np.arange(owners.shape[0])[:, None], owners[:, keep], self.micro_batch[keep][None]),
                  self.costs[keep][None])
        return work

    def makespans(self, owners: np.ndarray) -> np.ndarray:
        return self.spans(self.work(owners))

    def spans(self, work: np.ndarray) -> np.ndarray:
        """:func:`joint_1f1b_makespans` of encoder work ``[plan, rank, micro-batch]``, shares normalised already."""
        durations = _joint_durations(self.program, self.llm[None], work, **self.shares)
        return _replay(self.program, durations).max(axis=0)

    def lpt(self, items: np.ndarray) -> np.ndarray:
        """``items`` (a mask) by LPT over the step, micro-batch by micro-batch in run order; the rest on rank 0.
        A rank's load is its encoder work so far and, with stage shares, its stage's LLM work above the mean: a
        stage that also embeds or computes the loss takes fewer items, micro-batch by micro-batch."""
        owner, loads = np.zeros(self.costs.size, dtype=np.int64), np.zeros(self.pp)
        shares = self.shares["stage_shares"]
        excess = np.zeros(self.pp) if shares is None else shares - 1.0 / self.pp
        for j in range(self.llm.size):
            loads += excess * self.llm[j]
            mine = np.flatnonzero((self.micro_batch == j) & items)
            owner[mine] = lpt_ranks(self.costs[mine], loads, self.ranks(j))
        return owner

    def greedy(self, owner: np.ndarray, items: np.ndarray, budget: WorkBudget) -> np.ndarray:
        """``owner`` with ``items`` (a mask), heaviest first, each where the modelled step is shortest; once
        ``budget`` cannot pay for an item's trials, it and the items after it by LPT."""
        owner = owner.copy()
        program, share = self.program, self.shares["encoder_forward_share"]
        index = {(stage, kind, j): i for i, (stage, kind, j, _, _) in enumerate(program)}
        durations = _joint_durations(program, self.llm[None], self.work(owner, ~items), **self.shares)
        end = _replay(program, durations)
        loads = np.bincount(owner[~items], weights=self.costs[~items], minlength=self.pp)
        placing = np.flatnonzero(items)
        for item in placing[np.lexsort((placing, -self.costs[placing]))].tolist():
            j = int(self.micro_batch[item])
            ranks = self.ranks(j)
            if not budget.take(ranks.size):
                owner[item] = lpt_ranks(self.costs[item : item + 1], loads, ranks)[0]
                continue
            forward = [index[(int(r), "E", j)] for r in ranks]
            trial = np.repeat(durations, ranks.size, axis=1)
            trial[forward, np.arange(ranks.size)] += self.costs[item] * share
            trial[[index[(int(r), "EB", j)] for r in ranks], np.arange(ranks.size)] += self.costs[item] * (1 - share)
            # Actions before the item's first possible insertion keep their times: replay from there on.
            first = min(forward)
            ends = _replay(program, trial, np.repeat(end, ranks.size, axis=1), first=first)
            spans = ends.max(axis=0)
            slower = spans > spans.min() * (1 + 1e-9)
            pick = int(np.lexsort((-ranks, loads[ranks], ends[first:].sum(axis=0), slower))[0])
            owner[item] = ranks[pick]
            loads[ranks[pick]] += self.costs[item]
            durations, end = trial[:, pick : pick + 1].copy(), ends[:, pick : pick + 1].copy()
        return owner

    def descend(self, owner: np.ndarray, items: np.ndarray, max_rounds: int, budget: WorkBudget) -> np.ndarray:
        """``owner`` improved by moving one of ``items`` (a mask) at a time while the modelled step shortens and
        ``budget`` pays for the round's candidates."""
        owner, micro_batch, costs = owner.copy(), self.micro_batch, self.costs
        movable = np.flatnonzero(items)
        movable = movable[np.lexsort((movable, -costs[movable]))]  # heaviest first: it wins ties between moves
        # Every (item, rank) pair, stage 0 left out of the tail's items.
        item, rank = np.repeat(movable, self.pp), np.tile(np.arange(self.pp), movable.size)
        allowed = (rank > 0) | (micro_batch[item] < self.tail)
        item, rank = item[allowed], rank[allowed]
        work = self.work(owner)[0]
        now = float(self.spans(work[None])[0])
        for _ in range(max_rounds):
            moves = np.flatnonzero(rank != owner[item])
            if moves.size == 0 or not budget.take(moves.size):  # nothing to move, or no budget left to price it
                break
            candidates = np.repeat(work[None], moves.size, axis=0)
            rows, j = np.arange(moves.size), micro_batch[item[moves]]
            candidates[rows, owner[item[moves]], j] -= costs[item[moves]]
            candidates[rows, rank[moves], j] += costs[item[moves]]
            spans = self.spans(candidates)
            best = int(np.argmin(spans))  # the first of equals: heaviest item, lowest rank, as listed
            if not spans[best] < now * (1 - 1e-9):  # no move shortens the step
                break
            now, work = float(spans[best]), candidates[best]
            owner[item[moves[best]]] = rank[moves[best]]
        return owner


def lpt_ranks(costs: np.ndarray, loads: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Longest item first onto the rank of ``ranks`` with the least work so far (``loads``, updated in place);
    on ties the higher rank (pure). Returns each item's rank."""
    owner = np.zeros(costs.size, dtype=np.int64)
    if not costs.size:
        return owner
    if not len(ranks):
        raise ValueError(f"no rank to place {costs.size} item(s) on")
    # A heap of (load, -rank): its top is the least-loaded rank, on ties the higher, and only the chosen rank's load
    # changes, so each item costs O(log ranks) (a simulated step places millions). Python floats: the same IEEE
    # additions as one load array would make.
    load_of = np.asarray(loads, dtype=np.float64).tolist()
    heap = [(load_of[r], -r) for r in dict.fromkeys(np.asarray(ranks, dtype=np.int64).tolist())]
    heapq.heapify(heap)
    cost, placed, replace_top = costs.tolist(), owner.tolist(), heapq.heapreplace
    # A stable sort of the negated costs: descending cost, ties in index order.
    for item in np.argsort(-costs, kind="stable").tolist():
        load, negative = heap[0]
        placed[item] = -negative
        replace_top(heap, (load + cost[item], negative))
    owner[:] = placed
    for load, negative in heap:
        loads[-negative] = load
    return owner


def turned_peers(peer: np.ndarray, replica: int, peers: int) -> np.ndarray:
    """Peer labels of one data-parallel replica's items, turned by its index: ``(peer + replica) % peers`` (pure).

    Peers that split their items by LPT from equal loads put the largest item on the same peer in every replica
    (ties go to the higher rank), so each peer position's data-parallel group, over which the resharder balances,
    would hold every replica's largest items and have nowhere to spread them. Turned by the replica, those items
    land on different positions. Peers of one replica are alike, so its own step is the same either way.
    """
    return (np.asarray(peer, dtype=np.int64) + replica) % peers


def split_items(costs: np.ndarray, peers: int, replica: int = 0) -> np.ndarray:
    """The peer that encodes each item of peers that hold the same samples (pure, identical on every peer): longest
    first onto the least-loaded, the labels turned by the peers' data-parallel index ``replica``
    (:func:`turned_peers`)."""
    return turned_peers(lpt_ranks(np.asarray(costs, dtype=np.float64), np.zeros(peers), np.arange(peers)), replica,
                        peers)


def _joint_durations(program: tuple[tuple[int, str, int, int, tuple[int, ...]], ...], llm: np.ndarray,
                     encoder: np.ndarray, forward_share: float, encoder_forward_share: float,
                     stage_shares: np.ndarray | None = None) -> np.ndarray:
    """Durations ``[action, k]`` of the joint pipeline's ``program`` for ``k`` assignments (see
    :func:`joint_1f1b_makespans` for the arguments; ``stage_shares`` here already normalised by
    :func:`stage_shares_of`)."""
    stage, micro_batch, share, is_encoder = _program_columns(program, forward_share, encoder_forward_share)
    pp = encoder.shape[1]
    # The LLM's actions are computed for llm's rows only (one, broadcast, when every assignment shares them), and
    # only the encoder's actions gathered from the assignments: the search prices thousands of these a step.
    per_stage = (llm.T[micro_batch] / pp if stage_shares is None
                 else llm.T[micro_batch] * stage_shares[stage][:, None])
    durations = np.empty((len(program), encoder.shape[0]))
    durations[:] = per_stage * share[:, None]
    rows = np.flatnonzero(is_encoder)
    durations[rows] = encoder[:, stage[rows], micro_batch[rows]].T * share[rows, None]
    return durations


def stage_shares_of(stage_shares: ArrayLike, pp: int) -> np.ndarray:
    """Each stage's share of a micro-batch's LLM cost, checked (one positive, finite share per stage) and
    normalised to sum to one."""
    shares = np.asarray(stage_shares, dtype=np.float64)
    if shares.shape != (pp,) or not (np.isfinite(shares) & (shares > 0)).all():
        raise ValueError(f"stage_shares={list(np.atleast_1d(shares))} must hold a positive, finite share for each "
                         f"of the {pp} pipeline stages")
    return shares / shares.sum()


@lru_cache(maxsize=64)
def _program_columns(program: tuple[tuple[int, str, int, int, tuple[int, ...]], ...], forward_share: float,
                     encoder_forward_share: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Stage, micro-batch, share of the micro-batch's cost and whether it is encoder work, of each action."""
    shares = {"F": forward_share, "B": 1.0 - forward_share, "E": encoder_forward_share,
              "EB": 1.0 - encoder_forward_share, "G": 0.0}
    stage = np.array([a[0] for a in program], dtype=np.int64)
    micro_batch = np.array([a[2] for a in program], dtype=np.int64)
    share = np.array([shares[a[1]] for a in program])
    is_encoder = np.array([a[1] in ("E", "EB") for a in program])
    return stage, micro_batch, share, is_encoder


def _replay(program: tuple[tuple[int, str, int, int, tuple[int, ...]], ...], durations: np.ndarray,
            end: np.ndarray | None = None, first: int = 0) -> np.ndarray:
    """End times ``[action + 1, k]`` of ``program``'s actions with ``durations[action, k]``: each starts when its
    rank is free and what it waits for has ended. With ``end`` (whose rows before ``first`` hold the end times of
    actions no duration of which changed) only the actions from ``first`` on are replayed, in place. The last row
    stays 0: it stands for "no action". Actions go a wave at a time (:func:`_waves`), the same arithmetic as one
    at a time in program order, with a handful of array operations per wave: replanning calls this thousands of
    times a step, so the per-operation overhead, not the arithmetic, is its cost."""
    if end is None:
        end = np.zeros((len(program) + 1, durations.shape[1]))
    for actions, inputs in _waves(program):
        if first:
            if actions[-1] < first:
                continue
            if actions[0] < first:
                keep = int(np.searchsorted(actions, first))
                actions, inputs = actions[keep:], inputs[keep:]
        end[actions] = end[inputs].max(axis=1) + durations[actions]
    return end


@lru_cache(maxsize=64)
def _waves(program: tuple[tuple[int, str, int, int, tuple[int, ...]], ...]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The actions in waves that depend only on earlier waves, each wave's actions ascending with their inputs
    ``[action, width]`` (the action before it on its rank, then those it waits for; -1, the zero row of the end
    times, pads to the wave's widest)."""
    inputs = [(before, *needs) for _, _, _, before, needs in program]
    level = np.zeros(len(program) + 1, dtype=np.int64)
    for i, needs in enumerate(inputs):
        level[i] = 1 + level[list(needs)].max()
    waves = []
    for k in range(1, int(level.max(initial=0)) + 1):
        actions = np.flatnonzero(level[:-1] == k)
        width = max(len(inputs[a]) for a in actions)
        padded = np.full((actions.size, width), -1, dtype=np.int64)
        for row, a in enumerate(actions.tolist()):
            padded[row, : len(inputs[a])] = inputs[a]
        actions.flags.writeable = padded.flags.writeable = False  # cached: shared by every caller
        waves.append((actions, padded))
    return waves


@lru_cache(maxsize=64)
def _one_f_one_b_orders(pp: int, m: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Each stage's ``("F" | "B", micro-batch)`` under 1F1B, as torch's Schedule1F1B runs them: ``pp - 1 - stage``
    warm-up forwards, then alternating, then the drain."""
    orders = []
    for stage in range(pp):
        warmup = min(pp - 1 - stage, m)
        order = [("F", j) for j in range(warmup)]
        for j in range(m - warmup):
            order += [("F", warmup + j), ("B", j)]
        orders.append(tuple(order + [("B", j) for j in range(m - warmup, m)]))
    return tuple(orders)


@lru_cache(maxsize=64)
def _program(orders: tuple[tuple[tuple[str, int], ...], ...]) -> tuple[tuple[int, str, int, int, tuple[int, ...]], ...]:
    """Every rank's actions merged into one order that respects their dependencies
    (:func:`omni_lightning.balance.pipeline_replay.waits_for`): ``(stage, kind, micro-batch, index of the action
    before it on its rank, indices of the actions it waits for)``, -1 for none."""
    pp = len(orders)
    encoded = {(stage, j) for stage, order in enumerate(orders) for kind, j in order if kind == "E"}
    index: dict[tuple[int, str, int], int] = {}
    program: list[tuple[int, str, int, int, tuple[int, ...]]] = []
    position = [0] * pp
    while len(program) < sum(map(len, orders)):
        progressed = False
        for stage in range(pp):
            while position[stage] < len(orders[stage]):
                kind, j = orders[stage][position[stage]]
                needs = waits_for(stage, kind, j, pp, encoded)
                if any(need not in index for need in needs):
                    break
                before = index[(stage, *orders[stage][position[stage] - 1])] if position[stage] else -1
                index[(stage, kind, j)] = len(program)
                program.append((stage, kind, j, before, tuple(index[need] for need in needs)))
                position[stage] += 1
                progressed = True
        if not progressed:
            raise ValueError("the action orders deadlock: some action waits on one that never runs")
    return tuple(program)


def search_1f1b_order(micro_batch_costs: list[float], pp: int, *, forward_share: float = 1 / 3,
                      max_rounds: int = 64, budget: WorkBudget | None = None) -> list[int]:
    """The order of a step's micro-batches whose 1F1B step (:func:`one_f_one_b_makespans`) is the shortest found.

    Indivisible samples leave micro-batches of unequal cost however they are grouped, and 1F1B then stalls in its
    steady state wherever a heavy micro-batch follows light ones (a stage waits for the heavy forward or backward
    further down the pipeline). Which order hides that best depends on the costs, so the order is searched:
    steepest descent over all swaps and moves of one micro-batch, from DistTrain's order, ascending and
    descending order, keeping the best. Each candidate order replayed spends one evaluation of ``budget``
    (``None``: unbounded but for ``max_rounds``); a round it cannot pay for is not run. Deterministic; returns
    indices into ``micro_batch_costs``.
    """
    costs = np.asarray(micro_batch_costs, dtype=np.float64)
    m = costs.size
    if pp <= 1 or m <= 2:
        return order_for_1f1b(list(costs), pp)
    ascending = sorted(range(m), key=lambda i: (costs[i], i))
    moves = _order_moves(m)
    found = []
    for start in (order_for_1f1b(list(costs), pp), ascending, ascending[::-1]):
        order = np.array(start)
        now = float(one_f_one_b_makespans(costs[order], pp, forward_share=forward_share)[0])
        for _ in range(max_rounds):
            if budget is not None and not budget.take(len(moves)):
                break
            candidates = order[moves]
            spans = one_f_one_b_makespans(costs[candidates], pp, forward_share=forward_share)
            k = int(np.argmin(spans))
            if not spans[k] < now * (1 - 1e-9):  # no move shortens the step: a local optimum
                break
            now, order = float(spans[k]), candidates[k]
        found.append((now, order.tolist()))
    return min(found, key=lambda f: f[0])[1]  # the first start wins ties


@lru_cache(maxsize=64)
def _order_moves(m: int) -> np.ndarray:
    """Every swap of two positions of an order of ``m``, then every move of one entry two or more places, as
    rows of positions (``order[rows]`` are the candidate orders)."""
    moves = [(i, j, True) for i in range(m) for j in range(i + 1, m)]
    moves += [(i, j, False) for i in range(m) for j in range(m) if abs(i - j) > 1]
    rows = np.array([_moved(list(range(m)), i, j, swap) for i, j, swap in moves], dtype=np.int64)
    rows.flags.writeable = False  # cached: shared by every caller
    return rows


def refine_for_1f1b(batches: list[list[int]], costs: np.ndarray, tokens: np.ndarray, *, pp: int,
                    forward_share: float = 1 / 3, token_budget: int | None = None,
                    max_rounds: int = 256, budget: WorkBudget | None = None,
                    swap_pool: int = 512) -> list[list[int]]:
    """Micro-batches (lists of sample ids, in run order) reshaped for a shorter 1F1B step (pure, deterministic).

    Even micro-batches leave the bubble of the pipeline's fill and drain, and a sample larger than their fair share
    stays a heavy micro-batch of its own, where 1F1B stalls as the light ones meet it; a split towards the 1F1B cost
    profile cannot follow it with few samples a micro-batch. A ramp hides it better: micro-batches
    growing towards the heavy ones and shrinking after them, the lightest at the ends where the pipeline fills and
    drains. This finds one by steepest descent on :func:`one_f_one_b_makespans` over moving one sample to another
    micro-batch and swapping two, re-searching the order (:func:`search_1f1b_order`) whenever no such move helps.
    Micro-batches never exceed ``token_budget`` and no move empties one. A move that a critical path of a step already
    replayed shows cannot win is not replayed (:func:`_best_candidate`): the choices stay the same, and a round
    gets cheap as the descent nears a local optimum.

    Bounded: swaps pair only the ``swap_pool`` costliest samples (a swap of two tiny samples barely moves a step;
    all pairs of thousands of them would not fit in memory), and every candidate of a round, moves and swaps, spends
    one evaluation of ``budget`` (default: 2,000,000), as does every order :func:`search_1f1b_order` replays; a round
    that the budget cannot pay for is not run, and the best plan so far is kept. The count depends on the inputs
    alone, so every rank that runs the search stops at the same plan.
    """
    m = len(batches)
    assign = np.full(costs.size, -1, dtype=np.int64)
    for j, batch in enumerate(batches):
        assign[batch] = j
    ids = np.flatnonzero(assign >= 0)
    if pp <= 1 or m <= 1 or ids.size <= 1:
        return batches
    budget = WorkBudget(2_000_000) if budget is None else budget
    c, t = costs[ids].astype(np.float64), tokens[ids].astype(np.int64)
    where = assign[ids]
    pool = np.sort(np.lexsort((np.arange(ids.size), -c))[:swap_pool])  # the costliest, in id order
    first, second = (pool[k] for k in np.triu_indices(pool.size, k=1))
    steps = _OneFOneB.of(pp, m, forward_share)
    now = float(one_f_one_b_makespans(np.bincount(where, weights=c, minlength=m), pp, forward_share=forward_share)[0])
    paths = np.zeros((0, m))  # critical paths of the steps replayed so far (see below)
    for _ in range(max_rounds):
        load = np.bincount(where, weights=c, minlength=m)
        count = np.bincount(where, minlength=m)
        used = np.bincount(where, weights=t, minlength=m)
        # The candidates: a move of sample i to micro-batch j (none empties its own), or a swap of samples i
        # and k in different micro-batches (i leaves, k comes back); each moves cost `delta` from micro-batch
        # `src` to `dst`.
        allowed = (count[where] > 1)[:, None] & (np.arange(m)[None] != where[:, None])
        mover, target = np.nonzero(allowed)
        swap = np.flatnonzero(where[first] != where[second])
        leaving = np.concatenate([mover, first[swap]])
        returning = np.concatenate([np.full(mover.size, -1), second[swap]])  # -1: a move, nothing comes back
        src, dst = where[leaving], np.concatenate([target, where[second[swap]]])
        delta = c[leaving] - np.where(returning >= 0, c[returning], 0.0)
        token_delta = t[leaving] - np.where(returning >= 0, t[returning], 0)
        if not budget.take(leaving.size):
            break
        if token_budget is not None:
            fits = (used[dst] + token_delta <= token_budget) & (used[src] - token_delta <= token_budget)
            leaving, returning, src, dst, delta = leaving[fits], returning[fits], src[fits], dst[fits], delta[fits]
        best, span, paths = _best_candidate(steps, load, src, dst, delta, now * (1 - 1e-9), paths)
        if best >= 0:
            now = span
            if returning[best] >= 0:
                where[returning[best]] = src[best]
            where[leaving[best]] = dst[best]
            continue
        order = search_1f1b_order(list(load), pp, forward_share=forward_share, budget=budget)
        span = float(one_f_one_b_makespans(load[order], pp, forward_share=forward_share)[0])
        if not span < now * (1 - 1e-9):  # neither a sample nor the order can move for the better
            break
        now = span
        where = np.argsort(order)[where]  # micro-batch order[p] runs p-th
    out: list[list[int]] = [[] for _ in range(m)]
    for sample, j in zip(ids.tolist(), where.tolist(), strict=True):
        out[j].append(sample)
    return [sorted(batch, key=lambda s: -costs[s]) for batch in out]


def _best_candidate(steps: _OneFOneB, load: np.ndarray, src: np.ndarray, dst: np.ndarray, delta: np.ndarray,
                    below: float, paths: np.ndarray, chunk: int = 256) -> tuple[int, float, np.ndarray]:
    """The first of the candidates (each moving cost ``delta`` from micro-batch ``src`` to ``dst`` of ``load``)
    whose 1F1B step is the shortest, if shorter than ``below`` (-1 if none), and that step, replaying as few
    candidates as it can; and the pool of critical paths (weights ``[path, micro-batch]``) for the next call.

    Under a candidate's costs every path through the step is as long as its weights say, and the step at least as
    long: a candidate for which some path already found is not shorter than ``below``, nor than the best replayed
    so far, cannot be chosen, and is not replayed. Path ``P`` allows a candidate only while
    ``length_P + delta * (w_P[dst] - w_P[src])`` is shorter: an interval of ``delta`` for each (src, dst),
    whichever the path. The candidates are replayed a chunk at a time, in order, each chunk's critical paths joining
    the pool before the rest are checked again, so that most are ruled out without a replay: the choice is the
    one replaying every candidate would make.
    """
    best, best_span = -1, below
    pending = np.arange(src.size)
    while True:
        # The tiny slack keeps rounding in the path lengths from ruling out a candidate that would be chosen.
        low, high, setting = _allowed_moves(paths, load, best_span + 1e-12 * abs(best_span))
        paths = paths[setting]
        pending = pending[(low[src[pending], dst[pending]] < delta[pending])
                          & (delta[pending] < high[src[pending], dst[pending]])]
        if not pending.size:
            return best, best_span, paths
        replayed, pending = pending[:chunk], pending[chunk:]
        candidates = np.tile(load, (replayed.size, 1))
        rows = np.arange(replayed.size)
        candidates[rows, src[replayed]] -= delta[replayed]
        candidates[rows, dst[replayed]] += delta[replayed]
        end = steps.ends(candidates)
        spans = steps.makespans(end)
        k = int(np.argmin(spans))
        if spans[k] < best_span:  # later candidates only win by being strictly shorter: the first of equals stays
            best, best_span = int(replayed[k]), float(spans[k])
        found = steps.critical_paths(end)
        # Many candidates share a critical path: keep one of each (told apart by a fixed projection; a rare
        # collision only drops a path, which rules out less, never wrongly).
        _, first_of_each = np.unique(found @ _path_key(load.size), return_index=True)
        paths = np.concatenate([paths, found[np.sort(first_of_each)]])


@lru_cache(maxsize=64)
def _path_key(m: int) -> np.ndarray:
    """A fixed projection that tells critical paths over ``m`` micro-batches apart (see :func:`_best_candidate`)."""
    return np.random.default_rng(m).random(m)


def _allowed_moves(paths: np.ndarray, load: np.ndarray, below: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each (src, dst) micro-batch pair, the open interval of ``delta`` for which moving ``delta`` of cost
    from ``src`` to ``dst`` leaves every path of ``paths`` (weights ``[path, micro-batch]``) shorter than
    ``below`` under ``load``: ``[src, dst]`` arrays of its ends (empty where ``low >= high``), and the paths
    that set an end somewhere (the others rule out nothing these do not)."""
    m = load.size
    if not paths.size:
        return np.full((m, m), -np.inf), np.full((m, m), np.inf), np.zeros(0, dtype=np.int64)
    room = below - paths @ load  # [path]: how much each path may still grow
    slope = paths[:, None, :] - paths[:, :, None]  # [path, src, dst]: growth per unit of delta
    with np.errstate(divide="ignore", invalid="ignore"):
        limit = room[:, None, None] / slope
    # A path that grows with delta caps it, one that shrinks floors it, and one that stays as long as the step
    # whatever the move (zero slope, no room) rules the pair out: an infinite floor.
    highs = np.where(slope > 0, limit, np.inf)
    lows = np.where(slope < 0, limit, np.where((slope == 0) & (room[:, None, None] <= 0), np.inf, -np.inf))
    capping, flooring = highs.argmin(axis=0), lows.argmax(axis=0)
    high = np.take_along_axis(highs, capping[None], axis=0)[0]
    low = np.take_along_axis(lows, flooring[None], axis=0)[0]
    setting = np.union1d(capping[high < np.inf], flooring[low > -np.inf])
    return low, high, setting


def _moved(order: list[int], i: int, j: int, swap: bool) -> list[int]:
    """``order`` with positions ``i`` and ``j`` swapped, or with the entry at ``i`` moved to ``j``."""
    out = list(order)
    if swap:
        out[i], out[j] = out[j], out[i]
    else:
        out.insert(j, out.pop(i))
    return out
