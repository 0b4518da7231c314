"""The encoder stage of a step: plan where each item is encoded, move it there, encode, move the outputs back.

Every way a step can get its encoder outputs is an :class:`EncoderSource`, asked for one micro-batch's outputs at a
time (what the model's ``forward(batch, encoded)`` takes):

* :class:`LocalEncoders`: this rank's items, encoded here or, with a :class:`~omni_lightning.runtime.reshard.Resharder`,
  resharded over the encoder group first (long items split with sequence parallelism);
* :class:`~omni_lightning.runtime.joint.JointEncoders`: the joint encoder-LLM pipeline, every stage's rank encoding a
  share inside the schedule;
* :class:`~omni_lightning.runtime.pool.EncoderPoolLink`: the disaggregated placement's encoder pool.

A source is started with a step's micro-batches, told before each forward of one (the joint pipeline encodes ahead
there), asked for its outputs, finished after the step, and asked to reduce the gradients of encoder weights it
replicates before the optimizer step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from omni_lightning.balance.reshard import plan_encoder_work
from omni_lightning.batch import Encoded, EncoderOutputs, PackedBatch
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.parallel.attention import cu_seqlens_from_lengths
from omni_lightning.parallel.compat import all_gather_single
from omni_lightning.runtime.reshard import Resharder

__all__ = ["EncoderSource", "LocalEncoders"]


@runtime_checkable
class EncoderSource(Protocol):
    """Where a step's encoder outputs come from (see the module docstring)."""

    def start(self, micro_batches: Sequence[PackedBatch], *, train: bool) -> None:
        """Before the step's first forward: its micro-batches, in run order."""
        ...

    def before_forward(self, index: int) -> None:
        """Before the forward of micro-batch ``index`` on this rank's first pipeline stage (or the plain step)."""
        ...

    def outputs(self, index: int) -> Encoded:
        """Micro-batch ``index``'s encoder outputs, in placeholder order."""
        ...

    def finish(self) -> None:
        """After the step's last backward (or forward, when not training)."""
        ...

    def sync_gradients(self) -> None:
        """Before the optimizer step: reduce the gradients of encoder weights this source replicates."""
        ...

    @property
    def stats(self) -> Mapping[str, float]:
        """Statistics of the last step's encoder plan (``reshard/*`` metrics)."""
        ...


class LocalEncoders:
    """The encoder outputs of this rank's micro-batches, computed in line when the model asks.

    With ``resharder``, each micro-batch's items are first planned over the encoder group (an all-gather of their
    sizes), moved to the ranks that encode them (long ones split over SP blocks), and their outputs moved back; every
    rank of the group must then run the same micro-batches in the same order. Runs inside the model's
    :meth:`~omni_lightning.models.mllm.ReferenceMLLM.encoder_stage`, so the model's own FSDP unit is gathered.

    With ``peers`` (the tensor-parallel peers, which hold the same samples), the peers split the items instead of
    each encoding all of them: every peer plans the same split (longest first onto the least-loaded peer), runs the
    stems of all items (cheap, per token), encodes its own items' tokens and all-gathers the outputs; in backward
    each peer takes its own items' gradients (the peers' gradients of the LLM's input are the same), and
    :meth:`sync_gradients` sums the encoders' gradients over the peers.
    """

    def __init__(self, model: ReferenceMLLM, resharder: Resharder | None = None,
                 peers: dist.ProcessGroup | None = None) -> None:
        self.model, self.resharder = model, resharder
        self.peers = peers if peers is not None and resharder is None and dist.get_world_size(peers) > 1 else None
        self._micro_batches: Sequence[PackedBatch] = ()

    @property
    def stats(self) -> Mapping[str, float]:
        return self.resharder.stats if self.resharder is not None else {}

    def start(self, micro_batches: Sequence[PackedBatch], *, train: bool) -> None:
        self._micro_batches = micro_batches

    def before_forward(self, index: int) -> None:
        """Nothing to prepare: the outputs are computed when asked."""

    def outputs(self, index: int) -> Encoded:
        batch = self._micro_batches[index]
        if self.resharder is not None:
            run = lambda: self._resharded(batch)  # noqa: E731
        elif self.peers is not None:
            run = lambda: self._split_over_peers(batch)  # noqa: E731
        else:
            run = lambda: self.model.encode(batch)  # noqa: E731
        return EncoderOutputs(self.model.encoder_stage(run))

    def finish(self) -> None:
        self._micro_batches = ()

    def sync_gradients(self) -> None:
        """Sum the encoders' gradients over the peers that split their items (each holds its items' share); the
        encoders' FSDP reduces them over the data-parallel ranks with the rest of the model's."""
        if self.peers is None:
            return
        for encoder in self.model.encoders.values():
            for param in encoder.parameters():
                if param.requires_grad and param.grad is not None:
                    local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    dist.all_reduce(local, group=self.peers)

    def _split_over_peers(self, batch: PackedBatch) -> dict[str, tuple[torch.Tensor, ...]]:
        encoded = {}
        for name, encoder in self.model.encoders.items():
            inputs = self.model.encoder_inputs(batch, name)
            tokens_per_item = encoder.item_tokens(*inputs)
            if not tokens_per_item.numel():  # no items anywhere among the peers: a dummy one keeps FSDP aligned
                encoded[name] = (encoder(*encoder.dummy_inputs(inputs[0].device))[:0],)
                continue
            encoded[name] = (_encode_share(encoder, inputs, tokens_per_item, self.peers),)
        return encoded

    def _resharded(self, batch: PackedBatch) -> dict[str, tuple[torch.Tensor, ...]]:
        assert self.resharder is not None
        encoders = self.model.encoders
        inputs = {name: self.model.encoder_inputs(batch, name) for name in encoders}
        steps = self.resharder.plan({name: encoder.item_tokens(*inputs[name]) for name, encoder in encoders.items()},
                                    {name: encoder.tokens_per_output for name, encoder in encoders.items()})
        encoded: dict[str, tuple[torch.Tensor, ...]] = {}
        previous: torch.Tensor | None = None  # one chain of data dependencies orders the collectives in backward
        for name, encoder in encoders.items():
            previous = self.resharder.encode(encoder, inputs[name], steps[name], dependency=previous)
            encoded[name] = (previous,)
        return encoded


