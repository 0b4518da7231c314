"""OmniStrategy: Lightning's ModelParallelStrategy grown to the full parallel topology of an MLLM job.

A thin skin: it validates its arguments into the degrees and settings (:mod:`omni_lightning.parallel.settings`), builds
the job's layout once the processes exist and hands it to the module and the data module, and calls them at
Lightning's hooks. The launcher (:mod:`.launcher`), the non-finite guard (:mod:`.nonfinite`), the encoder pool's
sizing (:mod:`.pool_size`) and checkpoint I/O (:mod:`.checkpointing`) live beside it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer
from typing_extensions import override

from omni_lightning.balance.cost import CostModel
from omni_lightning.balance.reshard import LinkCost
from omni_lightning.data.failure_notice import FailureNotice
from omni_lightning.data.resumable import commit_consumed
from omni_lightning.datamodules.omni import OmniDataModule
from omni_lightning.datamodules.web import WebDataModule
from omni_lightning.deprecations import warn_renamed
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.models.parallelize import check_model_fits_layout
from omni_lightning.module import OmniModule
from omni_lightning.parallel.attention import attention_kernel
from omni_lightning.parallel.dims import ParallelDims
from omni_lightning.parallel.fsdp import set_gradient_sync
from omni_lightning.parallel.layout import EncoderPool, OmniLayout, OmniMeshes, build_layout
from omni_lightning.parallel.placement import PoolLayout
from omni_lightning.parallel.settings import PipelineSettings, PlacementSettings
from omni_lightning.runtime.loss import vocab_parallel_loss
from omni_lightning.runtime.pipeline import assign_layers, layer_costs
from omni_lightning.strategies.checkpointing import (
    LOADER_STATE_PATH,
    dims_record,
    get_path,
    load_sharded_checkpoint,
    loader_state_for_rank,
    optimizer_state_by_name,
    partial_path,
    publish_checkpoint,
    remove_path,
)
from omni_lightning.strategies.integrity import newest_verified, refuse_if_damaged, write_manifest_together
from omni_lightning.strategies.launcher import InPlaceLauncher, NoWeightsMultiProcessingLauncher, SubprocessLauncher
from omni_lightning.strategies.manifest import CheckpointNotSaved, LastVerified
from omni_lightning.strategies.nonfinite import NonFiniteGuard, NonFinitePolicy
from omni_lightning.strategies.pool_size import size_encoder_pool

__all__ = ["OmniStrategy"]

log = logging.getLogger(__name__)

LauncherName = Literal["subprocess", "fork", "spawn"]
Placement = Literal["multiplexed", "disaggregated"]


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
        encoder_reshard: reshard encoder items across the data-parallel ranks (the encoder pool's ranks under the
            disaggregated placement) every step so each rank's encoder work is about equal, splitting long items with
            sequence parallelism (see :mod:`omni_lightning.runtime.reshard`); default ``True`` when there are
            several such ranks.
        encoder_balance: deprecated name of ``encoder_reshard`` (warns once).
        link_cost: what moving bytes between ranks costs, so that the resharder moves and splits items, and
            ``OmniDataModule``'s reorder moves payloads, only where that pays:
            ``"auto"`` (Gloo between CPU processes; on GPUs NCCL over NVLink for a group inside a node, over the
            network for one spanning nodes: :data:`~omni_lightning.balance.reshard.CPU_GLOO`,
            :data:`~omni_lightning.balance.reshard.GPU_NVLINK`, :data:`~omni_lightning.balance.reshard.GPU_NETWORK`), a
            measured :class:`~omni_lightning.balance.reshard.LinkCost`, or ``"compute_only"`` (traffic is free).
        cost_model: what the model's modules cost on this hardware, for every plan: ``OmniDataModule``'s reorder
            (unless it is given its own) and the resharder's. Default: the model's training FLOPs
            (``module.cost_model()``). FLOPs misjudge encoders against the LLM where speed depends on shapes; a
            model fitted to measured steps (:func:`~omni_lightning.balance.cost.fit_cost_model`) fixes that. Its
            unit must be the link's: FLOPs at ``link_cost``'s ``flops_per_s`` (scale a fit in seconds by it).
        reshard_calibration_steps: with ``encoder_reshard`` outside a pipeline, how many training batches after the
            first are timed (each rank's encoder forwards over what the plan gave it, and its LLM forward) to price
            the resharder's plan in measured seconds from then on, each module keeping the shape of its price (FLOPs,
            or ``cost_model``) and its training priced by what of it trains (a frozen encoder at its forward alone)
            (see :class:`~omni_lightning.runtime.calibration.ResharderCalibrator`); ``0`` keeps those prices.
            Measured prices differ from run to run, and with them where items are encoded and so the order of
            floating-point sums: runs that must repeat bit for bit (as ``pp_calibration_steps`` too) set ``0``.
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

    Every process group is built in :meth:`setup_environment` (:func:`~omni_lightning.parallel.layout.build_layout`),
    before the data module's ``setup`` and the model's ``configure_model``, and handed to both as one
    :class:`~omni_lightning.parallel.layout.OmniLayout` (``omni_layout``); :attr:`parallel_dims`, :attr:`meshes` and
    :attr:`layout` expose it here.
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
        encoder_reshard: bool | None = None,
        encoder_balance: bool | None = None,
        link_cost: LinkCost | Literal["auto", "compute_only"] = "auto",
        cost_model: CostModel | None = None,
        reshard_calibration_steps: int = 2,
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
        self.placement_settings = PlacementSettings(placement, encoder_world_size, pool_workload)
        self._guard = NonFiniteGuard(on_nonfinite)
        if launcher not in ("subprocess", "fork", "spawn"):
            raise ValueError(f"launcher={launcher!r} must be 'subprocess', 'fork' or 'spawn'")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be a positive number of seconds")
        encoder_reshard = _renamed_flag(encoder_reshard, encoder_balance)
        steps = reshard_calibration_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"reshard_calibration_steps={steps!r} must be a non-negative integer (0: no calibration)")
        if enc_sp > 1 and encoder_reshard is False:
            raise ValueError(f"enc_sp={enc_sp} splits items planned by the resharder: drop encoder_reshard=False")
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout),
        )
        disaggregated = self.placement_settings.disaggregated
        # Under the disaggregated placement enc_sp splits items over the encoder pool, not the LLM's ranks.
        self._enc_sp = enc_sp
        self._degrees = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp,
                         "ep": ep, "enc_sp": 1 if disaggregated else enc_sp}
        self.pipeline_settings = PipelineSettings(pp_schedule, pp_microbatches, pp_virtual_stages, pp_max_tokens,
                                                  "pool" if disaggregated else pp_encoders, pp_calibration_steps)
        self.placement_settings.check(pp=pp, enc_sp=enc_sp, pipeline=self.pipeline_settings)
        # Validate what can be checked before the world size is known, so a typo fails at construction.
        ParallelDims(world_size=_smallest_world(self._degrees), **self._degrees)
        self.pipeline_settings.resolved(pp)
        self._launcher_name = launcher
        self._stepping = self._synced = False  # inside an optimizer step's closure; its gradients reduced already
        self._encoder_reshard = encoder_reshard
        self._link_cost = link_cost
        self._cost_model = cost_model
        self._reshard_calibration_steps = reshard_calibration_steps
        self._parallel_dims: ParallelDims | None = None
        self._pool_layout: PoolLayout | None = None
        self._layout: OmniLayout | None = None
        self.failure_notice: FailureNotice | None = None  # the job's, once the process group exists

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="omni-lightning: decoupled encoder/LLM parallelism", override=True
        )

    # ------------------------------------------------------------------------------------------- topology
    @property
    def placement(self) -> str:
        return self.placement_settings.placement

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
        if not self.placement_settings.disaggregated:
            return None
        if self._pool_layout is None:
            world = self.num_nodes * self.num_processes
            size = self.placement_settings.encoder_world_size
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
        return self._layout.pool if self._layout is not None else None

    def _solve_encoder_pool(self, world: int) -> int:
        config = getattr(self._lightning_module, "config", None)
        if not isinstance(config, ReferenceMLLMConfig):
            raise ValueError("encoder_world_size=None sizes the encoder pool from the model's configuration, which is "
                             "not known yet (or not a ReferenceMLLMConfig): pass encoder_world_size")
        workload = self.placement_settings.pool_workload
        assert workload is not None  # PlacementSettings checked it
        degrees = self._degrees
        unit = degrees["tp"] * degrees["pp"] * degrees["cp"] * degrees["dp_replicate"]
        return size_encoder_pool(config, workload, world_size=world, llm_unit=unit, tp=degrees["tp"])

    @property
    def encoder_reshard(self) -> bool:
        """Whether the data-parallel ranks share each step's encoder work (default: when there are several)."""
        if self._encoder_reshard is None:
            if (layout := self.pool_layout) is not None:
                return layout.encoder_world_size > 1
            return self.parallel_dims.dp > 1
        return self._encoder_reshard

    @property
    def encoder_balance(self) -> bool:
        """Deprecated name of :attr:`encoder_reshard`."""
        warn_renamed("OmniStrategy(encoder_balance=...)")
        return self.encoder_reshard

    @property
    def layout(self) -> OmniLayout:
        """This rank's layout: every group, the settings, the model's cost model and packing (after
        :meth:`setup_environment`)."""
        if self._layout is None:
            raise RuntimeError("OmniStrategy.layout exists only after setup_environment() created the process groups")
        return self._layout

    @property
    def meshes(self) -> OmniMeshes:
        return self.layout.meshes

    def check_model_fits(self, module: Any) -> None:
        """Raise ``ValueError`` if the model cannot run on this layout (heads or experts that the degrees do not
        divide, fewer decoder layers than pipeline stages, ...), without building anything but a meta-device copy.

        Runs in the launching process before workers start (fork and spawn launchers) and in
        :meth:`setup_environment` before the process group exists (every rank, whoever started it: the subprocess
        launcher, torchrun or SLURM). Modules without a :class:`ReferenceMLLMConfig` ``config`` are not checked.
        """
        config = getattr(module, "config", None)
        if not isinstance(config, ReferenceMLLMConfig):
            if self.placement_settings.disaggregated:
                raise ValueError("placement='disaggregated' needs an OmniModule whose config is a ReferenceMLLMConfig "
                                 "(item sizes and output widths travel by it)")
            return
        if config.attention_backend == "flash":  # fails here naming what flash-attn lacks, not at the first forward
            device_type = self.parallel_devices[0].type if self.parallel_devices else "cpu"
            attention_kernel("flash", device_type, getattr(module, "compute_dtype", torch.float32))
        dims = self.parallel_dims
        with torch.device("meta"):
            model = ReferenceMLLM(config)
        if self.placement_settings.disaggregated:
            for name, encoder in model.encoders.items():
                if encoder.n_heads % self._enc_sp:
                    raise ValueError(f"{name}.n_heads={encoder.n_heads} is not divisible by enc_sp={self._enc_sp}: "
                                     "pick enc_sp dividing the encoder heads")
        else:
            check_model_fits_layout(model, dims, reshard=self.encoder_reshard)
        if dims.pp_enabled:
            assign_layers(layer_costs(config.llm)[0], dims.pp * self.pipeline_settings.virtual_stages)

    @override
    def _configure_launcher(self) -> None:
        # Fail on a bad layout in the launching process, before any worker or process group exists (a pool size left
        # to the solver waits for the model, in check_model_fits).
        if not self.placement_settings.disaggregated or self.placement_settings.encoder_world_size is not None:
            _ = self.parallel_dims
        if self.cluster_environment.creates_processes_externally:
            self._launcher = InPlaceLauncher()
        elif self._launcher_name == "subprocess":
            self._launcher = SubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = NoWeightsMultiProcessingLauncher(self, start_method=self._launcher_name)

    @override
    def setup_environment(self) -> None:
        dims = self.parallel_dims
        module = self.lightning_module
        self.check_model_fits(module)
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        pool = self.pool_layout
        expected = pool.world_size if pool is not None else dims.world_size
        if dist.get_world_size() != expected:
            raise ValueError(f"OmniStrategy expected {expected} processes, the process group has "
                             f"{dist.get_world_size()}")
        layout = build_layout(dims, self.root_device.type, pipeline=self.pipeline_settings,
                              placement=self.placement_settings, reshard=self.encoder_reshard, pool=pool,
                              pool_enc_sp=self._enc_sp, link_cost=self._link_cost,
                              reshard_calibration_steps=self._reshard_calibration_steps,
                              ranks_per_node=self.num_processes)
        layout.cost_model = self._cost_model
        if isinstance(module, OmniModule):  # what the data module's plans price and pack by
            layout.cost_model = self._cost_model if self._cost_model is not None else module.cost_model()
            layout.packing = module.packing()
            module.omni_layout = layout
        if isinstance(datamodule := getattr(module.trainer, "datamodule", None), OmniDataModule):
            datamodule.omni_layout = layout
        # Every rank learns of another's failure through the rendezvous store (see data/failure_notice.py).
        self.failure_notice = FailureNotice.for_job()
        if self.failure_notice is not None:
            self.failure_notice.watch()
        if isinstance(datamodule, WebDataModule):
            datamodule.failure_notice = self.failure_notice
        self._layout = layout
        self._device_mesh = layout.meshes.world
        module._device_mesh = layout.meshes.world
        log.info("rank %d: %s", self.global_rank, f"encoder pool of {pool}" if layout.is_encoder_rank else dims)

    @override
    def teardown(self) -> None:
        if self.failure_notice is not None:
            self.failure_notice.stop_watching()
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Under torchrun, SLURM or the subprocess launcher the error raised is this rank's own (the fork and spawn
        # launchers raise JobStopped instead): say which rank failed first and why.
        if self.failure_notice is not None and (stopped := self.failure_notice.stopped_by_another_rank(exception)):
            log.error("%s", stopped)
            if hasattr(exception, "add_note"):
                exception.add_note(str(stopped))
        super().on_exception(exception)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Samplers split data over the data-parallel ranks only: TP/CP/PP peers must see the same samples.

        An encoder-pool rank reads the stream of the first LLM data-parallel rank it serves, so that both pools run
        the same number of batches an epoch; it takes its items from the LLM pool, not from those batches.
        """
        return {"num_replicas": self.parallel_dims.dp, "rank": self.layout.dp_rank}

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
        module = self.lightning_module
        if isinstance(module, OmniModule) and module.step is not None and module.step.runs_backward:
            # The pipeline schedule or the pool stream ran the backward inside training_step; a pipeline has no
            # single backward to wrap, so the hooks run once, now: the step's reduced loss, gradients in place
            # (reduced too on the optimizer step's last batch, where what the step leaves to reduce is reduced).
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)  # on_before_backward(loss)
            if self._stepping:
                module.sync_gradients()
                self._synced = True
            return self.precision_plugin.post_backward(closure_loss, module)  # on_after_backward
        # Under TP the loss was taken over vocabulary-sharded logits; their backward needs the same context.
        with vocab_parallel_loss() if self.parallel_dims.tp_enabled else nullcontext():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far because the loss or a gradient was not finite (``on_nonfinite="skip"``)."""
        return self._guard.skipped_steps

    @property
    def on_nonfinite(self) -> str:
        return self._guard.policy

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        def closure_then_sync_and_guard() -> Any:
            # What the step leaves to be reduced (experts outside FSDP, encoders replicated over the pipeline) is
            # reduced once the last backward of the step has run, before the precision plugin's hooks and gradient
            # clipping see the gradients (in backward already, for a step that runs its own).
            self._stepping, self._synced = True, False
            try:
                result = closure()
            finally:
                self._stepping = False
            module = self.lightning_module
            if isinstance(module, OmniModule) and not self._synced:
                module.sync_gradients()
            self._guard.check(module, optimizer, result, rank=self.global_rank, world_size=self.world_size,
                              device=self.root_device)
            return result

        return super().optimizer_step(optimizer, closure_then_sync_and_guard, model, **kwargs)

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
        loader_state = get_path(checkpoint, LOADER_STATE_PATH)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, {"dp_rank": self.layout.dp_rank, "loader": loader_state,
                                          "encoder_pool": self.is_encoder_rank})
        checkpoint["omni"] = {"parallel_dims": dims_record(self.parallel_dims), "ranks": gathered,
                              "placement": self.placement,
                              "encoder_world_size": self.pool_layout.encoder_world_size if self.pool_layout else 0}
        # Written under a hidden name and renamed once every rank is done (see strategies/checkpointing.py): a kill
        # while saving leaves the previous checkpoint the latest one. Rank 0 owns the names, as in Lightning.
        path = Path(self.broadcast(filepath))
        partial = partial_path(path)
        if self.global_rank == 0:
            remove_path(partial)  # left by a save that was killed
        self.barrier("omni_checkpoint_start")
        try:
            super().save_checkpoint(checkpoint, partial, storage_options)
            self.barrier("omni_checkpoint_written")  # every rank's shards and rank 0's meta.pt are complete
            if self._save_distributed_checkpoint:  # the manifest comes last: it vouches for every other file
                write_manifest_together(self, partial, int(checkpoint.get("global_step", 0)))
        except (Exception, CheckpointException) as error:  # a full disk, a write refused (DCP's exception is a
            # BaseException): the job stops, the published checkpoints stay
            failed = CheckpointNotSaved(
                f"checkpoint {path} could not be saved ({type(error).__name__}: {error}); the checkpoints saved "
                f"before it are intact (this one stays under the hidden name {partial.name} until a save replaces it)")
            if self.failure_notice is not None:
                self.failure_notice.post(failed)
            raise failed from error
        self.barrier("omni_checkpoint_complete")
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
        """Verify the checkpoint against its manifest (refusing a damaged one, naming its files), or for
        ``ckpt_path="last"`` pick the newest that verifies, then load it."""
        requested = self.broadcast(checkpoint_path)
        if isinstance(requested, LastVerified):
            path = newest_verified(self, Path(requested))
        else:
            path = Path(requested)
            refuse_if_damaged(self, path)
        if path.is_dir():  # sharded: optimizer state keyed by parameter name (see strategies/checkpointing.py)
            assert self.model is not None and self.lightning_module is not None
            checkpoint = load_sharded_checkpoint(path, self.model, self.optimizers,
                                                 strict=self.lightning_module.strict_loading, weights_only=weights_only)
        else:
            checkpoint = super().load_checkpoint(path, weights_only)
        loop_state = get_path(checkpoint, LOADER_STATE_PATH[:-1])
        if "omni" not in checkpoint or loop_state is None:
            return checkpoint
        state = loader_state_for_rank(checkpoint["omni"], self.layout.dp_rank, self.parallel_dims.dp,
                                      encoder_pool=self.is_encoder_rank, pp=self.parallel_dims.pp)
        if state is None:
            loop_state.pop(LOADER_STATE_PATH[-1], None)
        else:
            loop_state[LOADER_STATE_PATH[-1]] = state
        return checkpoint


def _smallest_world(degrees: dict[str, int]) -> int:
    dp_shard = degrees["dp_shard"] if degrees["dp_shard"] != -1 else math.lcm(degrees["ep"], degrees["enc_sp"])
    return degrees["pp"] * degrees["dp_replicate"] * dp_shard * degrees["cp"] * degrees["tp"]


def _renamed_flag(new: bool | None, old: bool | None) -> bool | None:
    """``encoder_reshard``, or its deprecated name's value where only that was given."""
    if old is None:
        return new
    warn_renamed("OmniStrategy(encoder_balance=...)")
    if new is not None and new != old:
        raise ValueError(f"encoder_reshard={new} and its deprecated name encoder_balance={old} disagree: "
                         "give encoder_reshard alone")
    return old
