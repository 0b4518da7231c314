"""Training metrics beyond what OmniModule logs itself: the measured per-rank load of every step
(:class:`LoadMonitor`) and the model FLOP/s and MFU (:class:`ThroughputMonitor`)."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.throughput import get_available_flops
from typing_extensions import override

from omni_lightning.balance.cost import CostModel
from omni_lightning.batch import PackingSpec
from omni_lightning.deprecations import warn_renamed, with_deprecated_names
from omni_lightning.modalities import DEFAULT_PACKING
from omni_lightning.parallel.compat import all_gather_single
from omni_lightning.runtime.calibration import micro_batch_features

__all__ = ["BalanceMonitor", "LoadMonitor", "ThroughputMonitor", "batch_training_flops", "loggers_write_this_step"]


def loggers_write_this_step(trainer: pl.Trainer) -> bool:
    """Whether Lightning hands this training batch's logged values to the loggers (every ``log_every_n_steps``
    optimizer steps), by Lightning's own rule, as its ``LearningRateMonitor`` asks.

    Each ``LightningModule.log`` call costs about a millisecond of Python here (Lightning moves the stored result to
    the value's device on every call), a tenth of a tiny model's step: statistics that only loggers read are logged
    on these steps alone.
    """
    return trainer._logger_connector.should_update_logs


class LoadMonitor(pl.Callback):
    """Logs, per step, the slowest rank's compute over the mean (``load/measured_imbalance``) and this step's
    mean compute seconds (``load/measured_step_cpu_s``), split into encoders and LLM forward where the model reports
    it (``load/measured_encoders_cpu_s``, ``load/measured_llm_forward_cpu_s``): what reordering and resharding
    together achieved.

    Compute is the training thread's CPU time (``time.thread_time``): a rank blocked in a collective uses none,
    so the figure is what each rank would take on dedicated hardware even when ranks share cores. Costs one small
    all-gather per step. ``history`` keeps every step's per-rank seconds for benchmarks. The progress bar shows
    the imbalance as ``imbalance`` every step; loggers get the figures on the steps they write.
    """

    def __init__(self) -> None:
        self.history: list[list[float]] = []
        self._started = 0.0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
                             ) -> None:
        self._started = time.thread_time()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        seconds = time.thread_time() - self._started
        forward = getattr(pl_module, "forward_cpu_seconds", {})
        device = trainer.strategy.root_device  # the default group is NCCL in a GPU job
        mine = torch.tensor([seconds, forward.get("encoders", 0.0), forward.get("llm", 0.0)], dtype=torch.float64,
                            device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = torch.empty(dist.get_world_size() * 3, dtype=torch.float64, device=device)
            all_gather_single(everyone, mine)
            everyone = everyone.view(-1, 3).cpu()
        else:
            everyone = mine[None]
        per_rank = everyone[:, 0]
        self.history.append(per_rank.tolist())
        samples = batch.get("num_samples", 1) if isinstance(batch, dict) else 1
        imbalance = float(per_rank.max() / per_rank.mean().clamp(min=1e-12))
        if loggers_write_this_step(trainer):
            metrics = {
                "load/measured_imbalance": imbalance,
                "load/measured_step_cpu_s": float(per_rank.mean()),
                "load/measured_encoders_cpu_s": float(everyone[:, 1].mean()),
                "load/measured_llm_forward_cpu_s": float(everyone[:, 2].mean()),
            }
            pl_module.log_dict(self._named(metrics), batch_size=max(int(samples), 1))
        # The progress bar shows the imbalance under a short name; loggers get the full one above.
        pl_module.log("imbalance", imbalance, prog_bar=True, logger=False, batch_size=max(int(samples), 1))

    def _named(self, metrics: dict[str, float]) -> dict[str, float]:
        return metrics


class BalanceMonitor(LoadMonitor):
    """Deprecated name of :class:`LoadMonitor`: logs its metrics under the 0.1 names ``balance/measured_*`` too
    (warns once)."""

    def __init__(self) -> None:
        super().__init__()
        warn_renamed("omni_lightning.monitor.BalanceMonitor")

    @override
    def _named(self, metrics: dict[str, float]) -> dict[str, float]:
        return with_deprecated_names(metrics)


def batch_training_flops(batch: dict[str, Any], cost_model: CostModel, spec: PackingSpec = DEFAULT_PACKING) -> float:
    """Training FLOPs (forward and backward) of a packed batch, or of a pipeline step's micro-batches, as the
    model's cost model counts them: per module, tokens and attention pairs of every item."""
    features = sum(micro_batch_features(micro, spec) for micro in batch.get("micro_batches", [batch]))
    return float(features @ cost_model.coefficients)


class ThroughputMonitor(pl.Callback):
    """Logs the job's model FLOP/s every step (``throughput/flops_per_s``) and, given the peak FLOP/s of one
    device, the model FLOPs utilisation (``throughput/mfu``). Samples/s and tokens/s come from
    :class:`~omni_lightning.OmniModule` itself (``train/samples_per_s``, ``train/tokens_per_s``, the latter on the
    progress bar).

    Args:
        peak_flops: peak FLOP/s of one device in the precision trained (e.g. ``989e12`` for an H100's dense
            bf16); ``None`` looks the device up in Lightning's table of known GPUs (by name and the module's
            compute dtype) and logs no MFU where it is not there (CPUs, unknown chips).

    The rate is over the wall time between the ends of consecutive batches and counts every data-parallel rank's
    batch once (tensor, context and pipeline peers hold the same one). FLOPs come from the batch's shapes and the
    model's :class:`~omni_lightning.balance.cost.CostModel` (matmul and attention FLOPs of forward and backward,
    as MFU is usually counted), so it needs a module that has one (``OmniModule.cost_model()``).
    """

    def __init__(self, peak_flops: float | None = None) -> None:
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"peak_flops={peak_flops} must be a positive FLOP/s figure or None")
        self.peak_flops = peak_flops
        self._cost_model: CostModel | None = None
        self._packing: PackingSpec = DEFAULT_PACKING
        self._last: float | None = None
        self._peak: float | None = peak_flops

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        cost_model, packing = getattr(pl_module, "cost_model", None), getattr(pl_module, "packing", None)
        if not callable(cost_model) or not callable(packing):
            raise ValueError(f"ThroughputMonitor counts FLOPs with the module's cost model; {type(pl_module).__name__} "
                             "has no cost_model() and packing() (OmniModule has): remove the callback for this module")
        self._cost_model, self._packing = cost_model(), packing()
        self._last = None
        self._peak = self.peak_flops
        if self._peak is None:
            self._peak = get_available_flops(trainer.strategy.root_device,
                                             getattr(pl_module, "compute_dtype", torch.float32))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now, last, self._last = time.perf_counter(), self._last, time.perf_counter()
        if last is None or self._cost_model is None:
            return  # the first batch has no start to measure from
        flops = torch.tensor([batch_training_flops(batch, self._cost_model, self._packing)], dtype=torch.float64,
                             device=trainer.strategy.root_device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flops)
        layout = getattr(pl_module, "omni_layout", None)  # OmniModule's, handed over by OmniStrategy
        copies = trainer.world_size // layout.dims.dp if layout is not None else 1  # peers that hold the same batch
        rate = float(flops) / copies / (now - last)
        metrics = {"throughput/flops_per_s": rate}
        if self._peak is not None:
            metrics["throughput/mfu"] = rate / (trainer.world_size * self._peak)
        pl_module.log_dict(metrics, batch_size=1)
