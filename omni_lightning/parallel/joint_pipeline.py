"""The joint encoder-LLM pipeline: encoder work inserted into the pipeline schedule, spread over every stage's rank.

With encoders on the first stage only (torchtitan's way), stage 0 runs every micro-batch's encoders on top of its
layers, so it is the slowest stage and every other stage waits on it; an encoder-heavy step stretches the whole
pipeline. Here every pipeline rank keeps the encoders, holds the step's micro-batches (so inputs need not travel),
and encodes a share of each micro-batch's items, planned identically everywhere (LPT over the pipeline ranks with
the encoder cost model); outputs go to stage 0 in one ``all_to_all_single``.

*When* (uniform on-demand insertion): encoder work of micro-batch ``T`` runs on every pipeline rank at the moment
stage 0 starts micro-batch ``T``, i.e. just before stage ``s`` runs its forward of micro-batch ``T - s`` (the 1F1B
forward wave puts those at the same time); the first ``pp - 1`` micro-batches are encoded before the schedule. The
same call returns the gradients of micro-batch ``T - lag`` (``lag = pp`` for 1F1B: stage 0 has finished that
micro-batch's backward by then) and runs its encoder backward, so encoder activations of at most ``2 pp - 1``
micro-batches are alive, whatever the step's encoder load. Each rank's added work per micro-batch is about
``1 / pp`` of the encoder work, the same on every stage, so the 1F1B order, micro-batch count and bubble stay
those of the LLM.

Every call is a collective over the pipeline group in the same order on every rank, and every rank runs every
encoder (a dummy item when it was given none), so FSDP and the exchanges never hang. Encoder weights are
replicated over the pipeline ranks; :meth:`JointEncoders.sync_gradients` sums their gradients before the optimizer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.balance.reshard import plan_encoder_work

__all__ = ["JointEncoders", "share_items"]

_MODALITIES = ("vision", "audio")


def share_items(token_counts: np.ndarray, cost: ModuleCost, pp: int) -> np.ndarray:
    """The pipeline rank that encodes each item of a micro-batch (pure; LPT on predicted cost, ties kept local)."""
    tokens = np.asarray(token_counts, dtype=np.float64)
    costs = cost.linear * tokens + cost.quadratic * tokens**2
    return plan_encoder_work(costs, np.zeros(tokens.size, dtype=np.int64), n_ranks=pp).rank_of


class _Items:
    """One modality's items of a micro-batch: their input rows, output rows and how to slice a subset."""

    def __init__(self, name: str, batch: dict[str, Any], encoder: nn.Module) -> None:
        self.name, self.encoder = name, encoder
        if name == "vision":
            self.grids = batch["vision_grids"]
            self.input_rows = (self.grids[:, 0] * self.grids[:, 1]).tolist()
            self.tokens = np.array(self.input_rows)
            self.sources = (batch["vision_patches"], batch["vision_positions"])
        else:
            self.lengths = batch["audio_lengths"]
            self.input_rows = self.lengths.tolist()
            self.tokens = np.array(self.input_rows) // encoder.config.downsample
            self.sources = (batch["audio_mels"],)
        self.output_rows = (self.tokens // encoder.tokens_per_output).astype(int).tolist()

    def inputs_of(self, items: np.ndarray) -> tuple[torch.Tensor, ...] | None:
        if items.size == 0:
            return None
        starts = np.concatenate([[0], np.cumsum(self.input_rows)]).astype(int)
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in items.tolist()])
        picked = tuple(source[rows.to(source.device)] for source in self.sources)
        index = torch.as_tensor(items, device=self.sources[0].device)
        return (*picked, self.grids[index]) if self.name == "vision" else (*picked, self.lengths[index])


