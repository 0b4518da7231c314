"""The global gradient norm of parameters sharded on different meshes, and clipping by it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from omni_lightning.parallel.local import local_tensor

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(parameters: list[torch.nn.Parameter], max_norm: float,
                    pp_group: dist.ProcessGroup | None = None,
                    not_in_norm: set[torch.nn.Parameter] | None = None, counted: bool = True) -> Tensor:
    """Clip by the global gradient norm across parameters sharded on different meshes (plain tensors too).

    ``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails when DTensors live on different
    meshes (decoder on ``dp x tp``, encoders on ``dp``). Here the local sums of squares of gradients laid out alike
    (one mesh, sharded over the same mesh dimensions) are added up on each rank and all-reduced over those dimensions
    once: a collective per layout, not one per parameter. Under pipeline parallelism each rank holds only its stages'
    parameters: ``pp_group`` sums the squares over the stages; ``not_in_norm`` are copies another pipeline rank
    already counts (they are still scaled). With ``counted=False`` this rank's squares stay out of that sum (a peer
    in ``pp_group`` holds the same ones). Nothing is read back to the host: the gradients are scaled on the device by
    ``min(1, max_norm / norm)``, left alone where the norm is not finite (the non-finite guard's business).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    in_norm = [p.grad for p in parameters if p.grad is not None and not (not_in_norm and p in not_in_norm)]
    device = next((p.device for p in parameters), torch.device("cpu"))  # a rank without gradients still reduces
    total_squares = torch.zeros((), dtype=torch.float64, device=device)
    by_layout, partial = _by_layout(in_norm)
    for reduce_over, tensors in by_layout.items():
        squares = torch.stack([norm.double() for norm in torch._foreach_norm(tensors, 2)]).square().sum()
        for group in reduce_over:
            dist.all_reduce(squares, group=group)
        total_squares = total_squares + squares.to(device)
    for grad in partial:
        total_squares = total_squares + grad.norm().full_tensor().double().square().to(device)
    if not counted:
        total_squares = torch.zeros_like(total_squares)
    if pp_group is not None:
        dist.all_reduce(total_squares, group=pp_group)
    total = total_squares.sqrt()
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    coefficient = torch.where(torch.isfinite(coefficient), coefficient, torch.ones_like(coefficient))
    local = [local_tensor(g) for g in grads]
    for on_device in _by_device(local).values():
        torch._foreach_mul_(on_device, coefficient.to(on_device[0].device, torch.float32))
    return total


def _by_layout(grads: list[Tensor]) -> tuple[dict[tuple[dist.ProcessGroup, ...], list[Tensor]], list[DTensor]]:
    """Local gradients grouped by the process groups their squares are summed over (one per sharded mesh dimension,
    none for a plain tensor or a replicated one), in order of first appearance (the same on every rank of a group);
    and apart, the gradients with a partial placement, whose local squares do not sum to the norm."""
    grouped: dict[tuple[dist.ProcessGroup, ...], list[Tensor]] = {}
    partial: list[DTensor] = []
    for grad in grads:
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            partial.append(grad)
            continue
        # Every placement but a replica splits the gradient (``_StridedShard``, FSDP's over TP, included).
        reduce_over = tuple(grad.device_mesh.get_group(i) for i, p in enumerate(grad.placements)
                            if not p.is_replicate()) if isinstance(grad, DTensor) else ()
        grouped.setdefault(reduce_over, []).append(local_tensor(grad))
    return grouped, partial


def _by_device(tensors: list[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    grouped: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        grouped.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return grouped
