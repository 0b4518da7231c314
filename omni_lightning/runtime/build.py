"""Apply the LLM and encoder parallelisms to an MLLM (reference or adapted), in torchtitan's order: TP, then FSDP."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import register_fsdp_forward_method

from omni_lightning.models.encoders import AudioEncoder, VisionEncoder
from omni_lightning.models.llm import Decoder
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.models.moe import MoEFeedForward
from omni_lightning.parallel.activation_checkpoint import apply_ac, apply_compile
from omni_lightning.parallel.expert_parallel import apply_ep
from omni_lightning.parallel.fsdp import apply_fsdp
from omni_lightning.parallel.layout import EncoderPool, OmniMeshes
from omni_lightning.parallel.tensor_parallel import apply_tp
from omni_lightning.runtime.joint import JointEncoders
from omni_lightning.runtime.pipeline import PipelineRunner, PipelineSettings
from omni_lightning.runtime.reshard import EncoderBalancer

__all__ = ["parallelize_mllm", "parallelize_encoder_pool", "check_model_fits_layout"]


def check_model_fits_layout(model: ReferenceMLLM, meshes: OmniMeshes, *, encoder_balance: bool = False) -> None:
    """Raise ``ValueError`` naming the model size or degree that the layout cannot serve."""
    dims = meshes.parallel_dims
    model.llm.check_tp(dims.tp)
    reference_llm = isinstance(model.llm, Decoder)
    # An LLM-pool rank of the disaggregated placement holds no encoders: the encoder pool checks its own.
    vision, audio = getattr(model, "vision", None), getattr(model, "audio", None)
    reference_encoders = all(e is None or isinstance(e, kind) for e, kind in ((vision, VisionEncoder),
                                                                              (audio, AudioEncoder)))
    # CP, EP and the pipeline drive the reference modules' own signatures (CP shards, experts, RoPE tables, stems).
    for name, supported, what in (("cp", reference_llm, "decoder"), ("ep", reference_llm, "decoder"),
                                  ("pp", reference_llm and reference_encoders, "decoder and encoders")):
        if getattr(dims, name) > 1 and not supported:
            parts = ", ".join(type(part).__name__ for part in (vision, audio, model.llm) if part is not None)
            raise ValueError(f"{name}={getattr(dims, name)} needs the reference {what}, not {parts}; adapted models "
                             "train with tp, dp_replicate and dp_shard")
    if reference_llm:
        llm = model.llm.config
        if dims.ep > 1 and not llm.moe_every:
            raise ValueError(f"ep={dims.ep} shards MoE experts but the LLM has no MoE layers (set llm.moe_every)")
        if llm.moe_every and llm.n_experts % dims.ep:
            raise ValueError(f"llm.n_experts={llm.n_experts} is not divisible by ep={dims.ep}; pick ep dividing it")
    if dims.enc_sp > 1 and not encoder_balance:
        raise ValueError(f"enc_sp={dims.enc_sp} splits items planned by the encoder balancer: set encoder_balance=True")
    for name in ("vision", "audio"):
        encoder = getattr(model, name, None)
        if encoder is None:  # an LLM-pool rank of the disaggregated placement
            continue
        if dims.enc_sp > 1 and not encoder.supports_sequence_parallel:
            raise ValueError(f"enc_sp={dims.enc_sp} splits long items, which {type(encoder).__name__} cannot encode "
                             "in pieces: use enc_sp=1 (whole-item encoder balancing still works)")
        if encoder.n_heads % dims.enc_sp:
            raise ValueError(
                f"{name}.n_heads={encoder.n_heads} is not divisible by enc_sp={dims.enc_sp}: Ulysses attention gives "
                "each member of an SP group a share of the heads; pick enc_sp dividing the encoder heads"
            )


def parallelize_mllm(
    model: ReferenceMLLM, meshes: OmniMeshes, *, param_dtype: torch.dtype | None = None,
    encoder_balance: bool = False, pipeline: PipelineSettings | None = None, activation_checkpointing: bool = False,
    compile_backend: str | None = None, encoder_source: Any = None,
) -> PipelineRunner | None:
    """Tensor-parallelise the decoder, then shard every transformer block and the root with FSDP2 (in place).

    With ``pp > 1`` the model is first cut into pipeline stages (``pipeline`` says how) and pruned to this rank's
    stages; each stage is then its own FSDP root, and the returned :class:`PipelineRunner` trains it.

    Encoder weights are sharded over the same data-parallel ranks as the decoder and replicated over TP peers,
    which see the same samples and so compute the same encoder gradients. With ``encoder_balance`` the
    data-parallel ranks share each step's encoder work (whole items by LPT, long ones split over ``enc_sp``
    blocks; see :mod:`omni_lightning.runtime.reshard`). ``activation_checkpointing`` recomputes every
    transformer block in the backward and ``compile_backend`` compiles their MLPs (see
    :mod:`omni_lightning.parallel.activation_checkpoint`), both between TP and FSDP. ``encoder_source`` feeds
    the first stage encoder outputs computed elsewhere (``pipeline.encoders == "pool"``: the encoder pool of the
    disaggregated placement).
    """
    check_model_fits_layout(model, meshes, encoder_balance=encoder_balance)
    runner = None
    if (pp_mesh := meshes.get("pp")) is not None:
        settings = pipeline or PipelineSettings()
        encoder_group, joint_balancer = None, None
        if settings.encoders == "joint":  # its own group, so its transfers never meet the schedule's
            encoder_group, _ = dist.new_subgroups_by_enumeration(meshes.parallel_dims.groups("pp"))
            if encoder_balance and meshes.encoder_group is not None:
                joint_balancer = _encoder_balancer(model, meshes)
        runner = PipelineRunner(model, pp_mesh.get_group(), schedule=settings.schedule,
                                n_microbatches=settings.microbatches or pp_mesh.size(),
                                virtual_stages=settings.virtual_stages, max_tokens=settings.max_tokens,
                                device=torch.device(pp_mesh.device_type), dtype=param_dtype or torch.float32,
                                encoders=settings.encoders, encoder_group=encoder_group,
                                data_parallel_group=dp_cp.get_group() if (dp_cp := meshes.get("dp_cp")) else None,
                                encoder_source=encoder_source,
                                llm_share=1 / (meshes.parallel_dims.tp * meshes.parallel_dims.cp),
                                calibration_steps=settings.calibration_steps,
                                tensor_parallel_group=tp.get_group() if (tp := meshes.get("tp")) else None,
                                encoder_balancer=joint_balancer)
    if (cp_mesh := meshes.get("cp")) is not None:
        model.cp_group = cp_mesh.get_group()
    first_stage_encoders = runner is None or (runner.joint is None and runner.has_first_stage)
    if encoder_balance and meshes.encoder_group is not None and first_stage_encoders:
        model.encoder_balancer = _encoder_balancer(model, meshes)
    if (tp_mesh := meshes.get("tp")) is not None:
        apply_tp(model.llm, tp_mesh)
    experts: list[torch.nn.Parameter] = []
    if meshes.ep_mesh is not None:
        experts = apply_ep(model.llm, meshes.ep_mesh, meshes.expert_replica_group,
                           gradient_divide=meshes.size("dp_cp"))
    if (loss_mesh := meshes.get("dp_cp")) is not None:
        for module in model.llm.modules():  # global routing statistics for the load-balance loss
            if isinstance(module, MoEFeedForward):
                module.stats_group = loss_mesh.get_group()
    # This rank's blocks: a pipeline stage has pruned the others (and, past stage 0, maybe the encoders).
    encoders = [encoder for name in ("vision", "audio") if (encoder := getattr(model, name, None)) is not None]
    blocks = [*model.llm.layers.values(), *(block for encoder in encoders for block in encoder.blocks)]
    if compile_backend is not None:
        apply_compile(blocks, compile_backend)
    if activation_checkpointing:
        apply_ac(blocks)
    fsdp_mesh = meshes.fsdp_mesh
    if runner is None:
        if fsdp_mesh is not None:
            apply_fsdp(model, fsdp_mesh, blocks=blocks, param_dtype=param_dtype, ignored_params=set(experts) or None)
        return None
    if fsdp_mesh is not None:
        if isinstance(runner.joint, JointEncoders):  # every pipeline rank runs the encoders: each its own FSDP root
            for encoder in (model.vision, model.audio):
                apply_fsdp(encoder, fsdp_mesh, blocks=[*encoder.blocks], param_dtype=param_dtype)
                if runner.joint.balancer is not None:  # it runs the stem and the rest apart, around its exchange
                    register_fsdp_forward_method(encoder, "embed")
                    register_fsdp_forward_method(encoder, "encode")
        for stage in runner.stage_modules:
            blocks = [*stage.layers.values()]
            if stage.is_first and runner.joint is None:
                blocks += [*model.vision.blocks, *model.audio.blocks]
            # Micro-batches of a step reuse the gathered weights: no reshard between forwards (torchtitan's choice).
            apply_fsdp(stage, fsdp_mesh, blocks=blocks, param_dtype=param_dtype, reshard_after_forward=False,
                       ignored_params=set(experts) or None)
    runner.build()
    return runner


def parallelize_encoder_pool(model: ReferenceMLLM, pool: EncoderPool, *, param_dtype: torch.dtype | None = None,
                             encoder_balance: bool = True, activation_checkpointing: bool = False,
                             compile_backend: str | None = None) -> None:
    """Parallelise an encoder-pool rank's encoders (disaggregated placement), in place: FSDP over the pool, and with
    ``encoder_balance`` each micro-batch's items resharded over the pool (long ones split over its SP blocks)."""
    encoders = [model.vision, model.audio]
    blocks = [block for encoder in encoders for block in encoder.blocks]
    if compile_backend is not None:
        apply_compile(blocks, compile_backend)
    if activation_checkpointing:
        apply_ac(blocks)
    if pool.group is not None and encoder_balance:
        enc_sp = max(pool.sp_blocks, default=1)
        model.encoder_balancer = EncoderBalancer(pool.group, pool.sp_blocks,
                                                 {"vision": model.vision.cost(), "audio": model.audio.cost()},
                                                 enc_sp=enc_sp)
    if pool.mesh is not None:
        apply_fsdp(model, pool.mesh, blocks=blocks, param_dtype=param_dtype)
        # The pool calls encode_items, not forward: FSDP must gather the root's parameters (stems, projectors) there.
        register_fsdp_forward_method(model, "encode_items")


def _encoder_balancer(model: ReferenceMLLM, meshes: OmniMeshes) -> EncoderBalancer:
    """Encoder resharding with long-short SP over this rank's encoder group (its data-parallel peers)."""
    costs = {"vision": model.vision.cost(), "audio": model.audio.cost()}
    return EncoderBalancer(meshes.encoder_group, meshes.encoder_sp_blocks, costs, enc_sp=meshes.parallel_dims.enc_sp)
