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

from omni_lightning.balance.pipeline_order import split_items
from omni_lightning.batch import GROUP_WORK_KEY, Encoded, EncoderOutputs, PackedBatch
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.parallel.attention import host_bounds
from omni_lightning.parallel.transfer import to_device
from omni_lightning.runtime.calibration import ResharderCalibrator
from omni_lightning.runtime.items import item_layout, select_items
from omni_lightning.runtime.peers import SamplePeers, gather_peer_outputs, sum_over_tensor_parallel_peers
from omni_lightning.runtime.reshard import EncoderStep, Resharder

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
    sizes, unless the loader's word settles it), moved to the ranks that encode them (long ones split over SP blocks),
    and their outputs moved back; every rank of the group must then run the same micro-batches in the same order. A
    micro-batch whose plan moves nothing is encoded as without a resharder. Runs inside the model's
    :meth:`~omni_lightning.models.mllm.ReferenceMLLM.encoder_stage`, so the model's own FSDP unit is gathered.

    With ``peers`` (the context- and tensor-parallel peers, which hold the same samples), the peers split the items
    instead of each encoding all of them (:mod:`omni_lightning.runtime.peers`): each encodes its own share
    (resharded over its data-parallel peers' shares where there is a resharder), and the outputs are all-gathered.

    With ``calibrator``, each encoder's forward of a measured training batch is timed for it.
    """

    def __init__(self, model: ReferenceMLLM, resharder: Resharder | None = None,
                 peers: SamplePeers | None = None, calibrator: ResharderCalibrator | None = None) -> None:
        self.model, self.resharder, self.calibrator = model, resharder, calibrator
        self.peers = peers if peers is not None and peers.size > 1 else None
        self._micro_batches: Sequence[PackedBatch] = ()
        self._train = False

    @property
    def stats(self) -> Mapping[str, float]:
        return self.resharder.stats if self.resharder is not None else {}

    def start(self, micro_batches: Sequence[PackedBatch], *, train: bool) -> None:
        self._micro_batches, self._train = micro_batches, train

    def before_forward(self, index: int) -> None:
        """Nothing to prepare: the outputs are computed when asked."""

    def outputs(self, index: int) -> Encoded:
        batch = self._micro_batches[index]
        if self.resharder is None and self.peers is None:
            run = lambda: self.model.encode(batch)  # noqa: E731
        else:
            run = lambda: self._encode(batch)  # noqa: E731
        return EncoderOutputs(self.model.encoder_stage(run))

    def finish(self) -> None:
        self._micro_batches = ()

    def sync_gradients(self) -> None:
        """Sum the encoders' gradients over the tensor-parallel peers that split their items; the encoders' FSDP
        reduces them over the data- and context-parallel ranks with the rest of the model's."""
        sum_over_tensor_parallel_peers(self.model.encoders.values(), self.peers)

    def _group_work(self, batch: PackedBatch) -> Mapping[str, Any] | None:
        """The loader's word on what the encoder group's ranks train beside this micro-batch, where it describes
        what each of them encodes: peers split a micro-batch's items, so each holds only a share of its rank's
        row, and only a word of no items at all still holds for them."""
        word = batch.get(GROUP_WORK_KEY)
        if word is None or self.peers is None:
            return word
        return word if not np.asarray(word["work"])[:, :-2].any() else None

    def _encode(self, batch: PackedBatch) -> dict[str, tuple[torch.Tensor, ...]]:
        """Every encoder's outputs of ``batch``: each peer's share of the items (all of them without peers),
        resharded over the encoder group where there is a resharder, the peers' shares gathered."""
        model = self.model
        shares = {name: _Share(model, batch, name, self.peers) for name in model.encoders}
        steps = None
        if self.resharder is not None:
            # An encoder pool's resharder plans encoder work alone: its batches carry no LLM sequences.
            work = llm_work(batch) if self.resharder.llm is not None else (0, 0)
            steps = self.resharder.plan({name: share.own_tokens for name, share in shares.items()},
                                        {name: encoder.tokens_per_output for name, encoder in model.encoders.items()},
                                        work, group_work=self._group_work(batch),
                                        host_lengths={name: share.own_token_counts for name, share in shares.items()})
        timing = self.calibrator if self._train else None
        if steps is not None and self.peers is None and _all_home_untimed(steps, timing):
            # The group's one plan keeps every item home (the same on every rank of the group, which holds this
            # rank's FSDP peers where no context- or tensor-parallel peers share its samples): encode as without
            # resharding, with no data-dependency chain, for there are no collectives between the encoders to order.
            return model.encode(batch)
        encoded: dict[str, tuple[torch.Tensor, ...]] = {}
        previous: torch.Tensor | None = None  # one chain of data dependencies orders the collectives in backward
        for name, encoder in model.encoders.items():
            share = shares[name]
            if steps is not None:
                inputs = share.own_inputs if share.own_inputs is not None else encoder.dummy_inputs(share.device)
                step = steps[name]
                timed = timing.timed(name, step.work) if timing is not None else None
                out = self.resharder.encode(encoder, inputs, step, dependency=previous, timed=timed)  # type: ignore[union-attr]
            else:
                if share.own_inputs is not None:
                    out = encoder(*share.own_inputs)
                else:  # no item of ours: a dummy pass still gives every weight its (zero) gradient, FSDP in step
                    out = encoder(*encoder.dummy_inputs(share.device))[:0]
                if previous is not None:
                    out = out + 0.0 * previous.sum()
            if self.peers is not None and share.owner.size:
                out = gather_peer_outputs(out, share.owner, share.outputs_per_item, self.peers)
            previous = out
            encoded[name] = (out,)
        return encoded


def _all_home_untimed(steps: Mapping[str, EncoderStep], timing: ResharderCalibrator | None) -> bool:
    """Whether no encoder's items travel and no encoder's forward on this rank is timed for the calibrator."""
    if any(step.exchange is not None for step in steps.values()):
        return False
    return timing is None or not any(step.work > 0 and timing.measures(name) for name, step in steps.items())


def llm_work(batch: PackedBatch) -> tuple[int, int]:
    """The LLM's tokens and causal attention pairs in ``batch`` (the cost features of its sequences)."""
    lengths = np.diff(host_bounds(batch["cu_seqlens"])).astype(np.int64)  # read once for every LLM layer too
    return int(lengths.sum()), int((lengths * (lengths + 1) // 2).sum())


class _Share:
    """One encoder's items of a micro-batch and the part of them this peer encodes (all of them without peers)."""

    def __init__(self, model: ReferenceMLLM, batch: PackedBatch, name: str, peers: SamplePeers | None) -> None:
        encoder = model.encoders[name]
        inputs = model.encoder_inputs(batch, name)
        self.device = inputs[0].device
        _, rows = item_layout(batch, model.packing, name)
        tokens = encoder.item_tokens(*inputs).cpu().numpy().astype(np.int64)  # stem tokens, as the encoder counts them
        self.outputs_per_item = (tokens // encoder.tokens_per_output).tolist()
        if peers is None:
            self.owner = np.zeros(tokens.size, dtype=np.int64)
            mine = np.arange(tokens.size)
        else:
            cost = encoder.cost()
            self.owner = split_items(cost.linear * tokens + cost.quadratic * tokens.astype(np.float64) ** 2,
                                     peers.size, peers.replica)
            mine = np.flatnonzero(self.owner == peers.rank)
        if mine.size == tokens.size:  # every item is this peer's: the inputs as they are, no copy
            self.own_inputs: tuple[torch.Tensor, ...] | None = inputs if mine.size else None
        else:
            self.own_inputs = select_items(inputs, rows, mine) if mine.size else None
        self.own_token_counts = tokens[mine]
        self.own_tokens = to_device(self.own_token_counts, self.device, torch.int64)
