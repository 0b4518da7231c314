"""Fork-launched Lightning runs of the reference MLLM, and the single-process reference they are compared with."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from device_discipline import device_discipline
from distributed import free_port
from torch.distributed.tensor import DTensor

from omni_lightning import OmniModule, OmniStrategy, ReferenceMLLM, ReferenceMLLMConfig, WebDataModule
from omni_lightning.data.packing import pack_samples
from omni_lightning.data.resumable import MARKER_KEY
from omni_lightning.modalities import DEFAULT_PACKING
from omni_lightning.runtime.items import split_micro_batches
from omni_lightning.runtime.loss import next_token_loss_sum
from omni_lightning.strategies.launcher import NoWeightsMultiProcessingLauncher

LEARNING_RATE = 1e-3
BATCH_SIZE = 2  # samples per micro-batch per data-parallel rank


class RecordRun(pl.Callback):
    """Rank 0 writes global losses by step number (1 = first step) and by micro-batch, optionally the gradients of
    the first optimizer step."""

    def __init__(self, out_dir: Path, *, grads: bool = False) -> None:
        self.out_dir = out_dir
        self.grads = grads
        self.losses: dict[int, float] = {}
        self.batch_losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses[trainer.global_step] = float(outputs["global_loss"])  # global_step already counts this step
        self.batch_losses.append(float(outputs["global_loss"]))
        if trainer.global_rank == 0:
            (self.out_dir / "losses.json").write_text(json.dumps(self.losses))
            (self.out_dir / "batch_losses.json").write_text(json.dumps(self.batch_losses))

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        if self.grads and trainer.global_step == 0:  # after the last accumulated micro-batch of the first step
            missing = [name for name, p in module.model.named_parameters() if p.grad is None and p.requires_grad]
            assert not missing, f"rank {trainer.global_rank}: no gradient for {missing}"
            # full_tensor() is collective: every rank calls it. Under pipeline parallelism each stage holds its own
            # parameters, so every rank writes its file and grads.pt is rank 0's; merged_grads() joins them.
            grads = {name: _full(p.grad) for name, p in module.model.named_parameters() if p.requires_grad}
            torch.save(grads, self.out_dir / f"grads_rank{trainer.global_rank}.pt")
            if trainer.global_rank == 0:
                torch.save(grads, self.out_dir / "grads.pt")


def merged_grads(out_dir: Path) -> dict[str, torch.Tensor]:
    """Every rank's recorded gradients in one dict (ranks holding the same parameter recorded the same values)."""
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(out_dir.glob("grads_rank*.pt")):
        merged.update(torch.load(path, weights_only=True))
    return merged


class Snapshot(pl.Callback):
    """Every rank saves the full weights and AdamW moments it holds (its stages' under pipeline parallelism) at a
    step, or at train start (after a checkpoint restore), as ``snapshot_{tag}_rank{r}.pt``."""

    def __init__(self, out_dir: Path, *, step: int | None = None) -> None:
        self.out_dir = out_dir
        self.step = step

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.step is None:
            self._save(trainer, module, "start")

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            self._save(trainer, module, f"step{self.step}")

    def _save(self, trainer: pl.Trainer, module: pl.LightningModule, tag: str) -> None:
        optimizer_state = trainer.optimizers[0].state
        trained = [(name, p) for name, p in module.model.named_parameters() if p in optimizer_state]
        snapshot = {  # full_tensor() is collective: every rank takes part, in the same parameter order
            "step": trainer.global_step,
            "weights": {name: _full(p.data) for name, p in module.model.named_parameters()},
            "exp_avg": {name: _full(optimizer_state[p]["exp_avg"]) for name, p in trained},
        }
        torch.save(snapshot, self.out_dir / f"snapshot_{tag}_rank{trainer.global_rank}.pt")


def _merged_snapshot(path: Path) -> dict[str, Any]:
    """Every rank's part of the snapshot ``path`` names (``snapshot_{tag}.pt``): ranks holding the same tensor
    saved the same values."""
    merged: dict[str, Any] = {"weights": {}, "exp_avg": {}}
    for part in sorted(path.parent.glob(f"{path.stem}_rank*.pt")):
        snapshot = torch.load(part, weights_only=True)
        merged["step"] = snapshot["step"]
        for kind in ("weights", "exp_avg"):
            merged[kind].update(snapshot[kind])
    assert merged["weights"], f"no snapshot {path.stem}_rank*.pt in {path.parent}"
    return merged


def assert_restored_exactly(saved: Path, restored: Path, step: int) -> None:
    """The snapshot a resumed run took at train start (``restored``: ``snapshot_start.pt``) equals the one the saving
    run took at ``step`` (``saved``): every weight and AdamW moment, bit for bit, whatever each layout held where."""
    before, after = _merged_snapshot(saved), _merged_snapshot(restored)
    assert after["step"] == step
    for kind in ("weights", "exp_avg"):
        assert after[kind].keys() == before[kind].keys(), kind
        for name, tensor in before[kind].items():
            torch.testing.assert_close(after[kind][name], tensor, rtol=0, atol=0, msg=f"{kind} {name}")


