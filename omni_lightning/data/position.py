"""What a data-parallel rank's stream has trained, in a form that does not depend on the number of ranks.

Every record a shard stream reads has a :class:`SampleSource`: its shard (an index into the data module's shard
list), the epoch (the pass over that shard) and its index in the shard. A :class:`DataPosition` holds, for each shard
the rank reads, the *frontier* (every record before it was read) and the records read but not trained yet (planned
for a later step of the reorder group, or carried over to the next group). So a record is done (trained, or skipped
as bad) when it lies before its shard's frontier and is not pending; nothing else is.

Each shard is read by exactly one rank (and loader worker), which owns its records until they train, wherever the
plan sends them: the ranks' positions are disjoint, and their union (:func:`merge_positions`) is the whole job's. A
job resumed with another number of ranks deals the shards anew, and each new rank reads its shards from the merged
position, skipping what is done: every record the interrupted run had not trained trains once, none twice.
Positions move by :class:`PositionDelta`, which travel with the batches and are applied when a batch is committed
(:mod:`~omni_lightning.data.resumable`), so a position is what training consumed, not what the loader read ahead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["POSITION_DELTA_KEY", "DataPosition", "PositionDelta", "PositionMismatch", "SampleSource", "merge_positions",
           "shard_list_digest"]

# Where a batch carries its PositionDelta, from the stream to the loader that commits it (which takes it out).
POSITION_DELTA_KEY = "_position_delta"


class PositionMismatch(ValueError):
    """A saved loader position that does not apply to this data (another shard list, or no shard positions)."""


class SampleSource(NamedTuple):
    """Where a record comes from: its shard (index into the shard list), the epoch (pass over that shard) in which it
    was read, its index in the shard, and whether it is the shard's last record."""

    shard: int
    epoch: int
    index: int
    last: bool = False

    @property
    def id(self) -> tuple[int, int, int]:
        return self.shard, self.epoch, self.index


def shard_list_digest(shards: Sequence[str]) -> str:
    """Identifies a shard list (its names in order): positions only map onto the same list."""
    return hashlib.sha256("\n".join(shards).encode()).hexdigest()[:16]


class PositionDelta:
    """What one batch moves a position by: records read (their shard frontier advances, and they are pending until
    trained), then records trained or skipped. A plain class: Lightning's device transfer passes it through."""

    __slots__ = ("read", "trained")

    def __init__(self, read: Iterable[SampleSource] = (), trained: Iterable[SampleSource] = ()) -> None:
        self.read = tuple(read)
        self.trained = tuple(trained)


@dataclass
class DataPosition:
    """Per shard, the frontier ``(epoch, next index)`` of what was read, and the records read but not trained.

    ``digest`` names the shard list (:func:`shard_list_digest`); ``tracked`` is ``False`` once a record without a
    source went by (a custom ``train_samples()``), which makes the position unusable for a resume.
    """

    digest: str
    frontier: dict[int, tuple[int, int]] = field(default_factory=dict)
    pending: set[tuple[int, int, int]] = field(default_factory=set)
    tracked: bool = True

    def apply(self, delta: PositionDelta) -> None:
        for source in delta.read:
            self._read(source)
        for source in delta.trained:
            self._trained(source)

    def untracked(self) -> None:
        self.tracked = False

    def _read(self, source: SampleSource | None) -> None:
        if source is None:
            self.tracked = False
            return
        after = (source.epoch + 1, 0) if source.last else (source.epoch, source.index + 1)
        self.frontier[source.shard] = max(self.frontier.get(source.shard, (0, 0)), after)
        self.pending.add(source.id)

    def _trained(self, source: SampleSource | None) -> None:
        if source is None:
            self.tracked = False
            return
        self.pending.discard(source.id)

    # --------------------------------------------------------------------------------------------- resuming
    def is_done(self, shard: int, epoch: int, index: int) -> bool:
        """Whether the record was trained (or skipped) already."""
        return (epoch, index) < self.frontier.get(shard, (0, 0)) and (shard, epoch, index) not in self.pending

    def pass_done(self, shard: int, epoch: int) -> bool:
        """Whether every record of the shard's pass ``epoch`` was trained (so it need not even be opened)."""
        return (epoch + 1, 0) <= self.frontier.get(shard, (0, 0)) and not any(
            s == shard and e == epoch for s, e, _ in self.pending)

    def first_open_epoch(self, shards: Iterable[int]) -> int:
        """The first epoch in which one of ``shards`` has a record left to train."""
        opens = [min([self.frontier.get(s, (0, 0))[0], *(e for p, e, _ in self.pending if p == s)]) for s in shards]
        return min(opens, default=0)

    def restricted_to(self, shards: Iterable[int]) -> DataPosition:
        """The part of the position about ``shards`` (what one rank of a new layout reads)."""
        mine = set(shards)
        return DataPosition(self.digest, {s: f for s, f in self.frontier.items() if s in mine},
                            {p for p in self.pending if p[0] in mine}, self.tracked)

    def copy(self) -> DataPosition:
        return DataPosition(self.digest, dict(self.frontier), set(self.pending), self.tracked)

    # --------------------------------------------------------------------------------------------- saving
    def to_state(self) -> dict[str, Any]:
        """Plain lists and numbers, for a checkpoint."""
        return {"digest": self.digest, "tracked": self.tracked,
                "frontier": sorted([s, e, i] for s, (e, i) in self.frontier.items()),
                "pending": sorted(list(p) for p in self.pending)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> DataPosition:
        return cls(state["digest"], {int(s): (int(e), int(i)) for s, e, i in state["frontier"]},
                   {(int(s), int(e), int(i)) for s, e, i in state["pending"]}, bool(state["tracked"]))


def merge_positions(positions: Iterable[DataPosition]) -> DataPosition:
    """The whole job's position from its ranks' (each shard is one rank's; peers sharing a stream agree): frontiers
    are the furthest, pending records the union. ``ValueError`` if they name different shard lists."""
    positions = list(positions)
    digests = {p.digest for p in positions}
    if len(digests) != 1:
        raise ValueError(f"loader positions of different shard lists ({sorted(digests)}) cannot be merged")
    merged = DataPosition(digests.pop(), tracked=all(p.tracked for p in positions))
    for position in positions:
        for shard, front in position.frontier.items():
            merged.frontier[shard] = max(merged.frontier.get(shard, (0, 0)), front)
        merged.pending |= position.pending
    return merged
