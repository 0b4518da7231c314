"""Streaming data path in one process: shard assignment, per-rank streams, exact resume, the consumed-batch loader
wrapper, WebDataModule's shard generation and the ``make-shards`` command."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader
from webdataset.tariterators import tarfile_samples

from omni_lightning.cli import main
from omni_lightning.data.resumable import MARKER_KEY, ConsumedMarker, ResumableLoader, commit_consumed
from omni_lightning.data.shards import SyntheticShards, expand_shards
from omni_lightning.data.streaming import ShardStream, assign_shards, decode_sample
from omni_lightning.data.synthetic import make_synthetic_shards
from omni_lightning.datamodules.web import WebDataModule

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

NUM_SHARDS, SAMPLES_PER_SHARD = 4, 6
SMALL = {"length_scale": 0.03, "max_llm_tokens": 128}
ALL_KEYS = {f"train-{s:06d}-{i:06d}" for s in range(NUM_SHARDS) for i in range(SAMPLES_PER_SHARD)}

Batch = dict[str, Any]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Four omni-mix shards of six samples (keys ``train-SSSSSS-IIIIII``), shared read-only by this module."""
    out = tmp_path_factory.mktemp("stream_shards")
    return make_synthetic_shards(out, num_shards=NUM_SHARDS, samples_per_shard=SAMPLES_PER_SHARD, **SMALL)


def make_stream(shards: list[str], *, dp_rank: int = 0, dp_size: int = 1, batch_size: int = 2,
                **kwargs: Any) -> ShardStream:
    return ShardStream(shards, dp_rank=dp_rank, dp_size=dp_size, batch_size=batch_size, **kwargs)


def take(batches: Iterable[Batch], n: int) -> list[list[str]]:
    """The sample keys of the next ``n`` batches."""
    return [batch["keys"] for batch in itertools.islice(batches, n)]


def flat(keys: list[list[str]]) -> list[str]:
    return [key for batch in keys for key in batch]


def shard_of(key: str) -> str:
    return key.rsplit("-", 1)[0]


def first_raw_sample(path: str, member: str | None = None) -> dict[str, Any]:
    """The first raw webdataset sample of a shard (the first holding ``member`` if given)."""
    return next(raw for raw in tarfile_samples([{"url": path}]) if member is None or member in raw)


# --- assign_shards and expand_shards ---------------------------------------------------------------------------


@pytest.mark.parametrize(("num_shards", "dp_size", "num_workers"), [(4, 1, 0), (8, 2, 2), (13, 3, 2), (6, 3, 2)])
def test_assign_shards_partitions_every_shard_once(num_shards: int, dp_size: int, num_workers: int) -> None:
    shards = [f"shard-{i}.tar" for i in range(num_shards)]
    everyone: list[str] = []
    for dp_rank in range(dp_size):
        workers = assign_shards(shards, dp_rank=dp_rank, dp_size=dp_size, num_workers=num_workers)
        assert len(workers) == max(num_workers, 1)
        assert all(workers), "every worker needs at least one shard"
        mine = [s for worker in workers for s in worker]
        assert len(set(mine)) == len(mine), "a rank's workers share a shard"
        everyone.extend(mine)
    assert sorted(everyone) == sorted(shards)


def test_assign_shards_rejects_too_few_shards() -> None:
    shards = [f"shard-{i}.tar" for i in range(5)]
    with pytest.raises(ValueError, match=r"5 shards.*3 data-parallel ranks x 2 loader workers") as info:
        assign_shards(shards, dp_rank=0, dp_size=3, num_workers=2)
    assert "at least 6 shards" in str(info.value)
    assert "num_workers" in str(info.value)
    with pytest.raises(ValueError, match="at least 6 shards"):
        ShardStream(shards, dp_rank=0, dp_size=3, batch_size=1, num_workers=2)


def test_expand_shards_patterns(shards: list[str]) -> None:
    folder = Path(shards[0]).parent
    assert expand_shards(str(folder / "train-{000000..000003}.tar")) == shards
    assert expand_shards(str(folder / "train-00000[13].tar")) == [shards[1], shards[3]]
    assert expand_shards(str(folder / "*.tar")) == shards
    assert expand_shards(str(folder)) == shards  # the index json is not a shard
    assert expand_shards([shards[3], str(folder / "train-{000000..000001}.tar")]) == [shards[3], *shards[:2]]
    assert expand_shards(str(folder / "val-*.tar")) == []
    # Brace patterns name files whether or not they exist (stream() reports the missing ones).
    assert expand_shards(str(folder / "val-{0..1}.tar")) == [str(folder / "val-0.tar"), str(folder / "val-1.tar")]


