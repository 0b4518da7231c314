"""OmniDataModule: streaming multimodal shards with decentralized grouped reordering and exact resume."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override

from omni_lightning.balance.cost import CostModel
from omni_lightning.balance.reorder import PIPELINE_ORDERS, PipelineOrder
from omni_lightning.balance.reshard import resolve_link
from omni_lightning.data.layouts import Layout
from omni_lightning.data.relay import StageRelay
from omni_lightning.data.reorder_stream import LengthPolicy, ReorderedStream, ReorderSettings
from omni_lightning.data.resumable import ResumableLoader
from omni_lightning.data.shards import SyntheticShards, existing_shards
from omni_lightning.data.streaming import SampleStream, Tokenizer
from omni_lightning.datamodules.web import WebDataModule
from omni_lightning.deprecations import warn_renamed
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.flops import reference_cost_model
from omni_lightning.parallel.layout import new_reorder_groups
from omni_lightning.parallel.settings import PipelineSettings

__all__ = ["OmniDataModule"]


# Data-parallel ranks planned together unless told otherwise.
_DEFAULT_GROUP = 8


def _renamed(old_name: str, old: Any, unset: Any, new_name: str, new: Any, new_default: Any) -> Any:
    """An argument's value, which may come under its deprecated name instead (given when that is not ``unset``)."""
    if old == unset:
        return new
    warn_renamed(f"OmniDataModule({old_name}=...)")
    if new not in (new_default, old):
        raise ValueError(f"{new_name}={new!r} and its deprecated name {old_name}={old!r} disagree: give {new_name} "
                         "alone")
    return old


def _unbatched(item: Any) -> Any:
    return item  # samples stay Python objects; packing happens after the plan


