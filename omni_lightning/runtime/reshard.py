"""Adaptive encoder resharding with long-short sequence parallelism, at run time.

Every micro-batch, the ranks of an encoder group (the data-parallel ranks: TP/CP peers hold the same samples and
form parallel groups that compute the same plan) all-gather the token length of each of their encoder items
(integers only), and each computes the same :func:`~omni_lightning.balance.reshard.plan_encoder_work` from them:
short items are encoded whole by the least-loaded rank, long items are split over an aligned SP block and run
with Ulysses attention. The items travel after each encoder's per-token stem (``embed``), which is cheap and
smaller than the raw input (e.g. 32 channels a patch instead of 588 pixels), with one differentiable
``all_to_all_single`` to the encoding ranks and one back to the rank whose LLM tokens consume them; backward sends
gradients the reverse way. The plan is recomputed from each step's items, so a text-only step moves nothing and a
step with one huge image splits it.

Every rank runs every encoder every step (a dummy item where it has nothing to encode or to send), and all of the
step's collectives sit on one chain of data dependencies (vision, then audio), so every rank issues its forward
and backward collectives in the same order whatever its data: no FSDP or SP collective can hang.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from numpy.typing import ArrayLike
from torch import nn

from omni_lightning.balance.cost import CostModel, ModuleCost
from omni_lightning.balance.digest import plan_digest
from omni_lightning.balance.reshard import (
    EncoderTraffic,
    ItemExchange,
    LinkCost,
    exchange_price,
    gain_beyond_price_error,
    item_prices,
    plan_encoder_work,
    plan_item_exchange,
    plan_resharding,
    resharding_may_pay,
)
from omni_lightning.parallel.agreement import check_plans_agree
from omni_lightning.parallel.attention import cu_seqlens_from_lengths
from omni_lightning.parallel.compat import all_gather_single
from omni_lightning.parallel.transfer import to_device

__all__ = ["EncoderStep", "Resharder"]

_INITIAL_CAPACITY = 64


@dataclass
class EncoderStep:
    """One encoder's plan for this rank and step; ``exchange`` is ``None`` when nothing travels (no such items in
    the group, or resharding would not gain enough)."""

    exchange: ItemExchange | None
    own_items: int
    predicted_cost: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per rank, with resharding
    unbalanced_cost: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per rank, each encodes its own
    items_split: int = 0
    items_moved: int = 0
    work: float = 0.0  # the compute this rank encodes, in the plan's prices (a split item's share of it)


def _device_of(inputs: tuple[torch.Tensor, ...]) -> torch.device:
    return inputs[0].device


class Resharder:
    """Plans and runs the encoders of one micro-batch over an encoder group.

    Args:
        group: the encoder group (this rank's data-parallel peers).
        sp_groups: this rank's aligned SP block of each degree ``2, 4, ..., enc_sp`` (a rank is in one per degree).
        costs: cost of each encoder by name, for an item of ``tokens`` stem tokens and ``tokens ** 2`` pairs.
        enc_sp: largest SP degree (1: whole items only, resharded by LPT).
        min_gain: reshard only when it lowers the slowest rank's predicted cost (encoder work, on top of its LLM
            work with ``llm``) by more than this fraction;
            otherwise each rank encodes its own items and nothing travels.
        traffic: each encoder's bytes per stem token and Ulysses collectives; with ``link``, the plan prices moving
            and splitting items (:func:`~omni_lightning.balance.reshard.item_prices`) and keeps them in place where
            resharding would not pay. Either ``None``: compute alone is priced.
        link: what the encoder group's links cost (bandwidth, latency, compute rate to compare them with).
        llm: the LLM's cost, where the encoders and the LLM run one after the other on each rank of the group: the
            plan then evens out each rank's encoder work on top of its share of the LLM's work on the micro-batch
            (``llm_share`` of the cost of the LLM work :meth:`plan` is given), not the encoder work alone.
            ``None``: the encoder work alone (e.g. in a pipeline, where encoder work is inserted between stages).
        llm_share: the part of a micro-batch's LLM work one rank runs (``1 / (cp * tp)``).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        sp_groups: Mapping[int, dist.ProcessGroup],
        costs: Mapping[str, ModuleCost],
        *,
        enc_sp: int = 1,
        min_gain: float = 0.05,
        traffic: Mapping[str, EncoderTraffic] | None = None,
        link: LinkCost | None = None,
        llm: ModuleCost | None = None,
        llm_share: float = 1.0,
    ) -> None:
        self.group = group
        self.sp_groups = dict(sp_groups)
        self.costs = dict(costs)
        self.enc_sp = enc_sp
        self.min_gain = self._min_gain_asked = min_gain
        self.unmeasured: frozenset[str] = frozenset()  # encoders whose items stay home (see calibrate)
        self.traffic = dict(traffic) if traffic is not None else None
        self.link = link
        self.llm, self.llm_share = llm, llm_share
        self.rank = dist.get_rank(group)
        self.n_ranks = dist.get_world_size(group)
        self.global_ranks = tuple(dist.get_process_group_ranks(group))
        self.stats: dict[str, float] = {}
        # Item lengths a rank sends in the gather's one fixed-width row; grows to the most items a rank has had.
        self._capacity = _INITIAL_CAPACITY

    @property
    def prices(self) -> CostModel:
        """What the plan prices the encoders and (where it plans on top of it) the LLM by."""
        return CostModel(**self.costs, llm=self.llm if self.llm is not None else ModuleCost(0.0, 0.0))

    def calibrate(self, prices: CostModel, *, price_error: float = 0.0, unmeasured: Iterable[str] = ()) -> None:
        """Plan from ``prices``, in seconds (the link's compute rate becomes one unit a second), from now on (what
        :class:`~omni_lightning.runtime.calibration.ResharderCalibrator` measures). ``price_error``: how far those
        prices missed the measured times; a plan reshards only for a predicted gain that error cannot account for
        (:func:`~omni_lightning.balance.reshard.gain_beyond_price_error`, and at least ``min_gain``).
        ``unmeasured``: encoders whose prices no timed forward backs; their items stay home until a later call
        leaves them out. Every rank of the group must be given the same prices, error and encoders."""
        self.min_gain = max(self._min_gain_asked, gain_beyond_price_error(price_error))
        self.unmeasured = frozenset(unmeasured)
        self.costs = {name: prices.module(name) for name in self.costs}
        if self.llm is not None:
            self.llm = prices.llm
        if self.link is not None:
            self.link = replace(self.link, flops_per_s=1.0)

    def llm_price(self, tokens: ArrayLike, pairs: ArrayLike) -> np.ndarray:
        """This rank's share of the LLM work of ``tokens`` and causal attention ``pairs`` (per micro-batch), in the
        plan's current prices: what each rank's encoder work is planned on top of."""
        if self.llm is None:
            raise ValueError("the resharder plans without the LLM: it was given no LLM cost")
        return self.llm_share * (self.llm.linear * np.asarray(tokens) + self.llm.quadratic * np.asarray(pairs))

    def plan(self, lengths: Mapping[str, torch.Tensor], multiples: Mapping[str, int],
             llm_work: tuple[int, int] = (0, 0), *, group_work: Mapping[str, Any] | None = None,
             host_lengths: Mapping[str, np.ndarray] | None = None) -> dict[str, EncoderStep]:
        """All-gather every encoder's item lengths and this rank's LLM work on the micro-batch (``llm_work``: its
        tokens and causal attention pairs; integers only) and plan each encoder in turn, each on top of the LLM's
        work (with ``llm``) and the encoders planned before it; then, where some rank has an item, check that every
        rank of the group computed the same plan.

        ``group_work``: the loader's word on the micro-batches trained beside this one, every rank's work in them
        (:data:`~omni_lightning.batch.GROUP_WORK_KEY`). Where it speaks for this group's ranks and shows that no
        encoder's items could gain from resharding (:func:`~omni_lightning.balance.reshard.resharding_may_pay`),
        every item stays home and nothing is gathered or checked: every member of the group reads the same word and
        prices, so all of them skip the collectives or none does.

        ``host_lengths``: the same lengths on the host, where the caller has them; a plan the word settles then
        reads nothing back from the device (on an accelerator each read waits for the work queued before it)."""
        names = list(lengths)
        local = [lengths[name].to(torch.int64) for name in names]
        if group_work is not None and tuple(group_work["ranks"]) == self.global_ranks:
            kept = self._kept_home(names, local, group_work, host_lengths)
            if kept is not None:
                self.stats = {**_summary(kept), "size_gathers": 0.0}
                return kept
        device = next(iter(lengths.values())).device  # collectives run where the backend wants their tensors
        all_counts, llm_features, gathered = self._gather_lengths(local, llm_work, device)
        base = np.zeros(self.n_ranks) if self.llm is None else self.llm_price(llm_features[:, 0], llm_features[:, 1])
        steps, decisions = {}, []
        for m, name in enumerate(names):
            start = all_counts[:, :m].sum(1)
            per_rank = [gathered[r, start[r] : start[r] + all_counts[r, m]].numpy() for r in range(self.n_ranks)]
            steps[name], decision = self._plan_one(name, per_rank, multiples[name], int(all_counts[self.rank, m]),
                                                   base)
            if steps[name].predicted_cost.size:
                base = base + steps[name].predicted_cost
            decisions += decision
        if int(all_counts.sum()):
            check_plans_agree("encoder resharding plan", plan_digest(decisions), self.group, device=device)
        # else no rank has an item for any encoder: the gathered counts, the same integers on every rank, decided
        # that alone, and checking it would cost every text-only micro-batch a second collective.
        self.stats = {**_summary(steps), "size_gathers": 1.0}
        return steps

    def _kept_home(self, names: list[str], local: list[torch.Tensor], word: Mapping[str, Any],
                   host_lengths: Mapping[str, np.ndarray] | None) -> dict[str, EncoderStep] | None:
        """Every encoder's step with its items kept home, where the loader's per-rank work (``word``) shows that
        none could gain from resharding; ``None`` where one might, or where the word does not price one of them.

        The word's rows hold each rank's stem tokens and pairs per encoder and its LLM tokens and pairs (the cost
        features :func:`~omni_lightning.balance.cost.work_features` names), the same integers on every member. They
        count stem tokens as the packing spec does, which for an encoder that counts its own otherwise (an audio
        stem counting frames before a stride) is off by about that ratio: a misjudged gate costs a gather or a
        missed move, never a disagreement."""
        columns = {name: 2 * i for i, name in enumerate(word["encoders"])}
        if any(name not in columns for name in names):
            return None
        work = np.asarray(word["work"], dtype=np.float64)
        for name, own in zip(names, local, strict=True):
            # The loader's plan may overstate a rank's items (a payload that failed to decode is left out), never
            # invent them.
            if own.numel() and not work[self.rank, columns[name]]:
                raise RuntimeError(f"the loader planned no {name} item on rank {self.global_ranks[self.rank]} for "
                                   f"this micro-batch, but it holds {own.numel()}")
        base = np.zeros(self.n_ranks) if self.llm is None else self.llm_price(work[:, -2], work[:, -1])
        exchange = exchange_price(self.link) if self.traffic is not None and self.link is not None else 0.0
        steps = {}
        for name, own in zip(names, local, strict=True):
            cost, column = self.costs[name], columns[name]
            in_place = cost(work[:, column], work[:, column + 1])
            if not in_place.any():
                steps[name] = EncoderStep(None, own.numel())
                continue
            if name not in self.unmeasured and resharding_may_pay(base, in_place, exchange=exchange,
                                                                  min_gain=self.min_gain):
                return None
            on_host = host_lengths[name] if host_lengths is not None else own.cpu().numpy()
            own_work = float(cost(int(on_host.sum()), float((on_host.astype(np.float64) ** 2).sum())))
            steps[name] = EncoderStep(None, own.numel(), in_place, in_place, 0, 0, own_work)
            base = base + in_place
        return steps

    def _gather_lengths(self, local: list[torch.Tensor], llm_work: tuple[int, int], device: torch.device
                        ) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
        """Every rank's item counts per encoder ``[rank, encoder]``, its LLM work ``[rank, (tokens, pairs)]`` and
        its lengths, concatenated over the encoders and zero-padded ``[rank, width]`` (on the CPU).

        One collective a micro-batch: each rank sends its counts, its LLM work and up to ``self._capacity`` lengths
        in a row of fixed width. Only when some rank has more items does a second gather send the rest, and the
        capacity grows to that on every rank (all of them read the same counts), so a workload's item counts settle
        it quickly.
        """
        n_names = len(local)
        head_width = n_names + 2
        flat = torch.cat(local)
        row = torch.zeros(head_width + self._capacity, dtype=torch.int64, device=device)
        row[:head_width] = to_device([t.numel() for t in local] + list(llm_work), device, torch.int64)
        head = min(flat.numel(), self._capacity)
        row[head_width : head_width + head] = flat[:head]
        rows = torch.empty(self.n_ranks * row.numel(), dtype=torch.int64, device=device)
        all_gather_single(rows, row, group=self.group)
        rows = rows.cpu().view(self.n_ranks, -1)
        all_counts, gathered = rows[:, :n_names], rows[:, head_width:]
        llm_features = rows[:, n_names:head_width].numpy().astype(np.float64)
        width = int(all_counts.sum(1).max())
        if width > self._capacity:
            rest = torch.zeros(width - self._capacity, dtype=torch.int64, device=device)
            rest[: max(flat.numel() - self._capacity, 0)] = flat[self._capacity :]
            tails = torch.empty(self.n_ranks * rest.numel(), dtype=torch.int64, device=device)
            all_gather_single(tails, rest, group=self.group)
            gathered = torch.cat([gathered, tails.cpu().view(self.n_ranks, -1)], dim=1)
            self._capacity = width
        return all_counts, llm_features, gathered

    def _plan_one(self, name: str, per_rank: list[np.ndarray], multiple: int, own: int, base: np.ndarray
                  ) -> tuple[EncoderStep, list[object]]:
        """The encoder's step on this rank, and the group-wide decisions behind it (what the ranks must agree on);
        ``base``: each rank's work planned before this encoder's."""
        item_lengths = np.concatenate(per_rank)
        if item_lengths.size == 0:
            return EncoderStep(None, own), [0]
        owners = np.repeat(np.arange(self.n_ranks), [len(x) for x in per_rank])
        cost = self.costs[name]
        item_costs = cost.linear * item_lengths + cost.quadratic * item_lengths.astype(np.float64) ** 2
        prices = None
        if self.traffic is not None and self.link is not None:
            prices = item_prices(item_lengths, self.traffic[name], self.link, enc_sp=self.enc_sp)
        if name in self.unmeasured:
            plan = plan_encoder_work(item_costs, owners, n_ranks=self.n_ranks, reshard=False)
        else:
            plan = plan_resharding(item_costs, owners, n_ranks=self.n_ranks, enc_sp=self.enc_sp, prices=prices,
                                   base=base, min_gain=self.min_gain)
        if plan.moved == 0:
            # Already about as even as resharding would make it (e.g. the loader balanced the samples): every rank
            # encodes its own items and nothing travels. The plan is the in-place one.
            work = float(item_costs[owners == self.rank].sum())
            return EncoderStep(None, own, plan.rank_cost, plan.rank_cost, 0, 0, work), [1]
        unbalanced = plan_encoder_work(item_costs, owners, n_ranks=self.n_ranks, reshard=False)
        exchange = plan_item_exchange(item_lengths, owners, plan, rank=self.rank, n_ranks=self.n_ranks,
                                      multiple=multiple)
        mine = (plan.sp_start <= self.rank) & (self.rank < plan.sp_start + plan.sp_degree)
        mine = np.where(plan.sp_degree > 1, mine, plan.rank_of == self.rank)
        work = float((item_costs[mine] / plan.sp_degree[mine]).sum())
        step = EncoderStep(exchange, own, plan.rank_cost, unbalanced.rank_cost, plan.items_split, plan.moved, work)
        return step, [2, plan.rank_of, plan.sp_start, plan.sp_degree]

    def encode(
        self, encoder: nn.Module, inputs: tuple[torch.Tensor, ...], step: EncoderStep,
        *, dependency: torch.Tensor | None = None, timed: AbstractContextManager[None] | None = None,
    ) -> torch.Tensor:
        """This rank's own items encoded wherever the plan put them, in their original order.

        ``dependency`` (e.g. the previous encoder's output) joins the data-dependency chain that fixes the order of
        collectives in backward. ``timed`` wraps the encoding of what the plan gave this rank (``step.work``), not
        the exchanges around it.
        """
        device = _device_of(inputs)
        timed = timed if timed is not None else nullcontext()
        if step.exchange is None:  # nothing moves: each rank encodes its own items (a dummy one if it has none)
            # Through embed and encode, as when items move: the encoders' FSDP peers may span several resharder
            # groups (context-parallel peers), some moving items and some not, and must unshard in the same order.
            tokens, lengths = encoder.embed(*(inputs if step.own_items > 0 else encoder.dummy_inputs(device)))
            with timed:
                local = encoder.encode(tokens, cu_seqlens_from_lengths(lengths))
            local = local if step.own_items > 0 else local[:0]
            return local + 0.0 * dependency.sum() if dependency is not None else local
        exchange = step.exchange
        idle = exchange.local_tokens == 0 and not exchange.chunks  # nothing of anyone's to encode here
        tokens, dummy, dummy_lengths = _embed_once(encoder, inputs if step.own_items > 0 else None,
                                                   sum(exchange.send_counts), with_dummy=idle, device=device)
        if dependency is not None:
            tokens = tokens + 0.0 * dependency.sum()
        send = tokens[to_device(exchange.send_index, device)]
        received = funcol.all_to_all_single_autograd(send, exchange.recv_counts, exchange.send_counts, self.group)
        local = received[to_device(exchange.local_index, device)]
        lengths = to_device(exchange.whole_lengths, device, torch.int64)
        # A member of an SP block whose chunk of a short item came out empty still joins the item's exchanges.
        with timed:
            if not idle:
                outputs = encoder.encode(local, cu_seqlens_from_lengths(lengths), exchange.chunks, self.sp_groups)
            else:  # a dummy item keeps this rank's FSDP and autograd steps in line with its peers'
                outputs = encoder.encode(dummy + 0.0 * local.sum(), cu_seqlens_from_lengths(dummy_lengths))[:0]
        multiple = encoder.tokens_per_output
        back = outputs[to_device(exchange.back_index, device)]
        returned = funcol.all_to_all_single_autograd(
            back, [n // multiple for n in exchange.send_counts], [n // multiple for n in exchange.recv_counts],
            self.group,
        )
        self.stats["bytes_moved"] = self.stats.get("bytes_moved", 0.0) + _bytes_moved(
            exchange, self.rank, tokens.shape[1] * tokens.element_size(), back.shape[1] * back.element_size() / multiple
        )
        return returned[to_device(exchange.assemble_index, device)]


def _embed_once(encoder: nn.Module, inputs: tuple[torch.Tensor, ...] | None, own_tokens: int, *, with_dummy: bool,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """This rank's own stem tokens (``inputs``; ``None``: it has no items) and, ``with_dummy``, a dummy item's tokens
    and length, all from one call of ``embed`` (a dummy item alone where the rank has none).

    Every rank of the encoder's FSDP group must call ``embed`` as often as the others, before its exchange: where
    the stem is an FSDP forward method (the joint pipeline's encoders), each call gathers its weights again in
    backward, and a rank with a second call after the exchange would gather them while its peers run the exchange's
    backward. Packed inputs hold their items back to back, so the dummy joins them as one more item at the end.
    """
    if inputs is None:
        tokens, lengths = encoder.embed(*encoder.dummy_inputs(device))
        return tokens[:0], tokens, lengths
    if not with_dummy:
        return encoder.embed(*inputs)[0], None, None
    joined = [torch.cat([own, extra]) for own, extra in zip(inputs, encoder.dummy_inputs(device), strict=True)]
    tokens, lengths = encoder.embed(*joined)
    return tokens[:own_tokens], tokens[own_tokens:], lengths[-1:]


def _bytes_moved(exchange: ItemExchange, rank: int, token_bytes: float, output_bytes_per_token: float) -> float:
    """Bytes this rank sends to other ranks, both directions."""
    out = sum(n for r, n in enumerate(exchange.send_counts) if r != rank)
    back = sum(n for r, n in enumerate(exchange.recv_counts) if r != rank)
    return out * token_bytes + back * output_bytes_per_token


def _summary(steps: Mapping[str, EncoderStep]) -> dict[str, float]:
    """Group-wide plan metrics of the step: encoders run one after another, so a step's encoder time is the sum
    over encoders of the slowest rank's share."""
    planned = [s for s in steps.values() if s.predicted_cost.size]
    if not planned:
        return {"items_split": 0.0, "items_moved": 0.0, "predicted_imbalance": 1.0, "unbalanced_imbalance": 1.0}

    def imbalance(costs: list[np.ndarray]) -> float:
        mean = sum(float(c.mean()) for c in costs)
        return sum(float(c.max()) for c in costs) / mean if mean > 0 else 1.0

    return {
        "items_split": float(sum(s.items_split for s in planned)),
        "items_moved": float(sum(s.items_moved for s in planned)),
        "predicted_imbalance": imbalance([s.predicted_cost for s in planned]),
        "unbalanced_imbalance": imbalance([s.unbalanced_cost for s in planned]),
    }
