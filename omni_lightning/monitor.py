"""BalanceMonitor: the measured per-rank cost of every step, beside the loader's prediction."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from typing_extensions import override

__all__ = ["BalanceMonitor"]


class BalanceMonitor(pl.Callback):
    """Logs, per step, the slowest rank's compute over the mean (``balance/measured_imbalance``) and this step's
    mean compute seconds, split into encoders and LLM forward where the model reports it.

    Compute is the training thread's CPU time (``time.thread_time``): a rank blocked in a collective uses none,
    so the figure is what each rank would take on dedicated hardware even when ranks share cores. Costs one small
    all-gather per step. ``history`` keeps every step's per-rank seconds for benchmarks.
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
        forward = getattr(getattr(pl_module, "model", None), "forward_cpu_seconds", {})
        mine = torch.tensor([seconds, forward.get("encoders", 0.0), forward.get("llm", 0.0)], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = torch.empty(dist.get_world_size() * 3, dtype=torch.float64)
            dist.all_gather_single(everyone, mine)
            everyone = everyone.view(-1, 3)
        else:
            everyone = mine[None]
        per_rank = everyone[:, 0]
        self.history.append(per_rank.tolist())
        samples = batch.get("num_samples", 1) if isinstance(batch, dict) else 1
        pl_module.log_dict(
            {
                "balance/measured_imbalance": float(per_rank.max() / per_rank.mean().clamp(min=1e-12)),
                "balance/measured_step_cpu_s": float(per_rank.mean()),
                "balance/measured_encoders_cpu_s": float(everyone[:, 1].mean()),
                "balance/measured_llm_forward_cpu_s": float(everyone[:, 2].mean()),
            },
            batch_size=max(int(samples), 1),
        )
