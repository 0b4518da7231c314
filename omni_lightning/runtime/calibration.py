"""Calibrating plans from a job's first steps, during training: the joint pipeline's item plan, the resharder's prices.

The joint pipeline places large encoder items on a model of the 1F1B step
(:func:`~omni_lightning.balance.pipeline_order.assign_encoder_items`), priced in FLOPs until it is told better. FLOPs
misjudge encoders against the LLM wherever speed depends on shapes (attention over a large patch grid, small
matmuls), so :class:`JointCalibrator` times the first steps of a job, fits the figures the plan needs
(:func:`~omni_lightning.balance.calibration.fit_joint_calibration`) and hands them to
:meth:`~omni_lightning.runtime.joint.JointEncoders.calibrate`: every pipeline rank gathers the same
records, so every rank computes the same figures and the same plans.

:class:`ResharderCalibrator` does the same for the encoder resharder of a plain step, whose plan weighs items'
compute against the LLM work under them and against the bytes moving them costs: it times the encoders' and the
LLM's forwards of the first steps and prices every module in measured seconds
(:func:`~omni_lightning.balance.calibration.fit_module_prices`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from omni_lightning.balance.calibration import (
    JointCalibration,
    fit_joint_calibration,
    fit_module_prices,
    forward_price_error,
    paced_by_slowest,
    unmeasured_modules,
)
from omni_lightning.balance.cost import CostModel, ModuleCost, work_features
from omni_lightning.batch import PackedBatch, PackingSpec
from omni_lightning.parallel.attention import host_bounds
from omni_lightning.parallel.timing import ActionLog
from omni_lightning.runtime.items import item_layout

if TYPE_CHECKING:
    from omni_lightning.runtime.joint import JointEncoders
    from omni_lightning.runtime.reshard import Resharder

__all__ = ["JointCalibrator", "ResharderCalibrator", "micro_batch_features"]

logger = logging.getLogger(__name__)

_ENCODER_KINDS = ("E", "EB")


def micro_batch_features(batch: PackedBatch, spec: PackingSpec) -> np.ndarray:
    """The cost features (:func:`~omni_lightning.balance.cost.work_features`) of a packed micro-batch: every
    encoder's items, and the LLM's sequences."""
    items = {fmt.name: item_layout(batch, spec, fmt.name)[0].tolist() for fmt in spec.encoders}
    return work_features(spec.encoder_names, items, np.diff(host_bounds(batch["cu_seqlens"])).tolist())


class JointCalibrator:
    """Times training steps ``skip`` to ``skip + steps - 1`` of the joint pipeline on this rank, then calibrates
    its item plan from every rank's records (``all_gather_object`` over the stage's tensor-parallel peers, each of
    which encodes a part of the stage's share, then over ``group``, the pipeline's ranks in stage order, then over
    the data-parallel peers, between which the resharder moves items); global rank 0 fits the figures and
    broadcasts them, so that every rank plans from identical numbers. The first ``skip`` steps are left out: they
    include one-off work (allocations, caches).

    ``llm_share``: the part of a stage's LLM work this rank runs (``1 / (tp * cp)``).
    """

    def __init__(self, joint: JointEncoders, group: dist.ProcessGroup, *, steps: int, clock: Callable[[], float],
                 flops: CostModel, llm_share: float = 1.0, skip: int = 1,
                 device: torch.device | None = None) -> None:
        if steps < 1:
            raise ValueError(f"calibration steps={steps} must be at least 1 (0 turns calibration off)")
        self.joint, self.group, self.steps, self.skip = joint, group, steps, skip
        self.device = device or torch.device("cpu")
        self.flops, self.llm_share, self.clock = flops, llm_share, clock
        self.seen = 0
        self.calibrated = False
        self.log: ActionLog | None = None  # while a measured step runs
        self._features: list[np.ndarray] = []
        self._actions: list[tuple[str, int, float]] = []

    def begin_step(self) -> ActionLog | None:
        """Before a training step: the log to time it with, if it is one of the measured ones."""
        if not self.calibrated and self.seen >= self.skip:
            self.log = ActionLog(self.clock)
        return self.log

    def end_step(self, micro_batches: list[dict[str, Any]]) -> None:
        """After a training step: keep its records and, after the last measured step, calibrate."""
        self.seen += 1
        if self.log is None:
            return
        offset = sum(f.shape[0] for f in self._features)
        spec = self.joint.model.packing
        self._features.append(np.stack([micro_batch_features(b, spec) for b in micro_batches]))
        self._actions += [(kind, offset + m, seconds) for kind, m, seconds in self.log.actions]
        self.log = None
        if self.seen == self.skip + self.steps:
            self._calibrate()

    def _calibrate(self) -> None:
        # Every rank must plan as its pipeline, its stage's tensor-parallel peers and (since the resharder
        # reshards items between them) its data-parallel peers do, so every rank fits the same records: each stage's
        # LLM passes as its first TP peer timed them and all its peers' encoder work, summed over the replicas (with
        # resharding a rank's encoder time is a share of all replicas' items of that micro-batch index; costs are
        # linear in the features, so sums fit the same coefficients).
        peers: list[Any] = [self._actions]
        # The context-parallel peers' encoder work comes with the data-parallel replicas' below.
        tp_group = self.joint.peers.tp_group if self.joint.peers is not None else None
        if tp_group is not None:
            peers = [None] * dist.get_world_size(tp_group)
            dist.all_gather_object(peers, self._actions, group=tp_group)
        stages: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(stages, peers, group=self.group)
        replica = [[a for a in stage[0] if a[0] not in _ENCODER_KINDS]
                   + [a for peer in stage for a in peer if a[0] in _ENCODER_KINDS] for stage in stages]
        replicas: list[Any] = [(np.concatenate(self._features), replica)]
        if self.joint.dp_group is not None:
            mine = replicas[0]
            replicas = [None] * dist.get_world_size(self.joint.dp_group)
            dist.all_gather_object(replicas, mine, group=self.joint.dp_group)
        features = np.sum([f for f, _ in replicas], axis=0)
        everyone = [[a for _, stage_actions in replicas for a in stage_actions[s]] for s in range(len(stages))]
        self.calibrated, self._features, self._actions = True, [], []
        figures = self._fitted_once(features, everyone)
        if figures is None:
            return
        self.joint.calibrate(figures.cost_model, forward_share=figures.forward_share,
                             encoder_forward_share=figures.encoder_forward_share, stage_shares=figures.stage_shares)
        if dist.get_rank() == 0:
            logger.info("joint pipeline calibrated on %d micro-batches: forward shares %.2f (LLM), %.2f (encoders); "
                        "stage shares of the LLM time %s", features.shape[0], figures.forward_share,
                        figures.encoder_forward_share, [round(share, 3) for share in figures.stage_shares])

    def _fitted_once(self, features: np.ndarray, actions: list[list[tuple[str, int, float]]]
                     ) -> JointCalibration | None:
        """The figures fitted once, on rank 0 (``None``: the records could not calibrate the plan)."""
        modules = self.flops.modules
        values = _fitted_on_rank_zero(
            lambda: fit_joint_calibration(features, actions, flops=self.flops, llm_share=self.llm_share).to_array(),
            2 * len(modules) + 2 + len(actions), self.device,
            "the joint pipeline keeps planning items in FLOPs: its timed steps could not calibrate it")
        return None if values is None else JointCalibration.from_array(values, modules)


class ResharderCalibrator:
    """Prices the encoder resharder's plan in measured seconds, during training.

    Over training batches ``skip`` to ``skip + steps - 1`` this rank times each encoder's forward over what the plan
    gave it to encode (its own items, or those moved to it and its shares of split ones, the exchanges left out) and
    the LLM's forward over its micro-batch (``clock``: thread CPU time on a CPU, wall time after a synchronize on an
    accelerator; see :func:`~omni_lightning.parallel.timing.action_clock`), beside the work each did in the plan's
    prices. After the last of them every rank's records are gathered over the world, global rank 0 fits the prices
    (:func:`~omni_lightning.balance.calibration.fit_module_prices`; on a wall clock each forward is matched with the
    largest work of the same forward on any rank, :func:`~omni_lightning.balance.calibration.paced_by_slowest`) and
    broadcasts them with how far they miss the timed forwards
    (:func:`~omni_lightning.balance.calibration.forward_price_error`), and every rank's resharder plans from the same
    figures, moving items only for a predicted gain that error cannot account for. Where the records cannot price the
    modules the resharder keeps its prices (a warning says so). Until then the plan runs on the prices it had, so
    the first batches split what they would have split. The first ``skip`` batches are left out: they include
    one-off work (allocations, caches).

    An encoder none of whose items those batches held (a workload's rare huge images) is priced at the LLM's rate,
    which can miss its own many times over, so the resharder keeps its items home
    (:meth:`~omni_lightning.runtime.reshard.Resharder.calibrate`) while its forwards, and those of any module still
    unpriced, go on being timed; the prices are fitted again after twice as many measured batches (``2 * steps``,
    then ``4 * steps``, ...) where some rank timed such a module since the last fit, each time from every record
    so far, until every module is measured: a number of batches every rank counts alike, and a number of
    collectives that grows with the logarithm of the batches.

    ``training_passes``: each module's training time over its forward's by name, read when the prices are fitted
    (:meth:`~omni_lightning.models.mllm.ReferenceMLLM.training_passes`: a frozen encoder runs its forward alone);
    without it every module trains in full, three times its forward.
    """

    def __init__(self, resharder: Resharder, *, steps: int, clock: Callable[[], float], skip: int = 1,
                 device: torch.device | None = None,
                 training_passes: Callable[[], Mapping[str, float]] | None = None) -> None:
        if steps < 1:
            raise ValueError(f"calibration steps={steps} must be at least 1 (0 turns calibration off)")
        if resharder.llm is None:
            raise ValueError("the resharder calibrates against the LLM's measured time: give it the LLM's cost")
        self.resharder, self.steps, self.skip, self.clock = resharder, steps, skip, clock
        self.training_passes = training_passes
        self.device = device or torch.device("cpu")
        self.prices = resharder.prices  # what the plan priced by before, whose shapes the fit keeps
        self.seen = 0
        self.calibrated = False
        self._records: dict[str, list[tuple[float, float]]] = {name: [] for name in self.prices.modules}
        self._fit_at = skip + steps  # batches seen when the prices are next fitted
        self._pending: frozenset[str] | None = None  # modules still timed after a fit left them unmeasured
        self._fitted_records = dict.fromkeys(self.prices.modules, 0)  # each module's records the last fit read
        # Each module's current prices over ``self.prices``: the records keep the units of the prices before.
        self._scale = dict.fromkeys(self.prices.modules, 1.0)

    @property
    def measuring(self) -> bool:
        """Whether the current training batch is timed (for some module)."""
        return not self.calibrated and self.seen >= self.skip

    def measures(self, module: str) -> bool:
        """Whether ``module``'s forward of the current training batch is timed."""
        return self.measuring and (self._pending is None or module in self._pending)

    def llm_work(self, tokens: int, pairs: int) -> float:
        """This rank's share of the LLM work of a micro-batch of ``tokens`` and causal ``pairs``, in the plan's
        current prices (what :meth:`timed` takes)."""
        return float(self.resharder.llm_price(tokens, pairs))

    def timed(self, module: str, work: float) -> AbstractContextManager[None]:
        """Time the block as ``module``'s forward over ``work`` (in the plan's current prices) where this batch
        measures it and there is work (a rank without items runs a dummy, which prices nothing: on an accelerator,
        timing it would only cost synchronizations)."""
        timing = work > 0 and self.measures(module)
        return self._timing(module, work / self._scale[module]) if timing else nullcontext()

    @contextmanager
    def _timing(self, module: str, work: float) -> Iterator[None]:
        started = self.clock()
        yield
        self._records[module].append((float(work), self.clock() - started))

    def end_batch(self) -> None:
        """After a training batch; after the last measured one, calibrate (a collective over the world)."""
        self.seen += 1
        if not self.calibrated and self.seen == self._fit_at:
            self._fit_at = self.skip + 2 * (self.seen - self.skip)
            if self._pending is None or self._timed_pending_since_last_fit():
                self._calibrate()

    def _timed_pending_since_last_fit(self) -> bool:
        """Whether any rank timed a module the last fit left unmeasured since that fit (a collective over the
        world: one integer, where gathering every record and fitting again would price nothing new)."""
        timed = sum(len(self._records[name]) - self._fitted_records[name] for name in self._pending or ())
        count = torch.tensor([timed], dtype=torch.int64, device=self.device)
        dist.all_reduce(count)
        return bool(count.item())

    def _calibrate(self) -> None:
        mine = {name: np.asarray(rows, dtype=np.float64).reshape(-1, 2) for name, rows in self._records.items()}
        self._fitted_records = {name: len(rows) for name, rows in self._records.items()}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if self.device.type != "cpu":  # a wall clock: ranks wait for each other inside a module
            everyone = paced_by_slowest(everyone)
        modules = self.prices.modules
        records = {name: np.concatenate([rank[name] for rank in everyone]) for name in modules}
        # Read now, not when the job was built: what trains is what a step's backward runs.
        passes = dict(self.training_passes()) if self.training_passes is not None else 3.0

        def fit() -> np.ndarray:
            fitted = fit_module_prices(records, prices=self.prices, train_per_forward=passes)
            unmeasured = unmeasured_modules(records, modules)
            return np.concatenate([fitted.coefficients, [forward_price_error(records, modules)],
                                   [float(name in unmeasured) for name in modules]])

        values = _fitted_on_rank_zero(
            fit, 3 * len(modules) + 1, self.device,
            "the encoder resharder keeps its prices for now: its timed forwards could not price them")
        if values is None:
            self._pending = frozenset(modules)
            return
        n = 2 * len(modules)
        prices = CostModel(**{name: ModuleCost(values[2 * i], values[2 * i + 1]) for i, name in enumerate(modules)})
        unmeasured = [name for name, flag in zip(modules, values[n + 1 :], strict=True) if flag]
        self.resharder.calibrate(prices, price_error=float(values[n]), unmeasured=unmeasured)
        self._scale = {name: _rate(prices.module(name), self.prices.module(name)) for name in modules}
        self._pending = frozenset(unmeasured)
        if not unmeasured:
            self.calibrated, self._records = True, {}
        if dist.get_rank() == 0:
            rates = ", ".join(f"{name} {_rate(prices.module(name), self.prices.module(name)):.3g}" for name in modules)
            factors = ", ".join(f"{name} {passes if isinstance(passes, float) else passes[name]:.3g}"
                                for name in modules)
            logger.info("encoder resharding priced from %d timed forwards, in seconds per unit of the prices before "
                        "(FLOPs unless a cost model was given): %s; training over forward: %s; the prices miss the "
                        "forwards by %.1f%%, so a plan must gain at least %.1f%%%s",
                        sum(len(r) for r in records.values()), rates, factors, 100 * values[n],
                        100 * self.resharder.min_gain,
                        f"; no timed work of {', '.join(unmeasured)} yet: their items stay home, and the prices are "
                        f"fitted again after batch {self._fit_at - 1}" if unmeasured else "")


def _rate(calibrated: ModuleCost, before: ModuleCost) -> float:
    return calibrated.linear / before.linear if before.linear else calibrated.quadratic / max(before.quadratic, 1e-300)


def _fitted_on_rank_zero(fit: Callable[[], np.ndarray], length: int, device: torch.device, failure: str
                         ) -> np.ndarray | None:
    """Global rank 0's ``fit()`` (``length`` float64 values) on every rank, so that every rank plans from identical
    numbers whatever its floating-point arithmetic would have made of the same records; ``None`` on every rank
    where the fit raised ``ValueError`` (logged as ``failure``)."""
    vector = np.full(length, np.nan)
    if dist.get_rank() == 0:
        try:
            vector = np.asarray(fit(), dtype=np.float64)
        except ValueError as error:
            logger.warning("%s (%s)", failure, error)
    shared = torch.as_tensor(vector, dtype=torch.float64).to(device)
    dist.broadcast(shared, src=0)
    values = shared.cpu().numpy()
    return None if np.isnan(values).any() else values
