"""The balancing loop of a data-parallel rank: buffer a group of steps, plan with the reorder group, exchange, pack.

Runs in the training process (loader workers only read and decode): every ``group_steps`` steps it pulls the
rank's next samples, all-gathers their integer metadata over the reorder group, computes the shared plan with
:func:`~omni_lightning.balance.reorder.plan_reorder_group`, sends the payloads the plan moves with one
``all_to_all_single``, and then yields that rank's packed micro-batches, step by step. Those two are the only
collectives of a group (a second gather only when carried samples overfill a buffer): every rank waits in each
for the slowest, so each one more would be another stall per group.

By default the next group is read, planned and exchanged on a background thread while the current one trains
(``ReorderSettings.plan_ahead``), so none of that is on the step's critical path. That is safe because the reorder
group is a gloo group of its own, used by nothing else (the layout creates it for the loader): its collectives,
issued by one thread in every member, never meet the training thread's.
"""

from __future__ import annotations

import logging
import math
import pickle
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from omni_lightning.balance.cost import CostModel
from omni_lightning.balance.digest import plan_digest
from omni_lightning.balance.reorder import GroupPlan, PipelineOrder, ReorderConfig, plan_in_place, plan_reorder_group
from omni_lightning.balance.reshard import LinkCost
from omni_lightning.batch import GROUP_WORK_KEY, IGNORE_INDEX, PackingSpec, PendingMedia
from omni_lightning.data.failure_notice import FailureNotice, JobStopped
from omni_lightning.data.packing import (
    DecodedSample,
    data_counts,
    empty_batch,
    pack_samples,
    sample_features,
    sample_layout,
)
from omni_lightning.data.position import POSITION_DELTA_KEY, DataPosition, PositionDelta, PositionMismatch
from omni_lightning.data.streaming import BadSample
from omni_lightning.modalities import DEFAULT_PACKING
from omni_lightning.parallel.agreement import check_plans_agree
from omni_lightning.parallel.compat import all_gather_single

__all__ = ["ReorderSettings", "ReorderedStream", "apply_length_policy", "llm_length"]

log = logging.getLogger(__name__)

_CLOSE_WAIT_S = 120.0  # the longest a closing stream waits for the group being planned ahead

LengthPolicy = Literal["truncate", "drop", "error"]


@dataclass(frozen=True)
class ReorderSettings:
    """How one rank's loader reorders.

    Args:
        samples_per_step: samples each rank reads per step (the group buffer is ``group_steps`` times this).
        group_steps: steps planned together.
        micro_batches: micro-batches per step (gradient accumulation or pipeline micro-batches).
        token_budget: most LLM tokens per micro-batch (``None``: unlimited).
        max_seq_len: longest sample, in LLM tokens (``None``: no limit); longer ones follow ``length_policy``.
        length_policy: ``"truncate"`` cuts text (drops the sample if its media alone are too long), ``"drop"``
            skips it, ``"error"`` raises. Truncations and drops are counted.
        reorder: ``False`` keeps every sample on the rank that read it, in arrival order (the naive split).
        pp: pipeline stages; with ``pp > 1`` micro-batches are ordered for 1F1B and a step's micro-batches are
            yielded together, as one batch holding the list ``micro_batches``.
        pipeline_order: with ``pp > 1``, how a step's micro-batches are shaped and ordered for 1F1B
            (``ReorderConfig.pipeline_order``: DistTrain's order, the ramp of the 1F1B cost profile, or the ramp
            refined by a search).
        llm_micro_batches: balance a step's micro-batches on their LLM cost alone: under the joint pipeline the
            encoder work of a micro-batch is spread over every stage and does not shape the pipeline.
        encoder_peers: under the joint pipeline, the ranks of a stage that split its encoder items between them
            (``ReorderConfig.encoder_peers``).
        link: prices the payload exchange (``ReorderConfig.link``); ``None``: compute alone.
        plan_ahead: read, plan and exchange the next group on a background thread while the current one trains, so
            that planning is off the step's critical path; ``False`` does it on the training thread between groups.
            Either way the plans, the samples and the resumable positions are the same.
    """

    samples_per_step: int
    group_steps: int = 8
    micro_batches: int = 1
    token_budget: int | None = None
    max_seq_len: int | None = None
    length_policy: LengthPolicy = "truncate"
    reorder: bool = True
    pp: int = 1
    pipeline_order: PipelineOrder = "disttrain"
    llm_micro_batches: bool = False
    encoder_peers: int = 1
    link: LinkCost | None = None
    plan_ahead: bool = True

    def __post_init__(self) -> None:
        if self.samples_per_step < 1 or self.group_steps < 1 or self.micro_batches < 1:
            raise ValueError("samples_per_step, group_steps and micro_batches must be at least 1")
        if self.length_policy not in ("truncate", "drop", "error"):
            raise ValueError(f"length_policy={self.length_policy!r} must be 'truncate', 'drop' or 'error'")
        if self.token_budget is not None and self.max_seq_len is not None and self.max_seq_len > self.token_budget:
            raise ValueError(
                f"max_seq_len={self.max_seq_len} exceeds token_budget={self.token_budget}: such a sample could never"
                " be placed; lower max_seq_len or raise the budget"
            )


