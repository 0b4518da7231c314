"""What an optimizer trains: the model's parts, frozen ones left out, parameter groups with their own learning-rate
multipliers and weight decay, and the warm-up-then-cosine schedule.

A part is a top-level component of :class:`~omni_lightning.models.ReferenceMLLM` (``vision``, ``audio``, ``llm``,
any extra encoder by its name) or ``projector``: every encoder's projector into the LLM's width, which fine-tuning
recipes treat apart from the tower it sits on, with what lays its outputs out for the LLM (the model's ``assembly``:
LLaVA-OneVision's newline embedding). Plain torch, no process groups: the same groups come out on every
rank of any layout, since parallelised parameters keep their names.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["PROJECTOR", "WarmupCosineLR", "apply_lr_multipliers", "check_parts", "freeze_parts", "model_parts",
           "parameter_groups", "part_of"]

PROJECTOR = "projector"
_ASSEMBLY = "assembly"  # ReferenceMLLM.assembly: it arranges projector outputs, and trains with the projectors
# Wrappers that activation checkpointing and torch.compile put into parameter names.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def _plain(name: str) -> list[str]:
    return [segment for segment in name.split(".") if segment not in _WRAPPER_SEGMENTS]


def part_of(name: str, encoders: Iterable[str]) -> str:
    """The part a parameter named ``name`` belongs to, given the model's encoder names."""
    segments = _plain(name)
    if (len(segments) > 1 and segments[0] in set(encoders) and segments[1] == PROJECTOR) or segments[0] == _ASSEMBLY:
        return PROJECTOR
    return segments[0]


def model_parts(model: nn.Module, encoders: Iterable[str]) -> tuple[str, ...]:
    """The parts ``model`` has parameters in, in the order of its parameters."""
    names = tuple(encoders)
    return tuple(dict.fromkeys(part_of(n, names) for n, _ in model.named_parameters()))


def check_parts(given: Iterable[str], known: Sequence[str], what: str) -> None:
    """``ValueError`` naming the parts in ``given`` that are not among ``known``."""
    if unknown := sorted(set(given) - set(known)):
        raise ValueError(f"{what} names {unknown}, which are not parts of the model: choose from {list(known)}")


def freeze_parts(model: nn.Module, freeze: Sequence[str], encoders: Iterable[str]) -> None:
    """Stop gradients for the parameters of the parts in ``freeze`` (``ValueError`` for unknown parts, or where
    nothing would be left to train)."""
    names = tuple(encoders)
    parts = model_parts(model, names)
    check_parts(freeze, parts, "freeze")
    if set(parts) <= set(freeze):
        raise ValueError(f"freeze={list(freeze)} freezes every part of the model {list(parts)}: nothing would train")
    for name, param in model.named_parameters():
        if part_of(name, names) in freeze:
            param.requires_grad_(False)


def _no_decay(model: nn.Module) -> set[str]:
    """Names of the parameters weight decay leaves alone: norms and biases (under two dimensions) and embeddings."""
    names = {name for name, param in model.named_parameters() if param.ndim < 2}
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            names.update(f"{module_name}.{n}" if module_name else n for n, _ in module.named_parameters())
    return names


def parameter_groups(model: nn.Module, encoders: Iterable[str], *, weight_decay: float | None,
                     lr_multipliers: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: trainable parameters only, one group per (part multiplier, decay). A
    pipeline stage holds some parts only, so the names in ``lr_multipliers`` are checked against the whole model
    beforehand (:func:`check_parts`), not here.

    Groups that decay carry ``weight_decay`` (``None``: the optimizer's own default); the others ``0.0``; with a
    ``weight_decay`` of 0 they are one group. Each group
    carries ``lr_multiplier`` (1.0 unless ``lr_multipliers`` names its part); :func:`apply_lr_multipliers` turns it
    into the group's ``lr`` once the optimizer has filled in its default.
    """
    names = tuple(encoders)
    multipliers = dict(lr_multipliers or {})
    if bad := {part: m for part, m in multipliers.items() if not (math.isfinite(m) and m >= 0)}:
        raise ValueError(f"lr_multipliers {bad} must be finite and non-negative")
    skip = _no_decay(model)
    groups: dict[tuple[float, bool], dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # Without decay to skip, norms and matrices share a group: the groups (and saved schedules) of a run that
        # sets neither decay nor multipliers are the single group they always were.
        multiplier, decays = multipliers.get(part_of(name, names), 1.0), name not in skip or weight_decay == 0.0
        group = groups.setdefault((multiplier, decays), {"params": [], "lr_multiplier": multiplier})
        if not decays or weight_decay is not None:
            group["weight_decay"] = weight_decay if decays else 0.0
        group["params"].append(param)
    return list(groups.values())


def apply_lr_multipliers(optimizer: torch.optim.Optimizer) -> None:
    """Scale each group's learning rate by its ``lr_multiplier`` and drop the key (before a schedule records the
    initial rates): saved optimizer state then has the keys it always had, so checkpoints stay interchangeable."""
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * group.pop("lr_multiplier", 1.0)


class WarmupCosineLR(LRScheduler):
    """Linear warm-up from ``warmup_start_factor`` of each group's rate to all of it over ``warmup_steps``, then a
    cosine decay to ``min_lr_ratio`` of it at ``max_steps``, held there after.

    Args:
        optimizer: the optimizer whose groups' rates to schedule.
        warmup_steps: steps of linear warm-up (0: none).
        max_steps: the step where the cosine reaches its floor; at least ``warmup_steps``.
        min_lr_ratio: the floor, as a fraction of each group's initial rate.
        warmup_start_factor: the first step's fraction of the rate (default: ``1 / warmup_steps``, so no step is
            taken at rate zero).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int = 0, max_steps: int = 1000,
                 min_lr_ratio: float = 0.0, warmup_start_factor: float | None = None, last_epoch: int = -1) -> None:
        if warmup_steps < 0 or max_steps < max(warmup_steps, 1):
            raise ValueError(f"need 0 <= warmup_steps <= max_steps and max_steps >= 1, got warmup_steps="
                             f"{warmup_steps}, max_steps={max_steps}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")
        self.warmup_steps, self.max_steps, self.min_lr_ratio = warmup_steps, max_steps, min_lr_ratio
        self.warmup_start_factor = 1 / warmup_steps if warmup_start_factor is None and warmup_steps else (
            warmup_start_factor or 0.0)
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        """The fraction of each group's initial rate at ``step`` (0 = the first optimizer step)."""
        if step < self.warmup_steps:
            start = self.warmup_start_factor
            return start + (1.0 - start) * step / self.warmup_steps
        span = self.max_steps - self.warmup_steps
        progress = min((step - self.warmup_steps) / span, 1.0) if span else 1.0
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def get_lr(self) -> list[float]:  # type: ignore[override]
        factor = self.factor(self.last_epoch)
        return [base * factor for base in self.base_lrs]
