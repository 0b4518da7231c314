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

__all__ = [
    "EncoderPlan", "ItemExchange", "SplitChunk", "encoder_lower_bound", "plan_encoder_work", "plan_item_exchange",
    "split_lengths",
]


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


def split_lengths(total: int, parts: int, multiple: int = 1) -> list[int]:
    """Contiguous chunk lengths for ``parts`` ranks, each a multiple of ``multiple`` (so that merge windows never
    straddle two ranks), as even as that allows; ``total`` must be a multiple of ``multiple``."""
    if parts < 1 or multiple < 1 or total % multiple:
        raise ValueError(f"cannot split {total} tokens into {parts} chunks of multiples of {multiple}")
    units, extra = divmod(total // multiple, parts)
    return [(units + (rank < extra)) * multiple for rank in range(parts)]


@dataclass(frozen=True)
class SplitChunk:
    """This rank's chunk of an item split over the aligned block ``sp_start .. sp_start + len(lengths) - 1``;
    ``lengths`` are every member's chunk lengths, in block order."""

    sp_start: int
    lengths: tuple[int, ...]


@dataclass
class ItemExchange:
    """How one rank's encoder items travel for one step, as row indices for two ``all_to_all_single`` calls.

    Outbound (token rows of the encoder's stem output): send ``tokens[send_index]`` with ``send_counts`` rows to
    each rank, receive ``recv_counts`` rows from each, then ``received[local_index]`` is the local layout: every
    whole item encoded here (as ``whole_lengths``), then every split-item chunk held here (``chunks``).
    Return (output rows, ``multiple`` tokens each): send ``outputs[back_index]`` with ``recv_counts / multiple``
    rows to each rank, receive ``send_counts / multiple`` rows, and ``returned[assemble_index]`` is the output of
    this rank's own items in their original order.
    """

    send_index: np.ndarray
    send_counts: list[int]
    recv_counts: list[int]
    local_index: np.ndarray
    whole_lengths: list[int]
    chunks: list[SplitChunk]
    back_index: np.ndarray
    assemble_index: np.ndarray

    @property
    def local_tokens(self) -> int:
        return int(self.local_index.size)


def _pieces(lengths: np.ndarray, plan: EncoderPlan, multiple: int) -> list[list[tuple[int, int, int]]]:
    """Every item's pieces as ``(encoding rank, offset, length)``: one for a whole item, one per SP member else."""
    pieces = []
    for item, length in enumerate(lengths.tolist()):
        degree = int(plan.sp_degree[item])
        if degree == 1:
            pieces.append([(int(plan.rank_of[item]), 0, length)])
            continue
        chunk_lengths = split_lengths(length, degree, multiple)
        offsets = np.concatenate([[0], np.cumsum(chunk_lengths)[:-1]]).tolist()
        start = int(plan.sp_start[item])
        pieces.append([(start + j, offsets[j], chunk_lengths[j]) for j in range(degree)])
    return pieces


def _ranges(spans: list[tuple[int, int]]) -> np.ndarray:
    """Concatenated ``arange(start, start + length)`` of every span."""
    if not spans:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(start, start + length, dtype=np.int64) for start, length in spans])


def plan_item_exchange(
    lengths: np.ndarray, owners: np.ndarray, plan: EncoderPlan, *, rank: int, n_ranks: int, multiple: int = 1
) -> ItemExchange:
    """Row bookkeeping of ``plan`` for ``rank``, computed identically everywhere from all-gathered integers.

    Args:
        lengths: token length of every item of the encoder group, ordered by owner then by the owner's item order
            (as an all-gather produces them); each a multiple of ``multiple``.
        owners: the rank that loaded each item.
        plan: :func:`plan_encoder_work` of these items.
        rank, n_ranks: this rank's index in the encoder group and the group's size.
        multiple: tokens per output row (the vision merge window): chunks never cut through one.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    owners = np.asarray(owners, dtype=np.int64)
    if np.any(np.diff(owners) < 0):
        raise ValueError("items must be ordered by owner rank, as an all-gather of per-rank item lists gives them")
    pieces = _pieces(lengths, plan, multiple)
    mine = np.flatnonzero(owners == rank)
    item_start = np.zeros(lengths.size, dtype=np.int64)  # offset of each item inside its owner's stem output
    for owner in range(n_ranks):
        of_owner = np.flatnonzero(owners == owner)
        item_start[of_owner] = np.cumsum(lengths[of_owner]) - lengths[of_owner]

    # Outbound: my items' pieces grouped by destination, in item order within a destination.
    outgoing = sorted(((dest, item, offset, length) for item in mine for dest, offset, length in pieces[item]),
                      key=lambda piece: piece[0])
    send_index = _ranges([(int(item_start[item]) + offset, length) for _, item, offset, length in outgoing])
    send_counts = [sum(p[3] for p in outgoing if p[0] == dest) for dest in range(n_ranks)]

    # Inbound: pieces encoded here arrive by source rank, each source's in its item order (= global item order).
    incoming = [(item, offset, length, len(piece_list)) for item, piece_list in enumerate(pieces)
                for dest, offset, length in piece_list if dest == rank]
    recv_counts = [sum(length for item, _, length, _ in incoming if owners[item] == src) for src in range(n_ranks)]
    arrival = np.concatenate([[0], np.cumsum([p[2] for p in incoming])]).astype(np.int64)
    whole = [i for i, p in enumerate(incoming) if p[3] == 1]
    split = [i for i, p in enumerate(incoming) if p[3] > 1]
    layout = whole + split  # piece order in the local layout
    local_index = _ranges([(int(arrival[i]), incoming[i][2]) for i in layout])
    chunks = [SplitChunk(int(plan.sp_start[incoming[i][0]]),
                         tuple(length for _, _, length in pieces[incoming[i][0]])) for i in split]

    # Return: outputs go back in arrival order, so each owner receives its pieces by encoding rank, item order.
    position = np.concatenate([[0], np.cumsum([incoming[i][2] // multiple for i in layout])]).astype(np.int64)
    local_row = {piece: int(position[k]) for k, piece in enumerate(layout)}
    back_index = _ranges([(local_row[i], incoming[i][2] // multiple) for i in range(len(incoming))])
    returned = sorted(((dest, item, offset, length) for item in mine for dest, offset, length in pieces[item]),
                      key=lambda piece: piece[0])
    returned_row = np.concatenate([[0], np.cumsum([p[3] // multiple for p in returned])]).astype(np.int64)
    where = {(item, offset): int(returned_row[k]) for k, (_, item, offset, _) in enumerate(returned)}
    assemble_index = _ranges([(where[(item, offset)], length // multiple)
                              for item in mine for _, offset, length in pieces[item]])
    return ItemExchange(send_index, send_counts, recv_counts, local_index, [incoming[i][2] for i in whole], chunks,
                        back_index, assemble_index)
