"""The disaggregated placement at run time: encoder outputs stream from the encoder pool to the LLM pool.

See :mod:`omni_lightning.parallel.placement` for who serves whom. A training step of ``n`` micro-batches runs, on
every rank of both pools, as:

* **LLM data-parallel leader** (the first LLM rank of a data-parallel rank): at the start of the step it sends, for
  every micro-batch, each serving encoder rank the inputs of the items it is to encode (for every encoder a header
  of its inputs' shapes, then the inputs), all at once and asynchronously; the items of a micro-batch are shared
  among the serving ranks by predicted cost (:func:`~omni_lightning.runtime.joint.share_items`).
* **Encoder rank**: receives micro-batch ``j``'s items from every LLM data-parallel rank it serves, encodes them
  all in one pass per encoder (evened out over the pool by the resharder), sends each LLM rank its outputs,
  then runs the backward of ``j - 1`` once its gradients are back. So the encoder forward of ``j + 1`` overlaps the
  LLM's forward and backward of ``j``, and at most two micro-batches' encoder activations are alive (without a
  pipeline; see below).
* **LLM ranks that embed** (the first pipeline stage's: the leader and its TP and CP peers): receive micro-batch
  ``j``'s outputs, put them in item order as leaves of the embedding, run the LLM's forward and backward (alone, or
  inside a pipeline schedule), and as soon as the backward has produced the leaves' gradients (an autograd hook) the
  leader sends them back: summed over CP peers (each holds its share of the tokens), scaled so the encoder pool's
  averaging FSDP reduction yields the gradient of the global loss (see :meth:`EncoderPoolLink.send_gradients`).

With a pipeline, stage 0 runs ``p`` forwards of 1F1B before its first backward, so the encoder rank runs the backward
of ``j - p`` after the forward of ``j`` (``lag``; after every forward under GPipe) and holds at most ``p + 1``
micro-batches' activations.

Every transfer is point to point, on one group per stream (items, outputs, gradients: one kind of message in one
direction each, so that both sides issue a pair's operations in the same order, which NCCL needs), apart from the
pools' collectives; and every encoder rank runs every encoder on every micro-batch (a dummy item where it has
none), so the encoder pool's FSDP collectives line up whatever the data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.balance.digest import plan_digest
from omni_lightning.batch import EncoderOutputs, PackedBatch, PackingSpec, input_key
from omni_lightning.parallel.agreement import check_plans_agree
from omni_lightning.parallel.placement import PoolLayout
from omni_lightning.parallel.transfer import to_device
from omni_lightning.runtime.encoders import LocalEncoders
from omni_lightning.runtime.items import item_layout, select_items
from omni_lightning.runtime.joint import share_items

__all__ = ["EncoderPoolLink", "EncoderPoolWorker", "arrival_order", "item_owners"]


class _Tags:
    """Tags of a micro-batch's transfers: per encoder a header, its inputs, its outputs and their gradients."""

    def __init__(self, spec: PackingSpec) -> None:
        self.per_encoder = [len(fmt.inputs) + 3 for fmt in spec.encoders]
        self.per_micro_batch = sum(self.per_encoder)

    def of(self, micro_batch: int, encoder: int, kind: str, input_index: int = 0) -> int:
        offset = sum(self.per_encoder[:encoder])
        slot = {"header": 0, "output": 1, "gradient": 2}.get(kind, 3 + input_index)
        return micro_batch * self.per_micro_batch + offset + slot


def item_owners(batch: PackedBatch, spec: PackingSpec, costs: dict[str, ModuleCost], n_servers: int
                ) -> dict[str, np.ndarray]:
    """Which serving encoder rank (by position in :meth:`PoolLayout.serving`) encodes each item of each encoder of a
    micro-batch (pure): longest first onto the least-loaded server, over all encoders in turn, the same on every LLM
    rank."""
    loads = np.zeros(n_servers)
    return {fmt.name: share_items(item_layout(batch, spec, fmt.name)[0], costs[fmt.name], loads)
            for fmt in spec.encoders}


def arrival_order(rows: np.ndarray, owner: np.ndarray, n_servers: int) -> np.ndarray:
    """Row index that turns outputs received server by server (each server's items in order) into item order."""
    rows = np.asarray(rows, dtype=np.int64)
    arrival = np.concatenate([np.flatnonzero(owner == s) for s in range(n_servers)]).astype(np.int64)
    start = np.zeros(len(rows), dtype=np.int64)
    start[arrival] = np.concatenate([[0], np.cumsum(rows[arrival])[:-1]]) if len(arrival) else []
    pieces = [np.arange(start[i], start[i] + rows[i]) for i in range(len(rows))]
    return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)


