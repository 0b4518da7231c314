"""Timing a rank's actions in CPU or device time: the records the joint pipeline's calibration fits.

On a CPU the clock is the thread's CPU time, so a rank blocked in a collective or waiting for a core counts nothing
(where ranks outnumber cores that is what dedicated hardware would take); on an accelerator it is wall time after a
synchronize.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

__all__ = ["ActionLog", "action_clock", "timed", "waiting"]


def action_clock(device: torch.device) -> Callable[[], float]:
    """Seconds of this rank's own work: thread CPU time on a CPU (a rank blocked in a collective or waiting for a
    core uses none, which matters where ranks outnumber cores), wall time after a synchronize on an accelerator."""
    if device.type == "cuda":
        def synchronized() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return synchronized
    return time.thread_time


class ActionLog:
    """The actions one pipeline rank ran in a step, in order: ``(kind, micro-batch, seconds)`` with the kinds of
    :class:`omni_lightning.balance.pipeline_replay.Action`. An action's seconds exclude the actions timed inside it
    and its waits."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.actions: list[tuple[str, int, float]] = []
        self._nested = [0.0]  # per open action: seconds of what was timed inside it

    @contextmanager
    def timed(self, kind: str, micro_batch: int, *, after_nested: bool = True) -> Iterator[None]:
        """Time the block as action ``kind`` of ``micro_batch``. ``after_nested``: the actions timed inside it ran
        before its own work (a forward that first encodes), so they come first in the order; otherwise after it
        (a backward whose hook sends the gradients it produced)."""
        mark, started = len(self.actions), self.clock()
        self._nested.append(0.0)
        try:
            yield
        finally:
            elapsed = self.clock() - started
            own = elapsed - self._nested.pop()
            self._nested[-1] += elapsed
            self.actions.insert(len(self.actions) if after_nested else mark, (kind, micro_batch, own))

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Time spent waiting for a transfer: taken out of the enclosing action, recorded as nothing."""
        started = self.clock()
        try:
            yield
        finally:
            self._nested[-1] += self.clock() - started


def timed(log: ActionLog | None, kind: str, micro_batch: int, *, after_nested: bool = True
          ) -> AbstractContextManager[None]:
    """:meth:`ActionLog.timed` where there is a log, nothing otherwise."""
    return nullcontext() if log is None else log.timed(kind, micro_batch, after_nested=after_nested)


def waiting(log: ActionLog | None) -> AbstractContextManager[None]:
    """:meth:`ActionLog.waiting` where there is a log, nothing otherwise."""
    return nullcontext() if log is None else log.waiting()
