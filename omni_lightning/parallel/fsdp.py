"""FSDP2 (``fully_shard``) for the reference MLLM: one unit per transformer block, then the root."""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = ["apply_fsdp", "set_gradient_sync"]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: list[nn.Module],
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    kept_gathered: Collection[nn.Module] = (),
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """Shard every module in ``blocks`` as its own FSDP unit, then ``model`` as the root unit (in place).

    ``mesh`` is 1-D for FSDP or 2-D ``(dp_replicate, dp_shard_cp)`` for HSDP. Gradients are averaged over all of
    its ranks, which is why the loss is scaled by the data-parallel size (see ``OmniModule``).
    ``ignored_params`` (expert-parallel weights) are left to their own gradient synchronisation.
    ``reshard_after_forward`` applies to the blocks: the root keeps its parameters gathered from its first forward
    (or forward method, e.g. the encoder stage) to its backward, as ``fully_shard`` does for a root by default, so
    that a step running several of its forward methods gathers them once, not once per method and again for the
    backward (the root holds the embeddings and the head, a model's largest weights). The blocks in
    ``kept_gathered`` (the forward's last block, whose backward runs first) keep their weights gathered from forward to
    backward too: resharding them would only gather them again at once, an all-gather per micro-batch that no
    compute hides.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kept = {id(block) for block in kept_gathered}
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward and id(block) not in kept,
                    ignored_params=ignored_params)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False, ignored_params=ignored_params)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient reduction of every FSDP unit in ``model`` on or off (off while accumulating)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(enabled, recurse=False)
