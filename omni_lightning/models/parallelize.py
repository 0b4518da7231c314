"""The reference MLLM's parallelize plan (kept beside the model, as torchtitan keeps one beside each family): tensor
parallelism of the decoder, expert parallelism of its MoE layers, compile and activation checkpointing of the blocks,
then FSDP2, in that order. It serves the reference components and the adapted ones alike, through the adapter
protocols; which ranks hold which parts (pipeline stages, pools) is the runtime's business, which calls this on
what a rank holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.distributed.tensor.parallel import parallelize_module

from omni_lightning.models.adapters.protocol import LLMAdapter
from omni_lightning.models.layers import GeluMLP
from omni_lightning.models.llm import Decoder, FeedForward
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.parallel.activation_checkpoint import apply_ac, apply_compile
from omni_lightning.parallel.dims import ParallelDims
from omni_lightning.parallel.expert_parallel import apply_ep
from omni_lightning.parallel.fsdp import apply_fsdp

__all__ = ["apply_tp", "check_model_fits_layout", "parallelize_reference"]


def check_model_fits_layout(model: ReferenceMLLM, dims: ParallelDims, *, reshard: bool = False) -> None:
    """Raise ``ValueError`` naming the model size or degree that the layout ``dims`` cannot serve (``reshard``:
    encoder items are resharded, as ``enc_sp > 1`` needs)."""
    model.llm.check_tp(dims.tp)
    # The pipeline and context parallelism drive the decoder layer by layer (LLMAdapter.run_layers).
    staged = all(hasattr(model.llm, name) for name in ("run_layers", "head_logits"))
    for name in ("pp", "cp"):
        if getattr(dims, name) > 1 and not staged:
            raise ValueError(f"{name}={getattr(dims, name)} runs the decoder layer by layer, which "
                             f"{type(model.llm).__name__} does not offer (LLMAdapter.run_layers and head_logits); "
                             "train it with tp, dp_replicate and dp_shard")
    if dims.pp > 1 and getattr(model.llm, "tied", False):
        raise ValueError("pipeline parallelism puts the embedding on the first stage and the LM head on the last, "
                         "which would untie a tied weight: build the model with tie_word_embeddings=False")
    experts = int(getattr(model.llm, "n_experts", 0))
    if dims.ep > 1 and not experts:
        fix = "set llm.moe_every" if isinstance(model.llm, Decoder) else f"{type(model.llm).__name__} is dense"
        raise ValueError(f"ep={dims.ep} shards MoE experts but the LLM has no MoE layers ({fix})")
    if experts and experts % dims.ep:
        raise ValueError(f"llm.n_experts={experts} is not divisible by ep={dims.ep}; pick ep dividing it")
    if dims.enc_sp > 1 and not reshard:
        raise ValueError(f"enc_sp={dims.enc_sp} splits items planned by the resharder: set encoder_reshard=True")
    for name, encoder in model.encoders.items():  # an LLM-pool rank of the disaggregated placement holds none
        if dims.enc_sp > 1 and not encoder.supports_sequence_parallel:
            raise ValueError(f"enc_sp={dims.enc_sp} splits long items, which {type(encoder).__name__} cannot encode "
                             "in pieces: use enc_sp=1 (whole-item encoder balancing still works)")
        if encoder.n_heads % dims.enc_sp:
            raise ValueError(
                f"{name}.n_heads={encoder.n_heads} is not divisible by enc_sp={dims.enc_sp}: Ulysses attention gives "
                "each member of an SP group a share of the heads; pick enc_sp dividing the encoder heads"
            )


def apply_tp(llm: LLMAdapter, tp_mesh: DeviceMesh) -> None:
    """Split the LLM's embedding, head and block projections over ``tp_mesh`` (in place), by its TP plans."""
    llm.check_tp(tp_mesh.size())
    # A pipeline stage may hold neither the embedding (not first) nor the head (not last).
    plan = {name: style for name, style in llm.tp_plan().items() if hasattr(llm, name)}
    if plan:
        parallelize_module(llm, tp_mesh, plan)
    for block in llm.layers.values():
        parallelize_module(block, tp_mesh, llm.layer_tp_plan(block))


