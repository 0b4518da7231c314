"""Apply the LLM and encoder parallelisms to the reference MLLM, in torchtitan's order: TP, then FSDP."""

from __future__ import annotations

import torch

from omni_lightning.balance.cost import CostModel
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.models.moe import MoEFeedForward
from omni_lightning.parallel.encoder_balance import EncoderBalancer
from omni_lightning.parallel.expert_parallel import apply_ep
from omni_lightning.parallel.fsdp import apply_fsdp
from omni_lightning.parallel.mesh import OmniMeshes
from omni_lightning.parallel.tensor_parallel import apply_tp, check_tp_compatible

__all__ = ["parallelize_mllm", "check_model_fits_layout"]

# Parallelisms that ParallelDims can lay out but the runtime does not apply yet.
_NOT_YET_APPLIED = ("pp",)


def check_model_fits_layout(model: ReferenceMLLM, meshes: OmniMeshes, *, encoder_balance: bool = False) -> None:
    """Raise ``ValueError`` naming the model size or degree that the layout cannot serve."""
    dims = meshes.parallel_dims
    unsupported = [f"{name}={dims.size(name)}" for name in _NOT_YET_APPLIED if dims.size(name) > 1]
    if unsupported:
        raise ValueError(
            f"{', '.join(unsupported)}: the reference model runtime applies FSDP/HSDP, TP, CP, EP and encoder SP "
            "so far, not pipeline parallelism; set these degrees to 1"
        )
    check_tp_compatible(model.config.llm, dims.tp)
    llm = model.config.llm
    if dims.ep > 1 and not llm.moe_every:
        raise ValueError(f"ep={dims.ep} shards MoE experts but the LLM has no MoE layers (set llm.moe_every)")
    if llm.moe_every and llm.n_experts % dims.ep:
        raise ValueError(f"llm.n_experts={llm.n_experts} is not divisible by ep={dims.ep}; pick ep dividing it")
    if dims.enc_sp > 1 and not encoder_balance:
        raise ValueError(f"enc_sp={dims.enc_sp} splits items planned by the encoder balancer: set encoder_balance=True")
    for name in ("vision", "audio"):
        heads = getattr(model.config, name).n_heads
        if heads % dims.enc_sp:
            raise ValueError(
                f"{name}.n_heads={heads} is not divisible by enc_sp={dims.enc_sp}: Ulysses attention gives each "
                "member of an SP group a share of the heads; pick enc_sp dividing the encoder heads"
            )


def parallelize_mllm(
    model: ReferenceMLLM, meshes: OmniMeshes, *, param_dtype: torch.dtype | None = None,
    encoder_balance: bool = False,
) -> None:
    """Tensor-parallelise the decoder, then shard every transformer block and the root with FSDP2 (in place).

    Encoder weights are sharded over the same data-parallel ranks as the decoder and replicated over TP peers,
    which see the same samples and so compute the same encoder gradients. With ``encoder_balance`` the
    data-parallel ranks share each step's encoder work (whole items by LPT, long ones split over ``enc_sp``
    blocks; see :mod:`omni_lightning.parallel.encoder_balance`).
    """
    check_model_fits_layout(model, meshes, encoder_balance=encoder_balance)
    if (cp_mesh := meshes.get("cp")) is not None:
        model.cp_group = cp_mesh.get_group()
    if encoder_balance and meshes.encoder_group is not None:
        costs = CostModel.from_config(model.config)
        model.encoder_balancer = EncoderBalancer(
            meshes.encoder_group, meshes.encoder_sp_blocks, {"vision": costs.vision, "audio": costs.audio},
            enc_sp=meshes.parallel_dims.enc_sp,
        )
    if (tp_mesh := meshes.get("tp")) is not None:
        apply_tp(model.llm, tp_mesh)
    experts: list[torch.nn.Parameter] = []
    if meshes.ep_mesh is not None:
        experts = apply_ep(model.llm, meshes.ep_mesh, meshes.expert_replica_group,
                           gradient_divide=meshes.size("dp_cp"))
    if (loss_mesh := meshes.get("dp_cp")) is not None:
        for layer in model.llm.layers:  # global routing statistics for the load-balance loss
            if isinstance(layer.feed_forward, MoEFeedForward):
                layer.feed_forward.stats_group = loss_mesh.get_group()
    if (fsdp_mesh := meshes.fsdp_mesh) is not None:
        blocks = [*model.llm.layers, *model.vision.blocks, *model.audio.blocks]
        apply_fsdp(model, fsdp_mesh, blocks=blocks, param_dtype=param_dtype, ignored_params=set(experts) or None)
