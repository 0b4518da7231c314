"""ReorderedStream's collectives: the wire format of moved samples, one metadata gather per group (two only when a
buffer outgrows a group), one payload exchange per group, none when nothing moves; planning ahead on a background
thread changes nothing a step trains on or a checkpoint holds."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from torchdata.stateful_dataloader import StatefulDataLoader

from omni_lightning.batch import GROUP_WORK_KEY
from omni_lightning.data.failure_notice import FailureNotice, JobStopped
from omni_lightning.data.layouts import LayoutNeedsProcessor
from omni_lightning.data.packing import DecodedSample
from omni_lightning.data.reorder_stream import ReorderedStream, ReorderSettings, _Wire
from omni_lightning.data.shards import existing_shards
from omni_lightning.data.streaming import SampleStream
from omni_lightning.modalities import DEFAULT_PACKING
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.flops import reference_cost_model
from omni_lightning.runtime.calibration import micro_batch_features

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

COST = reference_cost_model(ReferenceMLLMConfig.tiny())
PACK = DEFAULT_PACKING


def _samples() -> list[DecodedSample]:
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, size=(3, 28, 42, 3), dtype=np.uint8)
    return [
        DecodedSample("image", np.arange(5, 40, dtype=np.int32),
                      images=[rng.integers(0, 255, size=(28, 56, 3), dtype=np.uint8),
                              np.ascontiguousarray(frames[0])[:, ::-1]],  # a view that is not contiguous
                      meta={"modality": "image", "images": [[2, 4], [2, 3]], "nested": {"a": [1, 2]}}),
        DecodedSample("video", np.arange(5, 9, dtype=np.int64), images=list(frames), meta={"video_frames": 3}),
        DecodedSample("audio", np.array([7], dtype=np.int32), mel=rng.random((13, 80)).astype(np.float16)),
        DecodedSample("empty-mel", np.array([9], dtype=np.int32), mel=np.zeros((0, 80), dtype=np.float16)),
    ]


def test_wire_round_trip_gives_aligned_writable_views() -> None:
    samples = _samples()
    wires = [_Wire(s) for s in samples]
    buffer = torch.zeros(sum(w.nbytes for w in wires), dtype=torch.uint8)
    data, offset = memoryview(buffer.numpy()), 0
    for wire in wires:
        assert wire.nbytes % 64 == 0
        wire.write(data, offset)
        offset += wire.nbytes
    offset = 0
    for sample, wire in zip(samples, wires, strict=True):
        back = _Wire.read(data, offset, wire.nbytes)
        offset += wire.nbytes
        assert (back.key, back.meta) == (sample.key, sample.meta)
        assert (back.mel is None) == (sample.mel is None) and len(back.images) == len(sample.images)
        arrays = [back.tokens, *back.images, *([] if back.mel is None else [back.mel])]
        originals = [sample.tokens, *sample.images, *([] if sample.mel is None else [sample.mel])]
        for received, original in zip(arrays, originals, strict=True):
            assert received.dtype == original.dtype and received.shape == original.shape
            np.testing.assert_array_equal(received, original)
            assert received.flags.writeable and received.ctypes.data % 64 == 0
            assert received.size == 0 or np.shares_memory(received, buffer.numpy()), "received arrays are views"


class _NoLoader:
    def state_dict(self) -> dict[str, Any]:
        return {}


def _stream(group: dist.ProcessGroup | None, *, samples_per_step: int, group_steps: int) -> ReorderedStream:
    return ReorderedStream(_NoLoader(), group=group, group_index=0, cost_model=COST,
                          settings=ReorderSettings(samples_per_step=samples_per_step, group_steps=group_steps))


def _counting(name: str, calls: list[str]) -> Callable[..., Any]:
    original = getattr(dist, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return original(*args, **kwargs)

    return counted


def _world_gather(rank: int, world_size: int) -> None:
    stream = _stream(dist.group.WORLD, samples_per_step=2, group_steps=2)  # a group's buffer: 4 samples
    calls: list[str] = []
    dist.all_gather_single = _counting("all_gather_single", calls)  # type: ignore[assignment]
    for lengths, collectives in (((4, 4), 1), ((7, 4), 2), ((4, 5), 2), ((3, 4), 1)):
        rows = [np.arange(n * 11, dtype=np.int64).reshape(n, 11) + 1000 * r for r, n in enumerate(lengths)]
        calls.clear()
        gathered = stream._all_gather(rows[rank])
        np.testing.assert_array_equal(gathered, np.concatenate(rows))
        assert len(calls) == collectives, (lengths, calls)


@pytest.mark.distributed
def test_metadata_gather_is_one_collective_unless_a_buffer_outgrows_a_group() -> None:
    run_distributed(_world_gather, 2)


def _world_collectives(rank: int, world_size: int, shards: str) -> None:
    calls: list[str] = []
    for name in ("all_gather_single", "all_to_all_single"):
        setattr(dist, name, _counting(name, calls))
    paths = existing_shards(shards)
    groups = 3
    for balance in (True, False):
        samples = SampleStream(paths, dp_rank=rank, dp_size=world_size, batch_size=1, packing=PACK)
        loader = StatefulDataLoader(samples, batch_size=None, collate_fn=lambda item: item)
        stream = ReorderedStream(loader, group=dist.group.WORLD, group_index=0, cost_model=COST,
                                settings=ReorderSettings(samples_per_step=2, group_steps=3, reorder=balance,
                                                         plan_ahead=False),  # counted group by group
                                packing=PACK)
        calls.clear()
        iterator = iter(stream)
        batches = [next(iterator) for _ in range(groups * 3)]
        assert calls.count("all_gather_single") == 2 * groups  # the metadata, then the plan's digest
        moved = batches[-1]["reorder"]["samples_moved"]
        assert (moved > 0, calls.count("all_to_all_single")) == ((True, groups) if balance else (False, 0)), calls


@pytest.mark.distributed
def test_one_payload_exchange_per_group_and_none_when_nothing_moves(tiny_shards: str) -> None:
    run_distributed(_world_collectives, 3, tiny_shards)


def _world_group_work(rank: int, world_size: int, shards: str) -> None:
    paths = existing_shards(shards)
    samples = SampleStream(paths, dp_rank=rank, dp_size=world_size, batch_size=1, packing=PACK)
    loader = StatefulDataLoader(samples, batch_size=None, collate_fn=lambda item: item)
    stream = ReorderedStream(loader, group=dist.group.WORLD, group_index=0, cost_model=COST, packing=PACK,
                             settings=ReorderSettings(samples_per_step=1, group_steps=4))
    batches = list(itertools.islice(stream, 24))
    own = [micro_batch_features(batch, PACK).astype(np.int64).tolist() for batch in batches]
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, own)
    words = [batch[GROUP_WORK_KEY] for batch in batches]
    assert all(word["ranks"] == tuple(range(world_size)) for word in words)
    assert all(word["encoders"] == list(COST.encoder_names) for word in words)
    # Each rank's row is what that rank's micro-batch beside this one holds, as the model counts it.
    assert [word["work"].tolist() for word in words] == [list(rows) for rows in zip(*everyone, strict=True)]
    with_items = [bool(word["work"][:, :-2].any()) for word in words]
    assert True in with_items and False in with_items  # micro-batches with and without encoder items


@pytest.mark.distributed
def test_each_micro_batch_carries_every_group_ranks_work_beside_it(tiny_shards: str) -> None:
    run_distributed(_world_group_work, 2, tiny_shards)


def _shard_stream(shards: str, rank: int, world_size: int, *, plan_ahead: bool) -> ReorderedStream:
    samples = SampleStream(existing_shards(shards), dp_rank=rank, dp_size=world_size, batch_size=1, packing=PACK)
    loader = StatefulDataLoader(samples, batch_size=None, collate_fn=lambda item: item)
    return ReorderedStream(loader, group=dist.group.WORLD, group_index=0, cost_model=COST, packing=PACK,
                           settings=ReorderSettings(samples_per_step=2, group_steps=3, plan_ahead=plan_ahead))


def _trained(batch: dict[str, Any]) -> tuple[Any, ...]:
    stats = {k: v for k, v in batch["reorder"].items() if k != "reorder_seconds"}  # a wall time
    return batch["input_ids"].tolist(), batch["labels"].tolist(), stats, batch["step"], batch["data"]


def _world_plan_ahead(rank: int, world_size: int, shards: str) -> None:
    threads: list[str] = []
    gather = dist.all_gather_single

    def named(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return gather(*args, **kwargs)

    dist.all_gather_single = named  # type: ignore[assignment]
    runs = {}
    for plan_ahead in (False, True):
        stream = _shard_stream(shards, rank, world_size, plan_ahead=plan_ahead)
        iterator = iter(stream)
        batches, states = [], []
        for _ in range(12):  # four groups of three steps
            batches.append(_trained(next(iterator)))
            states.append(stream.state_dict())
        iterator.close()  # waits for the fifth group, planned ahead
        runs[plan_ahead] = batches, states
    assert runs[True] == runs[False], "planning ahead changed what trained, or what a checkpoint holds"
    # Without planning ahead, every group is planned on the training thread; with it, all but the first elsewhere.
    main = threading.main_thread().name
    assert threads[:8] == [main] * 8 and threads[8:10] == [main] * 2 and set(threads[10:]) == {"omni-plan-ahead"}
    assert len(threads[10:]) == 2 * 4, "the first group on the training thread, four more planned ahead"
    # Resuming mid-group from a state taken while the next group was being planned ahead.
    resumed = _shard_stream(shards, rank, world_size, plan_ahead=True)
    resumed.load_state_dict(runs[True][1][4])
    iterator = iter(resumed)
    assert [_trained(next(iterator)) for _ in range(7)] == runs[False][0][5:]
    iterator.close()
    # A second iteration, begun while the first is open, goes on from the position; closing the first afterwards
    # leaves the second's group planned ahead alone.
    again = _shard_stream(shards, rank, world_size, plan_ahead=True)
    first = iter(again)
    [next(first) for _ in range(4)]
    second = iter(again)
    taken = [_trained(next(second))]  # the second now plans its next group ahead
    first.close()
    assert taken + [_trained(next(second)) for _ in range(7)] == runs[False][0][4:]
    second.close()


@pytest.mark.distributed
def test_planning_ahead_trains_and_checkpoints_what_planning_in_step_does(tiny_shards: str) -> None:
    run_distributed(_world_plan_ahead, 2, tiny_shards)


class _FailingLoader:
    """Yields this rank's samples; on ``failing_rank`` read ``fail_at`` raises, as a setting the data contradicts."""

    def __init__(self, rank: int, failing_rank: int, fail_at: int) -> None:
        self.rank, self.failing_rank, self.fail_at = rank, failing_rank, fail_at

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __iter__(self) -> Any:
        text = DecodedSample("text", np.arange(5, 20, dtype=np.int64))
        for read in itertools.count():
            if self.rank == self.failing_rank and read == self.fail_at:
                raise LayoutNeedsProcessor("sample chat7 of shard s.tar is a dialogue: pass "
                                           "OmniDataModule(processor=PATH)")
            yield text