def parallelize_reference(
    model: ReferenceMLLM, *, tp_mesh: DeviceMesh | None = None, ep_mesh: DeviceMesh | None = None,
    expert_replicas: dist.ProcessGroup | None = None, gradient_divide: int = 1, fsdp_mesh: DeviceMesh | None = None,
    stages: Sequence[nn.Module] = (), param_dtype: torch.dtype | None = None, activation_checkpointing: bool = False,
    compile_backend: str | None = None,
) -> None:
    """Parallelise what this rank holds of ``model`` (in place): TP over ``tp_mesh``, experts sharded over
    ``ep_mesh`` (their gradients summed over ``expert_replicas`` and divided by ``gradient_divide``, the ranks FSDP
    averages over), MLPs compiled with ``compile_backend``, every block checkpointed, then FSDP2 over ``fsdp_mesh``
    (1-D, or 2-D for HSDP; experts are left to their own synchronisation).

    FSDP roots: without ``stages``, the model itself, each block its own unit; the runtime's encoder stage enters
    through :meth:`~omni_lightning.models.mllm.ReferenceMLLM.encoder_stage`, so the root's parameters (stems,
    projectors, embedding, head) are gathered for it. With pipeline ``stages`` (modules holding a run of decoder
    blocks as ``layers``, the first maybe the ``encoders`` too), each stage is a root that keeps its weights gathered
    between micro-batches, and encoders outside every stage are roots of their own.
    """
    llm = getattr(model, "llm", None)  # an encoder-pool rank of the disaggregated placement holds none
    if tp_mesh is not None and llm is not None:
        apply_tp(llm, tp_mesh)
    experts: list[nn.Parameter] = []
    if ep_mesh is not None and llm is not None:
        experts = apply_ep([m for m in llm.modules() if hasattr(m, "expert_parameter_names")], ep_mesh, expert_replicas,
                           gradient_divide=gradient_divide)
    encoders = model.encoders
    blocks = [*(llm.layers.values() if llm is not None else ()),
              *(block for encoder in encoders.values() for block in encoder.blocks)]
    if compile_backend is not None:
        apply_compile([m for block in blocks for m in block.modules() if isinstance(m, GeluMLP | FeedForward)],
                      compile_backend)
    if activation_checkpointing:
        apply_ac(blocks)
    if fsdp_mesh is None:
        if param_dtype is not None:  # it would be ignored: mixed precision is FSDP's policy here
            raise ValueError(f"param_dtype={param_dtype} needs an FSDP mesh (a 1-rank one where there is no data "
                             "parallelism); without a process group run the forward under torch.autocast")
        return
    ignored = set(experts) or None
    if not stages:
        # The forward runs the LLM's blocks last: its last block's backward comes first.
        last = [*llm.layers.values()][-1:] if llm is not None else []
        apply_fsdp(model, fsdp_mesh, blocks=blocks, param_dtype=param_dtype, kept_gathered=last,
                   ignored_params=ignored)
        register_fsdp_forward_method(model, "encoder_stage")
        return
    in_stages = {id(e) for stage in stages for e in getattr(stage, "encoders", {}).values()}
    for encoder in encoders.values():
        if id(encoder) not in in_stages:
            apply_fsdp(encoder, fsdp_mesh, blocks=[*encoder.blocks], param_dtype=param_dtype)
            # The encoder stage may run the stem and the rest apart, around its exchange of items.
            register_fsdp_forward_method(encoder, "embed")
            register_fsdp_forward_method(encoder, "encode")
    for stage in stages:
        stage_blocks = [*stage.layers.values(), *(b for e in getattr(stage, "encoders", {}).values() for b in e.blocks)]
        # Micro-batches of a step reuse the gathered weights: no reshard between forwards (torchtitan's choice).
        apply_fsdp(stage, fsdp_mesh, blocks=stage_blocks, param_dtype=param_dtype, reshard_after_forward=False,
                   ignored_params=ignored)
