"""One rank's failure, known to every rank of the job within seconds: through the rendezvous store, not a collective.

A rank that cannot go on (a shard read that stalls, data its settings cannot read, a checkpoint it cannot write)
posts its error in the job's rendezvous store before it raises. The other ranks may be waiting for it in a
collective, which is exactly why no collective can tell them: each rank's watch thread waits on the store's key (a
server-side wait: no polling traffic while nothing fails) and keeps the failure it learns. Then

* a rank waiting in the loader's own collectives (the reorder group's gather, where ranks wait for a slow reader)
  waits in slices and raises :class:`JobStopped` quoting the failure at once;
* a rank that fails by itself meanwhile (its peer's exit breaks its collective) gets its error replaced by, or
  annotated with, the quote (:meth:`FailureNotice.stopped_by_another_rank`, used by the launcher and the strategy);
* a rank stuck anywhere else (a model collective that only the failed rank's exit would end, and under NCCL not even
  that) is stopped by its watch thread after a short grace, with the quote on stderr.

The first failure posted stands; a rank that fails later raises its own error. The poster lingers (a second at most)
until the other ranks have read the notice, because the store may live in its own process (rank 0 under Lightning's
launchers) and vanish with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["Failure", "FailureNotice", "JobStopped"]

log = logging.getLogger(__name__)

_PREFIX = "omni_lightning/failure"
# How long the poster waits for the other ranks to read its notice, and how long a rank that learnt of a failure
# gets to stop by itself before its watch thread stops it.
_LINGER_S = 1.0
_GRACE_S = 5.0
# A store wait that times out logs a warning in c10d: wait long, so an idle watch stays quiet.
_WATCH_WAIT = timedelta(days=1)


class JobStopped(RuntimeError):
    """This rank stops because another rank of the job failed; the message quotes that rank's error."""


@dataclass(frozen=True)
class Failure:
    """The error a rank posted: its global rank and the error as text."""

    rank: int
    message: str

    def stopping(self, rank: int) -> JobStopped:
        return JobStopped(f"rank {rank} stops because rank {self.rank} failed: {self.message}")


def default_store() -> dist.Store:
    """The rendezvous store of the default process group (torch keeps it without a public accessor)."""
    return dist.distributed_c10d._get_default_store()


