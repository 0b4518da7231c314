"""One training step over the parallel model, of the kind the layout calls for, chosen once when the model is built.

* :class:`PlainStep`: the encoder stage, then the model's forward on the rank's micro-batch; Lightning runs the
  backward.
* :class:`PipelineStep`: a pipeline schedule over the step's micro-batches, forward and backward inside.
* :class:`PoolLLMStep` / :class:`PoolEncoderStep`: the two sides of the disaggregated placement streaming
  micro-batches to each other (the LLM side pipelined or not), backward inside.

:func:`build_step` prunes the model to what this rank runs, builds the encoder source, applies the model's
parallelize plan, and returns the step. Every step scales its loss with one :class:`~omni_lightning.runtime.loss.
StepLoss` and reports the same statistics (global loss, tokens, samples, MoE load-balance loss).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.balance.reshard import EncoderTraffic, resolve_link
from omni_lightning.batch import IGNORE_INDEX, PackedBatch
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.models.parallelize import check_model_fits_layout, parallelize_reference
from omni_lightning.parallel.expert_parallel import sync_expert_gradients, sync_token_split_gradients
from omni_lightning.parallel.fsdp import set_gradient_sync
from omni_lightning.parallel.grad_norm import clip_grad_norm_
from omni_lightning.parallel.layout import OmniLayout, OmniMeshes
from omni_lightning.parallel.timing import action_clock
from omni_lightning.parallel.transfer import to_device
from omni_lightning.runtime.calibration import JointCalibrator, ResharderCalibrator
from omni_lightning.runtime.encoders import EncoderSource, LocalEncoders, llm_work
from omni_lightning.runtime.items import split_micro_batches
from omni_lightning.runtime.joint import JointEncoders
from omni_lightning.runtime.loss import StepLoss, next_token_loss_sum, vocab_parallel_loss
from omni_lightning.runtime.peers import SamplePeers
from omni_lightning.runtime.pipeline import PipelineRunner
from omni_lightning.runtime.pool import EncoderPoolLink, EncoderPoolWorker
from omni_lightning.runtime.reshard import Resharder

__all__ = ["PipelineStep", "PlainStep", "PoolEncoderStep", "PoolLLMStep", "Step", "StepResult", "build_step"]


@dataclass
class StepResult:
    """``loss``: what Lightning backpropagates, or (for a step that ran its own backward) the loss value only.
    ``stats``: global figures of the step: ``loss`` (mean over its loss tokens), ``tokens``, ``samples`` and
    ``moe_aux_loss``."""

    loss: torch.Tensor
    stats: dict[str, torch.Tensor]


class Step(Protocol):
    """A kind of training step (see the module docstring)."""

    #: Whether :meth:`run` runs the backward itself (Lightning's own backward then has nothing to do).
    runs_backward: bool
    #: Thread CPU seconds of the last forward's encoder stage and LLM, where the step measures them.
    forward_cpu_seconds: dict[str, float]

    def run(self, batch: PackedBatch, *, train: bool, accumulate: int, last_of_step: bool = True) -> StepResult:
        """Forward (and, where :attr:`runs_backward`, backward) of one Lightning batch; ``accumulate`` batches make
        an optimizer step, ``last_of_step`` is its last."""
        ...

    def sync_gradients(self) -> None:
        """Before the optimizer step: reduce the gradients the step leaves to be reduced (experts, replicated
        encoders)."""
        ...

    def clip_gradients(self, parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over every rank's parameters, each counted once; returns the norm."""
        ...

    @property
    def encoder_stats(self) -> Mapping[str, float]:
        """The last step's encoder plan statistics (``reshard/*``)."""
        ...


def _sync_moe_gradients(model: ReferenceMLLM) -> None:
    """Experts' gradients summed over their replicas, MoE layers' over the tensor-parallel peers splitting tokens."""
    sync_expert_gradients(*model.moe_layers)
    sync_token_split_gradients(*model.moe_layers)


def _whole_aux(model: ReferenceMLLM, aux: torch.Tensor) -> torch.Tensor:
    """A (detached) MoE load-balance share summed over the tensor-parallel peers that split the tokens (each peer's
    share covers its tokens only), for logging."""
    if (group := model.moe_token_split_group) is not None:
        aux = aux.clone()
        dist.all_reduce(aux, group=group)
    return aux


