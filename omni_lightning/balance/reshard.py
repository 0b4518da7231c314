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

Where the encoders and the LLM run one after the other on every rank, the plan balances what each rank runs, its
encoder work on top of a *base* (its share of the LLM's work on the micro-batch): the loader has already balanced
the ranks' whole steps, and evening out the encoder work alone would push it onto the ranks whose samples carry
more LLM work.

Moving and splitting are not free: an item that travels sends its stem tokens out and its outputs back (and their
gradients the other way), a split item's block runs four Ulysses all-to-alls per attention layer each way, and any
exchange at all costs every rank the resharder's all-to-alls. :func:`item_prices` turns those bytes and messages
into the planner's cost units over a :class:`LinkCost`; with them the plan charges a moved item to its sender and
its receiver, splits an item only over a degree whose per-member share plus its traffic is cheaper, and keeps every
item where it was loaded when no priced plan beats that, on each rank's whole step and on the encoder stage alone
(the exchange that returns the encoded items waits for the stage's busiest rank).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CPU_GLOO", "GPU_NETWORK", "GPU_NVLINK", "EncoderPlan", "EncoderTraffic", "ItemExchange", "ItemPrices", "LinkCost",
    "SplitChunk",
    "encoder_lower_bound", "exchange_price", "gain_beyond_price_error", "item_prices", "plan_encoder_work",
    "plan_item_exchange", "plan_resharding", "resolve_link", "resharding_may_pay", "split_lengths",
]

# The resharder's all-to-alls that any exchange runs: the stem tokens out and the outputs back, forward and backward.
_EXCHANGE_MESSAGES = 4
# A resharded plan must beat keeping every item home by more than this factor; among those that do, one within it
# of the best is enough (fewer moves and splits for about the same peak).
_MARGIN = 1.01


@dataclass(frozen=True)
class LinkCost:
    """What the encoder group's links cost, to price data movement against compute.

    Args:
        bandwidth: bytes per second one rank sends (or receives) in a collective.
        latency: seconds one collective costs a rank however little it carries (launch, synchronisation and, on a
            CPU, the framework's per-call work).
        flops_per_s: the compute rate that turns the planner's FLOP costs into seconds, so that seconds of traffic
            and FLOPs of compute compare (a device's achieved, not peak, rate).
    """

    bandwidth: float
    latency: float
    flops_per_s: float

    def __post_init__(self) -> None:
        for name in ("bandwidth", "flops_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LinkCost.{name}={getattr(self, name)} must be positive")
        if not self.latency >= 0:
            raise ValueError(f"LinkCost.latency={self.latency} must be non-negative")

    def cost(self, nbytes: float | np.ndarray, messages: float = 0.0) -> float | np.ndarray:
        """The planner's cost (FLOP-equivalents) of sending ``nbytes`` in ``messages`` collectives."""
        return (nbytes / self.bandwidth + messages * self.latency) * self.flops_per_s


# Gloo between processes of one host, as benchmarks/link_cost.py measures it in whole-process CPU time on the
# 2-core dev machine (4 ranks, two runs in benchmarks/results/link_cost.txt; it depends on what else runs): 0.7-0.8
# ms a small collective when the ranks arrive together and 1.6-2.0 ms when they arrive up to 20 ms apart, as ranks
# of a training step do (a rank waiting in Gloo is not idle); 1.5-2.4 GB/s a rank. The rate is the
# marginal one the reference model trains at there (benchmarks/e2e.py's (a) on vlm_dynres: 2.8e-11 s of
# training-thread CPU per FLOP over its rank-steps), not the 50-75 GFLOP/s of one large matmul.
CPU_GLOO = LinkCost(bandwidth=2.2e9, latency=2e-3, flops_per_s=3.5e10)
# NCCL inside an NVLink node: ~100 GB/s achieved per rank in all-to-all, ~20 us a call, ~300 TFLOP/s in bf16.
GPU_NVLINK = LinkCost(bandwidth=1e11, latency=2e-5, flops_per_s=3e14)
# NCCL between nodes (InfiniBand or RoCE, one 200-400 Gb/s NIC per GPU): ~25 GB/s achieved per rank in all-to-all,
# ~50 us a call; the same compute rate.
GPU_NETWORK = LinkCost(bandwidth=2.5e10, latency=5e-5, flops_per_s=3e14)


def resolve_link(link: LinkCost | str, device_type: str, *, spans_nodes: bool = False) -> LinkCost | None:
    """The link a plan prices: ``link`` itself, the device's default for ``"auto"``, or ``None`` for
    ``"compute_only"`` (traffic is free). On CUDA the default is the group's slowest link: :data:`GPU_NVLINK` for a
    group inside one node, :data:`GPU_NETWORK` for one whose ranks ``spans_nodes``; elsewhere :data:`CPU_GLOO`."""
    if isinstance(link, LinkCost):
        return link
    if link == "auto":
        if device_type == "cuda":
            return GPU_NETWORK if spans_nodes else GPU_NVLINK
        return CPU_GLOO
    if link == "compute_only":
        return None
    raise ValueError(f"link_cost={link!r} must be a LinkCost, 'auto' or 'compute_only'")


@dataclass(frozen=True)
class EncoderTraffic:
    """The bytes one encoder's items put on the links, per stem token, and its Ulysses collectives.

    Args:
        stem_bytes: one stem token's row (it travels out forward, its gradient back in backward).
        output_bytes: encoder output per stem token (back forward, its gradient out in backward).
        ulysses_bytes: what a split item's Ulysses all-to-alls carry per token over the whole encoder, forward and
            backward (q, k, v and the output each layer: ``8 * layers * dim * element size``) before the
            ``(degree - 1) / degree`` that leaves a member.
        ulysses_messages: those all-to-alls (``8 * layers``).
    """

    stem_bytes: float
    output_bytes: float
    ulysses_bytes: float
    ulysses_messages: int

    @classmethod
    def of_encoder(cls, *, width: int, layers: int, output_width: int, tokens_per_output: int,
                   element_bytes: int) -> EncoderTraffic:
        """The traffic of an encoder of ``layers`` attention blocks ``width`` wide whose output rows are
        ``output_width`` wide, each shared by ``tokens_per_output`` stem tokens, in elements of ``element_bytes``."""
        return cls(stem_bytes=width * element_bytes, output_bytes=output_width * element_bytes / tokens_per_output,
                   ulysses_bytes=8 * layers * width * element_bytes, ulysses_messages=8 * layers)


@dataclass(frozen=True)
class ItemPrices:
    """What moving and splitting each item costs, in the planner's cost units.

    ``move[i]``: what sending item ``i`` whole to another rank costs its sender and, again, its receiver.
    ``split[i, k]``: what item ``i`` split over ``2 ** (k + 1)`` ranks costs each member on top of its share of the
    compute (its chunk's travel and the Ulysses all-to-alls). ``exchange``: what any resharding costs every rank
    (the resharder's all-to-alls out and back, forward and backward), paid once a step whatever moves.
    """

    move: np.ndarray
    split: np.ndarray
    exchange: float

    @classmethod
    def free(cls, n_items: int, enc_sp: int) -> ItemPrices:
        """No price on anything: the compute-only plan."""
        return cls(np.zeros(n_items), np.zeros((n_items, _degrees(enc_sp))), 0.0)


def _degrees(enc_sp: int) -> int:
    """How many split degrees (2, 4, ..., enc_sp) an SP limit allows."""
    return max(int(enc_sp).bit_length() - 1, 0)


def item_prices(lengths: np.ndarray, traffic: EncoderTraffic, link: LinkCost, *, enc_sp: int) -> ItemPrices:
    """Price moving and splitting items of ``lengths`` stem tokens over ``link`` (pure; same on every rank).

    A moved item's bytes cross its sender's and its receiver's links: its stem rows and output rows, each once
    forward and once (as gradients) backward. A member of a split item's block receives its chunk (the owner's own
    chunk stays, which this does not credit: a safe over-estimate) and, per Ulysses all-to-all, sends and
    receives ``(degree - 1) / degree`` of its chunk's activations.
    """
    lengths = np.asarray(lengths, dtype=np.float64)
    per_token = 2.0 * (traffic.stem_bytes + traffic.output_bytes)
    move = np.asarray(link.cost(lengths * per_token), dtype=np.float64)
    split = np.zeros((lengths.size, _degrees(enc_sp)))
    for k in range(split.shape[1]):
        degree = 2 ** (k + 1)
        chunk = lengths / degree
        ulysses = chunk * traffic.ulysses_bytes * (degree - 1) / degree
        split[:, k] = link.cost(chunk * per_token + ulysses, traffic.ulysses_messages)
    return ItemPrices(move, split, exchange_price(link))


def exchange_price(link: LinkCost) -> float:
    """What any resharding of a micro-batch costs every rank of the group over ``link``, whatever moves: the
    resharder's all-to-alls (:attr:`ItemPrices.exchange`)."""
    return float(link.cost(0.0, _EXCHANGE_MESSAGES))


def gain_beyond_price_error(price_error: float) -> float:
    """The least relative gain a plan must predict to be a gain at all, where each rank's predicted cost may be off
    by ``price_error`` (a fraction) either way: the peak kept in place may be overstated by it and the planned peak
    understated by it, so only ``in_place * (1 - e) > planned * (1 + e)`` is sure to pay, a gain of
    ``(1 + e) / (1 - e) - 1``. Infinite (never reshard) where the prices miss by 100% or more."""
    if not price_error >= 0:
        raise ValueError(f"price_error={price_error} must be non-negative")
    return 2.0 * price_error / (1.0 - price_error) if price_error < 1.0 else math.inf


def resharding_may_pay(base: np.ndarray, in_place: np.ndarray, *, exchange: float, min_gain: float) -> bool:
    """Whether any plan could lower the busiest rank's work by more than ``min_gain`` (pure; same on every rank).

    ``base``: each rank's work planned before this encoder's; ``in_place``: the cost of the items it loaded, were
    each encoded where it was loaded; ``exchange``: what any resharding costs every rank. No plan that moves
    anything beats the mean rank's work, or the busiest rank's base, plus the exchange, so where keeping every item
    home is within ``min_gain`` of that, there is nothing to plan. Needs only each rank's totals: a loader that
    knows them can tell without the item sizes.
    """
    peak_in_place = float((base + in_place).max())
    floor = max(float(base.sum() + in_place.sum()) / base.size, float(base.max())) + exchange
    # plan_encoder_work also wants the encoder stage's own peak lower by its margin, and no plan takes that below
    # the mean encoder work plus the exchange.
    stage_floor = float(in_place.sum()) / base.size + exchange
    return peak_in_place > floor * (1.0 + min_gain) and float(in_place.max()) > stage_floor * _MARGIN


def plan_resharding(
    costs: np.ndarray, owners: np.ndarray, *, n_ranks: int, enc_sp: int = 1, prices: ItemPrices | None = None,
    base: np.ndarray | None = None, min_gain: float = 0.05,
) -> EncoderPlan:
    """The resharder's plan of one encoder's items on a micro-batch (pure; same on every rank): every item where it
    was loaded unless some plan could gain more than ``min_gain`` (:func:`resharding_may_pay`) and the priced plan
    (:func:`plan_encoder_work`) does lower the busiest rank's ``base`` plus encoder work by more than that. The
    arguments are :func:`plan_encoder_work`'s; ``prices`` also gives the exchange the gate counts."""
    home = plan_encoder_work(costs, owners, n_ranks=n_ranks, reshard=False)
    base = np.zeros(n_ranks) if base is None else np.asarray(base, dtype=np.float64)
    exchange = prices.exchange if prices is not None else 0.0
    if not resharding_may_pay(base, home.rank_cost, exchange=exchange, min_gain=min_gain):
        return home
    plan = plan_encoder_work(costs, owners, n_ranks=n_ranks, enc_sp=enc_sp, prices=prices, base=base)
    if plan.moved == 0 or (base + home.rank_cost).max() <= (base + plan.rank_cost).max() * (1.0 + min_gain):
        return home
    return plan


@dataclass
class EncoderPlan:
    """Where each item is encoded.

    ``rank_of[i]`` is the rank that encodes item ``i`` whole, or ``-1`` if it is split; a split item runs on ranks
    ``sp_start[i] .. sp_start[i] + sp_degree[i] - 1`` (``sp_degree`` is 1 for a whole item). ``rank_cost`` is each
    rank's predicted encoder cost, with its priced traffic where the plan was priced; ``moved`` counts items that
    leave the rank that loaded them (a split item counts once).
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
    costs: np.ndarray, owners: np.ndarray, *, n_ranks: int, enc_sp: int = 1, reshard: bool = True,
    prices: ItemPrices | None = None, base: np.ndarray | None = None,
) -> EncoderPlan:
    """Plan one step of encoder work for an encoder group of ``n_ranks`` ranks.

    Args:
        costs: predicted encoder cost of each item (``CostModel`` vision or audio module cost of its length).
        owners: the rank that loaded each item (where its LLM tokens live).
        n_ranks: ranks in the encoder group.
        enc_sp: sequence-parallel degree; SP groups are ``enc_sp`` consecutive ranks (``n_ranks`` must be a multiple).
        reshard: ``False`` is the baseline without resharding: every rank encodes what it loaded.
        prices: what moving and splitting each item costs (:func:`item_prices`); ``None`` prices compute only.
            The plan's ``rank_cost`` then includes each rank's traffic, and the plan keeps every item in place
            unless a resharded plan has a lower priced peak.
        A resharded plan must lower the busiest rank's encoder work alone as well (``rank_cost``, without
        ``base``): the exchange that returns the encoded items waits for the busiest encoder rank, so a plan that
        only carries the encoder stage's peak from a rank with much LLM work to one with little would add the
        exchange and that wait to every rank.
        base: each rank's other work in the same step (``[n_ranks]``, e.g. its share of the LLM's work on the
            micro-batch, when the encoders and the LLM run one after the other on every rank): the plan evens out
            ``base + rank_cost``, what each rank runs, rather than the encoder work alone, so it does not move
            encoder work onto a rank whose samples already carry more LLM work. ``rank_cost`` leaves it out.
    """
    costs = np.asarray(costs, dtype=np.float64)
    owners = np.asarray(owners, dtype=np.int64)
    if enc_sp < 1 or n_ranks % enc_sp:
        raise ValueError(f"enc_sp={enc_sp} must be positive and divide the encoder group size {n_ranks}")
    prices = ItemPrices.free(costs.size, enc_sp) if prices is None else prices
    if prices.move.shape != costs.shape or prices.split.shape != (costs.size, _degrees(enc_sp)):
        raise ValueError(f"prices for {prices.move.shape} items and {prices.split.shape} splits do not fit "
                         f"{costs.size} items with enc_sp={enc_sp}")
    base = np.zeros(n_ranks) if base is None else np.asarray(base, dtype=np.float64)
    if base.shape != (n_ranks,) or not np.all(np.isfinite(base)) or np.any(base < 0):
        raise ValueError(f"base must hold a finite, non-negative load for each of the {n_ranks} ranks, got {base}")
    load = np.zeros(n_ranks)
    np.add.at(load, owners, costs)
    in_place = EncoderPlan(owners.copy(), np.full(costs.size, -1, dtype=np.int64), np.ones(costs.size, dtype=np.int64),
                           load, 0)
    if not reshard:
        return in_place

    # The most encoder work a rank can take before it passes the level every rank would reach if work split evenly
    # (without a base: the mean encoder work); an item costlier than that is a long one.
    fair_share = float(costs.sum() + base.sum()) / n_ranks - float(base.min())
    # Descending cost; ties by item index, so every rank orders identically.
    order = np.lexsort((np.arange(costs.size), -costs)).tolist()
    # Splitting costs communication, so split as little as balance allows: try split thresholds from the fair
    # share down, and keep the first plan whose peak is within 1% of the lowest. Keeping every item home comes
    # first: a resharded plan must beat it by more than that, its traffic and exchange included. At each threshold
    # the placement that moves only the surplus over LPT's peak comes before LPT's own.
    placed: dict[bytes, tuple[EncoderPlan, EncoderPlan]] = {}  # thresholds that split the same items share these
    candidates = [in_place] + [plan for k in range(0, 4 if enc_sp > 1 else 1)
                               for plan in _plan_with_threshold(costs, owners, order, n_ranks, enc_sp,
                                                                fair_share / 2**k, prices, placed, base)]
    peaks = [float((base + plan.rank_cost).max()) for plan in candidates]
    # A resharded plan must beat keeping every item home by more than 1%, on what each rank runs and on the encoder
    # stage alone; of the plans that do (home always does), the first within 1% of the lowest peak is enough.
    stage_peak_home = float(in_place.rank_cost.max())
    qualified = [(plan, peak) for plan, peak in zip(candidates, peaks, strict=True) if plan is in_place
                 or (peak * _MARGIN < peaks[0] and float(plan.rank_cost.max()) * _MARGIN < stage_peak_home)]
    best = min(peak for _, peak in qualified)
    return next(plan for plan, peak in qualified if peak <= best * _MARGIN)


def _plan_with_threshold(
    costs: np.ndarray, owners: np.ndarray, order: list[int], n_ranks: int, enc_sp: int, threshold: float,
    prices: ItemPrices, placed: dict[bytes, tuple[EncoderPlan, EncoderPlan]], base: np.ndarray,
) -> tuple[EncoderPlan, EncoderPlan]:
    """Split every item costlier than ``threshold`` over the fewest aligned ranks that bring its shares under it
    (at most ``enc_sp``) where the split pays, then place the whole items two ways: by LPT, each staying home unless
    moving it, priced, lowers the peak; and every item home, then only what the ranks above LPT's peak hold over
    it moved (far fewer items for about the same peak). Returns ``(surplus moved, LPT)``.
    ``placed`` holds the plans of other thresholds by their splits: the same splits (made in the same order, so
    with the same loads) give the same placements. Loads start at ``base``."""
    rank_of = owners.copy()
    sp_start = np.full(costs.size, -1, dtype=np.int64)
    sp_degree = np.ones(costs.size, dtype=np.int64)
    blocks = _BlockPeaks(base.tolist(), enc_sp)
    split: dict[int, tuple[int, int]] = {}  # item: (first rank of its block, degree)
    owner_of, move_of = owners.tolist(), prices.move.tolist()
    for item, degree, share in _paying_splits(costs, order, enc_sp, threshold, prices):
        # Aligned blocks of ``degree`` consecutive ranks lie inside one SP group (degree divides enc_sp).
        block = blocks.least_loaded(degree)
        split[item] = (block * degree, degree)
        blocks.add_to_block(block, degree, share)
        owner = owner_of[item]
        # The owner sends the chunks of other members (all of them when it is outside the block).
        if sent := move_of[item] * (1 - 1 / degree if owner // degree == block else 1):
            blocks.add_to_rank(owner, sent)
    if split:
        items = list(split)
        sp_start[items], sp_degree[items] = zip(*split.values(), strict=True)
        rank_of[items] = -1
    load = np.asarray(blocks.load, dtype=np.float64)

    splits = sp_start.tobytes() + sp_degree.tobytes()
    if splits not in placed:
        lpt, peak = _place_whole_items(costs, owners, order, rank_of, sp_start, sp_degree, load, prices, base)
        surplus = lpt if lpt.moved == 0 else _move_surplus(costs, owners, order, rank_of, sp_start, sp_degree, load,
                                                           prices, base, target=peak)
        placed[splits] = (surplus, lpt)
    return placed[splits]


class _BlockPeaks:
    """Each rank's load and, per SP degree ``2, 4, ..., enc_sp``, each aligned block's most loaded rank, kept up to
    date as loads grow, so that the split loop picks the least-loaded block without reducing every rank per item.
    Python floats: the same IEEE additions as an array's, and a block's peak grows by exactly what its ranks grow
    by (rounding is monotonic, so the largest stays the largest)."""

    def __init__(self, load: list[float], enc_sp: int) -> None:
        self.load = load
        self.peaks = {degree: [max(load[b : b + degree]) for b in range(0, len(load), degree)]
                      for degree in (2**k for k in range(1, enc_sp.bit_length())) if degree <= enc_sp}

    def least_loaded(self, degree: int) -> int:
        """The aligned block of ``degree`` ranks whose most loaded rank has the least (ties: the lowest block)."""
        peaks = self.peaks[degree]
        return peaks.index(min(peaks))

    def add_to_block(self, block: int, degree: int, amount: float) -> None:
        """Every rank of aligned block ``block`` of ``degree`` ranks takes ``amount`` more."""
        start = block * degree
        for rank in range(start, start + degree):
            self.load[rank] += amount
        for size, peaks in self.peaks.items():
            if size <= degree:  # blocks inside it: every rank of each grew alike
                for inner in range(start // size, (start + degree) // size):
                    peaks[inner] += amount
            else:  # the block that holds it
                outer = start // size
                peaks[outer] = max(peaks[outer], self.peaks[degree][block])

    def add_to_rank(self, rank: int, amount: float) -> None:
        """``rank`` takes ``amount`` more (``amount`` > 0)."""
        self.load[rank] += amount
        for size, peaks in self.peaks.items():
            peaks[rank // size] = max(peaks[rank // size], self.load[rank])


def _paying_splits(costs: np.ndarray, order: list[int], enc_sp: int, threshold: float, prices: ItemPrices
                   ) -> list[tuple[int, int, float]]:
    """``(item, degree, share)`` of every item costlier than ``threshold`` whose split pays, in ``order``: split over
    the fewest aligned ranks (a power of two up to ``enc_sp``) that bring its shares under the threshold, each share
    its compute and its split's traffic; an item whose traffic eats what the split saves stays whole. Computed for
    all such items at once: they are a prefix of ``order`` (descending cost), which can hold most of a step's
    items where the threshold is low."""
    if enc_sp == 1:
        return []
    long = np.asarray(order[: int(np.count_nonzero(costs > threshold))], dtype=np.int64)
    cost = costs[long]
    degree = np.full(long.size, 2, dtype=np.int64)
    for _ in range(enc_sp.bit_length()):
        grow = (degree < enc_sp) & (cost / degree > threshold)
        if not grow.any():
            break
        degree[grow] *= 2
    share = cost / degree + prices.split[long, np.log2(degree).astype(np.int64) - 1]
    pays = share < cost
    return list(zip(long[pays].tolist(), degree[pays].tolist(), share[pays].tolist(), strict=True))


def _move_surplus(
    costs: np.ndarray, owners: np.ndarray, order: list[int], rank_of: np.ndarray, sp_start: np.ndarray,
    sp_degree: np.ndarray, load: np.ndarray, prices: ItemPrices, base: np.ndarray, *, target: float,
) -> EncoderPlan:
    """Every item that is not split at home, on top of ``load`` (copied); then, heaviest first, an item of a rank
    above ``target`` moves to the least-loaded rank (ties: the lowest) where it fits under ``target``, its move
    priced on both ends, until its rank is no longer above it."""
    rank_of, load = rank_of.copy(), load.copy()
    whole = sp_degree == 1
    load += np.bincount(owners[whole], weights=costs[whole], minlength=load.size)
    # Only a rank above the target sends, and a receiver stays under it: no other rank's items ever move.
    heaviest_first = np.asarray(order, dtype=np.int64)
    senders = heaviest_first[(whole & (load[owners] > target))[heaviest_first]].tolist()
    # Python floats in the per-item loop, the same IEEE additions as the array's; a heap of (load, rank) whose
    # entries go stale when a rank's load changes (each change pushes the new one), so its top is the least-loaded
    # rank, on ties the lowest, as an argmin of the loads.
    loads, placed, cost, owner_of, move_of = (load.tolist(), rank_of.tolist(), costs.tolist(), owners.tolist(),
                                              prices.move.tolist())
    heap = [(value, rank) for rank, value in enumerate(loads)]
    heapq.heapify(heap)
    for item in senders:
        owner = owner_of[item]
        if loads[owner] <= target:
            continue
        while heap[0][0] != loads[heap[0][1]]:
            heapq.heappop(heap)
        rank, move = heap[0][1], move_of[item]
        if rank == owner or cost[item] <= move or loads[rank] + cost[item] + move > target:
            continue
        loads[owner] += move - cost[item]
        loads[rank] += cost[item] + move
        heapq.heapreplace(heap, (loads[rank], rank))
        heapq.heappush(heap, (loads[owner], owner))
        placed[item] = rank
    rank_of[:] = placed
    load = np.asarray(loads, dtype=np.float64)
    return _plan_of(rank_of, sp_start, sp_degree, owners, load, prices, base)


def _plan_of(rank_of: np.ndarray, sp_start: np.ndarray, sp_degree: np.ndarray, owners: np.ndarray,
             load: np.ndarray, prices: ItemPrices, base: np.ndarray) -> EncoderPlan:
    """The plan of a placement whose ranks run ``load`` (``base`` included, the exchange not yet)."""
    split = sp_degree > 1
    moved = int(np.count_nonzero((rank_of != owners) & ~split)) + int(np.count_nonzero(split))
    # Any exchange at all costs every rank the resharder's collectives.
    exchange = prices.exchange if moved else 0.0
    return EncoderPlan(rank_of, sp_start.copy(), sp_degree.copy(), load + exchange - base, moved)


def _place_whole_items(
    costs: np.ndarray, owners: np.ndarray, order: list[int], rank_of: np.ndarray, sp_start: np.ndarray,
    sp_degree: np.ndarray, load: np.ndarray, prices: ItemPrices, base: np.ndarray,
) -> tuple[EncoderPlan, float]:
    """Place the items that are not split by LPT, heaviest first, on top of ``load`` (copied): on the least-loaded
    rank unless home costs no more once the move is priced. Returns the plan and its peak before the exchange."""
    rank_of = rank_of.copy()
    # Python lists and floats, not numpy scalars, in the per-item loop (a simulated step places millions of items):
    # the same IEEE additions, several times faster.
    load, placed, cost, owner_of, move_of = (load.tolist(), rank_of.tolist(), costs.tolist(), owners.tolist(),
                                             prices.move.tolist())
    whole = (sp_degree == 1).tolist()
    # A heap of (load, rank) with lazy deletion: a rank whose load changed is pushed again, and an entry whose load
    # is no longer its rank's is dropped when it surfaces (loads only grow), so the top is the least-loaded rank (on
    # ties the lowest) in O(log ranks) instead of a linear removal per item.
    heap = [(load[r], r) for r in range(len(load))]
    heapq.heapify(heap)
    pop, push, replace_top = heapq.heappop, heapq.heappush, heapq.heapreplace
    for item in [item for item in order if whole[item]]:
        current, rank = heap[0]
        while current != load[rank]:
            pop(heap)
            current, rank = heap[0]
        owner, move, work = owner_of[item], move_of[item], cost[item]
        if rank == owner:
            placed[item] = rank
            load[rank] += work
            replace_top(heap, (load[rank], rank))
        # The least-loaded rank, unless the item costs no more at home than it would there, its move's price
        # included (the receiver pays it; so does the sender, which only staying avoids).
        elif load[owner] <= current + move or work <= move:
            placed[item] = owner
            load[owner] += work
            push(heap, (load[owner], owner))
        else:
            load[owner] += move
            load[rank] += move
            placed[item] = rank
            load[rank] += work
            replace_top(heap, (load[rank], rank))  # the top is this rank's entry: replace it before any push
            push(heap, (load[owner], owner))
    rank_of[:] = placed
    loads = np.asarray(load, dtype=np.float64)
    return _plan_of(rank_of, sp_start, sp_degree, owners, loads, prices, base), float(loads.max())


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
