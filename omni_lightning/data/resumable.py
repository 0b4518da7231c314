"""A loader whose checkpointed position is the last batch training consumed, not the last one prefetched.

Lightning's fetcher reads one batch ahead, so a stateful loader's own ``state_dict()`` taken at a checkpoint is a
batch (or more) past what was trained: a resumed run would silently skip those samples. ``ResumableLoader``
remembers the inner loader's state after every batch it hands out and tags each batch with a
:class:`ConsumedMarker`; OmniStrategy commits the marker when training starts on that batch, and ``state_dict()``
returns the state right after the last committed batch.

It also keeps the rank-independent position of what was consumed (:mod:`~omni_lightning.data.position`): each batch's
:class:`~omni_lightning.data.position.PositionDelta` is applied when the batch is committed. The inner state resumes
the same number of ranks exactly; the position resumes any other number (:meth:`ResumableLoader.load_state_dict` of
``{"resume_from": position}``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from omni_lightning.data.failure_notice import FailureNotice
from omni_lightning.data.position import POSITION_DELTA_KEY, DataPosition, PositionDelta, PositionMismatch

__all__ = ["ConsumedMarker", "ResumableLoader", "MARKER_KEY", "commit_consumed"]

MARKER_KEY = "_consumed_marker"


class ConsumedMarker:
    """Travels inside a batch dict; ``commit()`` records that training has taken this batch.

    A plain class on purpose: Lightning's device transfer recurses into dataclasses but passes other objects through.
    """

    def __init__(self, loader: ResumableLoader, sequence: int) -> None:
        self.loader = loader
        self.sequence = sequence

    def commit(self) -> None:
        self.loader._commit(self.sequence)


def commit_consumed(batch: Any) -> None:
    """Commit the marker of ``batch`` if it came from a :class:`ResumableLoader` (otherwise do nothing)."""
    if isinstance(batch, dict) and isinstance(marker := batch.get(MARKER_KEY), ConsumedMarker):
        marker.commit()


def _positioned(loader: Any) -> Any:
    """What keeps the stream's rank-independent position: the loader itself (a reordered stream, a relay) or the
    dataset of a ``StatefulDataLoader`` (a shard stream); ``None`` for sources without one."""
    for candidate in (loader, getattr(loader, "dataset", None)):
        if callable(getattr(candidate, "resume_from", None)):
            return candidate
    return None


class ResumableLoader:
    """Wraps a stateful loader (``torchdata``'s ``StatefulDataLoader``) that yields dict batches.

    Args:
        loader: the stateful loader.
        notice: where an error of ``loader`` is posted as this rank's failure before it propagates, so that the other
            ranks, which wait for this one in the model's collectives, stop quoting it. Only for a loader that reads
            without collectives of its own (a rank's shard stream), whose every error is this rank's.
    """

    def __init__(self, loader: Any, *, notice: FailureNotice | None = None) -> None:
        self.loader = loader
        self.notice = notice
        self._states_after: dict[int, dict[str, Any]] = {}
        self._deltas: dict[int, PositionDelta] = {}
        self._committed_state: dict[str, Any] = loader.state_dict()
        target = _positioned(loader)
        # None: not known (a source without shard positions, or a run resumed from a checkpoint that had none).
        self._position: DataPosition | None = target.start_position() if target is not None else None
        self._resumed_from: DataPosition | None = None  # what a resume under another number of ranks started from
        self._next_sequence = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._states_after.clear()
        self._deltas.clear()
        self._next_sequence = 0
        try:
            for batch in self.loader:
                sequence = self._next_sequence
                self._next_sequence += 1
                self._states_after[sequence] = self.loader.state_dict()
                batch = dict(batch)
                if (delta := batch.pop(POSITION_DELTA_KEY, None)) is not None:
                    self._deltas[sequence] = delta
                yield {**batch, MARKER_KEY: ConsumedMarker(self, sequence)}
        except Exception as error:
            if self.notice is not None:
                self.notice.post(error)
            raise

    def _commit(self, sequence: int) -> None:
        self._committed_state = self._states_after[sequence]
        for older in sorted(s for s in self._states_after if s <= sequence):
            del self._states_after[older]
            if (delta := self._deltas.pop(older, None)) is not None and self._position is not None:
                self._position.apply(delta)

    @property
    def position(self) -> DataPosition | None:
        """The rank-independent position after the last batch training consumed (``None`` if not known)."""
        return self._position

    def state_dict(self) -> dict[str, Any]:
        """Inner loader state after the last batch training consumed (the start or restored state if none yet), with
        the rank-independent position then and the one a resume under another number of ranks started from."""
        return {"inner": self._committed_state,
                "position": None if self._position is None else self._position.to_state(),
                "resumed_from": None if self._resumed_from is None else self._resumed_from.to_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state of this rank (the same number of ranks) exactly; or, given ``{"resume_from": position}``
        (the merged position of a run with another number of ranks), start this rank's share of what is left."""
        if "resume_from" in state:
            self._resume_from(DataPosition.from_state(state["resume_from"]))
            return
        if "inner" not in state:  # written before loader positions: exact, but the position is not known
            self.loader.load_state_dict(state)
            self._committed_state, self._position = state, None
            return
        if state["resumed_from"] is not None:  # the streams started from it: so they must again, to replay exactly
            self._resumed_from = DataPosition.from_state(state["resumed_from"])
            _positioned(self.loader).resume_from(self._resumed_from)
        self.loader.load_state_dict(state["inner"])
        self._committed_state = state["inner"]
        self._position = None if state["position"] is None else DataPosition.from_state(state["position"])

    def _resume_from(self, position: DataPosition) -> None:
        target = _positioned(self.loader)
        try:
            if target is None:
                raise PositionMismatch("this rank's samples (a custom train_samples()) cannot start from a shard "
                                       "position")
            mine = target.resume_from(position)
        except PositionMismatch as mismatch:
            warnings.warn(f"{mismatch}: this rank's stream restarts from the beginning of the data instead (model, "
                          "optimizer and step count are restored)", stacklevel=2)
            return
        self._committed_state = self.loader.state_dict()
        self._position, self._resumed_from = mine, mine.copy()