class GradientPresence(pl.Callback):
    """Rank 0 records, after each backward, whether the sharded parameters hold reduced gradients yet."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.present: list[bool] = []

    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.present.append(any(p.grad is not None for p in module.model.parameters()))
        if trainer.global_rank == 0:
            (self.out_dir / "grad_presence.json").write_text(json.dumps(self.present))


class RecordBatches(pl.Callback):
    """Every rank saves the batches it trains on, as ``batches_rank{r}.pt`` (a list in arrival order)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.batches: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.batches.append({k: v for k, v in batch.items() if k not in ("reorder", MARKER_KEY)})
        torch.save(self.batches, self.out_dir / f"batches_rank{trainer.global_rank}.pt")


class KillAtStep(pl.Callback):
    """Every rank dies abruptly when ``step`` is reached, as in a node failure after a checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os._exit(17)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def fit(
    out_dir: Path,
    shards: str,
    seed_checkpoint: Path,
    *,
    layout: dict[str, int],
    max_steps: int,
    devices: int = 4,
    callbacks: list[pl.Callback] | None = None,
    ckpt_path: str | None = None,
    module: OmniModule | None = None,
    datamodule: pl.LightningDataModule | None = None,
    **trainer_kwargs: Any,
) -> None:
    """Fit the tiny reference MLLM (or ``module``) on ``devices`` fork-started CPU ranks.

    The resharder plans on compute alone unless ``layout`` says otherwise: priced for Gloo, the tiny model's items
    would mostly stay home, and these runs check that moved and split items train exactly as one process does. It
    keeps its FLOP prices unless ``layout`` sets ``reshard_calibration_steps``: prices measured in seconds differ
    from run to run, and with them where items are encoded and the order of floating-point sums, which the runs
    compared bit for bit (a resume against an uninterrupted run) cannot allow."""
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = {"link_cost": "compute_only", "reshard_calibration_steps": 0, **layout}
    os.environ["MASTER_PORT"] = str(free_port())  # Lightning reuses the parent's port otherwise
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=OmniStrategy(launcher="fork", timeout=120, **layout),
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks or []),
        callbacks=callbacks or [],
        **trainer_kwargs,
    )
    if module is None:
        module = OmniModule(
            ReferenceMLLMConfig.tiny(), learning_rate=LEARNING_RATE, init_checkpoint=str(seed_checkpoint)
        )
    datamodule = datamodule or WebDataModule(shards, batch_size=BATCH_SIZE)
    with device_discipline():  # inherited by the fork-started ranks
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)


def assert_resumes_under(
    out_dir: Path, shards: str, seed_checkpoint: Path, *, saved: dict[str, Any], resumed: dict[str, Any],
    module: Callable[[], OmniModule] | None = None, datamodule: Callable[[], Any] | None = None,
    saved_devices: int = 4, resumed_devices: int = 4,
) -> Path:
    """Train 6 steps under layout ``saved`` with a checkpoint at step 3, resume that checkpoint under ``resumed``,
    and check that the resumed run starts from exactly the weights and AdamW moments the first held at step 3 and
    that steps 4-6 lose what the uninterrupted run lost (1e-4 relative: the layouts reduce in other orders).
    Returns the checkpoint's path."""
    make, make_data = module or (lambda: None), datamodule or (lambda: None)
    fit(out_dir / "full", shards, seed_checkpoint, layout=saved, max_steps=6, module=make(), datamodule=make_data(),
        devices=saved_devices,
        callbacks=[RecordRun(out_dir / "full"), Snapshot(out_dir / "full", step=3),
                   pl.callbacks.ModelCheckpoint(dirpath=out_dir / "ckpt", every_n_train_steps=3, save_top_k=-1)])
    (checkpoint,) = (out_dir / "ckpt").glob("*step=3.ckpt")
    fit(out_dir / "resumed", shards, seed_checkpoint, layout=resumed, max_steps=6, module=make(),
        datamodule=make_data(), devices=resumed_devices,
        callbacks=[RecordRun(out_dir / "resumed"), Snapshot(out_dir / "resumed")], ckpt_path=str(checkpoint))
    assert_restored_exactly(out_dir / "full" / "snapshot_step3.pt", out_dir / "resumed" / "snapshot_start.pt", 3)
    full = json.loads((out_dir / "full" / "losses.json").read_text())
    after = json.loads((out_dir / "resumed" / "losses.json").read_text())
    assert sorted(after) == ["4", "5", "6"]
    torch.testing.assert_close(torch.tensor([after[s] for s in "456"]), torch.tensor([full[s] for s in "456"]),
                               rtol=1e-4, atol=0)
    return checkpoint


