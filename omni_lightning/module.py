"""OmniModule: the LightningModule that trains a multimodal LLM under OmniStrategy (or on one device)."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from typing_extensions import override

from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.mllm import IGNORE_INDEX, ReferenceMLLM, next_token_loss_sum, vocab_parallel_loss
from omni_lightning.monitor import loggers_write_this_step
from omni_lightning.parallel.activation_checkpoint import apply_ac, apply_compile
from omni_lightning.parallel.fsdp import set_gradient_sync
from omni_lightning.parallel.layout import EncoderPool, OmniMeshes
from omni_lightning.runtime.build import parallelize_encoder_pool, parallelize_mllm
from omni_lightning.runtime.pipeline import PipelineRunner, split_micro_batches
from omni_lightning.runtime.pool import EncoderPoolLink, EncoderPoolWorker

__all__ = ["OmniModule", "initial_state_dict", "clip_grad_norm_"]


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


class OmniModule(LightningModule):
    """Next-token training of a multimodal LLM on packed micro-batches.

    Args:
        model: configuration of the reference MLLM (``ReferenceMLLMConfig.tiny()`` when omitted), or a built
            :class:`ReferenceMLLM`, whose rank-0 weights every rank starts from: e.g. with Hugging Face encoders or
            decoder in place of ``vision``/``audio``/``llm`` through :mod:`omni_lightning.models.adapters`.
        learning_rate, weight_decay, betas, warmup_steps: AdamW with linear warm-up.
        init_checkpoint: a seed checkpoint (a full ``state_dict`` saved with ``torch.save``) to start from;
            otherwise weights come from ``init_seed``. Either way every rank and every layout starts identically.
        init_seed: seed of the initial weights when no seed checkpoint is given.
        param_dtype: FSDP compute dtype for parameters (e.g. ``"bfloat16"`` on GPUs); ``None`` keeps fp32.
        activation_checkpointing: recompute every transformer block's activations in the backward instead of
            keeping them (less memory, about a third more compute).
        compile_backend: ``torch.compile`` backend for the blocks' MLPs (``"inductor"`` on GPUs); ``None`` runs
            eagerly. See :mod:`omni_lightning.parallel.activation_checkpoint` for what is compiled and why.

    The loss is the sum of next-token cross-entropies over text positions divided by the number of such
    positions in the *global* micro-batch (all data-parallel ranks together), so gradients do not depend on how
    samples are spread over ranks. With :class:`~omni_lightning.datamodules.OmniDataModule` and gradient
    accumulation (``micro_batches == accumulate_grad_batches``) the divisor is the loss tokens of the whole optimizer
    step, so the update does not depend on how the step was cut into micro-batches either; other data modules get
    Lightning's equal weighting of micro-batches.
    Logged: ``train/loss`` (global mean), ``train/tokens_per_s`` and ``train/samples_per_s`` (global).
    """

    def __init__(
        self,
        model: ReferenceMLLMConfig | ReferenceMLLM | None = None,
        *,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        init_checkpoint: str | None = None,
        init_seed: int = 0,
        param_dtype: str | None = None,
        activation_checkpointing: bool = False,
        compile_backend: str | None = None,
    ) -> None:
        super().__init__()
        built = model if isinstance(model, ReferenceMLLM) else None
        self.save_hyperparameters(ignore=["model"] if built is not None else None)
        self.config = built.config if built is not None else model or ReferenceMLLMConfig.tiny()
        # Held in a tuple so the module is not registered (and saved) twice before configure_model adopts it.
        self._built_model: tuple[ReferenceMLLM, ...] = (built,) if built is not None else ()
        self.model: ReferenceMLLM | None = None
        self.omni_meshes: OmniMeshes | None = None
        self._param_dtype = getattr(torch, param_dtype) if param_dtype else None
        self._last_step_time: float | None = None
        self._pipeline: PipelineRunner | None = None
        # The disaggregated placement: an LLM-pool rank's link to the encoder pool, or an encoder-pool rank's worker.
        self._pool_link: EncoderPoolLink | None = None
        self._pool_worker: EncoderPoolWorker | None = None

    @override
    def configure_model(self) -> None:
        """Build on the meta device (or adopt the given model), parallelise, then load the initial weights.

        Idempotent, as Lightning requires: a second call finds the model in place.
        """
        if self.model is not None:
            return
        built_model = bool(self._built_model)
        if built_model:
            (model,) = self._built_model
            state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        else:
            with torch.device("meta"):
                model = ReferenceMLLM(self.config)
            state = initial_state_dict(
                self.config, init_checkpoint=self.hparams.init_checkpoint, seed=self.hparams.init_seed
            )
        broadcast = dist.is_initialized()
        pool: EncoderPool | None = getattr(self.trainer.strategy, "encoder_pool", None) if self._trainer else None
        if pool is not None:
            self._parallelize_for_pool(model, pool)
        elif self.omni_meshes is not None:
            strategy = self.trainer.strategy
            self._pipeline = parallelize_mllm(
                model, self.omni_meshes, param_dtype=self._param_dtype,
                encoder_balance=bool(getattr(strategy, "encoder_balance", False)),
                pipeline=getattr(strategy, "pipeline_settings", None),
                activation_checkpointing=self.hparams.activation_checkpointing,
                compile_backend=self.hparams.compile_backend,
            )
        else:  # one process, or a strategy that does not parallelise the model itself
            blocks = [*model.llm.layers.values(), *model.vision.blocks, *model.audio.blocks]
            if self.hparams.compile_backend is not None:
                apply_compile(blocks, self.hparams.compile_backend)
            if self.hparams.activation_checkpointing:
                apply_ac(blocks)
        if self._pipeline is not None or pool is not None:
            # Each pipeline rank (or pool) holds only its part: rank 0 cannot broadcast the others' weights, so every
            # rank takes rank 0's full copy first (a built model) or already has it (seeded or from a seed checkpoint).
            if self._built_model:
                for tensor in state.values():
                    dist.broadcast(tensor, src=0)
            kept = model.state_dict().keys()
            state, broadcast = {k: v for k, v in state.items() if k in kept}, False
        device = self.trainer.strategy.root_device if self._trainer is not None else torch.device("cpu")
        # to_empty also wipes buffers outside the state dict (e.g. the rotary frequencies of Hugging Face decoders):
        # a built model already holds their values, so put them back.
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()} if built_model else {}
        model.to_empty(device=device)
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
        # Rank 0's copy wins, so a model built with unseeded randomness on each rank still starts identically.
        options = StateDictOptions(full_state_dict=True, strict=True, broadcast_from_rank0=broadcast)
        set_model_state_dict(model, state, options=options)
        self.model = model
        self._built_model = ()

    def _parallelize_for_pool(self, model: ReferenceMLLM, pool: EncoderPool) -> None:
        """Disaggregated placement: keep this pool's part of the model, parallelise it, connect it to the other."""
        strategy = self.trainer.strategy
        costs = {"vision": model.vision.cost(), "audio": model.audio.cost()}
        dtype = self._param_dtype or torch.float32
        options = {"param_dtype": self._param_dtype, "activation_checkpointing": self.hparams.activation_checkpointing,
                   "compile_backend": self.hparams.compile_backend}
        if strategy.is_encoder_rank:
            del model.llm
            parallelize_encoder_pool(model, pool, encoder_balance=strategy.encoder_balance, **options)
            self._pool_worker = EncoderPoolWorker(pool.layout, pool.transfers, model, self.config,
                                                  device=strategy.root_device, dtype=dtype)
            return
        del model.vision, model.audio
        meshes = self.omni_meshes
        assert meshes is not None
        if meshes.local_rank("pp") == 0:  # the first pipeline stage embeds: it receives the encoder outputs
            cp = meshes.get("cp")
            # The encoder pool's FSDP averages over its ranks, the LLM's loss is scaled by its data-parallel size.
            scale = (pool.layout.encoder_world_size if pool.mesh is not None else 1) / meshes.size("dp_cp")
            self._pool_link = EncoderPoolLink(pool.layout, pool.transfers, self.config, costs, dtype=dtype,
                                              cp_group=cp.get_group() if cp is not None else None,
                                              gradient_scale=scale)
        self._pipeline = parallelize_mllm(model, meshes, pipeline=strategy.pipeline_settings,
                                          encoder_source=self._pool_link, **options)

    @property
    def _disaggregated(self) -> bool:
        """Whether this rank belongs to one of the disaggregated placement's pools."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        return getattr(strategy, "placement", None) == "disaggregated"

    @property
    def _backward_in_step(self) -> bool:
        """Whether training_step runs the backward itself (a pipeline schedule, or the disaggregated pools' stream)."""
        return self._pipeline is not None or self._disaggregated

    @property
    def pipeline(self) -> PipelineRunner | None:
        """The pipeline runner under pipeline parallelism (``None`` otherwise)."""
        return self._pipeline

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        assert self.model is not None, "configure_model() has not run"
        return self.model(batch)

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:
        if self._backward_in_step and batch_idx % self.trainer.accumulate_grad_batches == 0:
            # Lightning zeroes gradients between training_step and backward, but the schedule's (or the pools')
            # backward runs inside training_step: zero them here instead (see optimizer_zero_grad).
            for p in self.parameters():
                p.grad = None
        if self._disaggregated:
            sync = (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0
            loss, stats = self._pool_loss_and_stats(batch, reduce_gradients=sync)
        elif self._pipeline is not None:
            loss, stats = self._pipeline_loss_and_stats(batch)
        else:
            loss, stats = self._loss_and_stats(batch)
        now = time.perf_counter()
        samples = batch["num_samples"]
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
            if "balance" in batch:  # loader-side plan statistics of OmniDataModule (this rank's view)
                self.log_dict({f"balance/{k}": float(v) for k, v in batch["balance"].items()}, batch_size=samples)
            if self.model is not None and self.model.encoder_balancer is not None:
                plan = self.model.encoder_balancer.stats  # this step's encoder plan (group-wide), this rank's bytes
                self.log_dict({f"encoder/{k}": float(v) for k, v in plan.items()}, batch_size=samples)
        return {"loss": loss, "global_loss": stats["loss"]}

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if self._disaggregated:
            _, stats = self._pool_loss_and_stats(batch, reduce_gradients=True)
        elif self._pipeline is not None:
            _, stats = self._pipeline_loss_and_stats(batch)
        else:
            _, stats = self._loss_and_stats(batch)
        # Each value is already global; sync_dist only averages identical per-rank epoch means.
        self.log("val/loss", stats["loss"], prog_bar=True, batch_size=batch["num_samples"], sync_dist=True)
        return stats["loss"]

    def _loss_and_stats(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert self.model is not None, "configure_model() has not run"
        loss_sum, loss_tokens = next_token_loss_sum(self(batch), self.model.local_labels(batch))
        meshes = self.omni_meshes
        cp = meshes.size("cp") if meshes is not None else 1
        accumulate, step_tokens = self._step_weighting(batch, loss_tokens, cp)
        aux_share = self.model.llm.moe_aux_loss()  # this rank's share of the MoE load-balance loss (0 if dense)
        # One collective for everything that needs the global batch: CP peers share samples, so count 1/cp each.
        totals = torch.stack(
            [
                aux_share.detach().double(),
                loss_sum.detach().double(),
                loss_tokens.double(),
                torch.tensor(batch["input_ids"].numel() / cp, dtype=torch.float64, device=loss_sum.device),
                torch.tensor(batch["num_samples"] / cp, dtype=torch.float64, device=loss_sum.device),
                torch.tensor(step_tokens, dtype=torch.float64, device=loss_sum.device),
            ]
        )
        loss_mesh = meshes.get("dp_cp") if meshes is not None else None
        if loss_mesh is not None:
            dist.all_reduce(totals, group=loss_mesh.get_group())
        aux, totals = totals[0], totals[1:]
        global_loss_tokens = totals[1].clamp(min=1.0)
        # FSDP averages gradients over the dp_cp ranks and Lightning divides each micro-batch's loss by the
        # accumulation count; undoing both makes the step's gradient that of (sum of token losses) / (loss tokens
        # of the whole step on every rank), the same as one process running the whole step at once.
        data_parallel = loss_mesh.size() if loss_mesh is not None else 1
        loss = loss_sum * (data_parallel * accumulate / totals[4].clamp(min=1.0).float())
        # The shares sum to the global load-balance loss; averaged per micro-batch like Lightning's accumulation.
        loss = loss + self.config.llm.moe_aux_loss_coef * data_parallel * aux_share
        stats = {"loss": (totals[0] / global_loss_tokens).float(), "tokens": totals[2], "samples": totals[3],
                 "moe_aux_loss": aux.float()}
        return loss, stats

    def _pipeline_loss_and_stats(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the pipeline schedule over the step's micro-batches (forward and, when training, backward).

        The schedule's backward already ran, so the returned loss only carries the value (OmniStrategy's backward
        is a no-op under pipeline parallelism). Loss scaling is the non-pipelined one: summed token losses over the
        step's global loss tokens, times the data-parallel size that FSDP averages over.
        """
        runner = self._pipeline
        assert runner is not None and self.omni_meshes is not None
        micro, counts, data_parallel = self._micro_batches_and_counts(batch, runner.n_microbatches)
        tokens = float(counts[0].clamp(min=1.0))
        accumulate = self.trainer.accumulate_grad_batches if self.training else 1
        tp = self.omni_meshes.get("tp") is not None
        with vocab_parallel_loss() if tp else nullcontext():
            if self.training:
                loss_sum = runner.step(micro, loss_scale=data_parallel / tokens / accumulate,
                                       # the load-balance loss is a mean over the schedule's micro-batches
                                       aux_scale=self.config.llm.moe_aux_loss_coef * data_parallel / accumulate
                                       / runner.n_microbatches)
            else:
                loss_sum = runner.evaluate(micro)
        # Only the last stage holds losses: summing over the pipeline and the data-parallel ranks makes them global.
        loss_sum = loss_sum.detach().double().reshape(1)
        for name in ("pp", "dp_cp"):
            if (mesh := self.omni_meshes.get(name)) is not None:
                dist.all_reduce(loss_sum, group=mesh.get_group())
        global_loss = (loss_sum[0] / tokens).float()
        stats = {"loss": global_loss, "tokens": counts[1], "samples": counts[2],
                 "moe_aux_loss": torch.zeros(())}
        return global_loss.detach().requires_grad_(), stats

    def _micro_batches_and_counts(self, batch: dict[str, Any], n: int
                                  ) -> tuple[list[dict[str, Any]], torch.Tensor, int]:
        """A step's micro-batches (the batch's own list, or the batch cut into ``n``), its global ``[loss tokens,
        tokens, samples]`` and the data-parallel size the loss is scaled by (what FSDP averages over)."""
        assert self.omni_meshes is not None
        merge, downsample = self.config.vision.merge, self.config.audio.downsample
        micro = batch.get("micro_batches") or split_micro_batches(batch, n, vision_merge=merge,
                                                                   audio_downsample=downsample)
        device = micro[0]["input_ids"].device
        cp = self.omni_meshes.size("cp")  # CP peers hold the same micro-batches: each counts 1 / cp of them
        counts = torch.tensor([float(sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)),
                               float(sum(mb["input_ids"].numel() for mb in micro)),
                               float(sum(mb["num_samples"] for mb in micro))], dtype=torch.float64, device=device) / cp
        loss_mesh = self.omni_meshes.get("dp_cp")
        if loss_mesh is not None:
            dist.all_reduce(counts, group=loss_mesh.get_group())
        return micro, counts, loss_mesh.size() if loss_mesh is not None else 1

    def _pool_loss_and_stats(self, batch: dict[str, Any], *,
                             reduce_gradients: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Disaggregated placement: stream the step's micro-batches between the pools, forward and backward.

        LLM-pool ranks run their pipeline schedule, or else scale losses as the pipeline does (summed token losses
        over the step's global loss tokens, times the data-parallel size FSDP averages over) and reduce gradients
        after the last micro-batch when ``reduce_gradients``; encoder-pool ranks encode what arrives. Rank 0's global
        loss and counts then go to every rank, so both pools log, check and return the same values. The returned loss
        only carries the value.
        """
        strategy = self.trainer.strategy
        n = strategy.stream_microbatches
        stats = torch.zeros(4, dtype=torch.float64)
        if self._pool_worker is not None:
            self._pool_worker.step(n, train=self.training, lag=strategy.stream_lag)
        elif self._pipeline is not None:
            _, result = self._pipeline_loss_and_stats(batch)
            stats = torch.stack([result[k].double().cpu().reshape(()) for k in ("loss", "tokens", "samples")]
                                + [torch.zeros((), dtype=torch.float64)])
        else:
            assert self._pool_link is not None and self.model is not None and self.omni_meshes is not None
            stats = self._stream_to_llm(batch, n, reduce_gradients=reduce_gradients)
        stats = stats.to(strategy.root_device)
        dist.broadcast(stats, src=0)
        global_loss = stats[0].float()
        result = {"loss": global_loss, "tokens": stats[1], "samples": stats[2], "moe_aux_loss": stats[3].float()}
        return global_loss.detach().requires_grad_(), result

    def _stream_to_llm(self, batch: dict[str, Any], n: int, *, reduce_gradients: bool) -> torch.Tensor:
        """An LLM-pool rank's part of :meth:`_pool_loss_and_stats`: ``[global loss, tokens, samples, aux]``."""
        link, model, meshes = self._pool_link, self.model, self.omni_meshes
        assert link is not None and model is not None and meshes is not None
        micro, counts, data_parallel = self._micro_batches_and_counts(batch, n)
        if len(micro) != n:
            raise ValueError(f"the batch holds {len(micro)} micro-batches but the encoder pool streams {n} a step "
                             f"(OmniStrategy(pp_microbatches={n})): plan {n} per step")
        device = micro[0]["input_ids"].device
        loss_mesh = meshes.get("dp_cp")
        tokens = float(counts[0].clamp(min=1.0))
        accumulate = self.trainer.accumulate_grad_batches if self.training else 1
        loss_scale = data_parallel / tokens / accumulate
        aux_scale = self.config.llm.moe_aux_loss_coef * data_parallel / accumulate / n  # a mean over micro-batches
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        aux_total = torch.zeros((), dtype=torch.float64, device=device)
        link.start(micro, train=self.training)
        tp = meshes.get("tp") is not None
        for i, mb in enumerate(micro):
            with vocab_parallel_loss() if tp else nullcontext():
                mb_sum, _ = next_token_loss_sum(model(mb, encoded=link.outputs(i)), model.local_labels(mb))
                aux = model.llm.moe_aux_loss()
                if self.training:  # the outputs' gradients leave for the encoder pool from inside this backward
                    set_gradient_sync(model, reduce_gradients and i == n - 1)
                    (mb_sum * loss_scale + aux_scale * aux).backward()
            loss_sum += mb_sum.detach().double()
            aux_total += aux.detach().double() / n
        link.finish()
        set_gradient_sync(model, True)
        totals = torch.stack([loss_sum, aux_total * data_parallel])
        if loss_mesh is not None:
            dist.all_reduce(totals, group=loss_mesh.get_group())
        return torch.stack([totals[0] / tokens, counts[1], counts[2], totals[1] / data_parallel]).cpu()

    def _step_weighting(self, batch: dict[str, Any], loss_tokens: torch.Tensor, cp: int) -> tuple[int, float]:
        """(accumulation factor to undo, this rank's share of the loss tokens of the whole optimizer step).

        Batches of :class:`~omni_lightning.datamodules.OmniDataModule` say how many loss tokens their step holds
        (CP peers hold the same step, so each counts ``1 / cp`` of it); other batches are weighted as a step of
        their own (Lightning's equal weighting of accumulated micro-batches).
        """
        step = batch.get("step")
        if not self.training or step is None or self._trainer is None:
            return 1, float(loss_tokens)
        # OmniDataModule.setup checked that each of its steps holds accumulate_grad_batches micro-batches.
        return self.trainer.accumulate_grad_batches, float(step["loss_tokens"]) / cp

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        if not self._backward_in_step:  # otherwise training_step zeroes before its backward runs
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    @override
    def configure_optimizers(self) -> Any:
        assert self.model is not None, "configure_model() has not run"
        optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.hparams.learning_rate,
            betas=tuple(self.hparams.betas),
            weight_decay=self.hparams.weight_decay,
        )
        warmup = self.hparams.warmup_steps
        if warmup <= 0:
            return optimizer
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
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
        pp_mesh = self.omni_meshes.get("pp") if self.omni_meshes is not None else None
        copies: set[torch.nn.Parameter] = set()
        if self._pipeline is not None and pp_mesh is not None and pp_mesh.get_local_rank() != 0:
            copies = self._pipeline.replicated_parameters()  # in the norm once, from the first pipeline rank
        pool: EncoderPool | None = getattr(self.trainer.strategy, "encoder_pool", None)
        if pool is not None:  # summed over the world: each pipeline stage's norm and the encoder pool's once
            rank, llm = self.trainer.global_rank, pool.layout.llm
            if pool.layout.is_encoder_rank(rank):
                counted = rank == pool.layout.encoder_ranks[0]
            else:
                counted = not any(index for dim, index in llm.coordinate(rank).items() if dim != "pp")
            clip_grad_norm_(list(self.model.parameters()), gradient_clip_val, pp_group=pool.transfers,
                            counted=counted)
            return
        clip_grad_norm_(list(self.model.parameters()), gradient_clip_val,
                        pp_group=pp_mesh.get_group() if pp_mesh is not None else None, not_in_norm=copies)


def clip_grad_norm_(parameters: list[torch.nn.Parameter], max_norm: float,
                    pp_group: dist.ProcessGroup | None = None,
                    not_in_norm: set[torch.nn.Parameter] | None = None, counted: bool = True) -> torch.Tensor:
    """Clip by the global gradient norm across parameters sharded on different meshes (plain tensors too).

    ``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails when DTensors live on different
    meshes (decoder on ``dp x tp``, encoders on ``dp``); reducing each norm to a plain scalar first avoids that.
    Under pipeline parallelism each rank holds only its stages' parameters: ``pp_group`` sums the squares over the
    stages; ``not_in_norm`` are copies another pipeline rank already counts (they are still scaled). With
    ``counted=False`` this rank's squares stay out of that sum (a peer in ``pp_group`` holds the same ones).
    """
    squares = []
    for p in parameters:
        if p.grad is None or (not_in_norm and p in not_in_norm):
            continue
        norm = p.grad.norm()
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).double() ** 2)
    total_squares = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    if not counted:
        total_squares = torch.zeros_like(total_squares)
    if pp_group is not None:
        dist.all_reduce(total_squares, group=pp_group)
    total = total_squares.sqrt()
    scale = max_norm / (float(total) + 1e-6)
    if scale < 1.0 and math.isfinite(scale):
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(scale)
    return total
