"""OmniStrategy: Lightning's ModelParallelStrategy grown to the full parallel topology of an MLLM job."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.strategies.launchers.multiprocessing import _check_bad_cuda_fork, _check_missing_main_guard
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _GlobalStateSnapshot,
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from omni_lightning.balance.allocation import ModuleShape, encoder_pool_size, pool_problem
from omni_lightning.balance.cost import CostModel
from omni_lightning.balance.workload import load_workload
from omni_lightning.data.resumable import commit_consumed
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.mllm import ReferenceMLLM, vocab_parallel_loss
from omni_lightning.parallel.dims import ParallelDims
from omni_lightning.parallel.expert_parallel import sync_expert_gradients
from omni_lightning.parallel.fsdp import set_gradient_sync
from omni_lightning.parallel.layout import EncoderPool, OmniMeshes, build_encoder_pool, build_meshes
from omni_lightning.parallel.placement import PoolLayout
from omni_lightning.runtime.build import check_model_fits_layout
from omni_lightning.runtime.pipeline import PIPELINE_SCHEDULES, PipelineSettings, assign_layers, layer_costs
from omni_lightning.strategies.checkpointing import (
    load_sharded_checkpoint,
    optimizer_state_by_name,
    partial_path,
    publish_checkpoint,
    remove_path,
)

__all__ = ["OmniStrategy", "loader_state_for_rank"]

log = logging.getLogger(__name__)

LauncherName = Literal["subprocess", "fork", "spawn"]
NonFinitePolicy = Literal["skip", "stop"]
Placement = Literal["multiplexed", "disaggregated"]

# Schedules that run one stage per pipeline rank (the others run pp_virtual_stages and need micro-batches % pp == 0).
_SINGLE_STAGE_SCHEDULES = ("1F1B", "GPipe")

# Where Lightning keeps the train loader state inside a checkpoint (written from rank 0 only).
_LOADER_STATE_PATH = ("loops", "fit_loop", "state_dict", "combined_loader")


class OmniStrategy(ModelParallelStrategy):
    """Multimodal-LLM training over ``pp x dp_replicate x dp_shard x cp x tp`` ranks, with encoder SP groups.

    Args:
        pp: pipeline-parallel stages of the LLM (outermost mesh dimension; see :class:`ParallelDims`).
        dp_replicate: data-parallel replicas (HSDP's replicate dimension; parameters are not sharded across it).
        dp_shard: data-parallel ranks the parameters are sharded over (FSDP2); ``-1`` takes what the other degrees
            leave of the world.
        cp: context-parallel ranks: each sequence's tokens are split head-tail over them for the LLM.
        tp: tensor-parallel ranks of the LLM (innermost mesh dimension, so they are on adjacent ranks).
        ep: expert-parallel ranks for MoE layers, carved out of the ``dp_shard x cp`` ranks.
        enc_sp: largest number of data-parallel ranks one encoder item may be split over with sequence
            parallelism (a power of two dividing the encoder heads).
        encoder_balance: reshard encoder items across the data-parallel ranks (the encoder pool's ranks under the
            disaggregated placement) every step so each rank's encoder work is about equal, splitting long items with
            sequence parallelism (see :mod:`omni_lightning.runtime.reshard`); default ``True`` when there are
            several such ranks.
        pp_schedule: pipeline schedule when ``pp > 1``: ``"1F1B"``, ``"GPipe"``, ``"Interleaved1F1B"`` or
            ``"InterleavedZeroBubble"`` (the last two run ``pp_virtual_stages`` stages per rank).
        pp_microbatches: micro-batches per step in the pipeline (default ``pp``); each training batch is cut into
            this many, or taken as is when it carries a ``micro_batches`` list.
        pp_virtual_stages: stages per rank for the interleaved schedules.
        pp_max_tokens: most tokens in one micro-batch; stage-to-stage buffers have this many rows.
        pp_encoders: ``"joint"`` (default for 1F1B and GPipe) inserts each micro-batch's encoder work into the
            schedule, shared by every stage's rank; ``"first_stage"`` runs encoders inside stage 0 (torchtitan's
            way; what the interleaved schedules use).
        pp_calibration_steps: with the joint pipeline under 1F1B, how many training batches after the first are
            timed (each stage's forward and backward, each rank's encoder work) to price its plan of which rank
            encodes each item with measured costs instead of FLOPs (see
            :mod:`omni_lightning.runtime.calibration`); ``0`` keeps FLOPs.
        launcher: how Lightning starts local processes when no cluster environment does: ``"subprocess"``
            (default; re-runs the script, for scripts and the CLI), ``"fork"`` (tests and notebooks) or
            ``"spawn"``. Under torchrun or SLURM the cluster starts the processes and this is ignored.
        timeout: process-group timeout in seconds; collectives that wait longer fail instead of hanging.
        process_group_backend: defaults to gloo on CPU and nccl on CUDA.
        save_distributed_checkpoint: write sharded torch.distributed.checkpoint directories (resumable under
            another layout) rather than one consolidated file. Either is written under a hidden ``.NAME.partial``
            and renamed to its name once every rank has finished, so a kill while saving leaves the previous
            checkpoint the latest complete one.
        placement: ``"multiplexed"`` (default) colocates the encoders with the LLM on every rank (MegaScale-Omni);
            ``"disaggregated"`` gives them a pool of their own, as DistTrain does: the LLM pool (the first ranks,
            laid out by the degrees above) and an encoder pool of ``encoder_world_size`` ranks (data parallelism and
            encoder SP: ``enc_sp`` then applies to that pool), whose outputs stream to the LLM pool micro-batch by
            micro-batch (see :mod:`omni_lightning.runtime.pool`), into a 1F1B or GPipe pipeline when
            ``pp > 1``.
        encoder_world_size: ranks of the encoder pool under ``placement="disaggregated"``; ``None`` sizes it with the
            pool solver (:func:`~omni_lightning.balance.allocation.encoder_pool_size`) for ``pool_workload``.
        pool_workload: a workload spec file or bundled preset name (``"vlm_dynres"``, ...) that the pool solver sizes
            the encoder pool for when ``encoder_world_size`` is ``None``.
        on_nonfinite: what a step does when the loss or a gradient is NaN or infinite on any rank (checked after the
            last backward of the step, agreed by one all-reduce over the world): ``"skip"`` (default) drops the
            gradients on every rank so the optimizer changes neither weights nor state (the step still counts, as does
            the learning-rate schedule), logs a warning with the step and the ranks, and counts it in the
            ``guard/skipped_steps`` metric; ``"stop"`` raises ``FloatingPointError`` on every rank.

    Invalid arguments, layouts and model sizes fail before any process starts where the launcher allows it (see
    ``docs/configuration_errors.md``).

    The LLM mesh, its flattened views and the encoder groups are built in :meth:`setup_environment`, before the
    data module's ``setup`` and the model's ``configure_model``, and exposed as :attr:`parallel_dims` and
    :attr:`meshes` (also as ``lightning_module.omni_meshes``).
    """

    strategy_name = "omni"

    def __init__(
        self,
        *,
        pp: int = 1,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
        enc_sp: int = 1,
        encoder_balance: bool | None = None,
        pp_schedule: str = "1F1B",
        pp_microbatches: int | None = None,
        pp_virtual_stages: int = 1,
        pp_max_tokens: int = 4096,
        pp_encoders: str = "joint",
        pp_calibration_steps: int = 2,
        launcher: LauncherName = "subprocess",
        timeout: float = 1800.0,
        process_group_backend: str | None = None,
        save_distributed_checkpoint: bool = True,
        on_nonfinite: NonFinitePolicy = "skip",
        placement: Placement = "multiplexed",
        encoder_world_size: int | None = None,
        pool_workload: str | None = None,
    ) -> None:
        _check_placement(placement, encoder_world_size, pool_workload, pp=pp, enc_sp=enc_sp, pp_schedule=pp_schedule)
        if on_nonfinite not in ("skip", "stop"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r} must be 'skip' or 'stop'")
        if launcher not in ("subprocess", "fork", "spawn"):
            raise ValueError(f"launcher={launcher!r} must be 'subprocess', 'fork' or 'spawn'")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be a positive number of seconds")
        if enc_sp > 1 and encoder_balance is False:
            raise ValueError(
                f"enc_sp={enc_sp} splits items planned by the encoder balancer: drop encoder_balance=False"
            )
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout),
        )
        self.placement = placement
        self._encoder_world_size, self._pool_workload = encoder_world_size, pool_workload
        self._pool_layout: PoolLayout | None = None
        self._encoder_pool: EncoderPool | None = None
        # Under the disaggregated placement enc_sp splits items over the encoder pool, not the LLM's ranks.
        self._enc_sp = enc_sp
        self._degrees = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp,
                         "ep": ep, "enc_sp": enc_sp if placement == "multiplexed" else 1}
        # Validate what can be checked before the world size is known, so a typo fails at construction.
        ParallelDims(world_size=_smallest_world(self._degrees), **self._degrees)
        self._launcher_name = launcher
        self._encoder_balance = encoder_balance
        if pp_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"pp_schedule={pp_schedule!r} must be one of {sorted(PIPELINE_SCHEDULES)}")
        for name, value in (("pp_virtual_stages", pp_virtual_stages), ("pp_max_tokens", pp_max_tokens),
                            ("pp_microbatches", 1 if pp_microbatches is None else pp_microbatches)):
            if value < 1:
                raise ValueError(f"{name}={value} must be at least 1")
        if pp_encoders not in ("joint", "first_stage"):
            raise ValueError(f"pp_encoders={pp_encoders!r} must be 'joint' or 'first_stage'")
        if isinstance(pp_calibration_steps, bool) or not isinstance(pp_calibration_steps, int) \
                or pp_calibration_steps < 0:
            raise ValueError(f"pp_calibration_steps={pp_calibration_steps!r} must be a non-negative integer (0: no "
                             "calibration)")
        if pp_schedule in _SINGLE_STAGE_SCHEDULES and pp_virtual_stages != 1:
            raise ValueError(f"pp_schedule={pp_schedule!r} runs one stage per rank but pp_virtual_stages="
                             f"{pp_virtual_stages}: use pp_virtual_stages=1 or pp_schedule='Interleaved1F1B'")
        microbatches = pp_microbatches or pp
        if pp_schedule not in _SINGLE_STAGE_SCHEDULES and microbatches % pp:
            raise ValueError(f"pp_schedule={pp_schedule!r} needs pp_microbatches ({microbatches}) to be a multiple of "
                             f"pp={pp}: use pp_microbatches={pp * -(-microbatches // pp)}")
        if pp_encoders == "joint" and pp_schedule not in _SINGLE_STAGE_SCHEDULES:
            pp_encoders = "first_stage"  # the interleaved schedules keep the encoders inside stage 0
        if placement == "disaggregated":
            pp_encoders = "pool"  # stage 0 receives the encoder pool's outputs
        self.pipeline_settings = PipelineSettings(pp_schedule, pp_microbatches, pp_virtual_stages, pp_max_tokens,
                                                  pp_encoders, pp_calibration_steps)
        self.on_nonfinite = on_nonfinite
        self._skipped_steps = 0
        self._parallel_dims: ParallelDims | None = None
        self._meshes: OmniMeshes | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="omni-lightning: decoupled encoder/LLM parallelism", override=True
        )

    # ------------------------------------------------------------------------------------------- topology
    @property
    def parallel_dims(self) -> ParallelDims:
        """Degrees of the LLM's ranks, resolved for this job's world size (available once the world size is known):
        the whole world, or the LLM pool under the disaggregated placement."""
        if self._parallel_dims is None:
            if (layout := self.pool_layout) is not None:
                self._parallel_dims = layout.llm
            else:
                self._parallel_dims = ParallelDims(world_size=self.num_nodes * self.num_processes, **self._degrees)
        return self._parallel_dims

    @property
    def pool_layout(self) -> PoolLayout | None:
        """Both pools' ranks under ``placement="disaggregated"`` (``None`` when multiplexed)."""
        if self.placement != "disaggregated":
            return None
        if self._pool_layout is None:
            world = self.num_nodes * self.num_processes
            size = self._encoder_world_size
            if size is None:
                size = self._solve_encoder_pool(world)
            if not 1 <= size < world:
                raise ValueError(f"encoder_world_size={size} must leave the LLM pool at least one of the {world} ranks")
            if size % self._enc_sp:
                raise ValueError(f"enc_sp={self._enc_sp} must divide encoder_world_size={size} (SP blocks are aligned "
                                 "ranks of the encoder pool)")
            self._pool_layout = PoolLayout(ParallelDims(world_size=world - size, **self._degrees), size)
        return self._pool_layout

    @property
    def is_encoder_rank(self) -> bool:
        """Whether this rank belongs to the encoder pool of the disaggregated placement."""
        return self.pool_layout is not None and self.pool_layout.is_encoder_rank(self.global_rank)

    @property
    def encoder_pool(self) -> EncoderPool | None:
        """The encoder pool's groups (disaggregated placement, after :meth:`setup_environment`)."""
        return self._encoder_pool

    @property
    def stream_microbatches(self) -> int:
        """Micro-batches a step streams from the encoder pool to the LLM pool (default ``pp``, at least 2, so encoder
        and LLM work overlap)."""
        return self.pipeline_settings.microbatches or max(self._degrees["pp"], 2)

    @property
    def stream_lag(self) -> int:
        """How many micro-batches after its forward the encoder pool runs one's backward: when the LLM pool's first
        stage has produced its gradients (1 without a pipeline, ``pp`` under 1F1B, all of them under GPipe)."""
        pp = self._degrees["pp"]
        if pp == 1:
            return 1
        return pp if self.pipeline_settings.schedule == "1F1B" else self.stream_microbatches

    def _solve_encoder_pool(self, world: int) -> int:
        module = self._lightning_module
        config = getattr(module, "config", None)
        if not isinstance(config, ReferenceMLLMConfig):
            raise ValueError("encoder_world_size=None sizes the encoder pool from the model's configuration, which is "
                             "not known yet (or not a ReferenceMLLMConfig): pass encoder_world_size")
        assert self._pool_workload is not None  # _check_placement
        degrees = self._degrees
        unit = degrees["tp"] * degrees["pp"] * degrees["cp"] * degrees["dp_replicate"]
        return size_encoder_pool(config, self._pool_workload, world_size=world, llm_unit=unit, tp=degrees["tp"])

    @property
    def encoder_balance(self) -> bool:
        """Whether the data-parallel ranks share each step's encoder work (default: when there are several)."""
        if self._encoder_balance is None:
            if (layout := self.pool_layout) is not None:
                return layout.encoder_world_size > 1
            return self.parallel_dims.dp > 1
        return self._encoder_balance

    @property
    def meshes(self) -> OmniMeshes:
        if self._meshes is None:
            raise RuntimeError("OmniStrategy.meshes exist only after setup_environment() created the process groups")
        return self._meshes

    def check_model_fits(self, module: Any) -> None:
        """Raise ``ValueError`` if the model cannot run on this layout (heads or experts that the degrees do not
        divide, fewer decoder layers than pipeline stages, ...), without building anything but a meta-device copy.

        Runs in the launching process before workers start (fork and spawn launchers) and in
        :meth:`setup_environment` before the process group exists (every rank, whoever started it: the subprocess
        launcher, torchrun or SLURM). Modules without a :class:`ReferenceMLLMConfig` ``config`` are not checked.
        """
        config = getattr(module, "config", None)
        if not isinstance(config, ReferenceMLLMConfig):
            if self.placement == "disaggregated":
                raise ValueError("placement='disaggregated' needs an OmniModule whose config is a ReferenceMLLMConfig "
                                 "(item sizes and output widths travel by it)")
            return
        dims = self.parallel_dims
        with torch.device("meta"):
            model = ReferenceMLLM(config)
        # No groups: the checks read only the degrees, and group creation would be collective.
        if self.placement == "disaggregated":
            for name in ("vision", "audio"):
                if getattr(model, name).n_heads % self._enc_sp:
                    raise ValueError(f"{name}.n_heads={getattr(model, name).n_heads} is not divisible by enc_sp="
                                     f"{self._enc_sp}: pick enc_sp dividing the encoder heads")
        else:
            check_model_fits_layout(model, OmniMeshes(dims, None, {}, None, {}),
                                    encoder_balance=self.encoder_balance)
        if dims.pp_enabled:
            stages = dims.pp * self.pipeline_settings.virtual_stages
            assign_layers(layer_costs(config.llm)[0], stages)

    @override
    def _configure_launcher(self) -> None:
        # Fail on a bad layout in the launching process, before any worker or process group exists (a pool size left
        # to the solver waits for the model, in check_model_fits).
        if self.placement == "multiplexed" or self._encoder_world_size is not None:
            _ = self.parallel_dims
        if self.cluster_environment.creates_processes_externally:
            self._launcher = None
        elif self._launcher_name == "subprocess":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _NoWeightsMultiProcessingLauncher(self, start_method=self._launcher_name)

    @override
    def setup_environment(self) -> None:
        dims = self.parallel_dims
        self.check_model_fits(self.lightning_module)
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        layout = self.pool_layout
        expected = layout.world_size if layout is not None else dims.world_size
        if dist.get_world_size() != expected:
            raise ValueError(f"OmniStrategy expected {expected} processes, the process group has "
                             f"{dist.get_world_size()}")
        self._meshes = build_meshes(dims, self.root_device.type, pool=layout)
        if layout is not None:
            self._encoder_pool = build_encoder_pool(layout, self._enc_sp, self.root_device.type)
        self._device_mesh = self._meshes.world
        module = self.lightning_module
        module._device_mesh = self._meshes.world
        module.omni_meshes = self._meshes
        log.info("rank %d: %s", self.global_rank, f"encoder pool of {layout}" if self.is_encoder_rank else dims)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Samplers split data over the data-parallel ranks only: TP/CP/PP peers must see the same samples.

        An encoder-pool rank reads the stream of the first LLM data-parallel rank it serves, so that both pools run
        the same number of batches an epoch; it takes its items from the LLM pool, not from those batches.
        """
        return {"num_replicas": self.parallel_dims.dp, "rank": self._dp_rank}

    @property
    def _dp_rank(self) -> int:
        """The data-parallel rank whose samples this rank reads (see :attr:`distributed_sampler_kwargs`)."""
        if self.is_encoder_rank:
            assert self.pool_layout is not None
            return self.pool_layout.served_by(self.global_rank)[0]
        return self.meshes.local_rank("dp")

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip FSDP gradient reduction on accumulation micro-batches; the last one reduces the sum."""
        set_gradient_sync(self.model, False)
        try:
            yield
        finally:
            set_gradient_sync(self.model, True)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self.parallel_dims.pp > 1 or self.placement == "disaggregated":
            return closure_loss  # the pipeline schedule or the pool stream ran the backward inside training_step
        # Under TP the loss was taken over vocabulary-sharded logits; their backward needs the same context.
        with vocab_parallel_loss() if self.parallel_dims.tp_enabled else nullcontext():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far because the loss or a gradient was not finite (``on_nonfinite="skip"``)."""
        return self._skipped_steps

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        def closure_then_sync_and_guard() -> Any:
            # Expert-parallel weights are outside FSDP: reduce their gradients once the last backward of the step
            # has run, before the precision plugin's hooks and gradient clipping see them.
            result = closure()
            sync_expert_gradients(self.lightning_module)
            if (pipeline := getattr(self.lightning_module, "pipeline", None)) is not None:
                pipeline.sync_gradients()
            self._guard_nonfinite(optimizer, result)
            return result

        return super().optimizer_step(optimizer, closure_then_sync_and_guard, model, **kwargs)

    def _guard_nonfinite(self, optimizer: Optimizer, loss: Any) -> None:
        """Agree over the world whether any rank's loss or gradients are non-finite, then skip the step or stop.

        Every rank enters the one all-reduce every step, whatever it found, so no rank can skip a collective the
        others enter. Gradients are checked after their reduction: a NaN from one rank reaches its data-parallel
        peers' gradients too, so the loss flag is the one that names where it started.
        """
        module = self.lightning_module
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        flags = torch.zeros(self.world_size, dtype=torch.int32, device=self.root_device)
        # Computed on the device: the flags are read back once, after the all-reduce (one host sync per step).
        flags[self.global_rank] = (_LOSS_NONFINITE * _nonfinite(loss, flags.device)
                                   + _GRADS_NONFINITE * _any_nonfinite_grad(params, flags.device))
        if dist.is_initialized():
            dist.all_reduce(flags)
        by_rank = flags.tolist()
        step = module.trainer.global_step
        if not any(by_rank):
            module.log("guard/skipped_steps", float(self._skipped_steps), batch_size=1)
            return
        bad_loss = [r for r, f in enumerate(by_rank) if f & _LOSS_NONFINITE]
        bad_grads = [r for r, f in enumerate(by_rank) if f & _GRADS_NONFINITE]
        found = "; ".join(f"{what} on rank(s) {ranks}" for what, ranks in
                          (("non-finite loss", bad_loss), ("non-finite gradients", bad_grads)) if ranks)
        if self.on_nonfinite == "stop":
            raise FloatingPointError(
                f"{found} at global_step={step}: stopping on every rank (OmniStrategy(on_nonfinite='stop')); pass "
                "on_nonfinite='skip' to skip such steps, or look for bad data, a too high learning rate or overflow "
                "in low precision"
            )
        for p in params:  # the optimizer leaves parameters without gradients alone: weights and state unchanged
            p.grad = None
        self._skipped_steps += 1
        module.log("guard/skipped_steps", float(self._skipped_steps), batch_size=1)
        if self.global_rank == 0:
            log.warning("skipped optimizer step at global_step=%d on every rank: %s (%d skipped so far)",
                        step, found, self._skipped_steps)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # The loader position a checkpoint records is the last batch training took, not the prefetched one.
        commit_consumed(batch)

    # ----------------------------------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        # Lightning writes loop state (with the loader position) from rank 0 only; each data-parallel rank reads
        # its own shards, so gather every rank's loader state into the checkpoint.
        loader_state = _get_path(checkpoint, _LOADER_STATE_PATH)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, {"dp_rank": self._dp_rank, "loader": loader_state,
                                          "encoder_pool": self.is_encoder_rank})
        checkpoint["omni"] = {"parallel_dims": _dims_record(self.parallel_dims), "ranks": gathered,
                              "placement": self.placement,
                              "encoder_world_size": self.pool_layout.encoder_world_size if self.pool_layout else 0}
        # Written under a hidden name and renamed once every rank is done (see strategies/checkpointing.py): a kill
        # while saving leaves the previous checkpoint the latest one. Rank 0 owns the names, as in Lightning.
        path = Path(self.broadcast(filepath))
        partial = partial_path(path)
        if self.global_rank == 0:
            remove_path(partial)  # left by a save that was killed
        self.barrier("omni_checkpoint_start")
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier("omni_checkpoint_written")  # every rank's shards and rank 0's meta.pt are complete
        if self.global_rank == 0:
            publish_checkpoint(partial, path)
        self.barrier("omni_checkpoint_published")

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        assert self.model is not None
        return optimizer_state_by_name(self.model, getattr(optimizer, "_optimizer", optimizer))

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir():  # sharded: optimizer state keyed by parameter name (see strategies/checkpointing.py)
            assert self.model is not None and self.lightning_module is not None
            checkpoint = load_sharded_checkpoint(path, self.model, self.optimizers,
                                                 strict=self.lightning_module.strict_loading, weights_only=weights_only)
        else:
            checkpoint = super().load_checkpoint(path, weights_only)
        loop_state = _get_path(checkpoint, _LOADER_STATE_PATH[:-1])
        if "omni" not in checkpoint or loop_state is None:
            return checkpoint
        state = loader_state_for_rank(checkpoint["omni"], self._dp_rank, self.parallel_dims.dp,
                                      encoder_pool=self.is_encoder_rank)
        if state is None:
            loop_state.pop(_LOADER_STATE_PATH[-1], None)
        else:
            loop_state[_LOADER_STATE_PATH[-1]] = state
        return checkpoint


def loader_state_for_rank(saved: dict[str, Any], dp_rank: int, dp_size: int, *, encoder_pool: bool = False) -> Any:
    """The loader state a resuming data-parallel rank continues from, or ``None`` to restart its stream.

    Ranks are matched by data-parallel rank (TP/CP/PP peers share a stream), so any layout with the same
    data-parallel size resumes exactly: the same samples in the same order as an uninterrupted run.

    With another data-parallel size (another world size, or the same one with other degrees) each rank reads other
    shards (``shards[dp_rank::dp_size]``) and no saved position applies: every rank restarts its stream from the
    beginning of the data (epoch 0), as a fresh run under the new layout would, with a warning; model, optimizer and
    step count are still restored. What that guarantees: no sample is lost (the first epoch after the resume trains
    every sample once), and the samples the interrupted epoch had trained before the checkpoint are trained once
    more (none when the checkpoint fell on an epoch boundary of every rank). Mapping positions exactly would need a
    new rank to finish the streams of the old ranks it inherits, whose epochs, shuffles and balance groups differ.
    """
    saved_dp = saved["parallel_dims"]["dp"]
    if saved_dp != dp_size:
        rank_zero_warn(
            f"the checkpoint was written with {saved_dp} data-parallel ranks and this run has {dp_size}: loader "
            "positions cannot be mapped, so every data-parallel rank restarts its shard stream from the beginning "
            "(model, optimizer and step count are restored)"
        )
        return None
    # An LLM rank resumes from an LLM rank's stream; an encoder-pool rank, which reads a copy of a stream to keep the
    # pools' epochs in step, from that stream (a checkpoint of the other placement holds no encoder-pool ranks).
    saved_ranks = [rank for rank in saved["ranks"] if rank["dp_rank"] == dp_rank]
    state = next((rank for rank in saved_ranks if rank.get("encoder_pool", False) == encoder_pool),
                 saved_ranks[0] if saved_ranks else None)
    if state is None:
        raise ValueError(f"the checkpoint holds no loader state for data-parallel rank {dp_rank} of {dp_size}")
    return state["loader"]


# Seconds a worker gets to fail by itself once another has died, then again after SIGTERM, before SIGKILL.
_SURVIVOR_GRACE_S = 2.0


class _NoWeightsMultiProcessingLauncher(_MultiProcessingLauncher):
    """Fork/spawn launcher that does not ship rank 0's weights back to the parent.

    The stock launcher pickles rank 0's state dict for the main process, which fails for DTensor shards and is
    meaningless for a sharded model; results and trainer state still come back.
    """

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """Lightning's launch, except that when a worker dies the others get ``_SURVIVOR_GRACE_S`` seconds to fail
        by themselves before they are terminated. They do within a fraction of a second: their next collective raises
        gloo's ``Connection closed by peer``. torch's default SIGTERMs them at once instead, and then they stayed
        blocked in collectives until its SIGKILL 30 s later (Lightning's SIGTERM handler itself enters a collective).
        The error still names the worker that died first and how (``process 2 terminated with signal SIGKILL``)."""
        if (check := getattr(self._strategy, "check_model_fits", None)) is not None:  # before any worker starts
            check(self._strategy.lightning_module)
        if self._start_method in ("fork", "forkserver"):
            _check_bad_cuda_fork()
        if self._start_method == "spawn":
            _check_missing_main_guard()
        if self._already_fit and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise NotImplementedError("fit() twice on one Trainer with the fork/spawn launcher: create a new Trainer "
                                      "and pass fit(ckpt_path=...)")
        os.environ["MASTER_PORT"] = str(self._strategy.cluster_environment.main_port)
        return_queue = mp.get_context(self._start_method).SimpleQueue()
        process_args = [trainer, function, args, kwargs, return_queue]
        if self._start_method == "spawn":
            process_args.append(_GlobalStateSnapshot.capture())
        context = mp.start_processes(self._wrapping_function, args=process_args, nprocs=self._strategy.num_processes,
                                     start_method=self._start_method, join=False)
        self.procs = context.processes
        while not context.join(grace_period=_SURVIVOR_GRACE_S):
            pass
        worker_output = return_queue.get()
        if trainer is None:
            return worker_output
        self._already_fit |= trainer.state.fn == TrainerFn.FITTING
        self._recover_results_in_main_process(worker_output, trainer)
        return worker_output.trainer_results

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> _WorkerOutput | None:
        if self._strategy.local_rank != 0:
            return None
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        return _WorkerOutput(best_model_path, None, trainer.state, results, self.get_extra_results(trainer))


_LOSS_NONFINITE, _GRADS_NONFINITE = 1, 2  # bits of a rank's flag in the non-finite guard's all-reduce


def _nonfinite(value: Any, device: torch.device) -> Tensor:
    """1 if ``value`` is a tensor holding a NaN or an infinity, else 0 (an int32 scalar on ``device``)."""
    if not isinstance(value, Tensor):
        return torch.zeros((), dtype=torch.int32, device=device)
    return (~torch.isfinite(value.detach()).all()).to(device=device, dtype=torch.int32)


def _any_nonfinite_grad(params: list[Tensor], device: torch.device) -> Tensor:
    """1 if this rank's part of any gradient holds a NaN or an infinity, else 0 (an int32 scalar on ``device``)."""
    local = [g for g in (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params) if g.numel()]
    if not local:  # an FSDP rank may hold an empty shard of every gradient
        return torch.zeros((), dtype=torch.int32, device=device)
    # One fused kernel per device and dtype instead of a Python loop over every gradient: a NaN anywhere makes
    # that tensor's max-norm NaN, an infinity makes it infinite.
    largest = torch.stack([n.to(device) for n in torch._foreach_norm(local, float("inf"))])
    return (~torch.isfinite(largest).all()).to(torch.int32)


def _check_placement(placement: str, encoder_world_size: int | None, pool_workload: str | None, *, pp: int,
                     enc_sp: int, pp_schedule: str) -> None:
    if placement not in ("multiplexed", "disaggregated"):
        raise ValueError(f"placement={placement!r} must be 'multiplexed' or 'disaggregated'")
    if placement == "multiplexed":
        if encoder_world_size is not None or pool_workload is not None:
            raise ValueError("encoder_world_size and pool_workload size the encoder pool of placement='disaggregated'; "
                             "the multiplexed placement runs the encoders on every rank")
        return
    if pp > 1 and pp_schedule not in _SINGLE_STAGE_SCHEDULES:
        raise ValueError(f"placement='disaggregated' streams encoder outputs into a 1F1B or GPipe pipeline, not "
                         f"pp_schedule={pp_schedule!r}: use one of those or placement='multiplexed'")
    if encoder_world_size is None and pool_workload is None:
        raise ValueError("placement='disaggregated' needs encoder_world_size=N, or pool_workload=FILE (a workload "
                         "spec) for the pool solver to size the encoder pool")
    if encoder_world_size is not None and (not isinstance(encoder_world_size, int) or encoder_world_size < 1):
        raise ValueError(f"encoder_world_size={encoder_world_size!r} must be a positive integer")
    if enc_sp & (enc_sp - 1):
        raise ValueError(f"enc_sp={enc_sp} must be a power of two (an item is split over 2, 4, ... aligned ranks)")


_POOL_SEQ_LEN = 4096  # LLM tokens a rank packs per step when the solver sizes the pools


def size_encoder_pool(config: ReferenceMLLMConfig, workload: str, *, world_size: int, llm_unit: int, tp: int,
                      seq_len: int = _POOL_SEQ_LEN, length_scale: float = 1.0,
                      cost_model: CostModel | None = None) -> int:
    """Encoder ranks for ``world_size`` ranks training ``config`` on ``workload`` (a spec file or preset name), by
    the pool solver.

    The solver compares the pools' predicted step times (the model's training FLOPs from its cost model, both pools
    on the same devices, so only ratios matter); the step holds one packed sequence of ``seq_len`` tokens per rank,
    of samples drawn as the synthetic shards draw them (``length_scale``). Memory is not the limit at these sizes.
    ``cost_model`` replaces the FLOP model with a measured one (e.g. :func:`~omni_lightning.balance.cost.fit_cost_model`
    on profiled steps, as DistTrain profiles before it sizes).
    """
    spec = load_workload(workload)
    with torch.device("meta"):
        model = ReferenceMLLM(config)
    encoders = [model.vision, model.audio]
    encoder_shape = ModuleShape(params=float(sum(p.numel() for e in encoders for p in e.parameters())),
                                layers=config.vision.n_layers + config.audio.n_layers, dim=config.vision.dim)
    llm_shape = ModuleShape(params=float(sum(p.numel() for p in model.llm.parameters())),
                            layers=config.llm.n_layers, dim=config.llm.dim)
    problem = pool_problem(cost_model or CostModel.from_config(config), spec, world_size=world_size,
                           memory_bytes=math.inf, device_flops=1.0, intra_node_bandwidth=math.inf, sequences=world_size,
                           seq_len=seq_len, encoder=encoder_shape, llm=llm_shape, samples=512,
                           length_scale=length_scale)
    return encoder_pool_size(problem, llm_unit=llm_unit, tp=tp)


def _smallest_world(degrees: dict[str, int]) -> int:
    dp_shard = degrees["dp_shard"] if degrees["dp_shard"] != -1 else math.lcm(degrees["ep"], degrees["enc_sp"])
    return degrees["pp"] * degrees["dp_replicate"] * dp_shard * degrees["cp"] * degrees["tp"]


def _dims_record(dims: ParallelDims) -> dict[str, int]:
    record = {k: v for k, v in asdict(dims).items() if not k.startswith("_")}
    record["dp_shard"] = dims.dp_shard_size
    record["dp"] = dims.dp
    return record


def _get_path(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree
