"""One rank's failure stops every rank of the job within seconds, each quoting it: a shard read that stalls
(``read_timeout``) and data a rank's settings cannot read (a dialogue without a chat template), under the reordering
data module (the other ranks wait for the failed one in the reorder group's gather) and under plain streams or
one-rank reorder groups (they wait in the model's collectives, which no loader collective breaks). All of it well
before the process-group timeout (120 s here)."""

from __future__ import annotations

import io
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from lightning_runs import fit, record_worker_errors
from PIL import Image

from omni_lightning import OmniDataModule, WebDataModule
from omni_lightning.data.failure_notice import Failure, FailureNotice, JobStopped
from omni_lightning.data.jsonl import write_shard
from omni_lightning.data.streaming import ShardStream, StalledRead, open_shard
from omni_lightning.data.synthetic import make_synthetic_shards

pytestmark = pytest.mark.distributed

RANKS = 2
READ_TIMEOUT = 2.0


def _jpeg(height: int, width: int, seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()


@pytest.fixture(scope="module")
def good_shard(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("good")
    (path,) = make_synthetic_shards(out, workload="omni_mix", num_shards=1, samples_per_shard=12, seed=3,
                                    length_scale=0.03, max_llm_tokens=160)
    return str(path)


@pytest.fixture(scope="module")
def layout_shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Image-text pairs (rank 0's shard) and dialogues (rank 1's), which the byte tokenizer cannot render."""
    out = tmp_path_factory.mktemp("layouts")
    pairs = [{"__key__": f"pair{i}", "jpg": _jpeg(40, 56, i), "txt": b"A cat sits on a mat."} for i in range(8)]
    dialogue = {"messages": [{"role": "user", "content": "<image> ?"}, {"role": "assistant", "content": "A cat."}],
                "images": ["0.jpg"]}
    chats = [{"__key__": f"chat{i}", "json": json.dumps(dialogue).encode(), "0.jpg": _jpeg(40, 40, i)}
             for i in range(8)]
    write_shard(out / "mixed-000000.tar", pairs)
    write_shard(out / "mixed-000001.tar", chats)
    return [str(out / "mixed-000000.tar"), str(out / "mixed-000001.tar")]


def _stalling_shard(folder: Path) -> str:
    """A shard whose storage never answers: a FIFO nobody writes, so opening it blocks (as a hung NFS open does)."""
    path = folder / "stalled-000001.tar"
    os.mkfifo(path)
    return str(path)


def _errors(out: Path) -> dict[int, tuple[float, str, str]]:
    return {int(p.stem.removeprefix("error_rank")): tuple(json.loads(p.read_text()))
            for p in out.glob("error_rank*.json")}


def _fails_together(out: Path, seed: Path, datamodule: Any) -> tuple[str, dict[int, tuple[float, str, str]]]:
    """Fit 3 steps on 2 ranks, which must fail: the launcher's error and each rank's (time, type, message)."""
    out.mkdir(parents=True, exist_ok=True)
    with record_worker_errors(out), pytest.raises(Exception) as raised:
        fit(out, "", seed, layout={"dp_shard": RANKS}, devices=RANKS, max_steps=3, datamodule=datamodule)
    return str(raised.value), _errors(out)


def _assert_every_rank_quotes(errors: dict[int, tuple[float, str, str]], kind: str, cause: str) -> None:
    """Rank 1 raised its own error; rank 0 raised JobStopped quoting it, within a few seconds."""
    assert sorted(errors) == [0, 1], errors
    failed_at, failed_kind, failed_message = errors[1]
    assert failed_kind == kind and re.search(cause, failed_message), errors[1]
    stopped_at, stopped_kind, stopped_message = errors[0]
    assert stopped_kind == "JobStopped", errors[0]
    assert stopped_message.startswith(f"rank 0 stops because rank 1 failed: {kind}: "), stopped_message
    assert re.search(cause, stopped_message), stopped_message
    assert stopped_at - failed_at < 5, (stopped_at, failed_at)


@pytest.mark.parametrize("reading", ["reorder group", "plain stream"])
def test_a_stalled_read_fails_every_rank_naming_the_rank_and_the_shard(reading: str, tmp_path: Path,
                                                                        good_shard: str, seed_checkpoint: Path
                                                                        ) -> None:
    """Rank 1's shard never answers: after read_timeout it raises StalledRead naming itself, the shard and the time
    waited; rank 0, waiting for it in the reorder group's gather or in the model's first collective, stops quoting
    it."""
    shards = [good_shard, _stalling_shard(tmp_path)]
    data = (OmniDataModule(shards, samples_per_step=2, group_steps=2, reorder_group_size=None,
                           read_timeout=READ_TIMEOUT) if reading == "reorder group"
            else WebDataModule(shards, batch_size=2, read_timeout=READ_TIMEOUT))
    started = time.time()
    launcher_error, errors = _fails_together(tmp_path / "run", seed_checkpoint, data)
    cause = (r"rank 1 \(data-parallel rank 1 of 2\): reading shard \S+stalled-000001.tar made no progress for 2 s "
             r"\(read_timeout=2\)")
    _assert_every_rank_quotes(errors, "StalledRead", cause)
    assert re.search(cause, launcher_error), launcher_error
    assert max(at for at, _, _ in errors.values()) - started < 45  # start-up, 2 s of stall; the group timeout: 120 s


@pytest.mark.parametrize("reading", ["one-rank reorder groups", "plain stream"])
def test_a_setting_the_data_contradicts_stops_every_rank(reading: str, tmp_path: Path, layout_shards: list[str],
                                                         seed_checkpoint: Path) -> None:
    """Rank 1 reads dialogues, which need a chat template the byte tokenizer lacks; rank 0 reads pairs and waits for
    rank 1 in the model's collectives. Both stop: rank 1 with the error, rank 0 quoting it."""
    data = (OmniDataModule(layout_shards, samples_per_step=2, group_steps=2, reorder_group_size=1)
            if reading == "one-rank reorder groups" else WebDataModule(layout_shards, batch_size=2))
    started = time.time()
    launcher_error, errors = _fails_together(tmp_path / "run", seed_checkpoint, data)
    cause = r"sample chat\d is a conversation, which is rendered with a tokenizer's chat template"
    _assert_every_rank_quotes(errors, "LayoutNeedsProcessor", cause)
    assert re.search(cause, launcher_error), launcher_error
    assert max(at for at, _, _ in errors.values()) - started < 45


def _world_with_a_rank_stuck_for_good(rank: int, world_size: int, out: Path, waiting_in: str) -> None:
    """Rank 1 posts its failure and then never exits (a read stuck in the kernel, which no signal ends); rank 0
    waits for it in a collective: the loader's gather (which reads the notice between slices) or any other."""
    notice = FailureNotice.for_job()
    assert notice is not None
    notice.watch()
    if rank == 1:
        (out / "posted").write_text(repr(time.time()))
        notice.post(StalledRead("reading shard s made no progress for 3 s"))
        time.sleep(60)
        return
    try:
        if waiting_in == "loader gather":
            gathered = torch.empty(world_size, dtype=torch.int64)
            notice.wait(dist.all_gather_into_tensor(gathered, torch.zeros(1, dtype=torch.int64), async_op=True))
        else:
            dist.barrier()
    except JobStopped as stopped:
        (out / "stopped").write_text(json.dumps([time.time(), str(stopped)]))
        raise


@pytest.mark.parametrize("waiting_in", ["loader gather", "another collective"])
def test_a_rank_whose_peer_never_exits_still_stops_quoting_it(waiting_in: str, tmp_path: Path,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    """No broken connection frees rank 0 here: in the loader's gather it raises JobStopped at once; in any other
    collective its watch thread stops the process after the grace period, with the quote on stderr."""
    with pytest.raises(Exception, match="(?i)process 0 terminated with") as raised:
        run_distributed(_world_with_a_rank_stuck_for_good, 2, tmp_path, waiting_in)
    posted = float((tmp_path / "posted").read_text())
    quote = "rank 0 stops because rank 1 failed: StalledRead: reading shard s made no progress for 3 s"
    if waiting_in == "loader gather":
        stopped_at, message = json.loads((tmp_path / "stopped").read_text())
        assert message == quote and stopped_at - posted < 1
    else:
        assert "exit code 1" in str(raised.value)
        assert f"JobStopped: {quote}" in capfd.readouterr().err
        assert time.time() - posted < 15  # the grace period is 5 s


# ------------------------------------------------------------------------------------------------ the pieces
def test_a_read_that_stops_midway_is_a_stall_not_a_broken_shard(tmp_path: Path, good_shard: str) -> None:
    """The storage answers half the shard, then nothing: the samples before the stall come out, then StalledRead
    (never a skipped 'unreadable shard', whatever on_bad_sample says)."""
    fifo = tmp_path / "half.tar"
    os.mkfifo(fifo)
    data = Path(good_shard).read_bytes()
    release = threading.Event()

    def storage() -> None:
        with open(fifo, "wb") as pipe:
            pipe.write(data[: len(data) // 2])
            pipe.flush()
            release.wait(30)  # holds the pipe open: the reader waits for more

    writer = threading.Thread(target=storage, daemon=True)
    writer.start()
    stream = ShardStream([str(fifo)], dp_rank=0, dp_size=1, batch_size=1, read_timeout=0.5, on_bad_sample="skip")
    samples, started = [], time.monotonic()
    with pytest.raises(StalledRead, match=r"^data-parallel rank 0 of 1: reading shard \S+half.tar made no progress "
                                          r"for 0.5 s \(read_timeout=0.5\): its storage stalls$"):
        for record in stream.iter_samples():
            samples.append(record)
    assert 0.5 <= time.monotonic() - started < 5
    assert samples and all(not hasattr(s, "reason") for s in samples)  # whole samples, no bad ones
    release.set()
    writer.join(5)


def test_timed_reads_read_a_healthy_shard_whole(good_shard: str) -> None:
    assert [raw["__key__"] for raw in open_shard(good_shard, read_timeout=5)] == [
        raw["__key__"] for raw in open_shard(good_shard)]


class _Store:
    """A rendezvous store in one process: enough of torch's Store for the notice's posting and reading."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if key not in self.values and expected == "":
            self.values[key] = desired.encode()
        return self.values.get(key, b"")

    def add(self, key: str, amount: int) -> int:
        self.values[key] = str(int(self.values.get(key, b"0")) + amount).encode()
        return int(self.values[key])

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]


def test_the_first_failure_posted_stands_and_others_quote_it() -> None:
    store = _Store()
    first, second, bystander = (FailureNotice(store, rank=r, world_size=3) for r in (2, 0, 1))
    first.post(StalledRead("reading shard s made no progress"))
    second.post(ValueError("a later error"))  # raised by its own rank; the notice keeps the first
    assert bystander.failure() == Failure(2, "StalledRead: reading shard s made no progress")
    stopped = bystander.stopped_by_another_rank(RuntimeError("Connection closed by peer"))
    assert isinstance(stopped, JobStopped)
    assert str(stopped) == "rank 1 stops because rank 2 failed: StalledRead: reading shard s made no progress"
    assert first.stopped_by_another_rank() is None  # its own failure: it raises its own error
    assert bystander.stopped_by_another_rank(stopped) is None  # already the quote
    with pytest.raises(JobStopped, match="rank 1 stops because rank 2 failed"):
        bystander.raise_if_stopped()
