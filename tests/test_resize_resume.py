"""Exact resume across data-parallel sizes: a checkpoint saved with N data-parallel ranks resumes with M (4 -> 2
through a pipeline change, 2 -> 4, 4 -> 3), and the rest of the epoch trains every sample the interrupted run had not
trained exactly once, none twice, counted by the (shard, epoch, index) of every sample trained in both runs.

The pieces first: the rank-independent position (pure), then the loaders in one process (each old rank's stream, its
position merged, each new rank's stream started from it; reordering within a rank, carried samples, token budgets),
then Lightning runs whose reorder groups move samples across ranks."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning_runs import fit
from torchdata.stateful_dataloader import StatefulDataLoader

from omni_lightning import OmniDataModule, ReferenceMLLMConfig
from omni_lightning.data.position import (
    DataPosition,
    PositionDelta,
    PositionMismatch,
    SampleSource,
    merge_positions,
    shard_list_digest,
)
from omni_lightning.data.reorder_stream import ReorderedStream, ReorderSettings
from omni_lightning.data.resumable import ResumableLoader, commit_consumed
from omni_lightning.data.streaming import SampleStream, ShardStream
from omni_lightning.data.synthetic import make_synthetic_shards
from omni_lightning.modalities import DEFAULT_PACKING
from omni_lightning.models.flops import reference_cost_model

SHARDS, PER_SHARD = 12, 6
SAMPLES = {(shard, index) for shard in range(SHARDS) for index in range(PER_SHARD)}


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return [str(p) for p in make_synthetic_shards(tmp_path_factory.mktemp("resize"), workload="omni_mix",
                                                  num_shards=SHARDS, samples_per_shard=PER_SHARD, seed=11,
                                                  length_scale=0.03, max_llm_tokens=160)]


# ------------------------------------------------------------------------------------------------ the position
def test_a_position_is_the_frontier_of_what_was_read_less_what_is_pending() -> None:
    position = DataPosition("d")
    position.apply(PositionDelta(read=[SampleSource(3, 0, 0), SampleSource(3, 0, 1), SampleSource(5, 0, 0, True)],
                                 trained=[SampleSource(3, 0, 0), SampleSource(5, 0, 0, True)]))
    assert position.frontier == {3: (0, 2), 5: (1, 0)} and position.pending == {(3, 0, 1)}
    assert position.is_done(3, 0, 0) and not position.is_done(3, 0, 1) and not position.is_done(3, 0, 2)
    assert position.pass_done(5, 0) and not position.pass_done(5, 1) and not position.pass_done(3, 0)
    assert position.first_open_epoch([3, 5]) == 0 and position.first_open_epoch([5]) == 1
    assert DataPosition.from_state(json.loads(json.dumps(position.to_state()))) == position
    other = DataPosition("d", {4: (2, 3)}, {(4, 1, 5)})
    merged = merge_positions([position, other, position.restricted_to([3])])  # peers repeat a position: harmless
    assert merged.frontier == {3: (0, 2), 5: (1, 0), 4: (2, 3)} and merged.pending == {(3, 0, 1), (4, 1, 5)}
    assert merged.first_open_epoch([4]) == 1 and merged.restricted_to([4]).frontier == {4: (2, 3)}
    with pytest.raises(ValueError, match="different shard lists"):
        merge_positions([position, DataPosition("e")])
    position.apply(PositionDelta(read=[None]))  # a source without positions: the position cannot resume
    assert not position.tracked


# ------------------------------------------------------------------------------------------------ one process
COST = reference_cost_model(ReferenceMLLMConfig.tiny())


def _reordered(paths: list[str], rank: int, size: int, budget: int | None) -> ResumableLoader:
    samples = SampleStream(paths, dp_rank=rank, dp_size=size, batch_size=1, packing=DEFAULT_PACKING,
                           on_bad_sample="skip")
    loader = StatefulDataLoader(samples, batch_size=None, collate_fn=lambda item: item)
    return ResumableLoader(ReorderedStream(loader, group=None, group_index=0, cost_model=COST, packing=DEFAULT_PACKING,
                                           settings=ReorderSettings(samples_per_step=2, group_steps=3,
                                                                    token_budget=budget)))


def _plain(paths: list[str], rank: int, size: int, budget: int | None) -> ResumableLoader:
    return ResumableLoader(StatefulDataLoader(ShardStream(paths, dp_rank=rank, dp_size=size, batch_size=2),
                                              batch_size=None))


def _train(loaders: list[ResumableLoader], steps: int, trained: list[SampleSource]) -> None:
    """Lightning's loop on every rank: fetch a batch ahead, commit the one trained on."""
    for loader in loaders:
        batches = iter(loader)
        for batch in itertools.islice(batches, steps):
            commit_consumed(batch)
            trained.extend(batch["sources"])
        next(batches)  # prefetched, never trained


def _first_epoch_once(trained: list[SampleSource]) -> None:
    counts = Counter((s.shard, s.index) for s in trained if s.epoch == 0)
    assert set(counts) == SAMPLES, f"lost {sorted(SAMPLES - set(counts))}"
    assert not [k for k, n in counts.items() if n > 1], "trained twice"


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(old=st.integers(1, 4), new=st.integers(1, 5), steps=st.integers(0, 14), budget=st.sampled_from([None, 150]),
       reordered=st.booleans())
