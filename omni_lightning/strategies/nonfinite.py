"""The non-finite guard: every step, all ranks agree whether any loss or gradient is NaN or infinite, then skip the
optimizer step on every rank or stop."""

from __future__ import annotations

import logging
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from omni_lightning.parallel.local import local_tensor

__all__ = ["NonFiniteGuard", "NonFinitePolicy"]

log = logging.getLogger(__name__)

NonFinitePolicy = Literal["skip", "stop"]

_LOSS_NONFINITE, _GRADS_NONFINITE = 1, 2  # bits of a rank's flag in the guard's all-reduce


class NonFiniteGuard:
    """``policy="skip"`` drops a bad step's gradients on every rank (the optimizer then changes neither weights nor
    state), logs a warning with the step and the ranks and counts it in ``guard/skipped_steps``; ``"stop"`` raises
    ``FloatingPointError`` on every rank."""

    def __init__(self, policy: NonFinitePolicy) -> None:
        if policy not in ("skip", "stop"):
            raise ValueError(f"on_nonfinite={policy!r} must be 'skip' or 'stop'")
        self.policy = policy
        self.skipped_steps = 0
        self._logged = False

    def check(self, module: pl.LightningModule, optimizer: Optimizer, loss: Any, *, rank: int, world_size: int,
              device: torch.device) -> None:
        """After the step's last backward, before its optimizer step (every rank, every step).

        Every rank enters the one all-reduce every step, whatever it found, so no rank can skip a collective the
        others enter. Gradients are checked after their reduction: a NaN from one rank reaches its data-parallel
        peers' gradients too, so the loss flag is the one that names where it started.
        """
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        flags = torch.zeros(world_size, dtype=torch.int32, device=device)
        # Computed on the device: the flags are read back after the all-reduce (the gradient check reads back one
        # verdict before it: the wait it adds is the wait for the backward that the flags' read-back waits for anyway).
        flags[rank] = (_LOSS_NONFINITE * _nonfinite(loss, flags.device)
                       + _GRADS_NONFINITE * _any_nonfinite_grad(params, flags.device))
        if dist.is_initialized():
            dist.all_reduce(flags)
        by_rank = flags.tolist()
        step = module.trainer.global_step
        if not any(by_rank):
            if not self._logged:  # the count is logged when it changes: a log call costs about 0.5 ms
                module.log("guard/skipped_steps", float(self.skipped_steps), batch_size=1)
                self._logged = True
            return
        bad_loss = [r for r, f in enumerate(by_rank) if f & _LOSS_NONFINITE]
        bad_grads = [r for r, f in enumerate(by_rank) if f & _GRADS_NONFINITE]
        found = "; ".join(f"{what} on rank(s) {ranks}" for what, ranks in
                          (("non-finite loss", bad_loss), ("non-finite gradients", bad_grads)) if ranks)
        if self.policy == "stop":
            raise FloatingPointError(
                f"{found} at global_step={step}: stopping on every rank (OmniStrategy(on_nonfinite='stop')); pass "
                "on_nonfinite='skip' to skip such steps, or look for bad data, a too high learning rate or overflow "
                "in low precision"
            )
        for p in params:  # the optimizer leaves parameters without gradients alone: weights and state unchanged
            p.grad = None
        self.skipped_steps += 1
        module.log("guard/skipped_steps", float(self.skipped_steps), batch_size=1)
        if rank == 0:
            log.warning("skipped optimizer step at global_step=%d on every rank: %s (%d skipped so far)",
                        step, found, self.skipped_steps)


def _nonfinite(value: Any, device: torch.device) -> Tensor:
    """1 if ``value`` is a tensor holding a NaN or an infinity, else 0 (an int32 scalar on ``device``)."""
    if not isinstance(value, Tensor):
        return torch.zeros((), dtype=torch.int32, device=device)
    return (~torch.isfinite(value.detach()).all()).to(device=device, dtype=torch.int32)


@torch.no_grad()  # DTensor.to_local outside autograd is an attribute read, not a ~20 us autograd function
def _any_nonfinite_grad(params: list[Tensor], device: torch.device) -> Tensor:
    """1 if this rank's part of any gradient holds a NaN or an infinity, else 0 (an int32 scalar on ``device``)."""
    local = [g for g in (local_tensor(p.grad) for p in params) if g.numel()]
    if not local:  # an FSDP rank may hold an empty shard of every gradient
        return torch.zeros((), dtype=torch.int32, device=device)
    # One fused kernel per device and dtype instead of a Python loop over every gradient. The 2-norm first: it is
    # finite only if every element is (a NaN or an infinity anywhere makes its sum of squares so), and on CPU it costs
    # about a sixth of the max-norm (benchmarks/guard_cost.py). Only a non-finite 2-norm, which finite values can also
    # reach by overflowing the sum of squares, is settled by the max-norm, finite exactly when every element is.
    if _finite(torch._foreach_norm(local, 2), device):
        return torch.zeros((), dtype=torch.int32, device=device)
    return (~_finite(torch._foreach_norm(local, float("inf")), device)).to(torch.int32)


def _finite(norms: tuple[Tensor, ...] | list[Tensor], device: torch.device) -> Tensor:
    """Whether every one of ``norms`` is finite (a bool scalar on ``device``)."""
    return torch.isfinite(torch.stack([n.to(device) for n in norms])).all()
