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
from typing import Protocol, runtime_checkable

import torch

from omni_lightning.batch import Encoded, EncoderOutputs, PackedBatch
from omni_lightning.models.mllm import ReferenceMLLM
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
    """

    def __init__(self, model: ReferenceMLLM, resharder: Resharder | None = None) -> None:
        self.model, self.resharder = model, resharder
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
        run = (lambda: self.model.encode(batch)) if self.resharder is None else (lambda: self._resharded(batch))
        return EncoderOutputs(self.model.encoder_stage(run))

    def finish(self) -> None:
        self._micro_batches = ()

    def sync_gradients(self) -> None:
        """Nothing to reduce: the encoders' FSDP reduces their gradients with the rest of the model's."""

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
