"""Lightning's backward hooks run in every placement: once per training_step, in order, with the step's reduced
loss and the gradients in place, also where the pipeline schedule or the pools' stream runs the backward itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning_runs import RecordRun, fit

pytestmark = pytest.mark.distributed


class RecordHooks(pl.Callback):
    """Every rank writes the hooks it saw, in order: the loss handed to ``on_before_backward``, whether this rank's
    parameters hold gradients at ``on_after_backward``, and each ``on_before_optimizer_step``."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.events = out_dir, []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.events.append(["batch"])

    def on_before_backward(self, trainer: pl.Trainer, module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.events.append(["before_backward", float(loss)])

    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        params = list(module.model.parameters())
        self.events.append(["after_backward", bool(params) and all(p.grad is not None for p in params)])

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        self.events.append(["optimizer_step"])
        (self.out_dir / f"hooks_rank{trainer.global_rank}.json").write_text(json.dumps(self.events))


@pytest.mark.parametrize("layout", [
    {"dp_shard": 2},
    {"pp": 2, "dp_shard": 1},
    {"pp": 2, "dp_shard": 1, "pp_schedule": "GPipe", "pp_encoders": "first_stage"},
    {"placement": "disaggregated", "encoder_world_size": 1},
], ids=["plain", "pp_1f1b_joint", "pp_gpipe_first_stage", "disaggregated"])
def test_backward_hooks_run_once_per_step_after_the_backward(layout: dict, tmp_path: Path, tiny_shards: str,
                                                              seed_checkpoint: Path) -> None:
    fit(tmp_path, tiny_shards, seed_checkpoint, layout=layout, devices=2, max_steps=3,
        callbacks=[RecordRun(tmp_path), RecordHooks(tmp_path)])
    losses = json.loads((tmp_path / "losses.json").read_text())
    for rank in range(2):
        events = json.loads((tmp_path / f"hooks_rank{rank}.json").read_text())
        assert [e[0] for e in events] == ["batch", "before_backward", "after_backward", "optimizer_step"] * 3, events
        after = [e[1] for e in events if e[0] == "after_backward"]
        assert all(after), f"rank {rank}: on_after_backward before every gradient was in place"
        if "pp" in layout or "placement" in layout:  # the step's reduced loss, the same on every rank
            before = [e[1] for e in events if e[0] == "before_backward"]
            torch.testing.assert_close(before, [losses[str(s)] for s in (1, 2, 3)], rtol=1e-6, atol=0)
