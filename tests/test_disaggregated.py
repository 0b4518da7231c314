"""The disaggregated placement on 4 CPU ranks against one process, and its checkpoints.

Tolerance: the foundation's parity test's (tests/test_parity.py): losses within 1e-4 relative, gradients within 1e-4
of their norm. The pools compute the same mathematics as one process; only the order of fp32 additions differs (the
encoder pool's FSDP average, the LLM pool's, the resharder's exchanges), ~1e-7 relative per step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning_runs import RecordRun, assert_resumes_under, fit, merged_grads, reference_run

from omni_lightning import OmniDataModule

pytestmark = pytest.mark.distributed

STEPS = 10
EXTRA_STEPS = 4  # the layouts beyond the two (1+3, 2+2): enough to see a wrong gradient move the losses
STREAMED = 2  # micro-batches a step streams from the encoder pool (OmniStrategy.stream_microbatches' default)
# 1+3 also clips by the global norm, far below these gradients' norm, so every step clips: a norm of one pool, or one
# counted per rank, would clip by another factor and move the losses from the second step on.
CLIP = {"1+3": 0.05}
LAYOUTS = {
    # fan-in: one encoder rank serves the three data-parallel ranks of the LLM pool
    "1+3": ({"placement": "disaggregated", "encoder_world_size": 1}, 3),
    # one encoder rank per LLM data-parallel rank; long items split over both encoder ranks (long-short SP)
    "2+2": ({"placement": "disaggregated", "encoder_world_size": 2, "enc_sp": 2}, 2),
    # fan-out: two encoder ranks share the items of the LLM pool's one data-parallel rank, which is TP over 2 ranks
    "2+2_tp2": ({"placement": "disaggregated", "encoder_world_size": 2, "tp": 2, "dp_shard": 1}, 1),
    # a 1F1B pipeline of 2 stages over 4 micro-batches: the encoder backward of j runs after the forward of j + 2
    "2+2_pp2": ({"placement": "disaggregated", "encoder_world_size": 2, "pp": 2, "dp_shard": 1,
                 "pp_microbatches": 4}, 1),
}


class RecordEncoderPlans(pl.Callback):
    """Encoder-pool ranks write, each step, how many items their resharder split over SP blocks and how many
    micro-batches' encoder activations were alive at once."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.split, self.in_flight = out_dir, [], []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if not trainer.strategy.is_encoder_rank:
            return
        self.split.append(module.step.encoder_stats.get("items_split", 0.0))
        self.in_flight.append(module.step.worker.peak_in_flight)
        record = {"split": self.split, "in_flight": self.in_flight}
        (self.out_dir / f"plans_rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_disaggregated_matches_single_process(name: str, tmp_path: Path, tiny_shards: str,
                                              seed_checkpoint: Path) -> None:
    layout, llm_dp = LAYOUTS[name]
    steps = STEPS if name in ("1+3", "2+2") else EXTRA_STEPS
    fit(tmp_path, tiny_shards, seed_checkpoint, layout=layout, max_steps=steps, gradient_clip_val=CLIP.get(name),
        callbacks=[RecordRun(tmp_path, grads=True), RecordEncoderPlans(tmp_path)])
    streamed, lag = layout.get("pp_microbatches", STREAMED), layout.get("pp", 1)
    # Gradients are recorded before clipping, in both runs.
    ref_losses, ref_grads = reference_run(tiny_shards, seed_checkpoint, dp_size=llm_dp, steps=steps,
                                          pipeline_micro_batches=streamed, clip=CLIP.get(name))
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert [int(k) for k in losses] == list(range(1, steps + 1))
    torch.testing.assert_close(torch.tensor(list(losses.values())), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    grads = merged_grads(tmp_path)  # the LLM pool's ranks hold llm.*, the encoder pool's vision.* and audio.*
    assert grads.keys() == ref_grads.keys()
    for param, ref in ref_grads.items():
        error = (grads[param] - ref).norm().item()
        assert error <= 1e-4 * ref.norm().item() + 1e-8, f"{name}: gradient of {param} differs by {error:.3g}"
    plans = json.loads((tmp_path / f"plans_rank{4 - layout['encoder_world_size']}.json").read_text())
    # The encoder forward of micro-batch j + lag ran before the backward of micro-batch j (it overlaps the LLM's work
    # on j), and no more micro-batches than that were alive at once.
    assert plans["in_flight"] == [min(lag + 1, streamed)] * steps
    if layout.get("enc_sp", 1) > 1:  # the parity covers split items only if some were split
        assert sum(plans["split"]) > 0, "no encoder item was split over the encoder pool: the SP path went untested"


def test_checkpoint_resumes_under_either_placement(tmp_path: Path, tiny_shards: str, seed_checkpoint: Path) -> None:
    """A disaggregated checkpoint (LLM pool dp_shard=2, 2 encoder ranks) resumes exactly under the same layout, and
    under the multiplexed placement with the same data-parallel size: weights and optimizer state are keyed by
    parameter name, so each rank reads what it now holds, and the two data-parallel ranks' loader positions carry
    over; steps 4-6 match the uninterrupted run either way."""
    saved = LAYOUTS["2+2"][0]
    checkpoint = assert_resumes_under(tmp_path / "same", tiny_shards, seed_checkpoint, saved=saved, resumed=saved)
    full = json.loads((tmp_path / "same" / "full" / "losses.json").read_text())
    out = tmp_path / "switched"
    fit(out, tiny_shards, seed_checkpoint, layout={"dp_shard": 2, "tp": 2}, max_steps=6, ckpt_path=str(checkpoint),
        callbacks=[RecordRun(out)])
    after = json.loads((out / "losses.json").read_text())
    assert sorted(after) == ["4", "5", "6"]
    torch.testing.assert_close(torch.tensor([after[s] for s in "456"]), torch.tensor([full[s] for s in "456"]),
                               rtol=1e-4, atol=0)


def test_omni_datamodule_streams_planned_micro_batches(tmp_path: Path, tiny_shards: str,
                                                      seed_checkpoint: Path) -> None:
    """OmniDataModule plans each step as the micro-batches the pools stream (balanced over the LLM pool's ranks),
    and validation runs through both pools; every rank logs rank 0's global loss."""
    train, val = (tiny_shards.replace("{000000..000007}", shards)
                  for shards in ("{000000..000005}", "{000006..000007}"))
    data = OmniDataModule(train, samples_per_step=4, group_steps=2, val_shards=val, val_batches=2)
    fit(tmp_path, tiny_shards, seed_checkpoint, layout=LAYOUTS["2+2"][0], max_steps=3, datamodule=data,
        val_check_interval=3, check_val_every_n_epoch=None, callbacks=[RecordRun(tmp_path), _RecordLogged(tmp_path)])
    logged = [json.loads((tmp_path / f"logged_rank{r}.json").read_text()) for r in range(4)]
    assert all(entry == logged[0] for entry in logged), logged
    assert logged[0]["val/loss"] > 0 and len(json.loads((tmp_path / "losses.json").read_text())) == 3


class _RecordLogged(pl.Callback):
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        metrics = {k: round(float(v), 6) for k, v in trainer.callback_metrics.items()
                   if k in ("train/loss", "val/loss")}
        (self.out_dir / f"logged_rank{trainer.global_rank}.json").write_text(json.dumps(metrics))
