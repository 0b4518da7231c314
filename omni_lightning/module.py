"""OmniModule: the LightningModule that trains a multimodal LLM under OmniStrategy (or on one device)."""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import AttributeDict, rank_zero_warn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from typing_extensions import override

from omni_lightning.balance.cost import CostModel
from omni_lightning.batch import PackingSpec
from omni_lightning.data.packing import DATA_COUNTS
from omni_lightning.data.processor import load_processor
from omni_lightning.deprecations import with_deprecated_names
from omni_lightning.export import PRETRAINED_KEY, pretrained_files
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.lora import lora_initial_state
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.models.pretrained import PretrainedModel, build_pretrained, read_checkpoint, reset_computed_buffers
from omni_lightning.monitor import loggers_write_this_step
from omni_lightning.parallel.initial_state import broadcast_parts
from omni_lightning.parallel.layout import OmniLayout, OmniMeshes
from omni_lightning.runtime.optim import (
    apply_lr_multipliers,
    check_parts,
    freeze_parts,
    model_parts,
    parameter_groups,
)
from omni_lightning.runtime.pipeline import PipelineRunner
from omni_lightning.runtime.step import PipelineStep, PlainStep, PoolLLMStep, Step, StepOptions, build_step

__all__ = ["OmniModule", "initial_state_dict"]

_DEFAULT_LEARNING_RATE = 1e-3


