"""How a job places and pipelines its work: the settings beside the parallel degrees, validated here once.

:class:`PipelineSettings` says how a pipeline runs, :class:`PlacementSettings` where the encoders run. Each checks
its own fields when built and, with the degrees, :meth:`PipelineSettings.resolved` and
:meth:`PlacementSettings.check` check what depends on them; the strategy builds both from its arguments, the runtime,
the data module and the simulator read them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

__all__ = ["MULTI_STAGE_SCHEDULES", "PIPELINE_SCHEDULE_NAMES", "PipelineSettings", "PlacementSettings"]

PIPELINE_SCHEDULE_NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")
# These run ``virtual_stages`` stages per rank and need micro-batches to be a multiple of pp.
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")
_ENCODER_PLACES = ("joint", "first_stage", "pool")

EncoderPlace = Literal["joint", "first_stage", "pool"]


@dataclass(frozen=True)
class PipelineSettings:
    """How a pipeline runs.

    Args:
        schedule: one of :data:`PIPELINE_SCHEDULE_NAMES`.
        microbatches: micro-batches per step (``None``: ``pp``).
        virtual_stages: stages per rank (``> 1`` only for the interleaved schedules).
        max_tokens: rows of the stage-to-stage buffers: the most tokens a micro-batch may hold.
        encoders: where encoders run: ``"joint"`` (inserted into the schedule on every stage's rank; 1F1B and GPipe,
            see :mod:`omni_lightning.runtime.joint`), ``"first_stage"`` (inside stage 0, torchtitan's way) or
            ``"pool"`` (another pool of ranks encodes and stage 0 receives the outputs: the disaggregated placement,
            see :mod:`omni_lightning.runtime.pool`).
        calibration_steps: with the joint pipeline under 1F1B, how many training steps (after the first) are timed
            to calibrate its item plan (:class:`~omni_lightning.runtime.calibration.JointCalibrator`); 0 keeps the
            FLOP model.

    Raises ``ValueError`` naming the argument (``pp_schedule``, ... as ``OmniStrategy`` calls them) and the fix.
    """

    schedule: str = "1F1B"
    microbatches: int | None = None
    virtual_stages: int = 1
    max_tokens: int = 4096
    encoders: EncoderPlace = "joint"
    calibration_steps: int = 0

    def __post_init__(self) -> None:
        if self.schedule not in PIPELINE_SCHEDULE_NAMES:
            raise ValueError(f"pp_schedule={self.schedule!r} must be one of {sorted(PIPELINE_SCHEDULE_NAMES)}")
        for name, value in (("pp_virtual_stages", self.virtual_stages), ("pp_max_tokens", self.max_tokens),
                            ("pp_microbatches", 1 if self.microbatches is None else self.microbatches)):
            if value < 1:
                raise ValueError(f"{name}={value} must be at least 1")
        if self.encoders not in _ENCODER_PLACES:
            raise ValueError(f"pp_encoders={self.encoders!r} must be 'joint' or 'first_stage'")
        steps = self.calibration_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"pp_calibration_steps={steps!r} must be a non-negative integer (0: no calibration)")
        if self.schedule not in MULTI_STAGE_SCHEDULES and self.virtual_stages != 1:
            raise ValueError(f"pp_schedule={self.schedule!r} runs one stage per rank but pp_virtual_stages="
                             f"{self.virtual_stages}: use pp_virtual_stages=1 or pp_schedule='Interleaved1F1B'")
        if self.encoders == "joint" and self.schedule in MULTI_STAGE_SCHEDULES:
            # The interleaved schedules keep the encoders inside stage 0.
            object.__setattr__(self, "encoders", "first_stage")

    @property
    def one_stage_per_rank(self) -> bool:
        return self.schedule not in MULTI_STAGE_SCHEDULES

    def resolved(self, pp: int) -> PipelineSettings:
        """These settings for ``pp`` stages: the micro-batch count filled in, checked against it."""
        microbatches = self.microbatches or pp
        if not self.one_stage_per_rank and microbatches % pp:
            raise ValueError(f"pp_schedule={self.schedule!r} needs pp_microbatches ({microbatches}) to be a multiple "
                             f"of pp={pp}: use pp_microbatches={pp * -(-microbatches // pp)}")
        return replace(self, microbatches=microbatches)


@dataclass(frozen=True)
class PlacementSettings:
    """Where the encoders run.

    Args:
        placement: ``"multiplexed"`` (on every rank, beside the LLM: MegaScale-Omni) or ``"disaggregated"`` (a pool of
            ranks of their own: DistTrain).
        encoder_world_size: ranks of the encoder pool (disaggregated); ``None`` sizes it with the pool solver for
            ``pool_workload``.
        pool_workload: a workload spec file or preset name the pool solver sizes the encoder pool for.
    """

    placement: Literal["multiplexed", "disaggregated"] = "multiplexed"
    encoder_world_size: int | None = None
    pool_workload: str | None = None

    def __post_init__(self) -> None:
        if self.placement not in ("multiplexed", "disaggregated"):
            raise ValueError(f"placement={self.placement!r} must be 'multiplexed' or 'disaggregated'")
        if not self.disaggregated:
            if self.encoder_world_size is not None or self.pool_workload is not None:
                raise ValueError("encoder_world_size and pool_workload size the encoder pool of placement="
                                 "'disaggregated'; the multiplexed placement runs the encoders on every rank")
            return
        if self.encoder_world_size is None and self.pool_workload is None:
            raise ValueError("placement='disaggregated' needs encoder_world_size=N, or pool_workload=FILE (a workload "
                             "spec) for the pool solver to size the encoder pool")
        size = self.encoder_world_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"encoder_world_size={size!r} must be a positive integer")

    @property
    def disaggregated(self) -> bool:
        return self.placement == "disaggregated"

    def check(self, *, pp: int, enc_sp: int, pipeline: PipelineSettings) -> None:
        """Raise ``ValueError`` if the pipeline or encoder SP degree cannot run with this placement."""
        if not self.disaggregated:
            if pipeline.encoders == "pool":
                raise ValueError("pp_encoders='pool' is the disaggregated placement's: use 'joint' or 'first_stage'")
            return
        if pp > 1 and not pipeline.one_stage_per_rank:
            raise ValueError(f"placement='disaggregated' streams encoder outputs into a 1F1B or GPipe pipeline, not "
                             f"pp_schedule={pipeline.schedule!r}: use one of those or placement='multiplexed'")
        if enc_sp & (enc_sp - 1):
            raise ValueError(f"enc_sp={enc_sp} must be a power of two (an item is split over 2, 4, ... aligned ranks)")