def _output_rows(batch: PackedBatch, spec: PackingSpec, encoder: str) -> np.ndarray:
    """Outputs (placeholder tokens) each of ``encoder``'s items in a micro-batch produces."""
    return item_layout(batch, spec, encoder)[0] // spec.encoder(encoder).tokens_per_output(spec)


class EncoderPoolLink:
    """The LLM side: sends items to the encoder pool and feeds its outputs to the embedding (see module docstring).

    Args:
        layout: both pools' ranks.
        group: a process group over the whole world, for these transfers only.
        spec: how micro-batches are packed (the encoders, their inputs).
        costs: the encoders' cost models, to share a micro-batch's items among serving ranks.
        widths: the width of each encoder's outputs (the LLM's embedding width, times one plus its DeepStack layers).
        dtype: dtype of the encoder outputs.
        cp_group: this rank's CP peers, whose output gradients are summed (``None`` without CP).
        gradient_scale: factor applied to the outputs' gradients before they travel (see :meth:`send_gradients`).
    """

    def __init__(self, layout: PoolLayout, streams: Mapping[str, dist.ProcessGroup], spec: PackingSpec,
                 costs: dict[str, ModuleCost], *, widths: Mapping[str, int], dtype: torch.dtype,
                 cp_group: dist.ProcessGroup | None, gradient_scale: float,
                 peer_groups: Sequence[dist.ProcessGroup] = ()) -> None:
        rank = dist.get_rank()
        self.layout, self.streams, self.spec, self.costs, self.dtype = layout, streams, spec, costs, dtype
        self.peer_groups = peer_groups  # the data-parallel rank's other consumers: they plan the owners too
        self.widths, self.cp_group, self.gradient_scale = dict(widths), cp_group, gradient_scale
        self.tags = _Tags(spec)
        dp_rank = layout.dp_rank_of(rank)
        self.servers = layout.serving(dp_rank)
        self.is_leader = layout.consumers(dp_rank)[0] == rank
        self._plans: list[dict[str, Any]] = []
        self._sends: list[dist.Work] = []
        self._leaves: dict[int, tuple[torch.Tensor, ...]] = {}

    @property
    def stats(self) -> dict[str, float]:
        return {}

    def start(self, micro_batches: list[PackedBatch], *, train: bool) -> None:
        """Before the first micro-batch: the leader sends every micro-batch's items; every rank posts receives."""
        self.train = train
        self._plans = []
        every_owner = [item_owners(batch, self.spec, self.costs, len(self.servers)) for batch in micro_batches]
        digest = plan_digest([owner for owners in every_owner for owner in owners.values()])
        device = micro_batches[0]["input_ids"].device if micro_batches else torch.device("cpu")
        for group in self.peer_groups:
            check_plans_agree("encoder pool's item plan", digest, group, device=device)
        for m, (batch, owners) in enumerate(zip(micro_batches, every_owner, strict=True)):
            rows = {fmt.name: _output_rows(batch, self.spec, fmt.name) for fmt in self.spec.encoders}
            device = batch["input_ids"].device
            incoming = []
            for e, fmt in enumerate(self.spec.encoders):
                buffers = [torch.empty(int(rows[fmt.name][owners[fmt.name] == s].sum()), self.widths[fmt.name],
                                       dtype=self.dtype, device=device) for s in range(len(self.servers))]
                works = [dist.irecv(buffer, src=server, group=self.streams["outputs"], tag=self.tags.of(m, e, "output"))
                         for buffer, server in zip(buffers, self.servers, strict=True) if buffer.shape[0]]
                incoming.append((buffers, works))
            self._plans.append({"owners": owners, "rows": rows, "incoming": incoming})
            if self.is_leader:
                for s, server in enumerate(self.servers):
                    self._send_items(batch, m, server, {name: owner == s for name, owner in owners.items()})

    def before_forward(self, m: int) -> None:
        """Nothing to do before a stage's forward: the outputs are already on their way (pipeline interface)."""

    def outputs(self, m: int) -> EncoderOutputs:
        """Micro-batch ``m``'s outputs of every encoder in item order, as leaves that collect their gradients."""
        plan, leaves = self._plans[m], []
        for e, fmt in enumerate(self.spec.encoders):
            buffers, works = plan["incoming"][e]
            for work in works:
                work.wait()
            order = arrival_order(plan["rows"][fmt.name], plan["owners"][fmt.name], len(self.servers))
            leaf = torch.cat(buffers)[to_device(order, buffers[0].device)].requires_grad_(self.train)
            if self.train:
                leaf.register_post_accumulate_grad_hook(lambda _, m=m: self._gradient_ready(m))
            leaves.append(leaf)
        self._leaves[m] = tuple(leaves)
        return EncoderOutputs({fmt.name: (leaf,) for fmt, leaf in zip(self.spec.encoders, leaves, strict=True)})

    def sync_gradients(self) -> None:
        """Nothing to reduce here: the encoder pool owns the encoders' gradients (pipeline interface)."""

    def _gradient_ready(self, m: int) -> None:
        """Autograd hook: once the backward has produced every output gradient of ``m``, send them at once."""
        if m in self._leaves and all(leaf.grad is not None or not leaf.numel() for leaf in self._leaves[m]):
            self.send_gradients(m)

    def send_gradients(self, m: int) -> None:
        """After the LLM's backward of ``m``: the leader sends each server the gradients of its outputs.

        The LLM's loss is scaled by its data-parallel size (its FSDP averages over those ranks), and the encoder
        pool's FSDP averages over the encoder ranks, so the gradients travel times ``gradient_scale`` = encoder
        FSDP size / LLM data-parallel size: the encoders' averaged gradients are then those of the global loss.
        """
        plan = self._plans[m]
        for e, fmt in enumerate(self.spec.encoders):
            leaf = self._leaves[m][e]
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            if self.cp_group is not None:  # each CP peer's loss covers its share of the tokens
                dist.all_reduce(grad, group=self.cp_group)
            if not self.is_leader:
                continue
            owner, rows = plan["owners"][fmt.name], plan["rows"][fmt.name]
            order = arrival_order(rows, owner, len(self.servers))
            by_arrival = torch.empty_like(grad)
            by_arrival[to_device(order, grad.device)] = grad * self.gradient_scale
            sizes = [int(rows[owner == s].sum()) for s in range(len(self.servers))]
            for piece, server in zip(by_arrival.split(sizes), self.servers, strict=True):
                if piece.shape[0]:
                    self._isend(piece, server, "gradients", self.tags.of(m, e, "gradient"))
        del self._leaves[m]

    def finish(self) -> None:
        """After the last micro-batch: send what no hook sent (outputs without items), then wait until every
        transfer of the step has left."""
        if self.train:
            for m in sorted(self._leaves):
                self.send_gradients(m)
        for work in self._sends:
            work.wait()
        self._sends.clear()
        self._leaves.clear()
        self._plans = []

    def _send_items(self, batch: PackedBatch, m: int, server: int, mine: dict[str, np.ndarray]) -> None:
        """The server's items of every encoder: a header of its inputs' shapes, then each non-empty input (every
        transfer on the device: NCCL moves device tensors only)."""
        device = batch["input_ids"].device
        for e, fmt in enumerate(self.spec.encoders):
            inputs = tuple(batch[input_key(fmt.name, n)] for n in fmt.input_names)
            _, rows = item_layout(batch, self.spec, fmt.name)
            picked = select_items(inputs, rows, np.flatnonzero(mine[fmt.name]))
            header = to_device([d for x in picked for d in x.shape], device, torch.int64)
            self._isend(header, server, "items", self.tags.of(m, e, "header"))
            for i, tensor in enumerate(picked):
                if tensor.numel():
                    self._isend(tensor, server, "items", self.tags.of(m, e, "input", i))

    def _isend(self, tensor: torch.Tensor, dst: int, stream: str, tag: int) -> None:
        self._sends.append(dist.isend(tensor.contiguous(), dst=dst, group=self.streams[stream], tag=tag))