class FailureNotice:
    """The job's failure notice in the rendezvous store (see the module docstring).

    Args:
        store: the rendezvous store (the default process group's).
        rank, world_size: this rank and the world's size.
        generation: which fit of these processes the notice belongs to (a failed fit's notice must not stop the
            next fit in the same processes); :meth:`for_job` agrees on it through the store.
    """

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, generation: int = 0) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self._key = f"{_PREFIX}/{generation}"
        self._acks = f"{_PREFIX}/{generation}/acks"
        self._failure: Failure | None = None
        self._lock = threading.Lock()
        self._settled = threading.Event()  # this rank raised, or is stopping, by itself: no hard stop
        self._posted = False  # this rank failed by itself: its error is its own, whoever posted first
        self._watching: threading.Thread | None = None

    @classmethod
    def for_job(cls) -> FailureNotice | None:
        """The notice of the current fit (``None`` without a process group). Every rank calls it once per fit: the
        fits counted in the store number the generation."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        store, world_size = default_store(), dist.get_world_size()
        generation = (store.add(f"{_PREFIX}/calls", 1) - 1) // world_size
        return cls(store, rank=dist.get_rank(), world_size=world_size, generation=generation)

    # ----------------------------------------------------------------------------------------------- posting
    def post(self, error: BaseException) -> None:
        """Post this rank's ``error`` as the job's failure (unless another rank's came first), then wait briefly for
        the other ranks to read it. Call it right before raising ``error``."""
        self._settled.set()
        self._posted = True
        message = f"{type(error).__name__}: {error}"
        try:
            standing = self.store.compare_set(self._key, "", f"{self.rank}\n{message}")
        except Exception as store_error:  # the store is gone (its host died): nothing more to tell
            log.warning("rank %d could not post its failure in the rendezvous store: %s", self.rank, store_error)
            return
        if _parse(standing).rank != self.rank:
            return  # another rank failed first; ours is raised here, theirs was posted
        deadline = time.monotonic() + _LINGER_S
        while time.monotonic() < deadline and self._read_acks() < self.world_size - 1:
            time.sleep(0.01)

    def _read_acks(self) -> int:
        try:
            return int(self.store.add(self._acks, 0))
        except Exception:
            return self.world_size  # the store is gone: nobody can read it any more

    # ----------------------------------------------------------------------------------------------- learning
    def failure(self) -> Failure | None:
        """The job's failure if one was posted (kept once known; read from the store otherwise)."""
        if self._failure is None:
            try:
                if self.store.check([self._key]):
                    self._learn(_parse(self.store.get(self._key)), self.store)
            except Exception:  # the store is gone
                return None
        return self._failure

    def _learn(self, failure: Failure, store: dist.Store) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = failure
        if failure.rank != self.rank:
            with contextlib.suppress(Exception):  # the poster, and its store, may have gone already
                store.add(self._acks, 1)

    def stopped_by_another_rank(self, error: BaseException | None = None) -> JobStopped | None:
        """:class:`JobStopped` quoting another rank's posted failure, to raise instead of ``error`` (e.g. a collective
        broken by that rank's exit); ``None`` if no other rank posted one, if this rank posted a failure of its own
        (it raises that), or if ``error`` is itself a :class:`JobStopped`."""
        failure = self.failure()
        if failure is None or failure.rank == self.rank or self._posted or isinstance(error, JobStopped):
            return None
        self._settled.set()
        return failure.stopping(self.rank)

    def raise_if_stopped(self, *, settle: bool = True) -> None:
        """Raise :class:`JobStopped` if another rank posted a failure (from what the watch thread learnt: no store
        traffic). ``settle=False`` from a thread other than the one that stops the rank: the watch thread still
        stops it after the grace unless that one raises meanwhile."""
        failure = self._failure
        if failure is not None and failure.rank != self.rank:
            if settle:
                self._settled.set()
            raise failure.stopping(self.rank)

    def await_failure(self, timeout: float = _GRACE_S) -> JobStopped | None:
        """:class:`JobStopped` quoting the failure another rank is known to be posting, once it is posted (at most
        ``timeout`` seconds); ``None`` if it was not."""
        deadline = time.monotonic() + timeout
        while (stopped := self.stopped_by_another_rank()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return stopped

    def wait(self, work: Any, *, settle: bool = True) -> None:
        """Wait for an asynchronous collective's ``work``, raising :class:`JobStopped` as soon as another rank posts a
        failure (it may be the rank the collective waits for). ``settle``: see :meth:`raise_if_stopped`."""
        pause = 0.0005
        while not work.is_completed():
            self.raise_if_stopped(settle=settle)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        work.wait()

    # ----------------------------------------------------------------------------------------------- watching
    def watch(self) -> None:
        """Start this rank's watch thread (a daemon): it waits on the store for a failure, keeps it, and stops this
        rank :data:`_GRACE_S` seconds later unless the rank raised by itself meanwhile."""
        if self._watching is not None:
            return
        own = self.store.clone()  # a connection of its own: a blocking wait must not hold up the rank's store calls
        self._watching = threading.Thread(target=self._watch, args=(own,), name="omni-failure-watch", daemon=True)
        self._watching.start()

    def stop_watching(self) -> None:
        """The fit ended: a failure posted from now on is not this fit's (the thread stays parked in the store)."""
        self._settled.set()

    def _watch(self, store: dist.Store) -> None:
        while not self._settled.is_set():
            try:
                store.wait([self._key], _WATCH_WAIT)
                self._learn(_parse(store.get(self._key)), store)
                break
            except Exception:  # the wait timed out (then wait again), or the store is gone with its host
                try:
                    store.check([self._key])
                except Exception:
                    return
        failure = self._failure
        if failure is None or failure.rank == self.rank or self._settled.wait(_GRACE_S):
            return
        quoted = failure.stopping(self.rank)
        log.error("%s (stopping this rank: it did not stop by itself within %.0f s)", quoted, _GRACE_S)
        print(f"{type(quoted).__name__}: {quoted}", file=sys.stderr, flush=True)
        os._exit(1)


def _parse(value: bytes | str) -> Failure:
    text = value.decode() if isinstance(value, bytes) else value
    rank, _, message = text.partition("\n")
    return Failure(int(rank), message)