def _world_failure(rank: int, world_size: int, fail_at: int, steps_taken: int) -> None:
    """Groups of 2 steps of 2 samples: read 1 fails in the first group (planned on the training thread), read 5 in
    the second (planned ahead while the first trains); ``steps_taken`` steps are asked for, the last raising unless
    it is 2 (training ended before the group that could not be read: the stream is closed without an error)."""
    notice = FailureNotice.for_job()
    assert notice is not None
    notice.watch()
    stream = ReorderedStream(_FailingLoader(rank, failing_rank=1, fail_at=fail_at), group=dist.group.WORLD,
                             group_index=3, cost_model=COST, notice=notice,
                             settings=ReorderSettings(samples_per_step=2, group_steps=2))
    iterator = iter(stream)
    started = time.monotonic()
    if fail_at >= 4:  # the first group trains on every rank
        assert [next(iterator)["num_samples"] for _ in range(2)] == [2, 2]
    if steps_taken == 2:
        iterator.close()
        assert time.monotonic() - started < 10
        assert notice.failure() is None, "a group no step trains on stops nothing"
        return
    expected = LayoutNeedsProcessor if rank == 1 else JobStopped
    with pytest.raises(expected, match=r"chat7 of shard s\.tar .*processor=PATH") as raised:
        next(iterator)
    assert time.monotonic() - started < 10, "the other members stop at once, not at the process-group timeout"
    if rank != 1:
        assert str(raised.value).startswith("rank 0 stops because rank 1 failed: LayoutNeedsProcessor: sample chat7")


@pytest.mark.distributed
@pytest.mark.parametrize(("fail_at", "steps_taken"), [(1, 1), (5, 3), (5, 2)])
def test_a_rank_that_fails_reading_stops_its_whole_reorder_group(fail_at: int, steps_taken: int) -> None:
    run_distributed(_world_failure, 2, fail_at, steps_taken)