class EncoderPoolWorker:
    """The encoder side: encodes the items the LLM pool sends, a micro-batch at a time (see module docstring).

    Args:
        layout: both pools' ranks.
        streams: the same world-wide point-to-point streams as the LLM side's.
        source: encodes a packed batch of items (:class:`~omni_lightning.runtime.encoders.LocalEncoders` over the
            model pruned to its encoders, resharding over the pool).
        spec: how micro-batches are packed (the encoders, their inputs).
        device: where the inputs go.
        dtype: dtype of the outputs sent.
    """

    def __init__(self, layout: PoolLayout, streams: Mapping[str, dist.ProcessGroup], source: LocalEncoders,
                 spec: PackingSpec, *, device: torch.device, dtype: torch.dtype) -> None:
        rank = dist.get_rank()
        self.layout, self.streams, self.source, self.spec = layout, streams, source, spec
        self.device, self.dtype = device, dtype
        self.tags = _Tags(spec)
        self.clients = layout.served_by(rank)  # LLM data-parallel ranks, in the order outputs are concatenated
        self.consumers = [layout.consumers(d) for d in self.clients]
        self.leaders = [consumers[0] for consumers in self.consumers]
        self.rank = rank
        self.peak_in_flight = 0

    def step(self, n_microbatches: int, *, train: bool, lag: int = 1) -> None:
        """Encode ``n_microbatches`` micro-batches as they arrive; the backward of each ``lag`` micro-batches later,
        once its gradients are back (1 without a pipeline, ``pp`` under 1F1B, every micro-batch under GPipe)."""
        in_flight: dict[int, tuple[list[torch.Tensor], list[list[int]]]] = {}
        sends: list[dist.Work] = []
        self.peak_in_flight = 0
        for m in range(n_microbatches):
            batch, per_client_rows = self._receive_items(m)
            self.source.start([batch], train=train)
            with torch.set_grad_enabled(train):
                encoded = self.source.outputs(0)
            self.source.finish()
            outputs = [encoded[fmt.name][0] for fmt in self.spec.encoders]
            for e, out in enumerate(outputs):
                pieces = out.detach().to(self.dtype).split([rows[e] for rows in per_client_rows])
                for consumers, piece in zip(self.consumers, pieces, strict=True):
                    if piece.shape[0]:
                        sends += [dist.isend(piece.contiguous(), dst=consumer, group=self.streams["outputs"],
                                             tag=self.tags.of(m, e, "output")) for consumer in consumers]
            if train:
                in_flight[m] = (outputs, per_client_rows)
                self.peak_in_flight = max(self.peak_in_flight, len(in_flight))
                if m >= lag:
                    self._backward(m - lag, *in_flight.pop(m - lag))
        for m in sorted(in_flight):
            self._backward(m, *in_flight.pop(m))
        for work in sends:
            work.wait()

    def _receive_items(self, m: int) -> tuple[PackedBatch, list[list[int]]]:
        """Micro-batch ``m``'s items from every client, packed client after client, and each client's output rows
        of every encoder."""
        spec, device = self.spec, self.device
        parts: dict[str, list[torch.Tensor]] = {}
        per_client_rows = []
        for leader in self.leaders:
            client: PackedBatch = {}
            for e, fmt in enumerate(spec.encoders):
                templates = fmt.empty(spec)
                header = torch.empty(sum(t.ndim for t in templates), dtype=torch.int64, device=device)
                dist.recv(header, src=leader, group=self.streams["items"], tag=self.tags.of(m, e, "header"))
                dims = header.tolist()
                for i, (name, template) in enumerate(zip(fmt.input_names, templates, strict=True)):
                    shape, dims = dims[: template.ndim], dims[template.ndim :]
                    tensor = torch.empty(shape, dtype=getattr(torch, str(template.dtype)), device=device)
                    if tensor.numel():
                        dist.recv(tensor, src=leader, group=self.streams["items"], tag=self.tags.of(m, e, "input", i))
                    client[input_key(fmt.name, name)] = tensor
                    parts.setdefault(input_key(fmt.name, name), []).append(tensor)
            per_client_rows.append([int(_output_rows(client, spec, fmt.name).sum()) for fmt in spec.encoders])
        return {key: _cat(tensors) for key, tensors in parts.items()}, per_client_rows

    def _backward(self, m: int, outputs: list[torch.Tensor], per_client_rows: list[list[int]]) -> None:
        grads = []
        for e, out in enumerate(outputs):
            pieces = []
            for leader, rows in zip(self.leaders, per_client_rows, strict=True):
                piece = torch.empty(rows[e], out.shape[1], dtype=self.dtype, device=out.device)
                if piece.shape[0]:
                    dist.recv(piece, src=leader, group=self.streams["gradients"], tag=self.tags.of(m, e, "gradient"))
                pieces.append(piece)
            grads.append(torch.cat(pieces).to(out.dtype))
        # Outputs of no item still carry their dummy encoder pass: an empty gradient keeps the FSDP hooks in line.
        # A frozen encoder's outputs need no backward (its gradients were received all the same: the exchange is
        # the same on every rank whatever is frozen).
        trained = [(out, grad) for out, grad in zip(outputs, grads, strict=True) if out.requires_grad]
        if trained:
            torch.autograd.backward(*zip(*trained, strict=True))


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Clients' inputs back to back; empty ones may lack the data's trailing width (a mel width nobody sent)."""
    wide = [t for t in tensors if t.numel()]
    return torch.cat(wide) if wide else tensors[0]
