"""Pipeline parallelism for the reference MLLM on ``torch.distributed.pipelining`` schedules.

The decoder's layers are cut into contiguous stages by :func:`assign_layers` (cost-balanced, with the LM head
charged to the last stage). Every pipeline rank keeps the same :class:`ReferenceMLLM` object, pruned to its stages'
layers (plus the encoders and embedding on the first stage, the norm and head on the last), so parameter names are
those of the unsplit model and checkpoints load under any layout.

Micro-batches are packed variable-length sequences. Stage-to-stage tensors must have fixed shapes for the P2P
buffers, so each one travels padded to ``max_tokens`` rows (hidden states, positions, sample boundaries); each
stage computes on the real rows only. The first stage's input is just the micro-batch number: it reads the packed
micro-batch (encoder inputs included) from the runner, so images and audio never need padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from omni_lightning.batch import PackedBatch
from omni_lightning.models.config import LLMConfig
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.parallel.context_parallel import shard_for_context_parallel
from omni_lightning.parallel.settings import PipelineSettings
from omni_lightning.parallel.timing import ActionLog, timed
from omni_lightning.runtime.calibration import JointCalibrator
from omni_lightning.runtime.encoders import EncoderSource
from omni_lightning.runtime.joint import JointEncoders
from omni_lightning.runtime.loss import StepLoss, next_token_loss_sum

__all__ = ["PIPELINE_SCHEDULES", "PipelineRunner", "assign_layers", "layer_costs", "stage_ids_of_rank"]

PIPELINE_SCHEDULES = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
}


# ------------------------------------------------------------------------------------------------- planning
def layer_costs(config: LLMConfig) -> tuple[list[float], float]:
    """Per-token linear FLOPs of every decoder layer, and of the final norm and LM head (charged to the last stage).

    The attention-pair term is the same for every layer, so it does not move the cut and is left out.
    """
    attention = 2.0 * config.dim * (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
    attention += 2.0 * config.n_heads * config.head_dim * config.dim
    swiglu = 6.0 * config.dim * config.ffn_hidden
    moe = 2.0 * config.dim * config.n_experts + config.moe_top_k * swiglu
    costs = [attention + (moe if config.is_moe_layer(i) else swiglu) for i in range(config.n_layers)]
    return costs, 2.0 * config.dim * config.vocab_size


def assign_layers(costs: Sequence[float], n_stages: int, *, first_cost: float = 0.0,
                  last_cost: float = 0.0) -> list[list[int]]:
    """Contiguous layer ranges for ``n_stages`` stages minimising the costliest stage (pure).

    Stage 0 also pays ``first_cost`` (embedding, encoders) and the last stage ``last_cost`` (norm and head).
    Every stage gets at least one layer.
    """
    n = len(costs)
    if n_stages < 1 or n < n_stages:
        raise ValueError(f"{n} decoder layers cannot fill {n_stages} pipeline stages (each needs at least one); "
                         "use fewer stages (pp x virtual stages) or a deeper model")
    prefix = np.concatenate([[0.0], np.cumsum(costs)])

    def cost(stage: int, start: int, end: int) -> float:
        extra = (first_cost if stage == 0 else 0.0) + (last_cost if stage == n_stages - 1 else 0.0)
        return float(prefix[end] - prefix[start]) + extra

    # best[s][i]: lowest peak over stages 0..s-1 covering layers [0, i); cut[s][i]: where stage s-1 starts.
    best = np.full((n_stages + 1, n + 1), np.inf)
    cut = np.zeros((n_stages + 1, n + 1), dtype=np.int64)
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):
                peak = max(best[s - 1][j], cost(s - 1, j, i))
                if peak < best[s][i] - 1e-12:
                    best[s][i], cut[s][i] = peak, j
    stages, end = [], n
    for s in range(n_stages, 0, -1):
        start = int(cut[s][end])
        stages.append(list(range(start, end)))
        end = start
    return stages[::-1]


def stage_ids_of_rank(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Stages run by a pipeline rank: ``pp_rank``, ``pp_rank + pp``, ... (loop placement)."""
    return [pp_rank + v * pp for v in range(virtual_stages)]