class JointEncoders:
    """Encoder work of a pipeline step, inserted into the schedule (see the module docstring)."""

    def __init__(self, model: nn.Module, pp_group: dist.ProcessGroup, costs: dict[str, ModuleCost], *,
                 n_microbatches: int, lag: int) -> None:
        self.model, self.group, self.costs = model, pp_group, costs
        self.pp, self.rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        self.n_microbatches, self.lag = n_microbatches, lag
        self.micro_batches: list[dict[str, Any]] = []
        self.train = True
        self.encoded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # stage 0: leaves fed to the embedding
        self._retained: dict[int, list[tuple[torch.Tensor, bool]]] = {}  # this rank's outputs awaiting backward
        self._plans: dict[int, list[tuple[_Items, np.ndarray]]] = {}
        self.done: list[int] = []  # micro-batches encoded so far this step, in order
        self.peak_in_flight = 0  # most micro-batches whose encoder activations were alive at once, this step

    # ---------------------------------------------------------------------------------------------- schedule
    def start(self, micro_batches: list[dict[str, Any]], *, train: bool) -> None:
        """Before the schedule: encode the micro-batches stage 0 needs before the first insertion point."""
        self.micro_batches, self.train, self.done, self.peak_in_flight = micro_batches, train, [], 0
        for step in range(min(self.pp - 1, self.n_microbatches)):
            self._insert(step)

    def before_forward(self, stage: int, micro_batch: int) -> None:
        """Called by stage ``stage`` before its forward of ``micro_batch``: the insertion point of ``stage +
        micro_batch`` (every rank reaches the same point at the same time of the forward wave)."""
        point = stage + micro_batch
        if self.pp - 1 <= point < self.n_microbatches:
            self._insert(point)

    def finish(self) -> None:
        """After the schedule: the encoder backward of the micro-batches not yet done, in order."""
        if self.train:
            for step in sorted(self._retained):
                self._backward(step)
        self.encoded.clear()
        self._retained.clear()
        self._plans.clear()
        self.micro_batches = []

    def outputs(self, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 0: the vision and audio outputs of ``micro_batch`` (leaves that collect their gradients)."""
        return self.encoded[micro_batch]

    # ------------------------------------------------------------------------------------------------ work
    def _insert(self, step: int) -> None:
        self._forward(step)
        if self.train and step - self.lag >= 0:
            self._backward(step - self.lag)

    def _forward(self, step: int) -> None:
        batch = self.micro_batches[step]
        plans, retained, gathered = [], [], []
        for name in _MODALITIES:
            items = _Items(name, batch, getattr(self.model, name))
            owner = share_items(items.tokens, self.costs[name], self.pp)
            mine = np.flatnonzero(owner == self.rank)
            inputs = items.inputs_of(mine)
            encoder = items.encoder
            with torch.set_grad_enabled(self.train):
                if inputs is None:  # nothing for this rank: a dummy item keeps every rank's collectives in step
                    out = encoder(*encoder.dummy_inputs(items.sources[0].device))
                    retained.append((out, True))
                    out = out[:0]
                else:
                    out = encoder(*inputs)
                    retained.append((out, False))
            plans.append((items, owner))
            gathered.append(self._to_stage_zero(out.detach(), items, owner))
        self._plans[step], self._retained[step] = plans, retained
        self.peak_in_flight = max(self.peak_in_flight, len(self._retained))
        if self.rank == 0:
            self.encoded[step] = tuple(g.requires_grad_(self.train) for g in gathered)  # type: ignore[assignment]
        self.done.append(step)

    def _to_stage_zero(self, out: torch.Tensor, items: _Items, owner: np.ndarray) -> torch.Tensor:
        """Every rank's outputs to pipeline rank 0, there put back in item order."""
        rows = np.array(items.output_rows, dtype=np.int64)
        from_rank = [int(rows[owner == r].sum()) for r in range(self.pp)]
        recv = from_rank if self.rank == 0 else [0] * self.pp
        send = [out.shape[0] if r == 0 else 0 for r in range(self.pp)]
        received = out.new_empty(sum(recv), out.shape[1])
        dist.all_to_all_single(received, out.contiguous(), recv, send, group=self.group)
        if self.rank != 0:
            return received
        return received[torch.as_tensor(_item_order(rows, owner, self.pp), device=out.device)]

    def _backward(self, step: int) -> None:
        """Stage 0 returns each rank its items' output gradients; each rank backpropagates its encoders."""
        outputs, grads = [], []
        for index, ((items, owner), (out, dummy)) in enumerate(zip(self._plans.pop(step), self._retained.pop(step),
                                                                   strict=True)):
            rows = np.array(items.output_rows, dtype=np.int64)
            width = out.shape[1]
            if self.rank == 0:
                leaf = self.encoded[step][index]
                full = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                send_tensor = full[torch.as_tensor(np.argsort(_item_order(rows, owner, self.pp), kind="stable"),
                                                   device=full.device)]
                send = [int(rows[owner == r].sum()) for r in range(self.pp)]
            else:
                send_tensor, send = out.new_empty(0, width), [0] * self.pp
            mine = 0 if dummy else int(rows[owner == self.rank].sum())
            grad = out.new_empty(mine, width)
            dist.all_to_all_single(grad, send_tensor.contiguous(), [mine if r == 0 else 0 for r in range(self.pp)],
                                   send, group=self.group)
            if dummy:
                outputs.append(out.sum() * 0.0)
                grads.append(torch.ones((), device=out.device))
            else:
                outputs.append(out)
                grads.append(grad)
        torch.autograd.backward(outputs, grads)
        self.encoded.pop(step, None)

    def sync_gradients(self) -> None:
        """Sum the encoders' gradients over the pipeline ranks (each encoded a share of every micro-batch)."""
        for name in _MODALITIES:
            for param in getattr(self.model, name).parameters():
                if param.grad is not None:
                    local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    dist.all_reduce(local, group=self.group)


def _item_order(rows: np.ndarray, owner: np.ndarray, pp: int) -> np.ndarray:
    """Row index that turns outputs received rank by rank (each rank's items in order) into item order."""
    arrival = [i for r in range(pp) for i in np.flatnonzero(owner == r)]
    arrival_start = np.zeros(len(rows), dtype=np.int64)
    position = 0
    for item in arrival:
        arrival_start[item] = position
        position += rows[item]
    pieces = [np.arange(arrival_start[i], arrival_start[i] + rows[i]) for i in range(len(rows))]
    return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)
