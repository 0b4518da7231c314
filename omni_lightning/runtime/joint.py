"""The joint encoder-LLM pipeline: encoder work inserted into the pipeline schedule, spread over every stage's rank.

With encoders on the first stage only (torchtitan's way), stage 0 runs every micro-batch's encoders on top of its
layers, so it is the slowest stage and every other stage waits on it; an encoder-heavy step stretches the whole
pipeline. Here every pipeline rank keeps the encoders, holds the step's micro-batches (so inputs need not travel),
and encodes a share of each micro-batch's items, planned identically everywhere from the cost model: LPT over the
pipeline ranks, balanced over the step; under 1F1B the plan models the step with the insertions below and places
the large items where it is shortest (:func:`~omni_lightning.balance.pipeline_order.assign_encoder_items`), so that an
image too large for one stage's slack goes where the schedule has room for it, not merely where there was least
encoder work so far. Shares travel to stage 0, and their gradients back, point to point and
asynchronously, so no stage waits for another's encoder work unless stage 0 would otherwise have it late. Under tensor
parallelism a stage's TP peers hold the same micro-batches: they split the stage's items between them (LPT at each
insertion, encoder by encoder, the labels turned by the replica), all-gather the outputs at the insertion (they reach it
together, as they do every TP collective), and each backpropagates its own items from the share's gradient, which every
peer of stage 0 holds whole. With a resharder, a stage's data-parallel peers (the same stage of other replicas, in step
with it through the stage's FSDP collectives) also plan each insertion's items together, long ones split with sequence
parallelism, exactly as the encoders do without a pipeline (:mod:`omni_lightning.runtime.reshard`).

*When* (uniform on-demand insertion), for 1F1B with ``p`` stages: just before its forward of micro-batch ``m``,
stage ``s > 0`` encodes its share of micro-batch ``m + s + 1`` (the forward wave reaches stage 0's forward of that
micro-batch about ``s + 1`` slots later, so the share is there in time) and backpropagates its share of micro-batch
``m - p``, whose gradients stage 0 sent as soon as its backward of ``m - p`` produced them (1F1B has finished it
by then). Stage 0 encodes its own share of ``m`` in line and backpropagates its share of ``m - p``; it gets no share
of the last ``p`` micro-batches, whose encoder backward would run after its last LLM backward and lengthen the
step, while the other stages have finished their LLM work by then and run it in the cool-down. So each rank's added
work per micro-batch is about ``1 / p`` of that micro-batch's encoder work, the LLM's 1F1B order and micro-batch
count do not change, and encoder activations of at most ``2 p`` micro-batches are alive whatever the step's load.
GPipe runs every backward after every forward, so there the encoder backward waits for the end of the step.

A rank skips an encoder at an insertion only when none of its data-parallel peers (same stage, other data) has
items for it there, which they agree on with one all-reduce per step; otherwise it runs a dummy item, so the
encoders' FSDP collectives line up across the peers. Encoder weights are replicated
over the pipeline ranks and their TP peers: :meth:`JointEncoders.sync_gradients` sums their gradients over both
before the optimizer step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from omni_lightning.balance.cost import CostModel, ModuleCost
from omni_lightning.balance.digest import plan_digest
from omni_lightning.balance.pipeline_order import assign_encoder_items, lpt_ranks, split_items, stage_shares_of
from omni_lightning.batch import EncoderOutputs
from omni_lightning.parallel.agreement import check_plans_agree
from omni_lightning.parallel.attention import host_bounds
from omni_lightning.parallel.coalesced import all_reduce_coalesced
from omni_lightning.parallel.local import local_tensor
from omni_lightning.parallel.timing import ActionLog, timed, waiting
from omni_lightning.parallel.transfer import to_device
from omni_lightning.runtime.items import item_layout, select_items
from omni_lightning.runtime.peers import SamplePeers
from omni_lightning.runtime.reshard import EncoderStep, Resharder

__all__ = ["JointEncoders", "share_items"]


def share_items(token_counts: np.ndarray, cost: ModuleCost, loads: np.ndarray, *,
                off_first_stage: bool = False) -> np.ndarray:
    """The pipeline rank that encodes each item of a micro-batch (pure).

    Longest item first onto the rank with the least encoder work so far this step (``loads``, updated in place),
    so that over a step every rank gets about the same; on ties the later stage, because stage 0 is on the
    pipeline's critical path (it also embeds and waits for everyone's shares). With ``off_first_stage`` stage 0
    gets none of the items (the micro-batches whose encoder backward would otherwise run after its last backward).
    """
    candidates = np.arange(1 if off_first_stage and loads.size > 1 else 0, loads.size)
    return lpt_ranks(_item_costs(token_counts, cost), loads, candidates)


def _item_costs(token_counts: np.ndarray, cost: ModuleCost) -> np.ndarray:
    """Predicted cost of each item: its tokens, and their pairs within the item (bidirectional attention)."""
    tokens = np.asarray(token_counts, dtype=np.float64)
    return cost.linear * tokens + cost.quadratic * tokens**2


class _Items:
    """One encoder's items of a micro-batch: their inputs, output rows, and which rank encodes each."""

    def __init__(self, name: str, batch: dict[str, Any], model: nn.Module, cost: ModuleCost) -> None:
        self.name, self.encoder = name, model.encoders[name]
        spec = model.packing
        self.inputs = model.encoder_inputs(batch, name)
        self.tokens, self.input_rows = item_layout(batch, spec, name)
        self.device = self.inputs[0].device
        self.output_rows = (self.tokens // spec.encoder(name).tokens_per_output(spec)).astype(np.int64)
        self.costs = _item_costs(self.tokens, cost)
        # Set by JointEncoders' plan of the step: the pipeline rank whose stage encodes each item, and which of that
        # stage's tensor-parallel peers does.
        self.owner = np.zeros(self.tokens.size, dtype=np.int64)
        self.peer = np.zeros(self.tokens.size, dtype=np.int64)

    def rows_of(self, rank: int) -> int:
        """Output rows of the share of pipeline rank ``rank``'s stage."""
        return int(self.output_rows[self.owner == rank].sum())

    def peer_rows(self, rank: int, tp: int) -> list[int]:
        """Output rows each tensor-parallel peer of ``rank``'s stage encodes."""
        mine = self.owner == rank
        return [int(self.output_rows[mine & (self.peer == p)].sum()) for p in range(tp)]

    def peer_order(self, rank: int, tp: int) -> torch.Tensor:
        """Row index that turns the peers' outputs of ``rank``'s share, concatenated peer by peer, into item order."""
        mine = np.flatnonzero(self.owner == rank)
        order = _item_order(self.output_rows[mine], self.peer[mine], tp)
        return to_device(order, self.device)

    def peer_rows_in_share(self, rank: int, peer: int) -> torch.Tensor:
        """Rows of ``rank``'s share (in item order) that tensor-parallel peer ``peer`` encodes."""
        mine = np.flatnonzero(self.owner == rank)
        rows = self.output_rows[mine]
        starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        pieces = [np.arange(starts[k], starts[k + 1]) for k in np.flatnonzero(self.peer[mine] == peer)]
        index = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        return to_device(index, self.device)

    def inputs_of(self, rank: int, peer: int = 0) -> tuple[torch.Tensor, ...] | None:
        items = np.flatnonzero((self.owner == rank) & (self.peer == peer))
        return select_items(self.inputs, self.input_rows, items) if items.size else None

    def item_order(self, pp: int) -> torch.Tensor:
        """Row index that turns the shares, concatenated by rank, into item order."""
        return to_device(_item_order(self.output_rows, self.owner, pp), self.device)


class JointEncoders:
    """Encoder work of a pipeline step, inserted into the schedule (see the module docstring).

    Args:
        model: the (pruned) ReferenceMLLM; every pipeline rank keeps its encoders.
        streams: groups over this rank's pipeline ranks used only for these transfers, one per direction
            (:data:`~omni_lightning.parallel.layout.JOINT_STREAMS`): ``"outputs"`` (to stage 0; also the group of
            the step-boundary reductions) and ``"gradients"`` (back).
        costs: cost of each encoder by name, per stem token and per attention pair.
        n_microbatches: micro-batches per step.
        lag: how many micro-batches after its forward an encoder backward runs (``pp`` for 1F1B; for GPipe the
            micro-batch count, i.e. after the schedule).
        one_f_one_b: the schedule is 1F1B, so large items are placed on a model of its step.
        llm_share: the part of a stage's LLM work this rank runs (``1 / (tp * cp)``), for that model.
        dtype: dtype of the encoders' outputs (the FSDP compute dtype).
        dp_group: the data-parallel peers whose FSDP collectives the encoders share (``None`` without them).
        peers: this stage's context- and tensor-parallel peers (``None`` without them). They hold the same
            micro-batches, so instead of each encoding all of its stage's share they split its items (LPT) and
            all-gather the outputs; each backpropagates its own items from the share's gradient summed over its
            context-parallel peers (each of which holds its token share's part).
        resharder: reshards each insertion's items over this stage's data-parallel peers, splitting long ones with
            sequence parallelism (:class:`~omni_lightning.runtime.reshard.Resharder`; ``None``: each
            rank encodes its own items). The peers reach every insertion together: their stage's FSDP collectives
            keep them in step.
    """

    def __init__(self, model: nn.Module, streams: Mapping[str, dist.ProcessGroup], costs: dict[str, ModuleCost], *,
                 n_microbatches: int, lag: int, one_f_one_b: bool = False, llm_share: float = 1.0,
                 dtype: torch.dtype = torch.float32, dp_group: dist.ProcessGroup | None = None,
                 peers: SamplePeers | None = None, resharder: Resharder | None = None) -> None:
        self.model, self.costs = model, costs
        self.group, self.gradient_group = streams["outputs"], streams["gradients"]
        # Predicted LLM cost of each micro-batch, in the unit of the encoders' FLOP costs, for the plan of a 1F1B step;
        # a rank runs ``llm_share`` of a stage's LLM work (1 / (tp * cp)) but every item it is given whole.
        self.llm_cost, self.llm_share = model.llm.cost(), llm_share
        self.forward_share = self.encoder_forward_share = 1 / 3  # FLOPs: the backward computes two gradients
        self.stage_shares: np.ndarray | None = None  # each stage's share of a micro-batch's LLM work; None: equal
        self.one_f_one_b = one_f_one_b
        self.pp, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.n_microbatches, self.lag, self.dtype, self.dp_group = n_microbatches, lag, dtype, dp_group
        self.peers, self.resharder = peers, resharder
        # Within a stage, ``tp`` peers (context- and tensor-parallel) split its items; ``tp_rank`` is this one.
        self.tp, self.tp_rank = (peers.size, peers.rank) if peers is not None else (1, 0)
        self._runs: np.ndarray = np.zeros(0, dtype=bool)  # [micro-batch, modality]: this rank runs the encoder
        self.micro_batches: list[dict[str, Any]] = []
        self.train = True
        self.encoded: dict[int, tuple[torch.Tensor, ...]] = {}  # stage 0: leaves fed to the embedding
        self.peak_in_flight = 0  # most micro-batches whose encoder activations were alive at once, this step
        self.done: list[int] = []  # micro-batches whose share this rank encoded, in order
        # Images, frames and clips of this rank's part of its stage's shares this step (wherever the resharder had
        # them encoded), and how many items the resharder moved between the stage's data-parallel peers (all of them).
        self.items_encoded = self.items_moved = 0
        self._items: dict[int, list[_Items]] = {}
        self._retained: dict[int, list[tuple[torch.Tensor | None, bool]]] = {}
        self._incoming: dict[int, list[tuple[torch.Tensor, list[dist.Work]]]] = {}
        self._sends: list[dist.Work] = []
        self.log: ActionLog | None = None  # times this rank's encoder actions while set (a measured step)

    def calibrate(self, cost_model: CostModel, *, forward_share: float, encoder_forward_share: float,
                  stage_shares: Sequence[float] | None = None) -> None:
        """Plan the steps that follow with measured figures instead of FLOPs (what
        ``OmniStrategy(pp_calibration_steps=...)`` does after timing a job's first steps, with
        :class:`~omni_lightning.runtime.calibration.JointCalibrator`): a cost model, the forward's share of an LLM
        micro-batch's and of an item's time, and each stage's share of a micro-batch's LLM time (``None``: equal).
        FLOPs misjudge all three on hardware whose speed depends on the shape, and the first and last stages
        also embed and compute the loss; the 1F1B plan of large items leans on them, and gives a stage with more
        LLM work less encoder work. ``cost_model.llm`` prices a micro-batch's LLM work on all of a stage's ranks
        together (the plan takes this rank's ``llm_share`` of it), its encoders an item on one rank: fit the LLM
        to the summed time of a stage's tensor- and context-parallel ranks. Every pipeline rank must calibrate
        with the same figures, since each computes the plan itself."""
        for name, share in (("forward_share", forward_share), ("encoder_forward_share", encoder_forward_share)):
            if not 0.0 < share < 1.0:
                raise ValueError(f"{name}={share} must be strictly between 0 and 1")
        shares = None if stage_shares is None else stage_shares_of(stage_shares, self.pp)
        self.costs = {name: getattr(cost_model, name) for name in self.model.encoder_names}
        self.llm_cost = cost_model.llm
        self.forward_share, self.encoder_forward_share = forward_share, encoder_forward_share
        self.stage_shares = shares

    # ---------------------------------------------------------------------------------------------- schedule
    @property
    def ahead(self) -> int:
        """How many micro-batches ahead of its forward this rank encodes (0 on stage 0: in line)."""
        return self.rank + 1 if self.rank > 0 else 0

    def start(self, micro_batches: list[dict[str, Any]], *, train: bool) -> None:
        """Before the schedule: plan every micro-batch, post the receives, encode the first shares."""
        self.micro_batches, self.train, self.done, self.peak_in_flight = micro_batches, train, [], 0
        self.items_encoded = self.items_moved = 0
        self._items = {m: [_Items(name, batch, self.model, self.costs[name]) for name in self.model.encoder_names]
                       for m, batch in enumerate(micro_batches)}
        self._plan(micro_batches)
        decisions = plan_digest([a for m in range(len(micro_batches)) for items in self._items[m]
                                 for a in (items.owner, items.peer)])
        device = micro_batches[0]["input_ids"].device if micro_batches else torch.device("cpu")
        for group in (self.group, self.peers.group if self.peers else None):  # pipeline ranks, the stage's peers
            check_plans_agree("joint pipeline's item plan", decisions, group, device=device)
        mine = np.array([[items.peer_rows(self.rank, self.tp)[self.tp_rank] > 0 for items in self._items[m]]
                         for m in range(len(micro_batches))], dtype=np.int64).reshape(len(micro_batches), -1)
        if self.dp_group is not None:  # a dummy is needed wherever a data-parallel peer runs the encoder
            agreed = torch.from_numpy(mine).to(device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.dp_group)
            mine = agreed.cpu().numpy()
        self._runs = mine.astype(bool)
        for m in range(len(micro_batches)):
            self._post_receives(m)
        for m in range(min(self.ahead, self.n_microbatches)):
            self._encode(m)

    def _plan(self, micro_batches: list[dict[str, Any]]) -> None:
        """Which rank encodes each item of the step, identically on every pipeline rank (a pure function of the
        micro-batches): longest item first onto the rank with the least encoder work so far this step, except that
        under 1F1B the large items go where the modelled step is shortest
        (:func:`~omni_lightning.balance.pipeline_order.assign_encoder_items`); GPipe's encoder backward all waits for
        the end of the step, so there balancing the work is all there is to it. Either way stage 0 gets
        none of the last ``lag`` micro-batches' items, whose encoder backward would follow its last LLM backward
        and lengthen the step, while the other stages are done with their LLM work by then and absorb it.
        Within a stage, its tensor-parallel peers split its items of each insertion by LPT (:meth:`_assign_peers`)."""
        self._plan_stages(micro_batches)
        self._assign_peers(len(micro_batches))

    def _assign_peers(self, n: int) -> None:
        """Which tensor-parallel peer of the owning stage encodes each item: at each insertion, encoder by encoder
        (the peers all-gather each encoder's outputs there, so each such gather waits for the busiest peer), longest
        first onto the least-loaded peer, as :class:`~omni_lightning.runtime.encoders.LocalEncoders` splits them
        (:func:`~omni_lightning.balance.pipeline_order.split_items`: the same on every peer, the labels turned by the
        replica)."""
        replica = self.peers.replica if self.peers is not None else 0
        for m in range(n):
            for items in self._items[m]:
                for rank in range(self.pp):
                    mine = np.flatnonzero(items.owner == rank)
                    items.peer[mine] = split_items(items.costs[mine], self.tp, replica)

    def _plan_stages(self, micro_batches: list[dict[str, Any]]) -> None:
        n = len(micro_batches)
        if self.one_f_one_b:
            lengths = [np.diff(np.asarray(host_bounds(batch["cu_seqlens"]), dtype=np.float64))
                       for batch in micro_batches]
            llm = self.llm_share * np.array([self.llm_cost(tokens.sum(), (tokens * (tokens + 1) / 2).sum())
                                             for tokens in lengths])
            everything = [items for m in range(n) for items in self._items[m]]
            micro_batch = np.repeat(np.arange(n), [sum(i.costs.size for i in self._items[m]) for m in range(n)])
            # A stage's peers share its items, so a stage spends about 1/tp of their cost (items are whole: LPT over
            # the peers keeps the stage near that unless one item outweighs the rest of its share).
            costs = np.concatenate([i.costs for i in everything]) / self.tp
            owner = assign_encoder_items(llm, micro_batch, costs, self.pp,
                                         forward_share=self.forward_share,
                                         encoder_forward_share=self.encoder_forward_share,
                                         stage_shares=self.stage_shares)
            for items, share in zip(everything, np.split(owner, np.cumsum([i.costs.size for i in everything])[:-1]),
                                    strict=True):
                items.owner = share
            return
        loads = np.zeros(self.pp)  # encoder work given to each rank so far this step, in micro-batch order
        tail = n - self.lag if self.lag < n else n
        for m in range(n):
            for items in self._items[m]:
                items.owner = lpt_ranks(items.costs, loads, np.arange(1 if m >= tail and self.pp > 1 else 0, self.pp))

    def before_forward(self, micro_batch: int) -> None:
        """Called by this rank's stage before its forward of ``micro_batch``."""
        if self.rank == 0:
            if self.train and micro_batch - self.lag >= 0:
                if micro_batch - self.lag in self.encoded:  # its backward left some output without a gradient
                    self._send_gradients(micro_batch - self.lag)
                self._backward(micro_batch - self.lag)
            self._encode(micro_batch)
            self._collect(micro_batch)
            return
        if micro_batch + self.ahead < self.n_microbatches:
            self._encode(micro_batch + self.ahead)
        if self.train and micro_batch - self.lag >= 0:
            self._backward(micro_batch - self.lag)

    def finish(self) -> None:
        """After the schedule: the encoder backward of the micro-batches not yet done, in order."""
        if self.train:
            for m in sorted(self._retained):
                if self.rank == 0 and m in self.encoded:
                    self._send_gradients(m)
                self._backward(m)
        for work in self._sends:
            work.wait()
        self._sends.clear()
        self.encoded.clear()
        self._retained.clear()
        self._incoming.clear()
        self._items.clear()
        self.micro_batches = []

    def outputs(self, micro_batch: int) -> EncoderOutputs:
        """Stage 0: every encoder's outputs of ``micro_batch`` (leaves that collect their gradients)."""
        leaves = self.encoded[micro_batch]
        return EncoderOutputs({name: (leaf,) for name, leaf in zip(self.model.encoder_names, leaves, strict=True)})

    @property
    def stats(self) -> dict[str, float]:
        """Items this rank encoded and items the resharder moved between the stage's data-parallel peers, this step."""
        return {"items_encoded": float(self.items_encoded), "items_moved": float(self.items_moved)}

    # ------------------------------------------------------------------------------------------------ work
    def _tag(self, micro_batch: int, modality: int, backward: bool) -> int:
        return (micro_batch * len(self.model.encoder_names) + modality) * 2 + int(backward)

    def _post_receives(self, m: int) -> None:
        """Stage 0 receives every other rank's shares of ``m``; the others receive their shares' gradients."""
        posted = []
        for modality, items in enumerate(self._items[m]):
            device, width = items.device, self.model.output_width(items.name)
            if self.rank == 0:
                buffers = [torch.empty(items.rows_of(r), width, dtype=self.dtype, device=device)
                           for r in range(self.pp)]
                works = [dist.irecv(buffers[r], group=self.group, group_src=r, tag=self._tag(m, modality, False))
                         for r in range(1, self.pp) if buffers[r].shape[0]]
                posted.append((buffers, works))
            elif self.train and items.rows_of(self.rank):
                grad = torch.empty(items.rows_of(self.rank), width, dtype=self.dtype, device=device)
                works = [dist.irecv(grad, group=self.gradient_group, group_src=0, tag=self._tag(m, modality, True))]
                posted.append((grad, works))
            else:
                posted.append((None, []))
        self._incoming[m] = posted  # type: ignore[assignment]

    def _encode(self, m: int) -> None:
        with timed(self.log, "E", m):
            self._encode_share(m)

    def _encode_share(self, m: int) -> None:
        retained = []
        with torch.set_grad_enabled(self.train):
            steps = self._reshard_plan(m)
            previous: torch.Tensor | None = None  # the chain that orders the resharder's collectives in backward
            for modality, items in enumerate(self._items[m]):
                inputs, encoder = items.inputs_of(self.rank, self.tp_rank), items.encoder
                out = None
                if not self._runs[m, modality]:  # neither this rank nor its data-parallel peers have work here
                    retained.append((None, True))
                elif steps is not None:  # every peer runs it, own items or not (then with a dummy)
                    encoded = self.resharder.encode(  # type: ignore[union-attr]
                        encoder, inputs or encoder.dummy_inputs(items.device), steps[items.name],
                        dependency=previous)
                    previous, out = encoded, encoded if inputs is not None else None
                    retained.append((encoded, inputs is None))
                elif inputs is None:  # nothing for this rank: a dummy item keeps its FSDP collectives in line
                    retained.append((encoder(*encoder.dummy_inputs(items.device)), True))
                else:
                    out = encoder(*inputs)
                    retained.append((out, False))
                if out is not None:
                    self.items_encoded += int(inputs[-1].shape[0])  # type: ignore[index]
                if not items.rows_of(self.rank):  # the stage has no share of this modality's items
                    continue
                share = self._stage_share(items, out)
                if self.rank == 0:
                    buffers, _ = self._incoming[m][modality]
                    buffers[0] = share
                else:
                    self._sends.append(dist.isend(share, group=self.group, group_dst=0,
                                                  tag=self._tag(m, modality, False)))
        self._retained[m] = retained
        self.done.append(m)
        self.peak_in_flight = max(self.peak_in_flight, len(self._retained))

    def _reshard_plan(self, m: int) -> dict[str, EncoderStep] | None:
        """The resharder's plan of this insertion's items over the stage's data-parallel peers (``None`` without a
        resharder, or where no peer runs an encoder here). The peers agree on which encoders run (``_runs``)."""
        running = [items for modality, items in enumerate(self._items[m]) if self._runs[m, modality]]
        if self.resharder is None or not running:
            return None
        own = {items.name: np.asarray(items.tokens[(items.owner == self.rank) & (items.peer == self.tp_rank)],
                                      dtype=np.int64) for items in running}
        steps = self.resharder.plan({items.name: to_device(own[items.name], items.device) for items in running},
                                    {items.name: items.encoder.tokens_per_output for items in running},
                                    host_lengths=own)
        self.items_moved += int(self.resharder.stats.get("items_moved", 0))
        return steps

    def _stage_share(self, items: _Items, out: torch.Tensor | None) -> torch.Tensor:
        """This stage's share of a modality's outputs, in item order (detached): this rank's own, all-gathered with
        its tensor-parallel peers' parts."""
        if self.tp == 1:
            assert out is not None  # the stage has a share, and this rank is all of the stage
            return out.detach().contiguous()
        rows = items.peer_rows(self.rank, self.tp)
        width = self.model.output_width(items.name)
        mine = torch.zeros(max(rows), width, dtype=self.dtype, device=items.device)
        if out is not None:
            mine[: out.shape[0]] = out.detach()
        parts = [torch.empty_like(mine) for _ in range(self.tp)]
        with waiting(self.log):
            dist.all_gather(parts, mine, group=self.peers.group)  # type: ignore[union-attr]
        joined = torch.cat([part[:n] for part, n in zip(parts, rows, strict=True)])
        return joined[items.peer_order(self.rank, self.tp)].contiguous()

    def _collect(self, m: int) -> None:
        """Stage 0: wait for ``m``'s shares and put them in item order as leaves."""
        leaves = []
        for modality, items in enumerate(self._items[m]):
            buffers, works = self._incoming[m][modality]
            with waiting(self.log):
                for work in works:
                    work.wait()
            leaf = torch.cat(buffers)[items.item_order(self.pp)].requires_grad_(self.train)
            if self.train:
                leaf.register_post_accumulate_grad_hook(lambda _, m=m: self._gradient_ready(m))
            leaves.append(leaf)
        self.encoded[m] = tuple(leaves)

    def _gradient_ready(self, m: int) -> None:
        """Autograd hook on stage 0: once the backward of ``m`` has produced every output's gradient, send the
        shares at once, so the other ranks' encoder backward of ``m`` overlaps the rest of stage 0's pass (in the
        cool-down, where stage 0 has no next forward to send them from)."""
        if m in self.encoded and all(leaf.grad is not None or not leaf.numel() for leaf in self.encoded[m]):
            self._send_gradients(m)

    def _send_gradients(self, m: int) -> None:
        """Stage 0: each rank's share of ``m``'s output gradients."""
        with timed(self.log, "G", m):
            self._send_gradient_shares(m)

    def _send_gradient_shares(self, m: int) -> None:
        for modality, items in enumerate(self._items[m]):
            leaf = self.encoded[m][modality]
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            by_rank = grad[torch.argsort(items.item_order(self.pp))].split(
                [items.rows_of(r) for r in range(self.pp)])
            self._incoming[m][modality] = (by_rank[0], [])
            for r in range(1, self.pp):
                if by_rank[r].shape[0]:
                    self._sends.append(dist.isend(by_rank[r].contiguous(), group=self.gradient_group, group_dst=r,
                                                  tag=self._tag(m, modality, True)))
        del self.encoded[m]

    def _backward(self, m: int) -> None:
        with timed(self.log, "EB", m):
            self._backward_share(m)

    def _backward_share(self, m: int) -> None:
        outputs, grads = [], []
        for modality, (out, dummy) in enumerate(self._retained.pop(m)):
            grad, works = self._incoming[m][modality]
            with waiting(self.log):  # the stage's share's gradient comes even where a peer encoded all of it
                for work in works:
                    work.wait()
            if out is None:
                continue
            if not out.requires_grad:  # a frozen encoder: its outputs end the backward
                continue
            items = self._items[m][modality]
            cp_group = self.peers.cp_group if self.peers is not None else None
            if cp_group is not None and items.rows_of(self.rank):
                # Each context-parallel peer holds its token share's part of the share's gradient; every peer of
                # the stage takes part, its own items or not.
                grad = grad.contiguous()
                dist.all_reduce(grad, group=cp_group)
            if dummy:
                outputs.append(out.sum() * 0.0)
                grads.append(torch.ones((), device=out.device))
                continue
            outputs.append(out)
            grads.append(grad if self.tp == 1 else grad[items.peer_rows_in_share(self.rank, self.tp_rank)])
        if outputs:
            torch.autograd.backward(outputs, grads)
        del self._incoming[m]

    def sync_gradients(self) -> None:
        """Sum the encoders' gradients over the pipeline ranks and their tensor-parallel peers (each encoded a part
        of every micro-batch); FSDP sums them over the data- and context-parallel ranks."""
        grads = []
        for encoder in self.model.encoders.values():
            for param in encoder.parameters():
                if not param.requires_grad:  # frozen: nothing to reduce
                    continue
                if param.grad is None:  # no share of this encoder's work here this step; the others had some
                    param.grad = torch.zeros_like(param)
                grads.append(local_tensor(param.grad))
        if self.peers is not None and self.peers.tp_group is not None:
            all_reduce_coalesced(grads, self.peers.tp_group)
        all_reduce_coalesced(grads, self.group)


def _item_order(rows: np.ndarray, owner: np.ndarray, pp: int) -> np.ndarray:
    """Row index that turns outputs concatenated rank by rank (each rank's items in order) into item order."""
    arrival = [i for r in range(pp) for i in np.flatnonzero(owner == r)]
    arrival_start = np.zeros(len(rows), dtype=np.int64)
    position = 0
    for item in arrival:
        arrival_start[item] = position
        position += rows[item]
    pieces = [np.arange(arrival_start[i], arrival_start[i] + rows[i]) for i in range(len(rows))]
    return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)
