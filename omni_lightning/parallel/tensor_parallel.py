"""Tensor parallelism (Megatron-style column/row splits): the linear styles the models' plans use.

Attention heads and MLP hidden units are split over the TP mesh; activations between blocks stay replicated,
so the encoders' outputs can be written into the embeddings without any resharding. The LM head's logits stay
sharded over the vocabulary (a DTensor) and the loss is computed under ``loss_parallel``. Encoders are not split:
they are small, and their balance comes from data and (long-short) sequence parallelism instead.
The plans themselves belong to the model (:class:`~omni_lightning.models.adapters.LLMAdapter`, applied by
:func:`omni_lightning.models.parallelize.apply_tp`): the reference decoder keeps MoE feed-forward layers replicated
over TP (expert parallelism is a separate dimension); Hugging Face decoders follow their ``base_model_tp_plan``.

The blocks' projections use :class:`ColwiseLinear` and :class:`RowwiseLinear` rather than DTensor's
``ColwiseParallel``/``RowwiseParallel``: their weights are the same DTensors (so FSDP, checkpoints and optimizers see
no difference), but they multiply local tensors and communicate explicitly, as Megatron does. A DTensor operation
works out its output's sharding and shape for every new input shape, and packed multimodal micro-batches have a
new token count nearly every step: that planning cost about 15 ms of Python per projection here, more than the
matmul itself.
"""

from __future__ import annotations

from functools import partial
from types import MethodType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from typing_extensions import override

__all__ = ["ColwiseLinear", "RowwiseLinear"]


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the backward sums the input gradient over TP, where each rank's weight shard gave a part."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Sum of the ranks' partial outputs over TP; every rank's gradient is the whole output gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _distribute_parameters(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Shard | Replicate]) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [placements[name]]),
                                                     requires_grad=param.requires_grad))


def _check_linear(module: nn.Module, style: str) -> None:
    if not isinstance(module, nn.Linear):
        raise ValueError(f"{style} splits an nn.Linear, not a {type(module).__name__}")


def _colwise_forward(module: nn.Linear, x: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    # Read the weights at call time: FSDP swaps in its unsharded parameters around each forward.
    bias = module.bias.to_local() if module.bias is not None else None
    return F.linear(_CopyToTensorParallel.apply(x, group), module.weight.to_local(), bias)


def _rowwise_forward(module: nn.Linear, x: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    out = _ReduceFromTensorParallel.apply(F.linear(x, module.weight.to_local()), group)
    return out + module.bias.to_local() if module.bias is not None else out


def _bind_forward(module: nn.Module, forward: Any, group: dist.ProcessGroup) -> None:
    # A method bound to the module, not a closure over it: ``copy.deepcopy`` rebinds a bound method to the copy,
    # so a copied model multiplies its own weights (the process group is shared, not copied).
    module.forward = MethodType(partial(forward, group=group), module)


class ColwiseLinear(ParallelStyle):
    """An ``nn.Linear`` whose output features are split over TP: replicated input, output features sharded (local)."""

    @override
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_linear(module, type(self).__name__)
        _distribute_parameters(module, device_mesh, {"weight": Shard(0), "bias": Shard(0)})
        _bind_forward(module, _colwise_forward, device_mesh.get_group())
        return module


class RowwiseLinear(ParallelStyle):
    """An ``nn.Linear`` whose input features are split over TP: input sharded on its last dimension (a
    :class:`ColwiseLinear`'s output), output summed over TP (replicated, local)."""

    @override
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_linear(module, type(self).__name__)
        _distribute_parameters(module, device_mesh, {"weight": Shard(1), "bias": Replicate()})
        _bind_forward(module, _rowwise_forward, device_mesh.get_group())
        return module
