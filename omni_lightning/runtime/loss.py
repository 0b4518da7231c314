"""The loss of a step: summed next-token cross-entropy, and :class:`StepLoss`, its one normalisation.

Every kind of step (plain, pipeline, encoder pool) divides the summed token losses by the step's *global* number of
loss tokens (all data-parallel ranks together), so gradients do not depend on how samples are spread over ranks or
cut into micro-batches, and multiplies by the data-parallel size that FSDP's gradient average divides by again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from omni_lightning.batch import IGNORE_INDEX

__all__ = ["StepLoss", "next_token_loss_sum", "vocab_parallel_loss"]


@dataclass(frozen=True)
class StepLoss:
    """How one step's losses are scaled before their backward.

    Args:
        loss_tokens: the global loss tokens the summed token losses are divided by: a number, or a scalar tensor on
            the compute device (the all-reduced count, which the step never reads back: on an accelerator a read
            would stall the host between the forward and the backward).
        data_parallel: the ranks FSDP averages gradients over (``dp_cp``): undone here.
        weight: the share of the optimizer step this loss stands for: 1 when ``loss_tokens`` counts the whole
            step, ``1 / k`` for each of ``k`` equally weighted parts (Lightning's gradient accumulation of batches
            that do not say how many tokens their step holds).
        aux_coef: the MoE load-balance loss coefficient.
        aux_parts: the micro-batches the load-balance loss is a mean over (times the accumulated parts).
    """

    loss_tokens: float | torch.Tensor
    data_parallel: int
    weight: float = 1.0
    aux_coef: float = 0.0
    aux_parts: int = 1

    @property
    def token_scale(self) -> float | torch.Tensor:
        """The factor of a summed token loss (a tensor where ``loss_tokens`` is one)."""
        if isinstance(self.loss_tokens, torch.Tensor):
            return self.data_parallel * self.weight / self.loss_tokens.clamp(min=1.0)
        return self.data_parallel * self.weight / max(self.loss_tokens, 1.0)

    @property
    def aux_scale(self) -> float:
        """The factor of a rank's share of the load-balance loss (the shares sum to the global loss)."""
        return self.aux_coef * self.data_parallel / self.aux_parts

    def __call__(self, loss_sum: torch.Tensor, aux_share: torch.Tensor | float = 0.0) -> torch.Tensor:
        """The scaled loss of a micro-batch's summed token loss and its load-balance share (in ``loss_sum``'s
        dtype)."""
        scale = self.token_scale
        if isinstance(scale, torch.Tensor):
            scale = scale.to(loss_sum.dtype)
        return loss_sum * scale + aux_share * self.aux_scale


_loss_parallel_depth = 0


@contextmanager
def vocab_parallel_loss() -> Iterator[None]:
    """``loss_parallel()`` that may be nested: only the outermost one enters and exits, because leaving an inner
    ``loss_parallel`` would switch it off for the outer one (a pipeline schedule computes losses and runs their
    backward inside one such context)."""
    global _loss_parallel_depth
    context = loss_parallel() if _loss_parallel_depth == 0 else nullcontext()
    _loss_parallel_depth += 1
    try:
        with context:
            yield
    finally:
        _loss_parallel_depth -= 1


def next_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy over positions whose label is not ``IGNORE_INDEX``, and how many there were.

    Vocabulary-sharded logits (a DTensor from tensor parallelism) are reduced without gathering them; the backward
    pass must then also run under ``loss_parallel`` (:func:`vocab_parallel_loss`).
    """
    if isinstance(logits, DTensor):
        with vocab_parallel_loss():
            loss_sum = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        loss_sum = loss_sum.to_local()
    else:
        loss_sum = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, (labels != IGNORE_INDEX).sum()
