"""Throughput and balance metrics, and Lightning's loggers, progress bar and ``trainer.validate`` across ranks."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from distributed import free_port
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from omni_lightning import OmniDataModule, OmniModule, OmniStrategy
from omni_lightning.balance.workload import SampleMeta
from omni_lightning.batch import BYTE_ROLES
from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.flops import reference_cost_model
from omni_lightning.monitor import LoadMonitor, ThroughputMonitor, batch_training_flops, loggers_write_this_step

# The byte tokens' roles (ids 0-3) and their first text id.
FIRST_TEXT_ID = BYTE_ROLES.first_free_id


def mixed_samples() -> tuple[list[DecodedSample], list[SampleMeta]]:
    """Three samples (images of several sizes, audio, text only) and their metadata."""
    rng = np.random.default_rng(0)
    shapes = [((4, 6), (2, 2)), (), ((8, 8),)]  # patch grids per sample (2x2-mergeable)
    audio = [12, 0, 40]
    samples, metas = [], []
    for i, (grids, frames) in enumerate(zip(shapes, audio, strict=True)):
        text = 5 + 3 * i
        images = [rng.integers(0, 256, (h * 14, w * 14, 3), dtype=np.uint8) for h, w in grids]
        mel = rng.standard_normal((frames, 80)).astype(np.float32) if frames else None
        samples.append(DecodedSample(f"s{i}", rng.integers(FIRST_TEXT_ID, 256, text), images, mel))
        metas.append(SampleMeta("image", text, images=grids, audio_frames=frames,
                                merge=(("audio", 4), ("image", 4), ("video", 4))))
    return samples, metas


def test_batch_flops_are_the_cost_models_sum_over_its_samples() -> None:
    """The FLOPs read off a packed batch's shapes equal the cost model's prediction from sample metadata."""
    samples, metas = mixed_samples()
    cost = reference_cost_model(ReferenceMLLMConfig.tiny())
    batch = pack_samples(samples)
    assert batch_training_flops(batch, cost) == pytest.approx(float(cost.costs(metas).sum()), rel=1e-9)
    step = {"micro_batches": [pack_samples(samples[:1]), pack_samples(samples[1:])]}
    assert batch_training_flops(step, cost) == pytest.approx(float(cost.costs(metas).sum()), rel=1e-9)


def test_peak_flops_must_be_positive() -> None:
    with pytest.raises(ValueError, match="peak_flops"):
        ThroughputMonitor(peak_flops=0)


def test_peak_flops_of_known_gpus_are_looked_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a figure, the device is looked up (Lightning's table of known GPUs) in the module's compute dtype;
    a given figure wins, and a device the table lacks logs no MFU."""
    import omni_lightning.monitor as monitor

    asked = []

    def table(device: torch.device, dtype: torch.dtype) -> float | None:
        asked.append((device.type, dtype))
        return 989e12 if device.type == "cuda" else None

    monkeypatch.setattr(monitor, "get_available_flops", table)
    module = OmniModule(ReferenceMLLMConfig.tiny(), param_dtype="bfloat16")
    for device, given, expected in (("cuda", None, 989e12), ("cpu", None, None), ("cuda", 5e12, 5e12)):
        trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)))
        callback = ThroughputMonitor(peak_flops=given)
        callback.on_train_start(trainer, module)  # type: ignore[arg-type]
        assert callback._peak == expected
    assert asked == [("cuda", torch.bfloat16), ("cpu", torch.bfloat16)]


class _ProgressBarMetrics(pl.Callback):
    def __init__(self) -> None:
        self.seen: set[str] = set()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.seen |= set(trainer.progress_bar_metrics)
        if trainer.global_step == trainer.max_steps and trainer.global_rank == 0:
            Path(trainer.default_root_dir, "progress_bar.txt").write_text("\n".join(sorted(self.seen)))


@pytest.mark.distributed
def test_loggers_progress_bar_and_validate_across_ranks(tmp_path: Path, tiny_shards: str,
                                                        seed_checkpoint: Path) -> None:
    """Two data-parallel ranks: CSV and TensorBoard get the throughput, FLOP/s, MFU and balance metrics and the
    validation loss, written once (rank 0); the progress bar shows tokens/s and the imbalance; and
    ``trainer.validate`` runs the validation split on its own."""
    shards = tiny_shards.replace("{000000..000007}", "{000000..000005}")
    val_shards = tiny_shards.replace("{000000..000007}", "{000006..000007}")
    data = OmniDataModule(shards, samples_per_step=2, group_steps=2, val_shards=val_shards, val_batches=2)
    module = OmniModule(ReferenceMLLMConfig.tiny(), learning_rate=1e-3, init_checkpoint=str(seed_checkpoint))
    os.environ["MASTER_PORT"] = str(free_port())
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=OmniStrategy(launcher="fork", timeout=120, dp_shard=2),
        max_steps=4, val_check_interval=2, check_val_every_n_epoch=None, log_every_n_steps=1,
        logger=[CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")],
        callbacks=[LoadMonitor(), ThroughputMonitor(peak_flops=1e12), _ProgressBarMetrics()],
        enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)

    rows = list(csv.DictReader((tmp_path / "csv" / "version_0" / "metrics.csv").open()))

    def logged(name: str) -> list[float]:
        return [float(row[name]) for row in rows if row.get(name)]
    assert len(logged("throughput/flops_per_s")) == 3  # every step after the first
    assert all(v > 0 for v in logged("train/samples_per_s") + logged("train/tokens_per_s"))
    assert all(0 < v < 1 for v in logged("throughput/mfu")) and len(logged("throughput/mfu")) == 3
    assert all(v >= 1 for v in logged("load/measured_imbalance"))
    assert len(logged("val/loss")) == 2  # after steps 2 and 4
    assert len(list((tmp_path / "tb").rglob("events.out.tfevents.*"))) == 1  # rank 0 writes, once
    assert {"train/tokens_per_s", "imbalance"} <= set((tmp_path / "progress_bar.txt").read_text().split())

    os.environ["MASTER_PORT"] = str(free_port())
    (result,) = trainer.validate(module, datamodule=data)
    assert torch.isfinite(torch.tensor(result["val/loss"]))


class _LogsWhenWritten(pl.LightningModule):
    """Logs ``every`` on each step and ``sparse`` only when the loggers write, as OmniModule logs plan statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.written: list[int] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch[0]).sum()
        self.log("every", float(batch_idx))
        if loggers_write_this_step(self.trainer):
            self.written.append(batch_idx)
            self.log("sparse", float(batch_idx))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_statistics_logged_only_when_written_reach_the_loggers_at_the_same_steps(tmp_path: Path) -> None:
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(7, 2)), batch_size=1)
    trainer = pl.Trainer(accelerator="cpu", max_steps=7, log_every_n_steps=3, logger=CSVLogger(tmp_path, name="csv"),
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    module = _LogsWhenWritten()
    trainer.fit(module, data)
    rows = list(csv.DictReader((tmp_path / "csv" / "version_0" / "metrics.csv").open()))
    every = [row["step"] for row in rows if row.get("every")]
    assert every == ["2", "5"]  # Lightning writes every third step
    assert [row["step"] for row in rows if row.get("sparse")] == every
    assert module.written == [2, 5]  # and logged nowhere else
