"""Sharded checkpoints: kill after step 5 and resume to step 10 exactly; resume under another layout."""

from __future__ import annotations

import copy
import glob
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_runs import BATCH_SIZE, KillAtStep, RecordRun, Snapshot, assert_restored_exactly, fit

from omni_lightning.data.position import DataPosition
from omni_lightning.strategies.checkpointing import loader_state_for_rank

pytestmark = pytest.mark.distributed

LAYOUT = {"dp_shard": 4}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_shards: str, seed_checkpoint: Path) -> dict[str, Path]:
    """An uninterrupted 10-step run, and a run that checkpoints at step 5 and is killed right after."""
    uninterrupted = tmp_path_factory.mktemp("uninterrupted")
    fit(uninterrupted, tiny_shards, seed_checkpoint, layout=LAYOUT, max_steps=10, callbacks=[RecordRun(uninterrupted)])
    killed = tmp_path_factory.mktemp("killed")
    callbacks = [
        ModelCheckpoint(dirpath=killed / "ckpt", every_n_train_steps=5, save_top_k=-1),
        RecordRun(killed),
        Snapshot(killed, step=5),
        KillAtStep(5),
    ]
    with pytest.raises(Exception, match="exit code 17"):
        fit(killed, tiny_shards, seed_checkpoint, layout=LAYOUT, max_steps=10, callbacks=callbacks)
    (checkpoint,) = glob.glob(str(killed / "ckpt" / "*step=5.ckpt"))
    return {"uninterrupted": uninterrupted, "killed": killed, "checkpoint": Path(checkpoint)}


def _losses(run: Path) -> dict[int, float]:
    return {int(step): loss for step, loss in json.loads((run / "losses.json").read_text()).items()}


def test_resume_continues_exactly_like_an_uninterrupted_run(
    runs: dict[str, Path], tmp_path: Path, tiny_shards: str, seed_checkpoint: Path
) -> None:
    assert sorted(_losses(runs["killed"])) == [1, 2, 3, 4, 5]  # the kill came right after the step-5 checkpoint
    fit(tmp_path, tiny_shards, seed_checkpoint, layout=LAYOUT, max_steps=10, callbacks=[RecordRun(tmp_path)],
        ckpt_path=str(runs["checkpoint"]))
    resumed, uninterrupted = _losses(tmp_path), _losses(runs["uninterrupted"])
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    # Same layout, same reduction order: model, optimizer and every rank's loader position restore exactly.
    assert [resumed[s] for s in range(6, 11)] == [uninterrupted[s] for s in range(6, 11)]


def test_every_rank_saves_its_own_loader_position(runs: dict[str, Path]) -> None:
    meta = torch.load(runs["checkpoint"] / "meta.pt", weights_only=False)
    ranks = meta["omni"]["ranks"]
    assert [r["dp_rank"] for r in ranks] == [0, 1, 2, 3]
    assert meta["omni"]["parallel_dims"]["dp"] == 4
    datasets = [r["loader"][0]["inner"]["dataset_state"] for r in ranks]
    assert [(d["dp_rank"], d["dp_size"]) for d in datasets] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    # Checkpointed after step 5: each rank has consumed exactly five micro-batches, not the prefetched sixth.
    assert {(d["epoch"], d["consumed"]) for d in datasets} == {(0, 5 * BATCH_SIZE)}


def test_resume_under_another_layout(
    runs: dict[str, Path], tmp_path: Path, tiny_shards: str, seed_checkpoint: Path
) -> None:
    """Saved with dp_shard=4, resumed with dp_shard=2 x tp=2: DCP reshards weights and optimizer moments."""
    fit(tmp_path, tiny_shards, seed_checkpoint, layout={"dp_shard": 2, "tp": 2}, max_steps=7,
        callbacks=[Snapshot(tmp_path), RecordRun(tmp_path)], ckpt_path=str(runs["checkpoint"]))
    assert_restored_exactly(runs["killed"] / "snapshot_step5.pt", tmp_path / "snapshot_start.pt", step=5)
    losses = _losses(tmp_path)
    assert sorted(losses) == [6, 7] and all(map(torch.isfinite, torch.tensor(list(losses.values()))))


def test_loader_states_map_by_data_parallel_rank(runs: dict[str, Path]) -> None:
    saved = torch.load(runs["checkpoint"] / "meta.pt", weights_only=False)["omni"]
    # Same data-parallel size under another layout (e.g. dp_shard=4 -> dp_replicate=2 x dp_shard=2): exact.
    assert loader_state_for_rank(saved, 2, 4)[0]["inner"]["dataset_state"]["dp_rank"] == 2
    # Another size: every rank gets the merged rank-independent position. Each of the 4 ranks read 5 micro-batches
    # of 2 from the first shard of its epoch: those 10 records are done, nothing is pending.
    (resized,) = loader_state_for_rank(saved, 1, 2)
    merged = DataPosition.from_state(resized["resume_from"])
    assert sorted(merged.frontier.values()) == [(0, 5 * BATCH_SIZE)] * 4 and not merged.pending
    # Samples from a custom train_samples() record no shard positions: the old way, with a warning.
    untracked = copy.deepcopy(saved)
    for rank in untracked["ranks"]:
        rank["loader"][0]["position"]["tracked"] = False
    with pytest.warns(UserWarning, match="custom train_samples"):
        assert loader_state_for_rank(untracked, 1, 2) is None
    # A checkpoint written before loader positions resumes the old way, with a warning.
    for rank in saved["ranks"]:
        rank["loader"] = [rank["loader"][0]["inner"]]
    with pytest.warns(UserWarning, match="written with 4 data-parallel ranks and this run has 2, and its loader "
                                         "states hold no shard positions .*: it resumes the old way"):
        assert loader_state_for_rank(saved, 1, 2) is None