def llm_length(sample: DecodedSample, spec: PackingSpec = DEFAULT_PACKING) -> int:
    """LLM tokens the sample will occupy once packed (BOS, placeholders, text)."""
    return sample_layout(sample, spec).llm_tokens


def apply_length_policy(
    sample: DecodedSample, max_seq_len: int | None, policy: LengthPolicy, spec: PackingSpec = DEFAULT_PACKING
) -> tuple[DecodedSample | None, str]:
    """``(sample or None, what happened)`` where what happened is ``""``, ``"truncated"`` or ``"dropped"``."""
    length = llm_length(sample, spec)
    if max_seq_len is None or length <= max_seq_len:
        return sample, ""
    if policy == "error":
        raise ValueError(f"sample {sample.key}: {length} LLM tokens exceed max_seq_len={max_seq_len}")
    if sample.targets is not None:  # rendered: cut the tail, never into a media item's run, keeping a target
        placeholders = np.flatnonzero(np.isin(sample.tokens, [i for _, i in spec.roles.placeholders]))
        if policy == "drop" or (placeholders.size and placeholders[-1] >= max_seq_len) or not sample.targets[
                1:max_seq_len].any():
            return None, "dropped"
        return replace(sample, tokens=sample.tokens[:max_seq_len], targets=sample.targets[:max_seq_len]), "truncated"
    keep_text = len(sample.tokens) - (length - max_seq_len)
    if policy == "drop" or keep_text < 1:
        return None, "dropped"
    meta = {**sample.meta, "text_tokens": keep_text}
    meta.pop("llm_tokens", None)
    return replace(sample, tokens=sample.tokens[:keep_text], meta=meta), "truncated"


def _assignment_digest(plan: GroupPlan) -> int:
    """What every member of a reorder group must agree on: the samples of every (rank, step) and those left over.
    How a rank cuts and orders its own steps into micro-batches is its own (only it runs the 1F1B search)."""
    bins = [sorted(i for ids in step for i in ids) for rank in plan.micro_batches for step in rank]
    return plan_digest([len(plan.micro_batches), *bins, sorted(plan.leftover)])


def _pack(samples: list[DecodedSample], spec: PackingSpec) -> dict[str, Any]:
    return pack_samples(samples, spec) if samples else empty_batch(spec)


# Received arrays are views into one receive buffer; each starts at an offset aligned as an allocator's would be.
_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _array(item: Any) -> np.ndarray:
    return np.frombuffer(item.data, dtype=np.uint8) if isinstance(item, PendingMedia) else np.asarray(item)


def _arrays(sample: DecodedSample) -> list[np.ndarray]:
    targets = [] if sample.targets is None else [sample.targets]
    return [sample.tokens, *(_array(item) for items in sample.media.values() for item in items), *targets]