class OmniDataModule(WebDataModule):
    """Multimodal webdataset shards, balanced across data-parallel ranks without a coordinator.

    Each data-parallel rank streams its own shards (TP/CP peers read the same ones; with encoders on pipeline
    stage 0 only, later stages receive each step's shapes from it instead) and, every ``group_steps`` steps,
    plans with the other ranks of its reorder group which (rank, step, micro-batch) trains on which sample, so
    that every rank's step costs about the same. See :mod:`omni_lightning.balance.reorder`. Data in another form:
    convert it to shards (``omni-lightning make-shards --from-jsonl``) or subclass and override
    :meth:`train_samples`.

    Args:
        shards: brace pattern, glob, directory, list or fsspec URLs of ``.tar`` shards; ``None`` in a subclass that
            supplies its samples by overriding :meth:`train_samples`.
        samples_per_step: samples each rank reads per step (on average; a rank may train on more or fewer).
        group_steps: steps planned together (each rank buffers ``group_steps * samples_per_step`` samples).
        micro_batches: micro-batches per step; use with ``accumulate_grad_batches=micro_batches``. Under pipeline
            parallelism the strategy's ``pp_microbatches`` sets it, and each batch holds a whole step.
        reorder: ``"grouped"`` (reorder samples across the reorder group) or ``"none"`` (each rank trains on what it
            read, in order).
        reorder_group_size: data-parallel ranks planned together: 1 (local only), k (all of them when there are
            fewer), or ``None`` for all.
        pipeline_order: under a 1F1B pipeline, how a step's micro-batches are shaped for it: ``"search"``
            (towards the cost profile whose 1F1B step is shortest, light micro-batches where the pipeline fills and
            drains, then refined by a local search on the 1F1B step around indivisible heavy samples; up to about
            a second a step at pp 8 with 32 micro-batches), ``"ramp"`` (the profile alone: nearly as short where a
            micro-batch holds many samples) or ``"disttrain"`` (even micro-batches in DistTrain's order). See
            ``ReorderConfig.pipeline_order``. Other schedules get even micro-batches in DistTrain's order.
        plan_ahead: read, plan and exchange the next group on a background thread while the current one trains
            (planning off the step's critical path); ``False``: on the training thread, between groups. The plans
            and the samples each step trains on are the same either way.
        token_budget: most LLM tokens in one micro-batch (``None``: no limit).
        max_seq_len: longest sample in LLM tokens (``None``: no limit); longer ones follow ``max_seq_len_policy``.
        max_seq_len_policy: ``"truncate"`` (cut the text), ``"drop"`` (skip the sample) or ``"error"``; truncated
            and dropped samples are counted in the ``reorder/`` metrics.
        on_bad_sample: ``"skip"`` (log with shard and key, count, keep steps aligned) or ``"error"``.
        cost_model: prices samples; by default derived from the LightningModule's ``config`` if it is a
            ``ReferenceMLLMConfig``, else from ``ReferenceMLLMConfig.tiny()``.
        tokenizer: turns ``txt`` members into ids (UTF-8 bytes by default).
        num_workers: loader worker processes per rank (each needs at least one shard).
        seed: seeds the per-epoch shard order and the plan's tie-breaking.
        synthetic: generate synthetic shards into the directory of ``shards`` if none exist yet.
        val_shards: optional validation shards (same format).
        val_batches: micro-batches per validation pass on every rank (equal counts keep collectives aligned).
        patch_size: pixels per side of a vision patch; must match the model's vision encoder (default: the
            processor's, else 14).
        vision_merge: vision tokens merged into one LLM token (4 = 2x2); must match the model (default: the
            processor's, else 4).
        audio_downsample: mel frames per audio token; must match the model.
        processor: a local Hugging Face processor or tokenizer directory (offline): tokenizer, token roles,
            vocabulary and media policy; ``None`` is UTF-8 bytes (the synthetic demo). See
            :class:`~omni_lightning.datamodules.WebDataModule`.
        layout: ``"auto"`` (per sample), ``"pairs"``, ``"conversations"`` or ``"synthetic"``
            (:mod:`omni_lightning.data.layouts`).
        caption_key: the json key of an image-text pair's caption.
        audio_frames_per_second: mel frames per second of decoded audio files (default: the feature extractor's,
            else 100); a value that contradicts the processor is an error.
        video_fps: frames per second sampled from video files (default: the processor's, else 2).
        video_max_frames: most frames sampled from one video (default: the processor's, else 32).
        read_timeout: seconds a shard read may make no progress before the job fails, every rank quoting the
            stalled rank's error (``None``: no limit). See :class:`~omni_lightning.datamodules.WebDataModule`.
        workload_balance: deprecated name of ``reorder`` (warns once).
        balance_group_size: deprecated name of ``reorder_group_size`` (warns once); a value other than its default
            (8) is the one used.
    """

    def __init__(
        self,
        shards: str | list[str] | None = "data/tiny_omni/train-{000000..000005}.tar",
        *,
        samples_per_step: int = 4,
        group_steps: int = 8,
        micro_batches: int = 1,
        reorder: Literal["grouped", "none"] = "grouped",
        reorder_group_size: int | None = _DEFAULT_GROUP,
        pipeline_order: PipelineOrder = "search",
        plan_ahead: bool = True,
        token_budget: int | None = None,
        max_seq_len: int | None = None,
        max_seq_len_policy: LengthPolicy = "truncate",
        on_bad_sample: Literal["skip", "error"] = "skip",
        cost_model: CostModel | None = None,
        tokenizer: Tokenizer | None = None,
        num_workers: int = 0,
        seed: int = 0,
        synthetic: SyntheticShards | None = None,
        val_shards: str | list[str] | None = None,
        val_batches: int = 4,
        patch_size: int | None = None,
        vision_merge: int | None = None,
        audio_downsample: int = 4,
        processor: str | None = None,
        layout: Layout = "auto",
        caption_key: str | None = None,
        audio_frames_per_second: int | None = None,
        video_fps: float | None = None,
        video_max_frames: int | None = None,
        read_timeout: float | None = 300.0,
        workload_balance: Literal["grouped", "none"] | None = None,
        balance_group_size: int | None = _DEFAULT_GROUP,
    ) -> None:
        super().__init__(
            shards, batch_size=samples_per_step, num_workers=num_workers, seed=seed, synthetic=synthetic,
            val_shards=val_shards, val_batches=val_batches, patch_size=patch_size, vision_merge=vision_merge,
            audio_downsample=audio_downsample, processor=processor, layout=layout, caption_key=caption_key,
            audio_frames_per_second=audio_frames_per_second, video_fps=video_fps, video_max_frames=video_max_frames,
            on_bad_sample=on_bad_sample, read_timeout=read_timeout,
        )
        reorder = _renamed("workload_balance", workload_balance, None, "reorder", reorder, "grouped")
        reorder_group_size = _renamed("balance_group_size", balance_group_size, _DEFAULT_GROUP, "reorder_group_size",
                                      reorder_group_size, _DEFAULT_GROUP)
        if reorder not in ("grouped", "none"):
            raise ValueError(f"reorder={reorder!r} must be 'grouped' or 'none'")
        if pipeline_order not in PIPELINE_ORDERS:
            raise ValueError(f"pipeline_order={pipeline_order!r} must be one of {PIPELINE_ORDERS}")
        if reorder_group_size is not None and reorder_group_size < 1:
            raise ValueError(f"reorder_group_size={reorder_group_size} must be at least 1 (or None for all ranks)")
        self.settings = ReorderSettings(
            samples_per_step=samples_per_step,
            group_steps=group_steps,
            micro_batches=micro_batches,
            token_budget=token_budget,
            max_seq_len=max_seq_len,
            length_policy=max_seq_len_policy,
            reorder=reorder == "grouped",
            plan_ahead=plan_ahead,
        )
        self.reorder_group_size = reorder_group_size
        self.pipeline_order = pipeline_order
        self.cost_model = cost_model
        self._prices_from_model = cost_model is None
        self.tokenizer = tokenizer
        self.reorder_group: dist.ProcessGroup | None = None
        self.reorder_group_index = 0
        self.relay_group: dist.ProcessGroup | None = None

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.reorder_group_size is not None and self.dp_size % min(self.reorder_group_size, self.dp_size):
            raise ValueError(
                f"reorder_group_size={self.reorder_group_size} must divide the data-parallel size {self.dp_size}"
            )
        layout = self.omni_layout
        if layout is not None and layout.pipelined:
            # A disaggregated step streams its micro-batches from the encoder pool to the LLM pool: a two-stage
            # pipeline, planned as one.
            pipeline = layout.pipeline
            self._plan_for_pipeline(max(layout.dims.pp, 2), pipeline)
            if layout.dims.pp > 1:  # what benchmarks/pipeline.py measures: micro-batches shaped for 1F1B
                # The 1F1B profile is no shape for other schedules (GPipe's step grows with its largest
                # micro-batch): they get even ones.
                order = self.pipeline_order if pipeline.schedule == "1F1B" else "disttrain"
                self.settings = replace(self.settings, pipeline_order=order,
                                        llm_micro_batches=pipeline.encoders == "joint",
                                        encoder_peers=layout.dims.tp * layout.dims.cp)
            if stage == "fit" and pipeline.encoders == "first_stage":
                self.relay_group = layout.relay_group()
        elif stage == "fit" and self.trainer is not None:
            accumulate = self.trainer.accumulate_grad_batches
            if self.settings.micro_batches != accumulate:
                # A step's loss is normalised by the tokens of all its micro-batches: Lightning must step after
                # exactly those.
                raise ValueError(
                    f"OmniDataModule(micro_batches={self.settings.micro_batches}) plans that many micro-batches per "
                    f"step but Trainer(accumulate_grad_batches={accumulate}): set OmniDataModule(micro_batches="
                    f"{accumulate}) or accumulate_grad_batches={self.settings.micro_batches}"
                )
        if self.cost_model is None:
            self.cost_model = self._model_cost_model()
        if layout is not None:  # the strategy's price of moving bytes, so the plan moves payloads only where it pays
            device = self.trainer.strategy.root_device.type if self.trainer is not None else "cpu"
            self.settings = replace(self.settings, link=resolve_link(layout.link_cost, device))
        if stage == "fit" and self.dp_size > 1:
            self._create_reorder_groups()

    def _model_cost_model(self) -> CostModel:
        """The model's cost model: the layout's, the module's own (an OmniModule prices its actual modules: a
        loaded Hugging Face family, adapters), or the reference model's of the module's config (of the tiny one for
        a module without one)."""
        if self.omni_layout is not None and self.omni_layout.cost_model is not None:
            return self.omni_layout.cost_model
        module = self.trainer.lightning_module if self.trainer is not None else None
        if callable(priced := getattr(module, "cost_model", None)):
            return priced()
        config = getattr(module, "config", None)
        return reference_cost_model(config if isinstance(config, ReferenceMLLMConfig) else ReferenceMLLMConfig.tiny())

    def _plan_for_pipeline(self, pp: int, pipeline: PipelineSettings) -> None:
        """Under pipeline parallelism a step is the schedule's micro-batches, planned (and ordered for 1F1B) here."""
        micro_batches = pipeline.microbatches or pp
        budget = self.settings.token_budget
        if budget is not None and budget > pipeline.max_tokens:
            raise ValueError(
                f"OmniDataModule(token_budget={budget}) lets a micro-batch hold more tokens than the pipeline's "
                f"stage buffers (OmniStrategy(pp_max_tokens={pipeline.max_tokens})): lower token_budget or raise "
                "pp_max_tokens"
            )
        if self.settings.micro_batches not in (1, micro_batches):
            raise ValueError(
                f"OmniDataModule(micro_batches={self.settings.micro_batches}) but the pipeline schedule runs "
                f"{micro_batches} micro-batches a step: leave micro_batches at 1 or set it to {micro_batches}"
            )
        self.settings = replace(self.settings, micro_batches=micro_batches, pp=pp)

    def _create_reorder_groups(self) -> None:
        """This rank's reorder group and its index: the layout creates them (TP/CP/PP peers form parallel reorder
        groups and compute the same plans). Under another strategy, the world when every rank reads its own data."""
        # A group larger than the data-parallel ranks is all of them (the default of 8 on a small job).
        size = self.dp_size if self.reorder_group_size is None else min(self.reorder_group_size, self.dp_size)
        if self.omni_layout is not None:
            self.reorder_group, self.reorder_group_index = self.omni_layout.reorder_groups(size)
            return
        if self.dp_size != self.trainer.world_size:
            # Another strategy with model parallelism: which ranks share data is not known here, so plan locally.
            rank_zero_warn(
                f"{type(self.trainer.strategy).__name__} has {self.dp_size} data-parallel ranks in a world of "
                f"{self.trainer.world_size}: reordering across ranks needs OmniStrategy, so each rank reorders only "
                "its own steps (reorder_group_size=1)"
            )
            self.reorder_group_size, size = 1, 1
        self.reorder_group, self.reorder_group_index = new_reorder_groups([list(range(self.trainer.world_size))],
                                                                          self.dp_rank, size)

    def train_samples(self) -> IterableDataset:
        """This data-parallel rank's training samples, one :class:`DecodedSample` at a time (the extension point).

        The default streams the webdataset ``shards``. Override it to reorder any other source: return an
        ``IterableDataset`` that yields this rank's share (``self.dp_rank`` of ``self.dp_size``; with
        ``num_workers > 0``, split further by ``torch.utils.data.get_worker_info()``) as ``DecodedSample`` objects,
        or ``BadSample`` for input to skip under ``on_bad_sample="skip"``, without end (start the next epoch
        yourself). For exact resume it also has ``state_dict()`` and ``load_state_dict(state)`` giving its position;
        ``StatefulDataLoader`` calls them. Planning, payload exchange, packing, pipeline steps and checkpointed
        positions then work as with shards; pass ``shards=None`` when there are none.
        """
        return SampleStream(
            existing_shards(self.shards), dp_rank=self.dp_rank, dp_size=self.dp_size, batch_size=1,
            num_workers=self.num_workers, seed=self.seed, packing=self.packing,
            on_bad_sample=self.on_bad_sample, tokenizer=self.tokenizer, reader=self.reader(),
            read_timeout=self.read_timeout,
        )

    @override
    def train_dataloader(self) -> ResumableLoader:
        loader = StatefulDataLoader(self.train_samples(), batch_size=None, num_workers=self.num_workers,
                                    collate_fn=_unbatched)
        assert self.cost_model is not None, "setup() has not run"
        module = self.trainer.lightning_module if self.trainer is not None else None
        priced = getattr(module, "cost_model", None)
        if self._prices_from_model and self.data_processor is not None and callable(priced):
            # The model took its vocabulary from this processor after setup: its LM head is priced as resolved.
            self.cost_model = priced()
        stream = ReorderedStream(
            loader,
            group=self.reorder_group,
            group_index=self.reorder_group_index,
            cost_model=self.cost_model,
            settings=self.settings,
            seed=self.seed,
            packing=self.packing,
            decode=self.reader().decode,  # media the reader planned from headers, decoded after the plan
            notice=self.failure_notice,
        )
        if self.relay_group is not None:  # encoders on stage 0 only: the other stages take shapes from it
            return ResumableLoader(StageRelay(stream, group=self.relay_group, spec=self.packing))
        return ResumableLoader(stream)