def reference_run(
    shards: str, seed_checkpoint: Path, *, dp_size: int, steps: int, accumulate: int = 1,
    config: ReferenceMLLMConfig | None = None, clip: float | None = None, pipeline_micro_batches: int = 1,
    param_dtype: torch.dtype | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process runs the global batch of every micro-batch: the union of what the ``dp_size`` ranks read.

    ``param_dtype`` computes as FSDP's mixed precision does: fp32 master weights and optimizer, parameters cast to
    ``param_dtype`` for the forward and backward (buffers stay fp32), gradients cast back to fp32.

    With ``accumulate`` > 1 each optimizer step averages that many micro-batch losses, as Lightning does; ``clip``
    clips the global gradient norm before each step (after the gradients are recorded, as Lightning's hooks see them).
    ``pipeline_micro_batches`` cuts each rank's batch as a pipeline does; only the MoE load-balance loss, which
    is a mean over those micro-batches, sees the cut. Returns every batch's loss and the first step's gradients.
    """
    data = WebDataModule(shards, batch_size=BATCH_SIZE)
    streams = [data.stream(shards, dp_rank=r, dp_size=dp_size, num_workers=0).iter_samples() for r in range(dp_size)]
    config = config or ReferenceMLLMConfig.tiny()
    model = ReferenceMLLM(config)
    model.load_state_dict(torch.load(seed_checkpoint, weights_only=True))
    module = OmniModule(config, learning_rate=LEARNING_RATE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=module.hparams.betas, weight_decay=0.0)
    master, model = model, _compute_copy(model, param_dtype)
    losses, first_grads = [], {}
    for step in range(steps):
        optimizer.zero_grad()
        _load_compute_copy(master, model)
        for _ in range(accumulate):
            per_rank = [[next(stream) for _ in range(BATCH_SIZE)] for stream in streams]
            cuts = [split_micro_batches(pack_samples(samples), pipeline_micro_batches, DEFAULT_PACKING)
                    for samples in per_rank]
            loss_sum = count = aux = 0.0
            for i in range(pipeline_micro_batches):  # global micro-batch i: micro-batch i of every rank
                keys = [k for rank_cuts in cuts for k in rank_cuts[i]["keys"]]
                samples = [s for rank in per_rank for s in rank if s.key in keys]
                if not samples:
                    continue
                batch = pack_samples(samples)
                mb_sum, mb_count = next_token_loss_sum(model(batch), batch["labels"])
                loss_sum, count = loss_sum + mb_sum, count + mb_count
                aux = aux + model.llm.moe_aux_loss() / pipeline_micro_batches  # zero for a dense model
            loss = loss_sum / count
            ((loss + config.llm.moe_aux_loss_coef * aux) / accumulate).backward()
            losses.append(loss.item())
        if model is not master:
            for name, p in master.named_parameters():
                p.grad = model.get_parameter(name).grad.float()
        if step == 0:
            first_grads = {name: p.grad.clone() for name, p in master.named_parameters()}
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        optimizer.step()
    return losses, first_grads


def _compute_copy(model: ReferenceMLLM, dtype: torch.dtype | None) -> ReferenceMLLM:
    if dtype is None:
        return model
    copy = ReferenceMLLM(model.config)
    for p in copy.parameters():
        p.data = p.data.to(dtype)
    return copy


def _load_compute_copy(master: ReferenceMLLM, compute: ReferenceMLLM) -> None:
    if compute is not master:
        with torch.no_grad():
            for name, p in compute.named_parameters():
                p.copy_(master.get_parameter(name))
                p.grad = None


class RecordKeys(pl.Callback):
    """Every rank writes the sample keys it trains on, by step number (1 = first step), to ``keys_rank{r}.json``."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.keys: dict[int, list[str]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.keys[trainer.global_step + 1] = list(batch["keys"])
        path = self.out_dir / f"keys_rank{trainer.global_rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.keys))
        os.replace(tmp, path)  # a rank killed mid-write leaves the previous version


def recorded_keys(run: Path, ranks: int) -> list[dict[int, list[str]]]:
    """What :class:`RecordKeys` wrote: per rank, the keys of every step."""
    return [{int(s): k for s, k in json.loads((run / f"keys_rank{r}.json").read_text()).items()} for r in range(ranks)]


class SigkillRankAtStep(pl.Callback):
    """Rank ``rank`` alone is SIGKILLed when ``step`` steps are done (a process or node lost without any clean-up);
    it first writes the wall-clock time of the kill to ``out_dir/killed_at``."""

    def __init__(self, step: int, rank: int, out_dir: Path) -> None:
        self.step = step
        self.rank = rank
        self.out_dir = out_dir

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            (self.out_dir / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def record_worker_errors(out_dir: Path) -> Iterator[None]:
    """Every fork-started worker that fails writes ``error_rank{r}.json``: seconds since the epoch, exception type and
    message (the parent only reports the first worker to fail). Patched before the workers fork."""
    wrapping_function = NoWeightsMultiProcessingLauncher._wrapping_function

    def recording(self: Any, process_idx: int, *args: Any, **kwargs: Any) -> Any:
        try:
            return wrapping_function(self, process_idx, *args, **kwargs)
        except Exception as error:
            (out_dir / f"error_rank{process_idx}.json").write_text(
                json.dumps([time.time(), type(error).__name__, str(error)]))
            raise

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NoWeightsMultiProcessingLauncher, "_wrapping_function", recording)
        yield