class _Wire:
    """A sample as the payload exchange sends it: each array's raw bytes at an aligned offset, then a pickled
    header (key, metadata, array layouts, a rendered sample's media order, its source), then the header's length in
    the last 8 bytes. A rendered sample's targets travel as its last array.

    Its size is known before the plan, so it travels with the gathered metadata and the receiver needs no separate
    size exchange; the receiver's arrays are views of the received bytes, not copies made by unpickling.
    """

    def __init__(self, sample: DecodedSample) -> None:
        self.arrays = [np.ascontiguousarray(a) for a in _arrays(sample)]
        layouts, offset = [], 0
        for array in self.arrays:
            layouts.append((array.dtype.str, array.shape, offset))
            offset += _aligned(array.nbytes)
        counts = [(name, len(items)) for name, items in sample.media.items()]
        pending = [(item.shape, item.member) if isinstance(item, PendingMedia) else None
                   for items in sample.media.values() for item in items]
        self.header = pickle.dumps((sample.key, sample.meta, counts, layouts, pending, sample.media_order,
                                    sample.targets is not None, sample.source), protocol=pickle.HIGHEST_PROTOCOL)
        self.nbytes = offset + _aligned(len(self.header) + 8)

    def write(self, out: memoryview, start: int) -> None:
        """Serialise into ``out[start : start + nbytes]`` (``start`` aligned)."""
        offset = start
        for array in self.arrays:
            if array.nbytes:  # a byte view of an empty array cannot be made
                out[offset : offset + array.nbytes] = memoryview(array).cast("B")
            offset += _aligned(array.nbytes)
        end = start + self.nbytes
        out[end - 8 - len(self.header) : end - 8] = self.header
        out[end - 8 : end] = len(self.header).to_bytes(8, "little")

    @staticmethod
    def read(data: memoryview, start: int, nbytes: int) -> DecodedSample:
        """The sample written at ``data[start : start + nbytes]``; its arrays are views of ``data``."""
        end = start + nbytes
        length = int.from_bytes(data[end - 8 : end], "little")
        key, meta, counts, layouts, pending, media_order, rendered, source = pickle.loads(
            data[end - 8 - length : end - 8])
        arrays: list[Any] = [np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=start + offset).reshape(
            shape) for dtype, shape, offset in layouts]
        for index, promise in enumerate(pending, start=1):  # still encoded: bytes and the shape planned for them
            if promise is not None:
                arrays[index] = PendingMedia(arrays[index].tobytes(), *promise)
        media, next_array = {}, 1
        for name, count in counts:
            media[name], next_array = arrays[next_array : next_array + count], next_array + count
        return DecodedSample(key=key, tokens=arrays[0], meta=meta, media=media,
                             targets=arrays[-1] if rendered else None, media_order=media_order, source=source)


class _ReadingFailed(Exception):
    """Some members of the reorder group could not read their samples for a group (``members``: their global ranks;
    ``own``: this rank's error, if it is one of them). Every member raises it at the same collective, so none is left
    waiting in one; the training thread turns it into the error each rank raises (:meth:`ReorderedStream._taken`)."""

    def __init__(self, members: list[int], own: BaseException | None) -> None:
        super().__init__(f"ranks {members} could not read their samples")
        self.members, self.own = members, own


@dataclass
class _PlannedGroup:
    """A group read, planned and exchanged: what training its steps needs, and what the next group carries."""

    start: dict[str, Any]  # where it began: the loader's state, the carried samples, its number
    read_counts: dict[str, int]  # samples skipped, truncated and dropped while reading it
    gathered: np.ndarray  # every member's metadata rows
    plan: GroupPlan
    samples: dict[int, DecodedSample]  # this rank's to train, by id (its own and those received)
    deltas: list[PositionDelta]  # what each step moves this rank's position by
    carry: list[bytes]  # this rank's leftovers, into the next group
    seconds: float  # wall time of reading, planning and exchanging it


class _Pending:
    """A group being planned on the planning thread."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._planned: _PlannedGroup | None = None
        self._error: BaseException | None = None

    def run(self, plan: Callable[..., _PlannedGroup], *args: Any, **kwargs: Any) -> None:
        try:
            self._planned = plan(*args, **kwargs)
        except BaseException as error:  # raised where the training thread takes the group
            self._error = error
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the group is planned (or failed) within ``timeout`` seconds (``None``: however long it takes)."""
        return self._done.wait(timeout)

    def result(self) -> _PlannedGroup:
        self.wait()
        if self._error is not None:
            raise self._error
        assert self._planned is not None
        return self._planned


class _PlanningThread:
    """The stream's background thread, planning one group at a time until the stream is gone. One long-lived thread
    (not one per group) so that its CPU is one clock to read; a daemon, so that a process leaving while a group is
    still being planned (the job ended or failed) is not held by it."""

    def __init__(self, owner: object) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="omni-plan-ahead", daemon=True).start()
        weakref.finalize(owner, self._jobs.put, None)  # the thread ends with its stream

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()
            del job  # it holds the stream, which must be free to go while this waits for the next

    def submit(self, plan: Callable[..., _PlannedGroup], *args: Any, **kwargs: Any) -> _Pending:
        pending = _Pending()
        self._jobs.put(lambda: pending.run(plan, *args, **kwargs))
        return pending