def test_loaders_resumed_with_another_rank_count_train_the_rest_once(shards: list[str], old: int, new: int,
                                                                     steps: int, budget: int | None,
                                                                     reordered: bool) -> None:
    """Ranks reorder their own steps (a token budget carries samples over to later groups), or stream plainly."""
    make = _reordered if reordered else _plain
    trained: list[SampleSource] = []
    interrupted = [make(shards, rank, old, budget) for rank in range(old)]
    _train(interrupted, steps, trained)
    merged = merge_positions(DataPosition.from_state(loader.state_dict()["position"]) for loader in interrupted)
    resumed = [make(shards, rank, new, budget) for rank in range(new)]
    for loader in resumed:
        loader.load_state_dict({"resume_from": merged.to_state()})
    _train(resumed, SHARDS * PER_SHARD // new + 8, trained)  # every new rank through its share of the epoch
    _first_epoch_once(trained)


def test_a_position_of_other_shards_restarts_the_stream_with_a_warning(shards: list[str]) -> None:
    saved = DataPosition(shard_list_digest(shards[:-1]), {0: (0, 3)})
    loader = _plain(shards, 0, 2, None)
    with pytest.warns(UserWarning, match="the loader position was saved for another shard list .* restarts from the "
                                         "beginning of the data"):
        loader.load_state_dict({"resume_from": saved.to_state()})
    first = next(iter(loader))
    assert [s.epoch for s in first["sources"]] == [0, 0] and first["sources"][0].index == 0
    with pytest.raises(PositionMismatch):
        ShardStream(shards, dp_rank=0, dp_size=1, batch_size=1).resume_from(saved)


# ------------------------------------------------------------------------------------------------ Lightning
class RecordSources(pl.Callback):
    """Every rank writes its data-parallel rank and the (shard, epoch, index) of each sample it trains, by step."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.steps: dict[int, list[list[int]]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        micro_batches = batch.get("micro_batches", [batch])
        self.steps[trainer.global_step + 1] = [list(s[:3]) for mb in micro_batches for s in mb["sources"]]
        record = {"dp_rank": trainer.strategy.distributed_sampler_kwargs["rank"], "steps": self.steps}
        (self.out_dir / f"sources_rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _trained(run: Path, up_to: int | None = None) -> list[SampleSource]:
    """What the run trained (each data-parallel rank once: its tensor and pipeline peers train the same samples)."""
    by_dp: dict[int, dict[str, list[list[int]]]] = {}
    for path in sorted(run.glob("sources_rank*.json")):
        record = json.loads(path.read_text())
        by_dp.setdefault(record["dp_rank"], record["steps"])
    return [SampleSource(*s) for steps in by_dp.values() for step, sources in steps.items()
            if up_to is None or int(step) <= up_to for s in sources]


def _data(shards: list[str]) -> OmniDataModule:
    return OmniDataModule(shards, samples_per_step=2, group_steps=2, reorder_group_size=None)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, shards: list[str], seed_checkpoint: Path) -> dict[int, Path]:
    """Runs on 4 and on 2 data-parallel ranks, each checkpointed at step 3: half-way through its second reorder
    group (a group plans 2 steps), so samples are read but not yet trained."""
    runs = {}
    for ranks in (4, 2):
        run = tmp_path_factory.mktemp(f"saved{ranks}")
        fit(run, "", seed_checkpoint, layout={"dp_shard": ranks}, devices=ranks, max_steps=3, datamodule=_data(shards),
            callbacks=[RecordSources(run), pl.callbacks.ModelCheckpoint(dirpath=run / "ckpt", every_n_train_steps=3)])
        runs[ranks] = run
    return runs


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("old", "layout", "devices"), [
    (4, {"dp_shard": 2, "pp": 2}, 4),  # 4 -> 2, through a pipeline change
    (2, {"dp_shard": 4}, 4),
    (4, {"dp_shard": 3}, 3),
], ids=["4-to-2-pp2", "2-to-4", "4-to-3"])
def test_another_data_parallel_size_trains_the_rest_of_the_epoch_once(saved: dict[int, Path], old: int,
                                                                      layout: dict[str, int], devices: int,
                                                                      shards: list[str], seed_checkpoint: Path,
                                                                      tmp_path: Path) -> None:
    (checkpoint,) = (saved[old] / "ckpt").glob("*.ckpt")
    ranks = torch.load(checkpoint / "meta.pt", weights_only=False)["omni"]["ranks"]
    assert any(rank["loader"][0]["position"]["pending"] for rank in ranks), "no sample read but not yet trained"
    before = _trained(saved[old], up_to=3)
    assert len({s.id for s in before}) == len(before) >= 3 * old  # the plan evens costs, not counts
    new = layout["dp_shard"]
    # The most any new rank has left of the epoch is a share of the shards, read 2 samples a step; plus a group.
    steps = -(-SHARDS // new) * PER_SHARD // 2 + 2
    fit(tmp_path, "", seed_checkpoint, layout=layout, devices=devices, max_steps=3 + steps, datamodule=_data(shards),
        callbacks=[RecordSources(tmp_path)], ckpt_path=str(checkpoint))
    _first_epoch_once(before + _trained(tmp_path))