# ------------------------------------------------------------------------------------------------ runtime
def _pad_rows(x: torch.Tensor, rows: int, value: float = 0, dim: int = 0) -> torch.Tensor:
    """``x`` padded along ``dim`` to ``rows`` (a new tensor)."""
    if x.shape[dim] > rows:
        raise ValueError(f"a micro-batch of {x.shape[dim]} tokens exceeds the pipeline's max_tokens={rows}: raise "
                         "OmniStrategy(pp_max_tokens=...) or cap micro-batches with OmniDataModule(token_budget=...)")
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, rows - x.shape[dim]]
    return F.pad(x, pad, value=value)


class _StageModule(nn.Module):
    """One pipeline stage of a (pruned) ReferenceMLLM; parameters stay registered under the model too.

    ``deep_in`` / ``deep_out``: whether DeepStack features (encoder features added after the first decoder layers,
    Qwen3-VL's) arrive with the hidden states / leave with them, because this stage or a later one holds such a
    layer. A decoder whose load-balancing loss couples all of its MoE layers (``router_stats_size`` > 0: the
    family's loss over every layer's routing statistics together) gets them summed along the pipeline: each stage
    adds its layers' to what it received, and the last computes the loss share from the whole model's; the
    probabilities' part carries gradients back to every stage's routers.
    """

    def __init__(self, model: ReferenceMLLM, runner: PipelineRunner, layer_ids: list[int], *, stage_index: int,
                 is_first: bool, is_last: bool, deep_in: bool = False, deep_out: bool = False) -> None:
        super().__init__()
        self.stage_index = stage_index
        self.layers = nn.ModuleDict({str(i): model.llm.layers[str(i)] for i in layer_ids})
        self.is_first, self.is_last = is_first, is_last
        self.deep_in, self.deep_out = deep_in, deep_out
        if is_first:
            self.tok_embeddings = model.llm.tok_embeddings
            if len(model.assembly):  # laid out where the placeholders are filled (LLaVA-OneVision's image newline)
                self.assembly = model.assembly
            if runner.settings.encoders == "first_stage":  # else the encoders are roots of their own, or elsewhere
                self.encoders = nn.ModuleDict(model.encoders)
        if is_last:
            self.norm, self.output = model.llm.norm, model.llm.output
        self._model = (model,)  # not registered: the model is not part of this stage
        self._runner = (runner,)
        self._config = model.config.llm
        self._deep_layers = max(model.deepstack_depths.values(), default=0)
        self._stats_size = int(getattr(model.llm, "router_stats_size", 0))

    def forward(self, *inputs: torch.Tensor) -> Any:
        """First stage: ``(micro-batch number,)``; later stages: ``(hidden, number)`` from the previous one, hidden
        padded to ``max_tokens`` rows (and DeepStack features ``[1, n, max_tokens, dim]`` between them where a later
        stage needs them). The last stage returns ``[[summed token loss, MoE load-balance share]]``.

        Every pipeline rank holds the step's micro-batches, so positions, sample boundaries and labels are read
        here rather than sent. Under context parallelism each stage works on this rank's head-tail token share.
        """
        (runner,) = self._runner
        index = int(inputs[-1].reshape(-1)[0])
        with timed(runner.action_log, "F", index):
            return self._forward(index, *inputs)

    def _forward(self, index: int, *inputs: torch.Tensor) -> Any:
        (model,), (runner,) = self._model, self._runner
        number = inputs[-1]
        batch = runner.micro_batches[index]
        if runner.source is not None:
            runner.source.before_forward(index)
        cu, positions = batch["cu_seqlens"].long(), model.positions(batch)
        cp_group = model.groups.cp
        shard = shard_for_context_parallel(cu, cp_group) if cp_group is not None else None
        local = shard.local_index if shard is not None else None
        if local is not None:
            positions = positions[..., local]
        tokens = positions.shape[-1]
        deep = None
        if self.is_first:
            assert runner.source is not None, "the first stage embeds: it needs an encoder source"
            encoded = runner.source.outputs(index)
            x, deep = model.embed(batch, encoded), model.deepstack(batch, encoded)
            if local is not None:
                x, deep = x[local], (deep[:, local] if deep is not None else None)
        else:
            x = inputs[0][0, :tokens]
            if self.deep_in:
                deep = inputs[1][0, :, :tokens]
        x = model.llm.run_layers(x, positions, cu, self.layers.items(), shard, deep)
        stats = self._router_stats(x, None if self.is_first else inputs[-2][0])
        aux = self._moe_aux_share()
        if self.is_last:
            if stats is not None:  # the whole model's routing statistics: the family's load-balancing loss
                aux = aux + model.llm.aux_share(stats)
            labels = batch["labels"] if local is None else batch["labels"][local]
            loss_sum, _ = next_token_loss_sum(model.llm.head_logits(x), labels)
            return torch.stack([loss_sum.reshape(()), aux.to(loss_sum.dtype)]).reshape(1, 2)
        if aux.requires_grad:
            x = _AddAuxGradient.apply(x, aux, runner.aux_scale)
        # Fresh tensors, not views: zero-bubble schedules detach stage outputs in place.
        out = [_pad_rows(x[None], runner.max_tokens, dim=1)]
        if self.deep_out:
            assert deep is not None, "DeepStack features must reach the stages that hold their layers"
            out.append(_pad_rows(deep[None], runner.max_tokens, dim=2))
        if stats is not None:
            out.append(stats[None].clone())
        return (*out, number.clone())

    def _router_stats(self, x: torch.Tensor, received: torch.Tensor | None) -> torch.Tensor | None:
        """The routing statistics of this stage's layers added to those of the stages before (``received``);
        ``None`` for a decoder without coupled statistics."""
        if not self._stats_size:
            return None
        (model,) = self._model
        own = model.llm.router_stats(self.layers.items())
        if own is None:  # no routed layer here: zeros that still join the graph, so gradients pass through
            own = torch.zeros(self._stats_size, device=x.device) + 0.0 * x.float().sum()
        return own if received is None else received + own

    def _moe_aux_share(self) -> torch.Tensor:
        """The MoE load-balance shares of this stage's layers (any module of theirs holding an ``aux_loss``)."""
        shares = [module.aux_loss for layer in self.layers.values() for module in layer.modules()
                  if isinstance(getattr(module, "aux_loss", None), torch.Tensor)]
        (runner,) = self._runner
        return torch.stack(shares).sum() if shares else torch.zeros((), device=runner.device)

    def example_io(self, max_tokens: int, dtype: torch.dtype, device: torch.device) -> tuple[tuple, tuple]:
        """Shapes of this stage's inputs and outputs, given to PipelineStage so no inference forward is needed."""
        number = torch.zeros(1, 1, dtype=torch.long, device=device)

        def between(deep: bool) -> tuple[torch.Tensor, ...]:
            tensors = [torch.zeros(1, max_tokens, self._config.dim, dtype=dtype, device=device, requires_grad=True)]
            if deep:
                tensors.append(torch.zeros(1, self._deep_layers, max_tokens, self._config.dim, dtype=dtype,
                                           device=device, requires_grad=True))
            if self._stats_size:
                tensors.append(torch.zeros(1, self._stats_size, device=device, requires_grad=True))
            return (*tensors, number)

        inputs = (number,) if self.is_first else between(self.deep_in)
        outputs = (torch.zeros(1, 2, device=device, requires_grad=True),) if self.is_last else between(self.deep_out)
        return inputs, outputs