class ReorderedStream:
    """Yields this rank's packed micro-batches, planned group by group with the other ranks of its reorder group.

    Args:
        loader: a ``StatefulDataLoader`` yielding one :class:`DecodedSample` or :class:`BadSample` at a time.
        group: process group of the reorder group (``None`` when it is this rank alone).
        group_index: which reorder group this is (breaks ties differently per group, identically per member).
        cost_model: prices samples; what the plan balances.
        settings: see :class:`ReorderSettings`.
        seed: seeds tie-breaking.
        packing: how samples pack into micro-batches (and whose encoders the cost model prices).
        decode: decodes a planned sample's pending media (after the plan, by the rank that trains it).
        notice: the job's failure notice: this rank posts its reading errors there (when training reaches the
            group it could not read), and waits for the others' metadata only until one of them posts a failure
            (``None`` in a one-process run).

    ``state_dict()`` is the position after the last micro-batch yielded: the loader state where the current
    group began, the samples carried into it, the counters then, and how many of its micro-batches were handed
    out. Resuming
    re-reads and re-plans that group (the plan is deterministic) and skips what was already yielded.
    """

    def __init__(
        self,
        loader: Any,
        *,
        group: dist.ProcessGroup | None,
        group_index: int,
        cost_model: CostModel,
        settings: ReorderSettings,
        seed: int = 0,
        packing: PackingSpec = DEFAULT_PACKING,
        decode: Callable[[DecodedSample], DecodedSample] | None = None,
        notice: FailureNotice | None = None,
    ) -> None:
        self.loader = loader
        self.decode = decode
        self.notice = notice
        self._decoders: ThreadPoolExecutor | None = None
        self._planner: _PlanningThread | None = None
        self._ahead: _Pending | None = None
        self.group = group
        self.group_index = group_index
        self.cost_model = cost_model
        self.settings = settings
        self.seed = seed
        self.packing = packing
        if cost_model.encoder_names != packing.encoder_names:
            raise ValueError(f"the cost model prices encoders {list(cost_model.encoder_names)} but samples pack for "
                             f"{list(packing.encoder_names)}: give OmniDataModule the model's cost model")
        # Columns of the gathered rows: valid, the cost features, LLM tokens, owner, payload bytes, wire bytes.
        self._features = slice(1, 1 + len(cost_model.feature_names))
        self._tokens, self._owner, self._bytes, self._wire = range(self._features.stop, self._features.stop + 4)
        self.counters = {"skipped": 0, "truncated": 0, "dropped": 0, "samples_moved": 0, "bytes_moved": 0}
        self._global_ranks = (tuple(dist.get_process_group_ranks(group)) if group is not None
                              else (dist.get_rank() if dist.is_initialized() else 0,))
        self._state: dict[str, Any] = {
            "loader": loader.state_dict(), "carry": [], "group": 0, "counters": dict(self.counters), "yielded": 0
        }

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._stop_planning_ahead()  # it reads the loader this state replaces
        self.loader.load_state_dict(state["loader"])
        self._state = dict(state)
        self.counters.update(state["counters"])

    def start_position(self) -> DataPosition:
        """The rank-independent position of a stream that has read nothing (an untracked one where the samples come
        from a custom ``train_samples()`` without shard positions)."""
        samples = getattr(self.loader, "dataset", None)
        if callable(getattr(samples, "start_position", None)):
            return samples.start_position()
        return DataPosition(digest="", tracked=False)

    def resume_from(self, position: DataPosition) -> DataPosition:
        """Start over from a position saved under another number of ranks: the sample stream reads this rank's
        shards skipping what was trained; no group is under way, nothing carried."""
        samples = getattr(self.loader, "dataset", None)
        if not callable(getattr(samples, "resume_from", None)):
            raise PositionMismatch("this rank's samples (a custom train_samples()) cannot start from a shard position")
        self._stop_planning_ahead()
        mine = samples.resume_from(position)
        self._state = {"loader": self.loader.state_dict(), "carry": [], "group": 0,
                       "counters": dict(self.counters), "yielded": 0}
        return mine

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._stop_planning_ahead()  # a re-iteration abandons the group planned ahead, and the one being decoded
        if self._decoders is not None:
            self._decoders.shutdown(wait=True, cancel_futures=True)
            self._decoders = None
        # Start where the current group began (a fresh start, a resume, or a re-iteration all land there), with the
        # counters as they stood then (a re-iteration replays the group's reading).
        self.loader.load_state_dict(self._state["loader"])
        self.counters.update(self._state["counters"])
        records = iter(self.loader)
        number, skip = self._state["group"], self._state["yielded"]
        ahead: _Pending | None = None  # this iteration's (self._ahead is the latest iteration's)
        try:
            planned = self._taken(partial(self._plan_group, records, list(self._state["carry"]), number))
            while True:
                if self.settings.plan_ahead:
                    self._planner = self._planner or _PlanningThread(self)
                    ahead = self._ahead = self._planner.submit(self._plan_group, records, planned.carry, number + 1,
                                                               ahead=True)
                yield from self._train_group(planned, skip)
                planned = self._taken(ahead.result if ahead is not None
                                      else partial(self._plan_group, records, planned.carry, number + 1))
                number, skip, ahead = number + 1, 0, None
        finally:
            # Closed after the last step it trained (or by an error): the group planned ahead is let finish, so that
            # its collectives are not cut off under the process group, but not waited for without end.
            if ahead is not None and not ahead.wait(_CLOSE_WAIT_S):
                log.warning("the loader's planning thread has not finished planning the next group in %.0f s; "
                            "leaving it", _CLOSE_WAIT_S)
            if ahead is not None and self._ahead is ahead:
                self._ahead = None

    def _taken(self, planning: Callable[[], _PlannedGroup]) -> _PlannedGroup:
        """A group's plan, taken on the training thread, which raises what stopped it: this rank's own reading error
        (posted in the failure notice first, so that the other ranks quote it), or a :class:`JobStopped` quoting the
        rank that failed (settling the notice: this rank stops by itself)."""
        try:
            return planning()
        except _ReadingFailed as failed:
            if failed.own is not None:
                if self.notice is not None:
                    self.notice.post(failed.own)
                raise failed.own from None
            stopped = self.notice.await_failure() if self.notice is not None else None
            raise stopped or RuntimeError(f"ranks {failed.members} of this rank's reorder group could not read their "
                                          "samples (their own errors say why)") from None
        except JobStopped:
            if self.notice is not None:
                self.notice.raise_if_stopped()
            raise

    def _stop_planning_ahead(self) -> None:
        """Wait for the group being planned ahead and drop it. Its collectives meet only the other members' planning
        threads, which plan the same group whatever their training threads do, so the wait ends."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.wait()

    def _plan_group(self, records: Iterator[Any], carry: list[bytes], number: int, *, ahead: bool = False
                    ) -> _PlannedGroup:
        """Read group ``number`` behind the carried samples, gather every member's metadata, plan, check that the
        members agree, and exchange the payloads the plan moves. Touches no state the training thread reads, so it
        can run ``ahead`` on the planning thread while the previous group trains; what stops it there is raised
        where the training thread takes the group (:meth:`_taken`)."""
        start = {"loader": self.loader.state_dict(), "carry": list(carry), "group": number}
        started = time.perf_counter()
        counts = dict.fromkeys(("skipped", "truncated", "dropped"), 0)
        samples = [pickle.loads(b) for b in carry]
        failure, fresh = None, []
        try:
            fresh = [next(records) for _ in range(self._fresh_count(len(carry)))]
            samples += [self._admit(record, counts) for record in fresh]
        except Exception as error:  # a setting the data contradicts: every member of the group must stop
            failure, samples = error, []
        # Only a group of ranks that plans moves can send a payload; others skip serialising.
        moves = self.group is not None and self.settings.reorder
        wires = [_Wire(s) if moves and s is not None else None for s in samples]
        if failure is not None and ahead:
            log.warning("reading the samples of group %d failed (%s): the job stops when training reaches it", number,
                        failure)
        gathered = self._all_gather(self._rows(samples, wires), failure, settle=not ahead)
        plan = self._plan(gathered, number)
        check_plans_agree("loader's reordering plan", _assignment_digest(plan), self.group,
                          device=torch.device("cpu"))  # a gloo group: the loader exchanges host tensors
        owned = self._owned_ids(gathered)
        local = {i: samples[i - owned.start] for i in owned if samples[i - owned.start] is not None}
        outgoing = {i: wires[i - owned.start] for i in local}
        everything = {**local, **self._exchange(outgoing, gathered, plan)}
        return _PlannedGroup(
            start=start, read_counts=counts, gathered=gathered, plan=plan, samples=everything,
            deltas=self._position_deltas(fresh, samples[len(samples) - len(fresh):], local, plan),
            carry=[pickle.dumps(local[i], protocol=pickle.HIGHEST_PROTOCOL) for i in plan.leftover if i in local],
            seconds=time.perf_counter() - started,
        )

    def _train_group(self, planned: _PlannedGroup, skip: int) -> Iterator[dict[str, Any]]:
        """This rank's packed micro-batches of a planned group, after the first ``skip`` (already trained)."""
        # The counters as they stood before the group was read, then its reading and plan counted, as if it had
        # been read only now: a resume from this group's start replays its reading.
        group_start = {**planned.start, "counters": dict(self.counters)}
        for name, count in planned.read_counts.items():
            self.counters[name] += count
        plan, gathered, rank = planned.plan, planned.gathered, self._rank()
        self.counters["samples_moved"] += plan.samples_moved
        self.counters["bytes_moved"] += plan.bytes_moved
        yielded = 0
        # Skips while reading count in the group's first step (they happened while reading it).
        read_skips = planned.read_counts["skipped"]
        decoded = self._decode_in_background(planned.samples, plan.micro_batches[rank])
        for step, micro_batches in enumerate(plan.micro_batches[rank]):
            trained = [[s for s in (self._take(decoded, i) for i in ids) if s is not None] for ids in micro_batches]
            # A payload that did not decode as planned is skipped in the step that planned it.
            decode_skips = sum(len(ids) for ids in micro_batches) - sum(len(s) for s in trained)
            self.counters["skipped"] += decode_skips
            step_mean = float(plan.step_cost[:, step].mean()) or 1.0
            encoder, llm = self._module_costs(gathered, [i for ids in micro_batches for i in ids])
            stats = {  # relative to the step's mean over the reorder group's ranks
                "predicted_cost": float(plan.step_cost[rank, step]) / step_mean,
                "predicted_encoder_cost": encoder / step_mean,
                "predicted_llm_cost": llm / step_mean,
                "predicted_imbalance": float(plan.step_cost[:, step].max()) / step_mean,
                "reorder_seconds": planned.seconds,
                **{k: float(v) for k, v in self.counters.items()},
            }
            packed = [_pack(samples, self.packing) for samples in trained]
            counts = data_counts([s for samples in trained for s in samples], packed, self.packing,
                                 skipped=(read_skips if step == 0 else 0) + decode_skips)
            # The module divides by the step's loss tokens (all micro-batches, all ranks), not each micro-batch's,
            # so accumulated gradients equal one pass over the whole step however the samples were split.
            totals = {"loss_tokens": sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in packed),
                      "micro_batches": len(packed)}
            delta = {POSITION_DELTA_KEY: planned.deltas[step]}  # rides the step's first batch
            if self.settings.pp > 1:  # a pipeline schedule takes the whole step at once, in 1F1B order
                yielded += len(packed)
                self._state = {**group_start, "yielded": yielded}
                if yielded > skip:
                    yield {"micro_batches": packed, "num_samples": sum(b["num_samples"] for b in packed),
                           "reorder": stats, "step": totals, "data": counts, **delta}
                continue
            for index, batch in enumerate(packed):
                yielded += 1
                self._state = {**group_start, "yielded": yielded}
                if yielded > skip:
                    yield {**batch, "reorder": stats, "step": totals, "data": counts, **delta,
                           GROUP_WORK_KEY: self._group_work(gathered, plan, step, index)}
                delta = {}

    def _position_deltas(self, fresh: list[DecodedSample | BadSample], admitted: list[DecodedSample | None],
                         local: dict[int, DecodedSample], plan: GroupPlan) -> list[PositionDelta]:
        """What each step of the group moves this rank's position by (see :mod:`~omni_lightning.data.position`):
        the records read for the group, and those skipped while reading, in the first step; in every step, this
        rank's samples that train in it, on whichever rank. Its leftovers stay pending."""
        skipped = [record.source for record, sample in zip(fresh, admitted, strict=True) if sample is None]
        deltas = []
        for step in range(self.settings.group_steps):
            trained = [local[i].source for steps in plan.micro_batches for ids in steps[step] for i in ids
                       if i in local]
            first = step == 0
            deltas.append(PositionDelta(read=[r.source for r in fresh] if first else (),
                                        trained=trained + skipped if first else trained))
        return deltas

    # ------------------------------------------------------------------------------------------------ decoding
    def _decode_in_background(self, samples: dict[int, DecodedSample], steps: list[list[list[int]]]
                              ) -> dict[int, Future[DecodedSample] | DecodedSample]:
        """This rank's samples of the group, decoding in worker threads in the order they train (pixels, frames and
        waveforms are decoded once, by the rank that trains them, after the plan, while earlier steps train)."""
        if self.decode is None:
            return dict(samples)
        if self._decoders is None:
            self._decoders = ThreadPoolExecutor(max_workers=2, thread_name_prefix="omni-decode")
        order = [i for micro_batches in steps for ids in micro_batches for i in ids]
        return {i: self._decoders.submit(self.decode, samples[i]) for i in order}

    def _take(self, decoded: dict[int, Future[DecodedSample] | DecodedSample], index: int) -> DecodedSample | None:
        """Sample ``index`` decoded, or ``None`` where its payload did not decode as planned (counted, logged)."""
        item = decoded[index]
        if not isinstance(item, Future):
            return item
        try:
            return item.result()
        except ValueError as error:
            log.warning("skipping a sample after the plan: %s", error)
            return None

    # ------------------------------------------------------------------------------------------------ steps
    def _fresh_count(self, carried: int) -> int:
        return max(self.settings.samples_per_step * self.settings.group_steps - carried, 0)

    def _admit(self, record: DecodedSample | BadSample, counts: dict[str, int]) -> DecodedSample | None:
        """The sample to plan with, or ``None`` for one skipped (bad) or dropped (too long): counted in ``counts``,
        logged."""
        if isinstance(record, BadSample):
            counts["skipped"] += 1
            log.warning("skipping sample %s of shard %s: %s", record.key, record.shard, record.reason)
            return None
        sample, outcome = apply_length_policy(
            record, self.settings.max_seq_len, self.settings.length_policy, self.packing
        )
        if outcome:
            counts[outcome] += 1
        return sample

    def _group_work(self, gathered: np.ndarray, plan: GroupPlan, step: int, index: int) -> dict[str, Any]:
        """Every rank's cost features of its micro-batch ``index`` of ``step`` (they train side by side), with the
        group's global ranks (:data:`~omni_lightning.batch.GROUP_WORK_KEY`)."""
        work = np.zeros((len(plan.micro_batches), self._features.stop - self._features.start), dtype=np.int64)
        for rank, steps in enumerate(plan.micro_batches):
            if index < len(steps[step]):
                work[rank] = gathered[steps[step][index], self._features].sum(axis=0)
        return {"ranks": self._global_ranks, "encoders": list(self.cost_model.encoder_names), "work": work}

    def _rows(self, samples: list[DecodedSample | None], wires: list[_Wire | None]) -> np.ndarray:
        """int64 per sample: valid, the cost features, LLM tokens, owner rank, approximate payload bytes, and the
        exact size it would travel with (0 where it cannot travel)."""
        rank = self._rank()
        width = self._wire + 1
        table = np.zeros((len(samples), width), dtype=np.int64)
        for row, (sample, wire) in enumerate(zip(samples, wires, strict=True)):
            table[row, self._owner] = rank
            if sample is None:
                continue
            # The cost model's features (see omni_lightning.balance.cost.work_features), from the payload itself.
            features = sample_features(sample, self.cost_model.encoder_names, self.packing)
            table[row, 0] = 1
            table[row, self._features] = features.astype(np.int64)
            table[row, self._tokens] = int(features[-2])
            table[row, self._bytes] = sum(a.nbytes for a in _arrays(sample))
            table[row, self._wire] = 0 if wire is None else wire.nbytes
        return table

    def _all_gather(self, rows: np.ndarray, failure: BaseException | None = None, *, settle: bool = True
                    ) -> np.ndarray:
        """Every member's rows, rank-major. Only integers travel: a few dozen bytes per sample.

        A member whose reading failed (``failure``) still takes part, with a count of -1, so that every member raises
        :class:`_ReadingFailed` here and none waits in a collective the others never issue. While the members wait
        for the slowest reader, a failure another rank posts in the job's failure notice (say, a checkpoint it could
        not write) raises :class:`JobStopped` at once instead of at the process group's timeout (see
        :mod:`~omni_lightning.data.failure_notice`; ``settle``: see ``FailureNotice.raise_if_stopped``).
        """
        if self.group is None:
            if failure is not None:
                raise _ReadingFailed([dist.get_rank() if dist.is_initialized() else 0], failure)
            return rows
        size, columns = dist.get_world_size(self.group), rows.shape[1]
        # A buffer holds a group's worth of samples, more only when more were carried in. So one collective of that
        # many rows, behind a row with the true count, covers the usual case; a longer buffer sends the rest in a
        # second one, which every member issues because all of them see the counts of the first.
        block = self.settings.samples_per_step * self.settings.group_steps
        first = torch.zeros(block + 1, columns, dtype=torch.int64)
        first[0, 0] = -1 if failure is not None else rows.shape[0]
        first[1 : 1 + min(rows.shape[0], block)] = torch.from_numpy(rows[:block])
        out = torch.empty(size * (block + 1), columns, dtype=torch.int64)
        if self.notice is None:
            all_gather_single(out, first, group=self.group)
        else:  # the ranks wait here for the slowest reader: in slices, reading the failure notice between them
            self.notice.wait(all_gather_single(out, first, group=self.group, async_op=True), settle=settle)
        heads = out.view(size, block + 1, columns).numpy()
        lengths = heads[:, 0, 0].tolist()
        if failed := [dist.get_global_rank(self.group, r) for r, n in enumerate(lengths) if n < 0]:
            raise _ReadingFailed(failed, failure)
        parts = [heads[r, 1 : 1 + min(n, block)] for r, n in enumerate(lengths)]
        longest = max(lengths)
        if longest > block:
            extra = rows[block:]
            rest = torch.zeros(longest - block, columns, dtype=torch.int64)
            rest[: len(extra)] = torch.from_numpy(extra)
            tails = torch.empty(size * (longest - block), columns, dtype=torch.int64)
            all_gather_single(tails, rest, group=self.group)
            tail = tails.view(size, longest - block, columns).numpy()
            parts = [np.concatenate([parts[r], tail[r, : max(n - block, 0)]]) for r, n in enumerate(lengths)]
        return np.concatenate(parts)

    def _plan(self, gathered: np.ndarray, group_number: int) -> GroupPlan:
        valid = np.flatnonzero(gathered[:, 0])
        n_ranks = 1 if self.group is None else dist.get_world_size(self.group)
        config = ReorderConfig(
            steps=self.settings.group_steps,
            micro_batches=self.settings.micro_batches,
            token_budget=self.settings.token_budget,
            pp=self.settings.pp,
            pipeline_order=self.settings.pipeline_order,
            link=self.settings.link,
            encoder_peers=self.settings.encoder_peers,
        )
        features = gathered[valid, self._features].astype(np.float64)
        costs = features @ self.cost_model.coefficients
        tokens, owners = gathered[valid, self._tokens], gathered[valid, self._owner]
        if self.settings.reorder:
            # The LLM's (tokens, pairs) are the last two features.
            llm = self.settings.llm_micro_batches
            llm_costs = features[:, -2:] @ self.cost_model.coefficients[-2:] if llm else None
            plan = plan_reorder_group(
                costs, tokens, owners, gathered[valid, self._bytes], n_ranks=n_ranks, config=config,
                seed=self.seed, epoch=group_number, group_index=self.group_index, micro_batch_costs=llm_costs,
                searched_rank=self._rank(),  # the 1F1B search shapes this rank's micro-batches only
            )
        else:
            plan = plan_in_place(costs, tokens, owners, n_ranks=n_ranks, config=config)
        # Plans index the valid rows; translate back to positions in the gathered arrays.
        plan.micro_batches = [[[valid[mb].tolist() for mb in step] for step in rank] for rank in plan.micro_batches]
        plan.leftover = valid[plan.leftover].tolist()
        return plan

    def _exchange(self, outgoing: dict[int, _Wire], gathered: np.ndarray, plan: GroupPlan) -> dict[int, DecodedSample]:
        """Send every planned sample to its rank; returns the samples received, by id.

        Both sides know from the plan which samples travel between them, in id order, and from the gathered
        metadata the size of each: one ``all_to_all_single`` carries the bytes.
        """
        if self.group is None:
            return {}
        rank, size = self._rank(), dist.get_world_size(self.group)
        destination = np.full(gathered.shape[0], -1)
        for r, steps in enumerate(plan.micro_batches):
            for step in steps:
                for ids in step:
                    destination[ids] = r
        owner, nbytes = gathered[:, self._owner], gathered[:, self._wire]
        moving = (destination >= 0) & (destination != owner)
        if not moving.any():
            return {}  # every member derives the same plan, so all of them skip the collective
        send_ids = [np.flatnonzero(moving & (owner == rank) & (destination == r)) for r in range(size)]
        recv_ids = [np.flatnonzero(moving & (owner == r) & (destination == rank)) for r in range(size)]
        send_splits = [int(nbytes[ids].sum()) for ids in send_ids]
        recv_splits = [int(nbytes[ids].sum()) for ids in recv_ids]
        send = torch.zeros(sum(send_splits), dtype=torch.uint8)  # zeroed: alignment padding travels too
        buffer, offset = memoryview(send.numpy()), 0
        for i in np.concatenate(send_ids).tolist():
            outgoing[i].write(buffer, offset)
            offset += int(nbytes[i])
        out = torch.empty(sum(recv_splits), dtype=torch.uint8)
        dist.all_to_all_single(out, send, recv_splits, send_splits, group=self.group)
        received, offset, data = {}, 0, memoryview(out.numpy())
        for i in np.concatenate(recv_ids).tolist():
            received[i] = _Wire.read(data, offset, int(nbytes[i]))
            offset += int(nbytes[i])
        return received

    def _module_costs(self, gathered: np.ndarray, ids: list[int]) -> tuple[float, float]:
        """Predicted (encoders, LLM) cost of the given samples."""
        per_feature = gathered[ids, self._features].astype(np.float64).sum(axis=0) * self.cost_model.coefficients
        return float(per_feature[:-2].sum()), float(per_feature[-2:].sum())

    def _rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    def _owned_ids(self, gathered: np.ndarray) -> range:
        mine = np.flatnonzero(gathered[:, self._owner] == self._rank())
        return range(int(mine[0]), int(mine[-1]) + 1) if mine.size else range(0)
