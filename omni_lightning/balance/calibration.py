"""Calibrating plans from measured steps (pure numpy): the joint pipeline's item plan, and the resharder's prices.

The joint pipeline (:class:`omni_lightning.runtime.joint.JointEncoders`) decides which pipeline rank
encodes each image or clip on a model of the 1F1B step, and that model needs four figures that FLOPs get wrong on
real hardware, whose speed depends on shapes: the cost of an item against the cost of an LLM micro-batch, the
forward's share of each, and each stage's share of the LLM work (the first stage also embeds, the last computes the
loss). :func:`fit_joint_calibration` derives all four from measured steps: every rank's recorded actions
(:class:`omni_lightning.sim.Action` kinds: ``F``, ``B`` for a stage's forward and backward of a micro-batch,
``E``, ``EB`` for its encoder share's forward and backward) and the features of each micro-batch.

The encoder resharder (:class:`omni_lightning.runtime.reshard.Resharder`) weighs an item's compute against the
LLM work under it and against the bytes moving it costs. :func:`fit_module_prices` prices each module in seconds
from the forwards of a job's first steps, so that those comparisons hold on the hardware at hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from omni_lightning.balance.cost import CostModel, ModuleCost, fit_cost_model_to_features

__all__ = [
    "JointCalibration", "fit_joint_calibration", "fit_module_prices", "forward_price_error", "paced_by_slowest",
    "training_passes", "unmeasured_modules",
]


@dataclass(frozen=True)
class JointCalibration:
    """What :meth:`~omni_lightning.runtime.joint.JointEncoders.calibrate` takes, in seconds.

    ``cost_model.llm`` prices a micro-batch's LLM work on all of a stage's ranks, over every stage; its encoders an
    item on one rank. ``forward_share`` and ``encoder_forward_share`` are the forward's share of the LLM's and of
    the encoders' time, ``stage_shares`` each stage's share of the LLM time.
    """

    cost_model: CostModel
    forward_share: float
    encoder_forward_share: float
    stage_shares: tuple[float, ...]

    def to_array(self) -> np.ndarray:
        """The figures as one float64 vector (the cost model's coefficients, the two forward shares, the stage
        shares): what one rank broadcasts, so that every rank plans from the same numbers."""
        shares = [self.forward_share, self.encoder_forward_share, *self.stage_shares]
        return np.concatenate([self.cost_model.coefficients, np.asarray(shares, dtype=np.float64)])

    @classmethod
    def from_array(cls, values: np.ndarray, modules: Sequence[str]) -> JointCalibration:
        """Inverse of :meth:`to_array` for a cost model of ``modules`` (encoders, then ``"llm"``)."""
        values = np.asarray(values, dtype=np.float64)
        n = 2 * len(modules)
        cost = CostModel(**{name: ModuleCost(values[2 * i], values[2 * i + 1]) for i, name in enumerate(modules)})
        return cls(cost, float(values[n]), float(values[n + 1]), tuple(float(x) for x in values[n + 2 :]))


def fit_joint_calibration(features: np.ndarray, actions: Sequence[Sequence[tuple[str, int, float]]], *,
                          flops: CostModel, llm_share: float = 1.0) -> JointCalibration:
    """The figures of :class:`JointCalibration`, fitted to measured pipeline steps.

    Args:
        features: ``[micro-batches, 2 * modules]``, the features (:func:`~omni_lightning.balance.cost.work_features`
            over ``flops``' modules) of every measured micro-batch, the steps' micro-batches one after another.
        actions: for each pipeline rank, in stage order, its ``(kind, micro-batch, seconds)``, the micro-batch
            indexing ``features``. Other kinds (``G``) are ignored.
        flops: the FLOP model, which names the encoders, and prices an encoder the measured steps did not exercise
            (or too few micro-batches to fit its two coefficients): its coefficients are scaled by the LLM's measured
            seconds per FLOP.
        llm_share: the part of a stage's LLM work one measured rank ran (``1 / (tp * cp)``).

    The LLM's coefficients are fitted (:func:`~omni_lightning.balance.cost.fit_cost_model_to_features`) to each
    micro-batch's forward and backward time summed over the stages, the encoders' to its encoder forward and
    backward time summed over the ranks; a module whose fit zeroes one of its two coefficients (a few noisy steps
    rarely separate them) is fitted in ``flops``' shape instead. Raises ``ValueError`` on malformed input or where
    the steps cannot determine the LLM's coefficients (fewer than two micro-batches, no LLM time).
    """
    table = np.asarray(features, dtype=np.float64)
    encoders = flops.encoder_names
    width = 2 * len(flops.modules)
    if table.ndim != 2 or table.shape[1] != width:
        raise ValueError(f"features of shape {list(table.shape)} must be [micro-batches, {width}]")
    if not 0.0 < llm_share <= 1.0:
        raise ValueError(f"llm_share={llm_share} must be in (0, 1]: the part of a stage's LLM work one rank runs")
    n = table.shape[0]
    seconds = {kind: np.zeros(n) for kind in ("F", "B", "E", "EB")}
    stage_seconds = np.zeros(len(actions))
    for stage, rank in enumerate(actions):
        for kind, micro_batch, duration in rank:
            if kind not in seconds:
                continue
            if not 0 <= micro_batch < n:
                raise ValueError(f"rank {stage} recorded {kind} of micro-batch {micro_batch}, but features describe "
                                 f"{n} micro-batches")
            seconds[kind][micro_batch] += duration
            if kind in ("F", "B"):
                stage_seconds[stage] += duration
    llm_seconds = (seconds["F"] + seconds["B"]) / llm_share
    if not stage_seconds.all():
        raise ValueError(f"every stage must have recorded LLM time to calibrate from; seconds per stage: "
                         f"{stage_seconds.tolist()}")
    fitted = fit_cost_model_to_features(table, llm_seconds.tolist(), modules=["llm"], encoders=encoders, prior=flops)
    measured = [name for i, name in enumerate(encoders) if table[:, 2 * i : 2 * i + 2].any()]
    encoder_seconds = seconds["E"] + seconds["EB"]
    if measured and encoder_seconds.any() and n >= 2 * len(measured):
        encoder_fit = fit_cost_model_to_features(table, encoder_seconds.tolist(), modules=measured, encoders=encoders,
                                                 prior=flops)
    else:
        measured, encoder_fit = [], fitted
    llm = 2 * len(encoders)
    llm_flops = float(flops.llm(table[:, llm].sum(), table[:, llm + 1].sum()))
    per_flop = float(llm_seconds.sum()) / llm_flops if llm_flops > 0 else 0.0
    model = fitted.replace(**{name: getattr(encoder_fit, name) if name in measured
                              else getattr(flops, name).scaled(per_flop) for name in encoders})
    return JointCalibration(model, _share(seconds["F"], seconds["B"]), _share(seconds["E"], seconds["EB"]),
                            tuple((stage_seconds / stage_seconds.sum()).tolist()))


def _share(forward: np.ndarray, backward: np.ndarray) -> float:
    """The forward's share of forward plus backward time; FLOPs' 1/3 where a pass went unrecorded."""
    total = float(forward.sum() + backward.sum())
    share = float(forward.sum()) / total if total > 0 else 0.0
    return share if 0.0 < share < 1.0 else 1 / 3


def training_passes(parameters: Sequence[tuple[int, bool]], *, inputs_need_gradient: bool) -> float:
    """A module's training time over its forward's, from what of it trains: 1 for the forward, plus the share of it
    the gradient runs back through, plus the share whose weights take gradients (3 where everything trains, as
    training FLOPs count it; 1 for a frozen encoder, whose inputs are data).

    Args:
        parameters: ``(size, trains)`` of each of the module's parameters in the order they run. Sizes stand in for
            the FLOPs of the layers they belong to.
        inputs_need_gradient: something before the module trains, so the gradient runs back through all of it;
            otherwise it runs back from the output to the first parameter that trains.
    """
    sizes = np.array([size for size, _ in parameters], dtype=np.float64)
    trains = np.array([bool(t) for _, t in parameters], dtype=bool)
    if (sizes < 0).any():
        raise ValueError("parameter sizes must be non-negative")
    total = sizes.sum()
    if total == 0:
        return 2.0 if inputs_need_gradient else 1.0
    weights = sizes[trains].sum() / total
    if inputs_need_gradient:
        through = 1.0
    else:
        first = int(np.argmax(trains)) if trains.any() else sizes.size
        through = sizes[first:].sum() / total
    return 1.0 + float(through) + float(weights)


def fit_module_prices(records: Mapping[str, np.ndarray], *, prices: CostModel,
                      train_per_forward: float | Mapping[str, float] = 3.0) -> CostModel:
    """``prices``' modules priced in seconds of training (forward and backward) from timed forwards.

    Args:
        records: by module name (``prices``' encoders and ``"llm"``), rows ``(work, seconds)``: one rank's forward
            of that module over one micro-batch, and the work it did in ``prices``' units (for the LLM, the rank's
            share of the micro-batch's). Rows without work (a rank that ran a dummy item) are left out.
        prices: what the plan priced by so far (FLOPs, or a user's cost model): each module keeps its shape, the
            ratio of its quadratic to its linear coefficient, and is scaled by its measured seconds per unit.
        train_per_forward: a training pass's time over its forward's (FLOPs': 3), for every module or by module
            name (:func:`training_passes`: a frozen encoder runs its forward alone).

    A module's seconds per unit is the ratio of its records' total seconds to their total work. A slope past a
    per-call constant (launches, gathering the module's weights, which every rank pays alike) would be closer to
    what sways a plan, but a few noisy records over similar work cannot separate the two (on this project's CPU runs,
    the 8 records of 2 batches on 4 ranks gave a vision slope of about half the ratio), and the ratio keeps every
    module's constant in alike. A module the records do not exercise (or that took no measurable time) scales by the
    LLM's rate, a placeholder that keeps the plan's units one (:func:`unmeasured_modules` names those modules, whose
    prices a plan should not act on). Raises ``ValueError`` where the LLM has no records with work, or on malformed
    input.
    """
    rates = _forward_rates(records, prices.modules)
    if not isinstance(train_per_forward, Mapping):
        train_per_forward = dict.fromkeys(prices.modules, train_per_forward)
    if missing := sorted(set(prices.modules) - set(train_per_forward)):
        raise ValueError(f"train_per_forward has no factor for module(s) {missing}")
    for name, factor in train_per_forward.items():
        if not factor > 0:
            raise ValueError(f"train_per_forward={factor} ({name}) must be positive")
    return CostModel(**{name: prices.module(name).scaled(train_per_forward[name] * rates.get(name, rates["llm"]))
                        for name in prices.modules})


def forward_price_error(records: Mapping[str, np.ndarray], modules: Sequence[str]) -> float:
    """How far the prices :func:`fit_module_prices` fits to ``records`` miss the timed forwards themselves: the sum
    over every record with work of ``|seconds - rate * work|``, each module at its fitted rate, over the records'
    seconds. 0 where the prices explain every forward; a plan whose predicted gain is smaller than this rests on
    the prices' error rather than on the work (e.g. per-call constants, which the ratio spreads over the work and
    no move removes). Raises ``ValueError`` as :func:`fit_module_prices` does."""
    rates = _forward_rates(records, modules)
    missed = seconds = 0.0
    for name in modules:
        rows = _records_with_work(records, name)
        missed += float(np.abs(rows[:, 1] - rates.get(name, rates["llm"]) * rows[:, 0]).sum())
        seconds += float(rows[:, 1].sum())
    return missed / seconds


def unmeasured_modules(records: Mapping[str, np.ndarray], modules: Sequence[str]) -> list[str]:
    """The modules whose records carry no timed work (:func:`fit_module_prices` prices them at the LLM's rate, a
    guess that can miss a module's own rate many times over: a tiny LLM's many small matmuls against an encoder's
    few large ones). Raises ``ValueError`` as :func:`fit_module_prices` does."""
    rates = _forward_rates(records, modules)
    return [name for name in modules if name not in rates]


def _forward_rates(records: Mapping[str, np.ndarray], modules: Sequence[str]) -> dict[str, float]:
    """Each module's forward seconds per unit of work over its records with work (modules without any, or whose
    records took no time, are left out); see :func:`fit_module_prices`."""
    if unknown := sorted(set(records) - set(modules)):
        raise ValueError(f"records of module(s) {unknown}, but the prices have {list(modules)}")
    rates = {}
    for name in modules:
        rows = _records_with_work(records, name)
        if rows.size and (rate := float(rows[:, 1].sum() / rows[:, 0].sum())) > 0:
            rates[name] = rate
    if rates.get("llm", 0.0) <= 0:
        raise ValueError("the LLM's timed forwards carry no work or took no time: nothing to price the modules by")
    return rates


def _records_with_work(records: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    """``name``'s ``(work, seconds)`` rows that carry work, as float64 ``[n, 2]``; raises ``ValueError`` on a
    non-finite or negative entry."""
    rows = np.asarray(records.get(name, np.zeros((0, 2))), dtype=np.float64).reshape(-1, 2)
    if not np.isfinite(rows).all() or (rows < 0).any():
        raise ValueError(f"{name}: work and seconds must be finite and non-negative")
    return rows[rows[:, 0] > 0]


def paced_by_slowest(per_rank: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Each rank's ``(work, seconds)`` rows (:func:`fit_module_prices`) with each row's work replaced by the
    largest work any rank did in the same row, for wall clocks: where ranks wait for each other inside a module
    (FSDP gathers its weights block by block), every rank's forward takes about as long as the slowest's. A module
    whose ranks recorded different numbers of rows keeps its own work."""
    out = [dict(rank) for rank in per_rank]
    for name in {name for rank in per_rank for name in rank}:
        tables = [np.asarray(rank.get(name, np.zeros((0, 2))), dtype=np.float64).reshape(-1, 2) for rank in per_rank]
        if len({table.shape[0] for table in tables}) != 1:
            continue
        slowest = np.max([table[:, 0] for table in tables], axis=0)
        for rank, table in zip(out, tables, strict=True):
            rank[name] = np.column_stack([slowest, table[:, 1]])
    return out