def _loss_group(meshes: OmniMeshes | None) -> dist.ProcessGroup | None:
    mesh = meshes.get("dp_cp") if meshes is not None else None
    return mesh.get_group() if mesh is not None else None


@dataclass
class PlainStep:
    """The encoder stage, then the model's forward; the loss is returned for Lightning's backward.

    With :class:`~omni_lightning.datamodules.OmniDataModule` batches (which say how many loss tokens their optimizer
    step holds) the loss is divided by the loss tokens of the whole step, so the update does not depend on how the
    step was cut into micro-batches; other batches get Lightning's equal weighting of accumulated batches.
    ``source=None`` leaves encoding to the model's own forward (a model a user built and wrapped themselves).
    ``autocast`` runs the forward under ``torch.autocast`` in that dtype: mixed precision in one process without
    a process group, where FSDP cannot run (fp32 weights, gradients and optimizer all the same).
    """

    model: ReferenceMLLM
    source: LocalEncoders | None
    meshes: OmniMeshes | None = None
    runs_backward: bool = False
    forward_cpu_seconds: dict[str, float] = field(default_factory=dict)
    autocast: torch.dtype | None = None

    @property
    def encoder_stats(self) -> Mapping[str, float]:
        return self.source.stats if self.source is not None else {}

    @property
    def calibrator(self) -> ResharderCalibrator | None:
        """What times this step's first training batches to price the resharder's plan (``None``: nothing)."""
        return self.source.calibrator if self.source is not None else None

    def run(self, batch: PackedBatch, *, train: bool, accumulate: int, last_of_step: bool = True) -> StepResult:
        model, meshes = self.model, self.meshes
        device_type = batch["input_ids"].device.type
        with torch.autocast(device_type, self.autocast) if self.autocast is not None else nullcontext():
            started = time.thread_time()
            encoded = None
            if self.source is not None:
                self.source.start([batch], train=train)
                encoded = self.source.outputs(0)
            encoded_at = time.thread_time()
            calibrator = self.calibrator if train else None
            timing = calibrator is not None and calibrator.measures("llm")  # reading the work syncs with the device
            with calibrator.timed("llm", calibrator.llm_work(*llm_work(batch))) if timing else nullcontext():
                logits = model(batch, encoded)
        # This thread's forward CPU seconds (a blocked collective costs none), for the measured balance.
        self.forward_cpu_seconds = {"encoders": encoded_at - started, "llm": time.thread_time() - encoded_at}
        if self.source is not None:
            self.source.finish()
        if calibrator is not None:
            calibrator.end_batch()
        loss_sum, loss_tokens = next_token_loss_sum(logits, model.local_labels(batch))
        cp = meshes.size("cp") if meshes is not None else 1
        step = batch.get("step") if train else None
        aux_share = model.llm.moe_aux_loss()  # this rank's share of the MoE load-balance loss (0 if dense)
        # One collective for everything that needs the global batch. Nothing of it is read back here: the loss is
        # scaled by the all-reduced count on the device (on an accelerator a read would stall the host between the
        # forward and the backward), and the host's numbers reach the device in one copy that does not wait.
        device = loss_sum.device
        # CP peers hold the same samples: each counts 1 / cp of them.
        step_count = float(step["loss_tokens"]) if step is not None else 0.0
        host = to_device([batch["input_ids"].numel() / cp, batch["num_samples"] / cp, step_count / cp], device,
                         torch.float64)
        step_tokens = host[2] if step is not None else loss_tokens.double()  # no step's count: this batch's own
        totals = torch.stack([_whole_aux(model, aux_share.detach().double()), loss_sum.detach().double(),
                              loss_tokens.double(), host[0], host[1], step_tokens])
        if (group := _loss_group(meshes)) is not None:
            dist.all_reduce(totals, group=group)
        aux, global_loss_sum, global_tokens, tokens, samples, global_step_tokens = totals
        accumulate = accumulate if train else 1
        loss = StepLoss(global_step_tokens, _data_parallel(meshes), weight=1.0 if step is not None else
                        1 / accumulate, aux_coef=model.config.llm.moe_aux_loss_coef, aux_parts=accumulate)
        stats = {"loss": (global_loss_sum / global_tokens.clamp(min=1.0)).float(), "tokens": tokens,
                 "samples": samples, "moe_aux_loss": aux.float()}
        # Lightning divides every accumulated batch's loss by the accumulation count: undone here.
        return StepResult(loss(loss_sum, aux_share) * accumulate, stats)

    def sync_gradients(self) -> None:
        if self.source is not None:
            self.source.sync_gradients()
        _sync_moe_gradients(self.model)

    def clip_gradients(self, parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(parameters, max_norm)


def _data_parallel(meshes: OmniMeshes | None) -> int:
    """The ranks FSDP averages gradients over (what the loss is scaled by)."""
    mesh = meshes.get("dp_cp") if meshes is not None else None
    return mesh.size() if mesh is not None else 1


def _micro_batches_and_counts(batch: PackedBatch, n: int, model: ReferenceMLLM, meshes: OmniMeshes
                              ) -> tuple[list[PackedBatch], torch.Tensor]:
    """A step's micro-batches (the batch's own list, or the batch cut into ``n``) and its global ``[loss tokens,
    tokens, samples]``."""
    micro = batch.get("micro_batches") or split_micro_batches(batch, n, model.packing)
    device = micro[0]["input_ids"].device
    cp = meshes.size("cp")  # CP peers hold the same micro-batches: each counts 1 / cp of them
    # Counted on the device and never read back (see PlainStep.run); the host's counts reach it in one copy.
    loss_tokens = torch.stack([(mb["labels"] != IGNORE_INDEX).sum() for mb in micro]).sum().double().reshape(1)
    known = to_device([sum(mb["input_ids"].numel() for mb in micro), sum(mb["num_samples"] for mb in micro)], device,
                      torch.float64)
    counts = torch.cat([loss_tokens, known]) / cp
    if (group := _loss_group(meshes)) is not None:
        dist.all_reduce(counts, group=group)
    return micro, counts


@dataclass
class PipelineStep:
    """A pipeline schedule over the step's micro-batches, forward and backward (there is no single backward for
    Lightning to run); the returned loss only carries the value."""

    model: ReferenceMLLM
    runner: PipelineRunner
    meshes: OmniMeshes
    runs_backward: bool = True
    forward_cpu_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def encoder_stats(self) -> Mapping[str, float]:
        return self.runner.source.stats if self.runner.source is not None else {}

    def run(self, batch: PackedBatch, *, train: bool, accumulate: int, last_of_step: bool = True) -> StepResult:
        runner, meshes = self.runner, self.meshes
        micro, counts = _micro_batches_and_counts(batch, runner.n_microbatches, self.model, meshes)
        accumulate = accumulate if train else 1
        loss = StepLoss(counts[0], _data_parallel(meshes), weight=1 / accumulate,
                        aux_coef=self.model.config.llm.moe_aux_loss_coef,
                        aux_parts=accumulate * runner.n_microbatches)  # a mean over the schedule's micro-batches
        with vocab_parallel_loss() if meshes.get("tp") is not None else nullcontext():
            loss_sum = runner.step(micro, loss) if train else runner.evaluate(micro)
        # Only the last stage holds losses: summing over the pipeline and the data-parallel ranks makes them global.
        loss_sum = loss_sum.detach().double().reshape(1)
        for name in ("pp", "dp_cp"):
            if (mesh := meshes.get(name)) is not None:
                dist.all_reduce(loss_sum, group=mesh.get_group())
        global_loss = (loss_sum[0] / counts[0].clamp(min=1.0)).float()
        stats = {"loss": global_loss, "tokens": counts[1], "samples": counts[2],
                 "moe_aux_loss": torch.zeros((), device=global_loss.device)}
        return StepResult(global_loss.detach().requires_grad_(), stats)

    def sync_gradients(self) -> None:
        _sync_moe_gradients(self.model)
        self.runner.sync_gradients()

    def clip_gradients(self, parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        pp_mesh = self.meshes.get("pp")
        assert pp_mesh is not None
        # Copies every pipeline rank holds (the joint pipeline's encoders) count once, from the first pipeline rank.
        copies = self.runner.replicated_parameters() if pp_mesh.get_local_rank() != 0 else set()
        return clip_grad_norm_(parameters, max_norm, pp_group=pp_mesh.get_group(), not_in_norm=copies)


@dataclass
class _PoolSide:
    """What both sides of the disaggregated placement share: the stream's length and lag, and the world-wide norm."""

    layout: OmniLayout
    microbatches: int
    lag: int

    def broadcast(self, stats: torch.Tensor, device: torch.device) -> StepResult:
        """Rank 0's ``[global loss, tokens, samples, aux]`` to every rank, so both pools log, check and return the same
        values."""
        stats = stats.to(device)
        dist.broadcast(stats, src=0)
        global_loss = stats[0].float()
        result = {"loss": global_loss, "tokens": stats[1], "samples": stats[2], "moe_aux_loss": stats[3].float()}
        return StepResult(global_loss.detach().requires_grad_(), result)

    def clip(self, parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Summed over the world: each pipeline stage's norm and the encoder pool's, once."""
        pool = self.layout.pool
        assert pool is not None
        rank, llm = self.layout.rank, pool.layout.llm
        if pool.layout.is_encoder_rank(rank):
            counted = rank == pool.layout.encoder_ranks[0]
        else:
            counted = not any(index for dim, index in llm.coordinate(rank).items() if dim != "pp")
        return clip_grad_norm_(parameters, max_norm, pp_group=pool.transfers, counted=counted)


@dataclass
class PoolEncoderStep:
    """An encoder-pool rank's step: encode what the LLM pool sends, micro-batch by micro-batch."""

    model: ReferenceMLLM
    worker: EncoderPoolWorker
    side: _PoolSide
    device: torch.device
    runs_backward: bool = True
    forward_cpu_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def encoder_stats(self) -> Mapping[str, float]:
        return self.worker.source.stats

    def run(self, batch: PackedBatch, *, train: bool, accumulate: int, last_of_step: bool = True) -> StepResult:
        self.worker.step(self.side.microbatches, train=train, lag=self.side.lag)
        return self.side.broadcast(torch.zeros(4, dtype=torch.float64), self.device)

    def sync_gradients(self) -> None:
        """Nothing beyond FSDP's reduction over the pool."""

    def clip_gradients(self, parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        return self.side.clip(parameters, max_norm)


@dataclass
class PoolLLMStep:
    """An LLM-pool rank's step: the micro-batches' forward and backward as the encoder pool's outputs arrive (through
    its pipeline schedule when there is one), their gradients sent back from inside the backward."""

    model: ReferenceMLLM
    link: EncoderPoolLink | None
    meshes: OmniMeshes
    side: _PoolSide
    device: torch.device
    pipeline: PipelineStep | None = None
    runs_backward: bool = True
    forward_cpu_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def encoder_stats(self) -> Mapping[str, float]:
        return {}

    def run(self, batch: PackedBatch, *, train: bool, accumulate: int, last_of_step: bool = True) -> StepResult:
        if self.pipeline is not None:
            result = self.pipeline.run(batch, train=train, accumulate=accumulate)
            stats = torch.stack([result.stats[k].double().cpu().reshape(()) for k in ("loss", "tokens", "samples")]
                                + [torch.zeros((), dtype=torch.float64)])
        else:
            stats = self._stream(batch, train=train, accumulate=accumulate, reduce_gradients=last_of_step or not train)
        return self.side.broadcast(stats, self.device)

    def _stream(self, batch: PackedBatch, *, train: bool, accumulate: int, reduce_gradients: bool) -> torch.Tensor:
        """``[global loss, tokens, samples, aux]`` of the step, having run its forward and backward."""
        link, model, meshes, n = self.link, self.model, self.meshes, self.side.microbatches
        assert link is not None
        micro, counts = _micro_batches_and_counts(batch, n, model, meshes)
        if len(micro) != n:
            raise ValueError(f"the batch holds {len(micro)} micro-batches but the encoder pool streams {n} a step "
                             f"(OmniStrategy(pp_microbatches={n})): plan {n} per step")
        device = micro[0]["input_ids"].device
        accumulate = accumulate if train else 1
        data_parallel = _data_parallel(meshes)
        loss = StepLoss(counts[0], data_parallel, weight=1 / accumulate,
                        aux_coef=model.config.llm.moe_aux_loss_coef, aux_parts=accumulate * n)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        aux_total = torch.zeros((), dtype=torch.float64, device=device)
        link.start(micro, train=train)
        tp = meshes.get("tp") is not None
        for i, mb in enumerate(micro):
            with vocab_parallel_loss() if tp else nullcontext():
                mb_sum, _ = next_token_loss_sum(model(mb, link.outputs(i)), model.local_labels(mb))
                aux = model.llm.moe_aux_loss()
                if train:  # the outputs' gradients leave for the encoder pool from inside this backward
                    set_gradient_sync(model, reduce_gradients and i == n - 1)
                    loss(mb_sum, aux).backward()
            loss_sum += mb_sum.detach().double()
            aux_total += aux.detach().double() / n
        link.finish()
        set_gradient_sync(model, True)
        totals = torch.stack([loss_sum, _whole_aux(model, aux_total) * data_parallel])
        if (group := _loss_group(meshes)) is not None:
            dist.all_reduce(totals, group=group)
        return torch.stack([totals[0] / counts[0].clamp(min=1.0), counts[1], counts[2],
                            totals[1] / data_parallel]).cpu()

    def sync_gradients(self) -> None:
        if self.pipeline is not None:
            self.pipeline.sync_gradients()
        else:
            _sync_moe_gradients(self.model)

    def clip_gradients(self, parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        return self.side.clip(parameters, max_norm)


@dataclass(frozen=True)
class StepOptions:
    """How the model's blocks run: compute dtype (FSDP's ``param_dtype``; ``None`` keeps fp32), activation
    checkpointing, and the ``torch.compile`` backend of their MLPs (``None``: eager)."""

    param_dtype: torch.dtype | None = None
    activation_checkpointing: bool = False
    compile_backend: str | None = None


def build_step(model: ReferenceMLLM, layout: OmniLayout | None, *, device: torch.device,
               options: StepOptions = StepOptions()) -> Step:
    """Prune ``model`` to what this rank runs, parallelise it and return its step (see the module docstring)."""
    if layout is None:  # one process, or a strategy that does not parallelise the model itself
        parallelize_reference(model, compile_backend=options.compile_backend,
                              activation_checkpointing=options.activation_checkpointing)
        return PlainStep(model, LocalEncoders(model), autocast=options.param_dtype)
    model.use_groups(layout.model_groups)
    if layout.pool is not None:
        return _pool_step(model, layout, device, options)
    check_model_fits_layout(model, layout.dims, reshard=layout.reshard)
    meshes = layout.meshes
    pipelined = meshes.get("pp") is not None
    resharder = (_resharder(model, layout, device, options, on_llm=not pipelined)
                 if layout.reshard and meshes.encoder_group is not None else None)
    if not pipelined:
        _parallelize(model, meshes, options)
        calibrator = None
        if resharder is not None and layout.reshard_calibration_steps:
            calibrator = ResharderCalibrator(resharder, steps=layout.reshard_calibration_steps,
                                             clock=action_clock(device), device=device,
                                             training_passes=model.training_passes)
        # Context- and tensor-parallel peers hold the same samples: they split the encoder items.
        return PlainStep(model, LocalEncoders(model, resharder, sample_peers(meshes), calibrator), meshes)
    runner = _pipeline_runner(model, layout, device, options, resharder)
    return PipelineStep(model, runner, meshes)


def sample_peers(meshes: OmniMeshes) -> SamplePeers | None:
    """This rank's context- and tensor-parallel peers (``None`` without any)."""
    peers = meshes.get("cp_tp")
    if peers is None:
        return None
    cp, tp = meshes.get("cp"), meshes.get("tp")
    return SamplePeers(peers.get_group(), cp.get_group() if cp is not None else None,
                       tp.get_group() if tp is not None else None, replica=meshes.local_rank("dp"))


def _parallelize(model: ReferenceMLLM, meshes: OmniMeshes, options: StepOptions,
                 stages: Sequence[nn.Module] = ()) -> None:
    tp, dp_cp = meshes.get("tp"), meshes.get("dp_cp")
    # Mixed precision is FSDP's policy, so a layout without data parallelism runs FSDP over one rank for it.
    fsdp_mesh = meshes.mixed_precision_mesh() if options.param_dtype is not None else meshes.fsdp_mesh
    parallelize_reference(model, tp_mesh=tp, ep_mesh=meshes.ep_mesh, expert_replicas=meshes.expert_replica_group,
                          gradient_divide=dp_cp.size() if dp_cp is not None else 1, fsdp_mesh=fsdp_mesh,
                          stages=stages, param_dtype=options.param_dtype,
                          activation_checkpointing=options.activation_checkpointing,
                          compile_backend=options.compile_backend)


def _resharder(model: ReferenceMLLM, layout: OmniLayout, device: torch.device, options: StepOptions, *,
               on_llm: bool) -> Resharder:
    """Encoder resharding with long-short SP over this rank's encoder group (its data-parallel peers); ``on_llm``:
    each rank runs its encoders and then the LLM on the same micro-batch, so the plan balances the two together."""
    meshes = layout.meshes
    assert meshes.encoder_group is not None
    prices = layout.cost_model
    llm_cost = prices.llm if prices is not None else model.llm.cost()
    llm = {"llm": llm_cost, "llm_share": 1.0 / (layout.dims.cp * layout.dims.tp)} if on_llm else {}
    return Resharder(meshes.encoder_group, meshes.encoder_sp_blocks, _encoder_costs(model, layout),
                     enc_sp=layout.dims.enc_sp, **llm,
                     **_reshard_pricing(model, layout, device, options, meshes.encoder_group))


def _encoder_costs(model: ReferenceMLLM, layout: OmniLayout) -> dict[str, ModuleCost]:
    """What the resharder prices this rank's encoders' items by: the layout's cost model (the strategy's
    ``cost_model``, which the loader's plan prices by too), else each encoder's FLOPs."""
    if layout.cost_model is not None:
        return {name: layout.cost_model.module(name) for name in model.encoders}
    return {name: encoder.cost() for name, encoder in model.encoders.items()}


def _reshard_pricing(model: ReferenceMLLM, layout: OmniLayout, device: torch.device, options: StepOptions,
                     group: dist.ProcessGroup) -> dict[str, Any]:
    """The resharder's ``traffic`` and ``link`` for this model, device and encoder ``group`` (none under
    ``"compute_only"``)."""
    link = resolve_link(layout.link_cost, device.type, spans_nodes=layout.spans_nodes(group))
    if link is None:
        return {}
    element = torch.finfo(options.param_dtype or torch.float32).bits // 8
    traffic = {name: _encoder_traffic(encoder, model.output_width(name), element)
               for name, encoder in model.encoders.items()}
    return {"traffic": traffic, "link": link}


def _encoder_traffic(encoder: nn.Module, output_width: int, element_bytes: int) -> EncoderTraffic:
    """The bytes an encoder's items move per stem token (:meth:`EncoderTraffic.of_encoder`), its width read from
    the encoder's config where it has one, else the output width, a bound for the usual projector."""
    config = getattr(encoder, "config", None)
    width = getattr(config, "dim", None) or getattr(config, "hidden_size", None) or output_width
    return EncoderTraffic.of_encoder(width=width, layers=len(encoder.blocks), output_width=output_width,
                                     tokens_per_output=encoder.tokens_per_output, element_bytes=element_bytes)


def _pipeline_runner(model: ReferenceMLLM, layout: OmniLayout, device: torch.device, options: StepOptions,
                     resharder: Resharder | None, source: EncoderSource | None = None) -> PipelineRunner:
    """Cut ``model`` into this rank's pipeline stages and parallelise them; ``source`` feeds the first stage where
    the encoders run elsewhere (the encoder pool)."""
    meshes, dims = layout.meshes, layout.dims
    pp_mesh = meshes.get("pp")
    assert pp_mesh is not None
    settings = layout.pipeline.resolved(dims.pp)
    dtype = options.param_dtype or torch.float32
    calibrator = None
    if settings.encoders == "joint":
        joint = _joint_encoders(model, layout, settings, dtype, resharder)
        if settings.calibration_steps and settings.schedule == "1F1B":  # GPipe's plan is plain LPT
            streams = layout.pipeline_transfer_streams()
            assert streams is not None
            calibrator = JointCalibrator(joint, streams["outputs"], steps=settings.calibration_steps,
                                         clock=action_clock(device), flops=model.cost_model(),
                                         llm_share=joint.llm_share, device=device)
        source = joint
    elif settings.encoders == "first_stage" and meshes.local_rank("pp") == 0:
        source = LocalEncoders(model, resharder, sample_peers(meshes))
    runner = PipelineRunner(model, pp_mesh.get_group(), settings=settings, device=device, dtype=dtype,
                            source=source, calibrator=calibrator)
    _parallelize(model, meshes, options, stages=runner.stage_modules)
    runner.build()
    return runner


def _joint_encoders(model: ReferenceMLLM, layout: OmniLayout, settings: Any, dtype: torch.dtype,
                    resharder: Resharder | None) -> JointEncoders:
    meshes, dims = layout.meshes, layout.dims
    streams = layout.pipeline_transfer_streams()
    assert streams is not None
    costs = model.cost_model()
    dp_cp = meshes.get("dp_cp")
    # 1F1B has finished micro-batch T - pp's backward on stage 0 when it starts T; GPipe only at the end.
    return JointEncoders(model, streams, dict(costs.encoders), n_microbatches=settings.microbatches,
                         lag=dims.pp if settings.schedule == "1F1B" else settings.microbatches,
                         one_f_one_b=settings.schedule == "1F1B", llm_share=1 / (dims.tp * dims.cp), dtype=dtype,
                         dp_group=dp_cp.get_group() if dp_cp is not None else None,
                         peers=sample_peers(meshes), resharder=resharder)


def _pool_step(model: ReferenceMLLM, layout: OmniLayout, device: torch.device, options: StepOptions) -> Step:
    """The disaggregated placement: keep this pool's part of the model, parallelise it, connect it to the other."""
    pool, dims, meshes = layout.pool, layout.dims, layout.meshes
    assert pool is not None
    dtype = options.param_dtype or torch.float32
    microbatches = layout.pipeline.microbatches or max(dims.pp, 2)  # at least 2, so the pools' work overlaps
    lag = 1 if dims.pp == 1 else dims.pp if layout.pipeline.schedule == "1F1B" else microbatches
    side = _PoolSide(layout, microbatches, lag)
    if layout.is_encoder_rank:
        del model.llm
        several = pool.layout.encoder_world_size > 1
        parallelize_reference(model, fsdp_mesh=pool.mesh if several or options.param_dtype else None,
                              param_dtype=options.param_dtype,
                              activation_checkpointing=options.activation_checkpointing,
                              compile_backend=options.compile_backend)
        resharder = None
        if pool.group is not None and layout.reshard:
            resharder = Resharder(pool.group, pool.sp_blocks, _encoder_costs(model, layout),
                                  enc_sp=max(pool.sp_blocks, default=1),
                                  **_reshard_pricing(model, layout, device, options, pool.group))
        worker = EncoderPoolWorker(pool.layout, pool.streams, LocalEncoders(model, resharder), model.packing,
                                   device=device, dtype=dtype)
        return PoolEncoderStep(model, worker, side, device)
    costs = dict((layout.cost_model or model.cost_model()).encoders)
    for name in model.encoder_names:
        delattr(model, name)
    link = None
    if meshes.local_rank("pp") == 0:  # the first pipeline stage embeds: it receives the encoder outputs
        cp = meshes.get("cp")
        # The encoder pool's FSDP averages over its ranks, the LLM's loss is scaled by its data-parallel size.
        scale = pool.layout.encoder_world_size / meshes.size("dp_cp")
        peers = [mesh.get_group() for mesh in (meshes.get("cp"), meshes.get("tp")) if mesh is not None]
        widths = {name: model.output_width(name) for name in model.encoder_names}
        link = EncoderPoolLink(pool.layout, pool.streams, model.packing, costs, widths=widths, dtype=dtype,
                               cp_group=cp.get_group() if cp is not None else None, gradient_scale=scale,
                               peer_groups=peers)
    check_model_fits_layout(model, dims, reshard=False)
    if dims.pp == 1:
        _parallelize(model, meshes, options)
        return PoolLLMStep(model, link, meshes, side, device)
    runner = _pipeline_runner(model, layout, device, options, None, source=link)
    return PoolLLMStep(model, link, meshes, side, device, PipelineStep(model, runner, meshes))