def initial_state_dict(
    config: ReferenceMLLMConfig, *, init_checkpoint: str | Path | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    """The full (unsharded) initial weights: a seed checkpoint file if given, else a seeded fresh model.

    Every layout starts from these exact tensors, so runs under different layouts are comparable step by step.
    """
    if init_checkpoint is not None:
        return torch.load(init_checkpoint, map_location="cpu", weights_only=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ReferenceMLLM(config).state_dict()


def _holds_tokenizer(path: str) -> bool:
    return any((Path(path) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))


class OmniModule(LightningModule):
    """Next-token training of a multimodal LLM on packed micro-batches.

    Args:
        model: configuration of the reference MLLM (``ReferenceMLLMConfig.tiny()`` when omitted), or a built
            :class:`ReferenceMLLM`, whose rank-0 weights every rank starts from: e.g. with Hugging Face encoders or
            decoder in place of ``vision``/``audio``/``llm`` through :mod:`omni_lightning.models.adapters`.
        pretrained: a local Hugging Face checkpoint directory of a supported family
            (:data:`~omni_lightning.models.pretrained.SUPPORTED_FAMILIES`: Qwen2-VL, Qwen2.5-VL, the Qwen2.5-Omni
            thinker, LLaVA-OneVision), trained whole with the family's own modules and numerics: its vision (and
            audio) towers and merger or projector (with LLaVA-OneVision's layout of tiles and newline), its decoder
            (with M-RoPE where it has it), its LM head. Built on the
            meta device; rank 0 reads the weights and every rank receives its shards. Its tokenizer gives the token
            roles, and a data module given no processor reads with the checkpoint's.
        lora: LoRA adapters on the decoder's projections, as ``peft.LoraConfig`` arguments (e.g. ``{"r": 8,
            "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}``), with ``pretrained``: the decoder's own
            weights freeze, the adapters train (under FSDP and TP), and ``export-hf`` merges them or writes a peft
            adapter.
        learning_rate, weight_decay, betas, warmup_steps: AdamW (learning rate 1e-3 by default) with linear warm-up,
            used when no ``optimizer`` / ``lr_scheduler`` is given. Where both are, the callable wins: its own
            learning rate and weight decay, its schedule (a warning names what is ignored).
        optimizer: builds the optimizer from parameter groups (``--optimizer`` on the command line, e.g.
            ``torch.optim.SGD``); the groups hold the trainable parameters only, with weight decay off for norms,
            biases and embeddings.
        lr_scheduler: builds the schedule from the optimizer (``--lr_scheduler``, e.g.
            :class:`~omni_lightning.WarmupCosineLR`); it steps once per optimizer step.
        freeze: parts left as they are: any of ``"vision"``, ``"audio"``, ``"projector"`` (every encoder's
            projector), ``"llm"`` and extra encoders by name. Frozen parameters get no gradient, no optimizer state
            and no gradient reduction.
        lr_multipliers: per-part factors on the learning rate, e.g. ``{"vision": 0.1}``.
        init_checkpoint: a seed checkpoint (a full ``state_dict`` saved with ``torch.save``) to start from;
            otherwise weights come from ``init_seed``. Either way every rank and every layout starts identically.
        init_seed: seed of the initial weights when no seed checkpoint is given.
        param_dtype: FSDP compute dtype for parameters (e.g. ``"bfloat16"`` on GPUs); ``None`` keeps fp32.
        activation_checkpointing: recompute every transformer block's activations in the backward instead of
            keeping them (less memory, about a third more compute).
        compile_backend: ``torch.compile`` backend for the blocks' MLPs (``"inductor"`` on GPUs); ``None`` runs
            eagerly. See :mod:`omni_lightning.parallel.activation_checkpoint` for what is compiled and why.
        deprecated_metric_names: also log the loader's plan (``reorder/*``) and the encoder plan (``reshard/*``)
            under their 0.1 names ``balance/*`` and ``encoder/*`` (warns once); ``False`` logs the new names alone.

    The loss is the sum of next-token cross-entropies over text positions divided by the number of such
    positions in the *global* micro-batch (all data-parallel ranks together), so gradients do not depend on how
    samples are spread over ranks (:class:`~omni_lightning.runtime.loss.StepLoss`). With
    :class:`~omni_lightning.datamodules.OmniDataModule` and gradient accumulation (``micro_batches ==
    accumulate_grad_batches``) the divisor is the loss tokens of the whole optimizer step, so the update does not
    depend on how the step was cut into micro-batches either; other data modules get Lightning's equal weighting of
    micro-batches. What a step runs (plain, pipelined, the disaggregated pools) is chosen once, in
    :meth:`configure_model` (:func:`~omni_lightning.runtime.step.build_step`).
    Logged: ``train/loss`` (global mean), ``train/tokens_per_s`` and ``train/samples_per_s`` (global).
    """

    def __init__(
        self,
        model: ReferenceMLLMConfig | ReferenceMLLM | None = None,
        *,
        pretrained: str | None = None,
        lora: dict[str, Any] | None = None,
        learning_rate: float | None = None,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        freeze: Sequence[str] = (),
        lr_multipliers: dict[str, float] | None = None,
        init_checkpoint: str | None = None,
        init_seed: int = 0,
        param_dtype: str | None = None,
        activation_checkpointing: bool = False,
        compile_backend: str | None = None,
        deprecated_metric_names: bool = True,
    ) -> None:
        super().__init__()
        if pretrained is not None and model is not None:
            raise ValueError("give OmniModule either model or pretrained, not both: a checkpoint brings its model")
        if lora and pretrained is None:
            raise ValueError("lora adapts a pretrained decoder: give OmniModule(pretrained=DIR, lora=...)")
        built = model if isinstance(model, ReferenceMLLM) else None
        # The callables are code, not settings: the CLI's config records them; a checkpoint cannot rebuild them.
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler", *(["model"] if built is not None else [])])
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.freeze, self.lr_multipliers = tuple(freeze), dict(lr_multipliers or {})
        self.pretrained, self.lora = pretrained, dict(lora) if lora else None
        if pretrained is not None:  # the family's shape from its config.json; the weights load in configure_model
            model = build_pretrained(pretrained).config
            if _holds_tokenizer(pretrained):  # and its token roles from its own tokenizer
                model = replace(model, roles=load_processor(pretrained).roles)
        self.config = built.config if built is not None else model or ReferenceMLLMConfig.tiny()
        # Held in a tuple so the module is not registered (and saved) twice before configure_model adopts it.
        self._built_model: tuple[ReferenceMLLM, ...] = (built,) if built is not None else ()
        self.model: ReferenceMLLM | None = None
        self.omni_layout: OmniLayout | None = None  # handed over by OmniStrategy.setup_environment
        self.step: Step | None = None
        self._cost_model: CostModel | None = None
        self._options = StepOptions(getattr(torch, param_dtype) if param_dtype else None, activation_checkpointing,
                                    compile_backend)
        self._sizes_from_data = model is None  # the vocabulary and token roles come from the data's processor
        # A checkpoint directory holding a processor serves a data module that was given none.
        self.processor_source = pretrained if pretrained is not None and _holds_tokenizer(pretrained) else None
        self._last_step_time: float | None = None
        self._video_fps: float | None = None  # the data module's video sampling rate, once setup has seen it
        self._pretrained_view: PretrainedModel | None = None  # the family's model on the meta device, built once

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype forward and backward compute in (``param_dtype``; fp32 when none was given)."""
        return self._options.param_dtype or torch.float32

    @property
    def omni_meshes(self) -> OmniMeshes | None:
        """This rank's LLM mesh and encoder groups (``None`` outside OmniStrategy)."""
        return self.omni_layout.meshes if self.omni_layout is not None else None

    def cost_model(self) -> CostModel:
        """The model's cost model in training FLOPs (from a meta-device copy before :meth:`configure_model`; of the
        whole model on a rank that holds a part of it, a pipeline stage or a pool). The parts ``freeze`` names cost
        what a frozen part runs (a frozen encoder its forward alone), before the model is built as after."""
        if self._cost_model is not None:
            return self._cost_model
        view = self._model_view()
        if self.freeze:  # what configure_model will freeze (a user's built model: what it freezes anyway)
            freeze_parts(view, self.freeze, view.encoder_names)
        return view.cost_model()

    def packing(self) -> PackingSpec:
        """How samples pack for the model."""
        return self._model_view().packing

    def _model_view(self) -> ReferenceMLLM:
        if self.model is not None:
            return self.model
        if self._built_model:
            return self._built_model[0]
        if self.pretrained is not None:  # the family's own modules and modalities, on the meta device
            if self._pretrained_view is None or self._pretrained_view.config.roles != self.config.roles:
                self._pretrained_view = build_pretrained(self.pretrained, self.config.roles, self.lora)
            return self._pretrained_view.model
        with torch.device("meta"):
            return ReferenceMLLM(self.config)

    @property
    def pipeline(self) -> PipelineRunner | None:
        """The pipeline runner under pipeline parallelism (``None`` otherwise)."""
        step = self.step.pipeline if isinstance(self.step, PoolLLMStep) else self.step
        return step.runner if isinstance(step, PipelineStep) else None

    @property
    def forward_cpu_seconds(self) -> dict[str, float]:
        """Thread CPU seconds of the last forward's encoder stage and LLM, where the step measures them."""
        return self.step.forward_cpu_seconds if self.step is not None else {}

    @override
    def setup(self, stage: str) -> None:
        """Take the vocabulary and token roles from the data module's processor (Lightning runs the data module's
        setup first): a reference model built without explicit sizes adopts them; a given config must agree. The
        resolved config replaces the ``model`` hyper-parameter, so the checkpoint records it. A model whose positions
        count seconds of video (Qwen2.5-VL) takes the rate the data module samples videos at."""
        datamodule = getattr(self._trainer, "datamodule", None)
        self._video_fps = getattr(getattr(datamodule, "video_policy", None), "fps", None)
        processor = getattr(datamodule, "data_processor", None)
        if processor is None or processor.is_bytes or self._built_model or self.model is not None:
            return
        config, llm = self.config, self.config.llm
        if self.pretrained is not None:
            self._check_pretrained_roles(processor)
        if self._sizes_from_data:
            llm = replace(llm, vocab_size=processor.vocab_size)
        elif config.roles not in (None, processor.roles):
            raise ValueError(f"the model's token roles {config.roles} differ from those of the processor at "
                             f"{processor.source} ({processor.roles})")
        elif llm.vocab_size < processor.vocab_size:
            raise ValueError(f"llm.vocab_size={llm.vocab_size} is smaller than the vocabulary of the tokenizer at "
                             f"{processor.source} (len(tokenizer) = {processor.vocab_size}): leave the model's sizes "
                             "to the data (OmniModule() without a model) or raise llm.vocab_size")
        self.config = replace(config, llm=llm, roles=processor.roles)
        if self.pretrained is None:  # a checkpoint's family config comes from its directory, which hparams name
            self.hparams["model"] = self.config
        self._cost_model = None
        check = getattr(self._trainer.strategy, "check_model_fits", None)
        if check is not None:  # the pre-launch check ran with the sizes unresolved (tp must divide the vocabulary)
            check(self)

    @property
    @override
    def hparams_initial(self) -> AttributeDict:
        """What loggers record (``hparams.yaml``): the arguments as given, with ``model`` as :meth:`setup` resolved it
        from the data's processor (as the checkpoint's hyper-parameters hold it), not the ``None`` it was given."""
        initial = super().hparams_initial
        if "model" in initial and "model" in self.hparams:
            initial["model"] = copy.deepcopy(self.hparams["model"])
        return initial

    @override
    def configure_model(self) -> None:
        """Build on the meta device (or adopt the given model), prune and parallelise it for this rank's step, then
        load the initial weights.

        Idempotent, as Lightning requires: a second call finds the model in place.
        """
        if self.model is not None:
            return
        built_model = bool(self._built_model)
        layout = self.omni_layout
        if built_model:
            (model,) = self._built_model
            state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        elif self.pretrained is not None:
            pretrained, state = self._pretrained_model()
            model = pretrained.model
        else:
            with torch.device("meta"):
                model = ReferenceMLLM(self.config, groups=layout.model_groups if layout is not None else None)
            state = initial_state_dict(
                self.config, init_checkpoint=self.hparams.init_checkpoint, seed=self.hparams.init_seed
            )
        # Checked on the whole model, before a pipeline stage keeps its part of it.
        check_parts(self.lr_multipliers, model_parts(model, model.encoder_names), "lr_multipliers")
        if self.freeze:  # before parallelising: frozen parameters are sharded, never reduced
            freeze_parts(model, self.freeze, model.encoder_names)
        device = self.trainer.strategy.root_device if self._trainer is not None else torch.device("cpu")
        self._cost_model = model.cost_model()  # before this rank's step prunes the model to its part
        self.step = build_step(model, layout, device=device, options=self._options)
        broadcast = dist.is_initialized()
        if layout is not None and (layout.dims.pp > 1 or layout.pool is not None):
            # Each pipeline rank (or pool) holds only its part, which FSDP's broadcast from rank 0 cannot serve: rank
            # 0's copy (a built model's, a checkpoint's) goes to every rank tensor by tensor and each keeps its part;
            # a seeded model (or one from a seed checkpoint) is already whole on every rank.
            kept = model.state_dict().keys()
            if built_model or self.pretrained is not None:
                state = broadcast_parts(state, kept, device)
            state, broadcast = {k: v for k, v in state.items() if k in kept}, False
        # to_empty also wipes buffers outside the state dict (e.g. the rotary frequencies of Hugging Face decoders):
        # a built model already holds their values, so put them back.
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()} if built_model else {}
        model.to_empty(device=device)
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
        if self.pretrained is not None and not built_model:
            reset_computed_buffers(pretrained)
        # Rank 0's copy wins, so a model built with unseeded randomness on each rank still starts identically.
        options = StateDictOptions(full_state_dict=True, strict=True, broadcast_from_rank0=broadcast)
        set_model_state_dict(model, state, options=options)
        self.model = model
        self._built_model = ()

    def _pretrained_model(self) -> tuple[PretrainedModel, dict[str, torch.Tensor]]:
        """The checkpoint's model on the meta device and, on rank 0 only (it sends every rank its shards), its
        weights: read from the safetensors files, and from the seed for what the family lacks (an audio encoder)."""
        assert self.pretrained is not None
        built = build_pretrained(self.pretrained, self.config.roles, self.lora)
        model = built.model
        if self._video_fps is not None and hasattr(model.llm, "video_fps"):
            model.llm.video_fps = self._video_fps
        if self.omni_layout is not None:
            model.use_groups(self.omni_layout.model_groups)
        if dist.is_initialized() and dist.get_rank() != 0:
            return built, {}
        state = read_checkpoint(self.pretrained, built.checkpoint_names)
        state.update(lora_initial_state(model, self.hparams.init_seed))  # what no checkpoint holds
        if seeded := [name for name, stored in built.checkpoint_names.items() if stored is None and name not in state]:
            fresh = initial_state_dict(self.config, seed=self.hparams.init_seed)
            state.update({name: fresh[name] for name in seeded})
        return built, state

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.pretrained is not None:  # what export-hf needs besides the weights: the family's configs, tokenizer
            checkpoint[PRETRAINED_KEY] = {"files": pretrained_files(self.pretrained)}

    def _check_pretrained_roles(self, processor: Any) -> None:
        """The data's placeholders must be the checkpoint's own tokens, and its vocabulary within the model's."""
        llm = self._model_view().llm
        for modality, attr in (("image", "image_token_id"), ("video", "video_token_id")):
            expected = getattr(llm, attr, None)
            if expected is not None and processor.roles.has_placeholder(modality) and \
                    processor.roles.placeholder(modality) != expected:
                raise ValueError(f"the processor at {processor.source} marks {modality}s with token "
                                 f"{processor.roles.placeholder(modality)} but the checkpoint at {self.pretrained} "
                                 f"expects {expected}: use the checkpoint's own processor")
        if processor.vocab_size > self.config.llm.vocab_size:
            raise ValueError(f"the tokenizer at {processor.source} has {processor.vocab_size} tokens, more than the "
                             f"checkpoint's vocabulary of {self.config.llm.vocab_size}")

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        assert self.model is not None, "configure_model() has not run"
        return self.model(batch)

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:
        step = self._configured_step()
        accumulate = self.trainer.accumulate_grad_batches
        if step.runs_backward and batch_idx % accumulate == 0:
            # Lightning zeroes gradients between training_step and backward, but this step's backward runs inside
            # training_step: zero them here instead (see optimizer_zero_grad).
            for p in self.parameters():
                p.grad = None
        result = step.run(batch, train=True, accumulate=accumulate, last_of_step=(batch_idx + 1) % accumulate == 0)
        stats, samples = result.stats, batch["num_samples"]
        now = time.perf_counter()
        if self._last_step_time is not None:
            elapsed = now - self._last_step_time
            self.log("train/tokens_per_s", stats["tokens"] / elapsed, prog_bar=True, batch_size=samples)
            self.log("train/samples_per_s", stats["samples"] / elapsed, batch_size=samples)
        self._last_step_time = now
        # Already reduced over the data-parallel ranks: no sync_dist needed.
        self.log("train/loss", stats["loss"], prog_bar=True, batch_size=samples)
        if self.config.llm.moe_every:
            self.log("train/moe_aux_loss", stats["moe_aux_loss"], batch_size=samples)
        # Plan statistics only loggers read: logged on the steps they are written (each log call costs).
        if self._trainer is not None and loggers_write_this_step(self._trainer):
            if "reorder" in batch:  # loader-side plan statistics of OmniDataModule (this rank's view)
                self._log_plan("reorder", batch["reorder"], samples)
            if plan := step.encoder_stats:  # this step's encoder plan (group-wide), this rank's bytes
                self._log_plan("reshard", plan, samples)
        if self._trainer is not None and hasattr(getattr(self._trainer, "datamodule", None), "data_processor"):
            trainer = self._trainer
            # A collective: gated by the step count alone, which every rank shares (Lightning's own rule also
            # logs when one rank's trainer.should_stop is set, which other ranks may not see yet).
            if (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % trainer.log_every_n_steps == 0:
                self._log_data(batch.get("data"))
        return {"loss": result.loss, "global_loss": stats["loss"]}

    def _log_data(self, counts: Mapping[str, int] | None) -> None:
        """``data/*``: what went into this step, summed over the data-parallel ranks. Peers holding the same samples
        (tensor, context and pipeline parallel) count them once, through the first of them."""
        layout = self.omni_layout
        first_copy = layout is None or not layout.is_encoder_rank and all(
            layout.meshes.local_rank(name) == 0 for name in ("tp", "cp", "pp"))
        mine = [float(counts[k]) if counts is not None and first_copy else 0.0 for k in DATA_COUNTS]
        total = torch.tensor(mine, dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        self.log_dict({f"data/{k}": v for k, v in zip(DATA_COUNTS, total.tolist(), strict=True)}, batch_size=1)

    def _log_plan(self, prefix: str, stats: Mapping[str, float], samples: int) -> None:
        metrics = {f"{prefix}/{k}": float(v) for k, v in stats.items()}
        if self.hparams.get("deprecated_metric_names", True):
            metrics = with_deprecated_names(metrics)
        self.log_dict(metrics, batch_size=samples)

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        stats = self._configured_step().run(batch, train=False, accumulate=1).stats
        # Each value is already global; sync_dist only averages identical per-rank epoch means.
        self.log("val/loss", stats["loss"], prog_bar=True, batch_size=batch["num_samples"], sync_dist=True)
        return stats["loss"]

    def _configured_step(self) -> Step:
        if self.step is None:
            if self.model is None:
                raise RuntimeError("configure_model() has not run")
            # A subclass's configure_model built (and maybe wrapped) the model itself: it encodes in its own forward.
            self.step = PlainStep(self.model, source=None)
        return self.step

    def sync_gradients(self) -> None:
        """Before the optimizer step: reduce the gradients the step leaves to be reduced (OmniStrategy calls it)."""
        if self.step is not None:
            self.step.sync_gradients()

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        if self.step is None or not self.step.runs_backward:  # otherwise training_step zeroes before its backward
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    @override
    def configure_optimizers(self) -> Any:
        assert self.model is not None, "configure_model() has not run"
        hparams = self.hparams
        given = self.optimizer_factory is not None
        if given and (hparams.learning_rate is not None or hparams.weight_decay):
            rank_zero_warn(f"OmniModule got an optimizer and learning_rate={hparams.learning_rate}, weight_decay="
                           f"{hparams.weight_decay}: the optimizer's own learning rate and weight decay are used")
        groups = parameter_groups(self.model, self.model.encoder_names, weight_decay=None if given else
                                  hparams.weight_decay, lr_multipliers=self.lr_multipliers)
        if given:
            optimizer = self.optimizer_factory(groups)
        else:
            lr = _DEFAULT_LEARNING_RATE if hparams.learning_rate is None else hparams.learning_rate
            optimizer = torch.optim.AdamW(groups, lr=lr, betas=tuple(hparams.betas))
        apply_lr_multipliers(optimizer)
        warmup = hparams.warmup_steps
        if self.scheduler_factory is not None:
            if warmup > 0:
                rank_zero_warn(f"OmniModule got an lr_scheduler and warmup_steps={warmup}: the scheduler is used, "
                               "warmup_steps is ignored")
            schedule = self.scheduler_factory(optimizer)
        elif warmup > 0:
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        else:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    @override
    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        if gradient_clip_val is None:
            return
        if gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r}: only 'norm' is supported")
        assert self.model is not None
        self._configured_step().clip_gradients(list(self.model.parameters()), gradient_clip_val)