# --- decode_sample ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("member", ["tokens.npy", "json"])
def test_decode_sample_names_a_missing_member(shards: list[str], member: str) -> None:
    raw = first_raw_sample(shards[0])
    del raw[member]
    with pytest.raises(ValueError, match=rf"sample {raw['__key__']}: member '{member}' is missing"):
        decode_sample(raw)


def test_decode_sample_names_a_missing_image(shards: list[str]) -> None:
    raw = first_raw_sample(shards[0], "img0.png")
    del raw["img0.png"]
    with pytest.raises(ValueError, match=rf"sample {raw['__key__']}: member 'img0.png' is missing"):
        decode_sample(raw)


# --- ShardStream -----------------------------------------------------------------------------------------------


def test_data_parallel_ranks_split_the_samples(shards: list[str]) -> None:
    per_epoch = NUM_SHARDS * SAMPLES_PER_SHARD // 2 // 2  # batches of 2 per rank and epoch
    rank_keys = [flat(take(make_stream(shards, dp_rank=r, dp_size=2), per_epoch)) for r in range(2)]
    assert all(len(keys) == len(set(keys)) for keys in rank_keys)
    assert not set(rank_keys[0]) & set(rank_keys[1])
    assert set(rank_keys[0]) | set(rank_keys[1]) == ALL_KEYS


def test_peers_of_one_rank_read_the_same_samples(shards: list[str]) -> None:
    """Two streams of the same data-parallel rank (tensor-parallel peers) agree, across an epoch boundary too."""
    first, second = (take(make_stream(shards, dp_rank=1, dp_size=2), 9) for _ in range(2))
    assert first == second


def test_epochs_reshuffle_shards_and_never_end(shards: list[str]) -> None:
    stream = make_stream(shards)
    batches = iter(stream)
    per_epoch = len(ALL_KEYS) // 2
    epochs = [flat(take(batches, per_epoch)) for _ in range(2)]
    assert stream.state_dict()["epoch"] == 1
    for keys in epochs:
        assert sorted(keys) == sorted(ALL_KEYS)
    orders = [list(dict.fromkeys(shard_of(k) for k in keys)) for keys in epochs]
    assert orders[0] != orders[1]
    # The stream goes on into the next epoch.
    assert len(take(batches, 1)) == 1
    assert stream.state_dict() == {"dp_rank": 0, "dp_size": 1, "epoch": 2, "consumed": 2}


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_stream_resumes_exactly(shards: list[str], k: int) -> None:
    """Batches of 5 over 12 samples per epoch: batch 2 spans the epoch boundary."""
    reference = take(make_stream(shards, dp_rank=1, dp_size=2, batch_size=5), k + 3)
    interrupted = make_stream(shards, dp_rank=1, dp_size=2, batch_size=5)
    batches = iter(interrupted)
    assert take(batches, k) == reference[:k]
    state = interrupted.state_dict()
    resumed = make_stream(shards, dp_rank=1, dp_size=2, batch_size=5)
    resumed.load_state_dict(state)
    assert take(resumed, 3) == reference[k:]


def test_stream_rejects_another_ranks_state(shards: list[str]) -> None:
    state = make_stream(shards, dp_rank=0, dp_size=2).state_dict()
    with pytest.raises(ValueError, match=r"rank 0/2 cannot resume rank 1/2"):
        make_stream(shards, dp_rank=1, dp_size=2).load_state_dict(state)


def test_max_batches_is_a_bounded_pass_from_the_start(shards: list[str]) -> None:
    start = take(make_stream(shards), 3)
    stream = make_stream(shards, max_batches=3)
    assert [b["keys"] for b in stream] == start
    take(stream, 1)  # an abandoned partial pass
    assert [b["keys"] for b in stream] == start
    assert len(list(make_stream(shards, max_batches=20))) == 20  # longer than an epoch


# --- ResumableLoader over StatefulDataLoader -------------------------------------------------------------------


def loader(shards: list[str], *, num_workers: int = 0, **kwargs: Any) -> ResumableLoader:
    stream = make_stream(shards, num_workers=num_workers, **kwargs)
    return ResumableLoader(StatefulDataLoader(stream, batch_size=None, num_workers=num_workers))


def train_with_prefetch(resumable: ResumableLoader, steps: int) -> Batch:
    """Lightning's loop: fetch batch i + 1 before training on batch i. Returns the prefetched, untrained batch."""
    batches = iter(resumable)
    pending = next(batches)
    for _ in range(steps):
        prefetched = next(batches)
        commit_consumed(pending)
        pending = prefetched
    return pending


