"""A loader whose checkpointed position is the last batch training consumed, not the last one prefetched.

Lightning's fetcher reads one batch ahead, so a stateful loader's own ``state_dict()`` taken at a checkpoint is a
batch (or more) past what was trained: a resumed run would silently skip those samples. ``ResumableLoader``
remembers the inner loader's state after every batch it hands out and tags each batch with a
:class:`ConsumedMarker`; OmniStrategy commits the marker when training starts on that batch, and ``state_dict()``
returns the state right after the last committed batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omni_lightning.data.failure_notice import FailureNotice

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
        self._committed_state: dict[str, Any] = loader.state_dict()
        self._next_sequence = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._states_after.clear()
        self._next_sequence = 0
        try:
            for batch in self.loader:
                sequence = self._next_sequence
                self._next_sequence += 1
                self._states_after[sequence] = self.loader.state_dict()
                yield {**batch, MARKER_KEY: ConsumedMarker(self, sequence)}
        except Exception as error:
            if self.notice is not None:
                self.notice.post(error)
            raise

    def _commit(self, sequence: int) -> None:
        self._committed_state = self._states_after[sequence]
        for older in [s for s in self._states_after if s <= sequence]:
            del self._states_after[older]

    def state_dict(self) -> dict[str, Any]:
        """Inner loader state after the last batch training consumed (the start or restored state if none yet)."""
        return self._committed_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        self._committed_state = state
