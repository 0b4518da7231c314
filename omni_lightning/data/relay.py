"""Pipeline stages after the first receive a step's shapes from stage 0 instead of reading shards themselves.

With encoders inside stage 0 (``OmniStrategy(pp_encoders="first_stage")``) only stage 0 needs pixels and mel
frames; the other stages need the token layout (sample boundaries, positions, labels) to run their layers and
the loss. Stage 0 reads, plans and packs as usual and broadcasts each step without its payload tensors to its
pipeline peers. Because the peers never decode, every decision about the step (a skipped bad sample, the plan)
is stage 0's alone, so the stages cannot disagree on what a step holds; the loader position travels with each
step, so every stage checkpoints the same position and any of them can resume as stage 0 of another layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from omni_lightning.batch import PackingSpec, input_key
from omni_lightning.data.position import DataPosition

__all__ = ["StageRelay", "payload_keys", "without_payloads"]


def payload_keys(spec: PackingSpec) -> tuple[str, ...]:
    """What only the encoders read (their per-token inputs: pixels, mel frames); everything else in a micro-batch is
    the token layout every stage uses."""
    return tuple(input_key(fmt.name, i.name) for fmt in spec.encoders for i in fmt.inputs if not i.per_item)


def without_payloads(step: dict[str, Any], spec: PackingSpec) -> dict[str, Any]:
    """A whole pipeline step (``{"micro_batches": [...], ...}``) with the encoder payloads left out."""
    payloads = set(payload_keys(spec))
    micro = [{k: v for k, v in mb.items() if k not in payloads} for mb in step["micro_batches"]]
    return {**step, "micro_batches": micro}


class StageRelay:
    """Stage 0 iterates ``stream`` and broadcasts each step's shapes over ``group``; later stages receive them.

    Args:
        stream: the stateful stream of whole steps; built on every stage (so all of them start from, and restore,
            the same state) but iterated on stage 0 only.
        group: a gloo process group of this rank's pipeline peers, stage 0 first.
        spec: how the micro-batches are packed (which of their tensors are encoder payloads).
    """

    def __init__(self, stream: Any, *, group: dist.ProcessGroup, spec: PackingSpec) -> None:
        self.stream = stream
        self.group = group
        self.spec = spec
        self.source = dist.get_global_rank(group, 0)
        self._state: dict[str, Any] = stream.state_dict()

    @property
    def is_source(self) -> bool:
        return dist.get_rank(self.group) == 0

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict() if self.is_source else self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)
        self._state = state

    def start_position(self) -> DataPosition:
        return self.stream.start_position()

    def resume_from(self, position: DataPosition) -> DataPosition:
        """Every stage starts its stream over from ``position`` (stage 0 reads it; the others restore from it)."""
        mine = self.stream.resume_from(position)
        self._state = self.stream.state_dict()
        return mine

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self._send() if self.is_source else self._receive()

    def _send(self) -> Iterator[dict[str, Any]]:
        steps = iter(self.stream)
        while True:
            try:
                step = next(steps)
            except Exception as error:
                # The peers wait in the broadcast: tell them why no step comes, then fail here as well.
                self._broadcast({"error": f"pipeline stage 0 could not produce a step: {error}"})
                raise
            self._broadcast({"step": without_payloads(step, self.spec), "state": self.stream.state_dict()})
            yield step

    def _receive(self) -> Iterator[dict[str, Any]]:
        while True:
            message = self._broadcast(None)
            if "error" in message:
                raise RuntimeError(message["error"])
            self._state = message["state"]
            yield message["step"]

    def _broadcast(self, message: dict[str, Any] | None) -> dict[str, Any]:
        box = [message]
        dist.broadcast_object_list(box, src=self.source, group=self.group)
        return box[0]