@pytest.mark.parametrize("steps", [1, 7])
def test_resumable_loader_resumes_after_the_last_committed_batch(shards: list[str], steps: int) -> None:
    """Six batches per epoch on rank 1 of 2, so ``steps=7`` resumes in the second epoch."""
    reference = take(loader(shards, dp_rank=1, dp_size=2), steps + 2)
    interrupted = loader(shards, dp_rank=1, dp_size=2)
    prefetched = train_with_prefetch(interrupted, steps)
    assert prefetched["keys"] == reference[steps]
    state = interrupted.state_dict()
    assert state["inner"] != interrupted.loader.state_dict(), "the inner loader is a batch ahead of training"
    resumed = loader(shards, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert take(resumed, 2) == reference[steps:]


def test_resumable_loader_starts_from_the_start_state(shards: list[str]) -> None:
    reference = take(loader(shards), 2)
    resumable = loader(shards)
    start = resumable.state_dict()
    batches = iter(resumable)
    first = next(batches)
    assert isinstance(first[MARKER_KEY], ConsumedMarker)
    next(batches)
    for not_a_marked_batch in ({"keys": first["keys"]}, {MARKER_KEY: "marker"}, [first], None):
        commit_consumed(not_a_marked_batch)
    assert resumable.state_dict() == start, "nothing was committed"
    resumed = loader(shards)
    resumed.load_state_dict(start)
    assert take(resumed, 2) == reference


def test_resumable_loader_with_worker_processes(shards: list[str]) -> None:
    """Two workers of two shards each, 12 batches an epoch: resume with per-worker positions across the boundary."""
    reference = take(loader(shards, num_workers=2), 14)
    assert sorted(flat(reference[:12])) == sorted(ALL_KEYS)
    interrupted = loader(shards, num_workers=2)
    prefetched = train_with_prefetch(interrupted, 11)
    assert prefetched["keys"] == reference[11]
    resumed = loader(shards, num_workers=2)
    resumed.load_state_dict(interrupted.state_dict())
    assert take(resumed, 3) == reference[11:]


# --- WebDataModule and make-shards -----------------------------------------------------------------------------


def test_prepare_data_writes_missing_shards_with_the_pattern_prefix(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pattern = str(tmp_path / "data" / "val-{000000..000001}.tar")
    synthetic = SyntheticShards(workload="vlm_dynres", num_shards=2, samples_per_shard=2, **SMALL)
    module = WebDataModule(pattern, batch_size=2, synthetic=synthetic)
    module.prepare_data()
    assert sorted(p.name for p in (tmp_path / "data").glob("*.tar")) == ["val-000000.tar", "val-000001.tar"]
    assert take(module.stream(pattern), 2)[0] == ["val-000000-000000", "val-000000-000001"]

    def must_not_run(*args: Any, **kwargs: Any) -> list[str]:
        raise AssertionError("prepare_data rewrote existing shards")

    monkeypatch.setattr("omni_lightning.datamodules.web.make_synthetic_shards", must_not_run)
    module.prepare_data()


@pytest.mark.parametrize("pattern", ["{tmp}", "{tmp}/new_dir", "{tmp}/*.tar"])
def test_prepare_data_fills_an_empty_or_new_shard_directory(tmp_path: Path, pattern: str) -> None:
    synthetic = SyntheticShards(workload="vlm_dynres", num_shards=2, samples_per_shard=2, **SMALL)
    shards = pattern.format(tmp=tmp_path)
    WebDataModule(shards, synthetic=synthetic).prepare_data()
    assert [Path(p).name for p in expand_shards(shards)] == ["train-000000.tar", "train-000001.tar"]


def test_prepare_data_without_synthetic_config_writes_nothing(tmp_path: Path) -> None:
    WebDataModule(str(tmp_path / "train-{000000..000001}.tar")).prepare_data()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("pattern", ["train-{000000..000001}.tar", "*.tar"])
def test_stream_of_missing_shards_points_to_make_shards(tmp_path: Path, pattern: str) -> None:
    module = WebDataModule(str(tmp_path / pattern))
    with pytest.raises(ValueError, match="make-shards"):
        module.stream(module.shards)


def test_train_dataloader_streams_resumable_batches(shards: list[str]) -> None:
    module = WebDataModule(shards, batch_size=3)
    first = next(iter(module.train_dataloader()))
    assert isinstance(first[MARKER_KEY], ConsumedMarker)
    assert first["keys"] == take(make_stream(shards, batch_size=3), 1)[0]


def test_make_shards_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["make-shards", "--out", str(tmp_path), "--workload", "vlm_dynres", "--num-shards", "2",
          "--samples-per-shard", "3", "--length-scale", "0.03", "--max-llm-tokens", "128"])
    assert f"wrote 2 shards to {tmp_path}" in capsys.readouterr().out
    paths = expand_shards(str(tmp_path))
    assert [Path(p).name for p in paths] == ["train-000000.tar", "train-000001.tar"]
    decoded = [decode_sample(raw) for raw in tarfile_samples({"url": p} for p in paths)]
    assert [s.key for s in decoded] == [f"train-{s:06d}-{i:06d}" for s in range(2) for i in range(3)]
    assert all(len(s.tokens) > 0 for s in decoded)