def _encode_share(encoder: nn.Module, inputs: tuple[torch.Tensor, ...], tokens_per_item: torch.Tensor,
                  peers: dist.ProcessGroup) -> torch.Tensor:
    """This peer's share of the items encoded, every peer's outputs gathered in item order."""
    rank, size = dist.get_rank(peers), dist.get_world_size(peers)
    lengths = tokens_per_item.tolist()
    cost = encoder.cost()
    costs = np.array([cost.linear * n + cost.quadratic * n * n for n in lengths])
    owner = plan_encoder_work(costs, np.zeros(len(lengths), dtype=np.int64), n_ranks=size, reshard=True).rank_of
    tokens, _ = encoder.embed(*inputs)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    mine = np.flatnonzero(owner == rank)
    if mine.size:
        own = torch.cat([tokens[bounds[i] : bounds[i + 1]] for i in mine.tolist()])
        out = encoder.encode(own, cu_seqlens_from_lengths(tokens_per_item[torch.as_tensor(mine)]))
    else:  # no item of ours: a dummy pass still gives every weight its (zero) gradient and keeps FSDP aligned
        out = encoder(*encoder.dummy_inputs(tokens.device))[:0]
    outputs_per_item = [n // encoder.tokens_per_output for n in lengths]
    return _GatherShares.apply(out, owner, outputs_per_item, rank, peers)


class _GatherShares(torch.autograd.Function):
    """Forward: every peer's outputs, put back in item order. Backward: this peer's items' gradients, as they are
    (every peer computes the same gradient of the LLM's input, so nothing is summed)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, owner: np.ndarray, outputs_per_item: list[int], rank: int,
                peers: dist.ProcessGroup) -> torch.Tensor:
        size = dist.get_world_size(peers)
        rows = [sum(n for n, o in zip(outputs_per_item, owner, strict=True) if o == r) for r in range(size)]
        padded = out.new_zeros(max(rows), out.shape[1])
        padded[: out.shape[0]] = out
        gathered = out.new_empty(size * max(rows), out.shape[1])
        all_gather_single(gathered, padded, group=peers)
        pieces = gathered.view(size, max(rows), out.shape[1])
        taken, chunks = [0] * size, []
        for n, o in zip(outputs_per_item, owner.tolist(), strict=True):
            chunks.append(pieces[o, taken[o] : taken[o] + n])
            taken[o] += n
        ctx.mine = [(sum(outputs_per_item[:i]), n) for i, (n, o) in enumerate(zip(outputs_per_item, owner.tolist(),
                                                                                  strict=True)) if o == rank]
        ctx.own_rows = out.shape[0]
        return torch.cat(chunks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        own = [grad[start : start + n] for start, n in ctx.mine]
        mine = torch.cat(own) if own else grad.new_zeros(ctx.own_rows, grad.shape[1])
        return mine, None, None, None, None