class _TimedStage(PipelineStage):
    """A pipeline stage whose backward of a micro-batch is timed while its runner has an action log (its forward
    is timed by :class:`_StageModule`)."""

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        (runner,) = self.submod._runner
        # The joint pipeline's hook sends the gradients from inside the backward, once it has made them.
        with timed(runner.action_log, "B", bwd_chunk_id, after_nested=False):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


class _AddAuxGradient(torch.autograd.Function):
    """Identity on a stage's hidden states whose backward also feeds ``scale`` as the gradient of the stage's MoE
    load-balance share, so that loss term trains the routers although only the last stage produces a loss."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.aux_shape, ctx.scale = aux.shape, scale
        return hidden.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=grad.device), None


class PipelineRunner:
    """The stages this rank runs and the schedule that drives them; ``step`` trains on one step's micro-batches.

    Args:
        model: the whole model; the runner prunes it to what this rank's stages run (and, by ``settings.encoders``,
            keeps the encoders on every rank, on the first stage, or on none).
        pp_group: this rank's pipeline peers, stage order.
        settings: the pipeline's settings, resolved for its degree.
        device, dtype: where the stage-to-stage buffers live, and their dtype (the FSDP compute dtype).
        source: on the ranks that run the first stage, the micro-batches' encoder outputs (with the joint pipeline,
            on every rank: each encodes a share); ``None`` elsewhere.
        calibrator: times the joint pipeline's first steps and calibrates its item plan (``None``: FLOPs).
    """

    def __init__(self, model: ReferenceMLLM, pp_group: dist.ProcessGroup, *, settings: PipelineSettings,
                 device: torch.device, dtype: torch.dtype = torch.float32, source: EncoderSource | None = None,
                 calibrator: JointCalibrator | None = None) -> None:
        pp, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        self.settings = settings.resolved(pp)
        self.max_tokens = settings.max_tokens
        self.micro_batches: list[PackedBatch] = []
        n_stages = pp * settings.virtual_stages
        costs, head = layer_costs(model.config.llm)
        self.layers_by_stage = assign_layers(costs, n_stages, last_cost=head)
        self.stage_ids = stage_ids_of_rank(pp_rank, pp, settings.virtual_stages)
        self.source, self.calibrator = source, calibrator
        # While set, every stage forward and backward and every joint-pipeline action of a step is timed into it.
        self.action_log: ActionLog | None = None
        deep_layers = max(model.deepstack_depths.values(), default=0)
        # Whether stage s or a later one holds a layer that takes DeepStack features.
        needs_deep = [any(i < deep_layers for stage in self.layers_by_stage[s:] for i in stage)
                      for s in range(n_stages)]
        self.stage_modules = [
            _StageModule(model, self, self.layers_by_stage[s], stage_index=s, is_first=s == 0,
                         is_last=s == n_stages - 1, deep_in=s > 0 and needs_deep[s],
                         deep_out=s < n_stages - 1 and needs_deep[s + 1])
            for s in self.stage_ids
        ]
        self._model = (model,)
        self.device, self._group, self._n_stages, self._dtype = device, pp_group, n_stages, dtype
        self._prune(model)
        self.schedule: Any = None
        self._loss = StepLoss(1.0, 1)
        self._loss_sums: list[torch.Tensor] = []

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self._n_stages - 1 in self.stage_ids

    def _prune(self, model: ReferenceMLLM) -> None:
        """Drop what this rank's stages do not run, so it holds (and checkpoints) only its own parameters."""
        keep = {str(i) for s in self.stage_ids for i in self.layers_by_stage[s]}
        model.llm.layers = nn.ModuleDict({k: v for k, v in model.llm.layers.items() if k in keep})
        places = self.settings.encoders
        if places == "pool" or (places == "first_stage" and not self.has_first_stage):
            for name in model.encoders:  # the encoder pool's ranks (or stage 0) hold the encoders
                delattr(model, name)
        if not self.has_first_stage:
            del model.llm.tok_embeddings
            model.assembly = nn.ModuleDict()
        if not self.has_last_stage:
            del model.llm.norm, model.llm.output

    def build(self) -> None:
        """Wrap the stages (after TP/FSDP were applied to them) and create the schedule."""
        stages = []
        for index, module in zip(self.stage_ids, self.stage_modules, strict=True):
            inputs, outputs = module.example_io(self.max_tokens, self._dtype, self.device)
            stages.append(_TimedStage(module, index, self._n_stages, self.device, input_args=inputs,
                                      output_args=outputs, group=self._group))
        schedule_class = PIPELINE_SCHEDULES[self.settings.schedule]
        first = stages if not self.settings.one_stage_per_rank else stages[0]
        # Loss scaling is ours (tokens of the whole step), so the schedule must not average over micro-batches.
        self.schedule = schedule_class(first, n_microbatches=self.n_microbatches, loss_fn=self._scaled_loss,
                                       scale_grads=False)

    def _scaled_loss(self, output: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        loss_sum, aux = output[0, 0], output[0, 1]
        self._loss_sums.append(loss_sum.detach())
        return self._loss(loss_sum, aux)

    @property
    def aux_scale(self) -> float:
        """The factor of a stage's MoE load-balance share (fed to the stages that hold no loss)."""
        return self._loss.aux_scale

    @property
    def n_microbatches(self) -> int:
        assert self.settings.microbatches is not None  # resolved
        return self.settings.microbatches

    def sync_gradients(self) -> None:
        """Reduce gradients of weights replicated over the pipeline ranks (the joint pipeline's encoders)."""
        if self.source is not None:
            self.source.sync_gradients()

    def replicated_parameters(self) -> set[nn.Parameter]:
        """Parameters every pipeline rank holds a copy of (counted once in a global gradient norm)."""
        if self.settings.encoders != "joint":
            return set()
        (model,) = self._model
        return {p for encoder in model.encoders.values() for p in encoder.parameters()}

    def step(self, micro_batches: list[PackedBatch], loss: StepLoss) -> torch.Tensor:
        """Run the schedule over ``micro_batches``, forward and backward, scaling each micro-batch's summed token
        loss and MoE load-balance share by ``loss``; returns this rank's summed token loss (non-zero on the last
        stage only)."""
        return self._run(micro_batches, loss, train=True)

    def evaluate(self, micro_batches: list[PackedBatch]) -> torch.Tensor:
        """Forward only; returns this rank's summed token loss, as :meth:`step` does."""
        with torch.no_grad():
            return self._run(micro_batches, StepLoss(1.0, 1), train=False)

    def _run(self, micro_batches: list[PackedBatch], loss: StepLoss, *, train: bool) -> torch.Tensor:
        if len(micro_batches) != self.n_microbatches:
            raise ValueError(f"the pipeline schedule runs {self.n_microbatches} micro-batches a step, got "
                             f"{len(micro_batches)}: set OmniStrategy(pp_microbatches=...) to match the data")
        self.micro_batches, self._loss, self._loss_sums = micro_batches, loss, []
        calibrator = self.calibrator if train else None
        if calibrator is not None:
            self.action_log = calibrator.begin_step()
        if isinstance(self.source, JointEncoders):
            self.source.log = self.action_log
        device = micro_batches[0]["input_ids"].device
        args = (torch.arange(len(micro_batches), device=device)[:, None],) if self.has_first_stage else ()
        kwargs: dict[str, Any] = {}
        if self.has_last_stage:  # the last stage reads labels itself; the schedule only needs one target each
            kwargs["target"] = torch.zeros(len(micro_batches), 1, device=device)
        try:
            if self.source is not None:
                self.source.start(micro_batches, train=train)
            (self.schedule.step if train else self.schedule.eval)(*args, return_outputs=False, **kwargs)
            if self.source is not None:
                self.source.finish()
            if calibrator is not None:
                calibrator.end_step(micro_batches)
        finally:
            self.micro_batches = []
            if calibrator is not None:
                self.action_log = None
        return torch.stack(self._loss_sums).sum() if self._loss_sums else torch.zeros((), device=device)
