"""Calibrating a :class:`~omni_lightning.balance.cost.CostModel` in seconds from measured work, by non-negative
least squares on the work's features (pure numpy).

A measurement is some work (a rank's samples of a step, or a packed micro-batch) and its measured time; the model
predicts a step as the sum of its samples' costs, and costs are linear in the features, so the fit solves
``min ||features @ coefficients - seconds||`` over non-negative coefficients.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Sequence

import numpy as np

from omni_lightning.balance.cost import DEFAULT_ENCODERS, CostModel, ModuleCost, feature_matrix, feature_names
from omni_lightning.balance.workload import SampleMeta
from omni_lightning.batch import PackingSpec
from omni_lightning.modalities import DEFAULT_PACKING

__all__ = ["fit_cost_model", "fit_cost_model_to_features"]

logger = logging.getLogger(__name__)


def _least_squares_on(a: np.ndarray, b: np.ndarray, passive: np.ndarray) -> np.ndarray:
    """Unconstrained least squares over the variables in ``passive``; the others stay zero."""
    s = np.zeros(a.shape[1])
    if passive.any():
        s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
    return s


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Lawson-Hanson active-set solution of ``min ||a x - b||`` subject to ``x >= 0``.

    The passive set P holds the variables free to be positive. Outer loop: move into P the variable whose
    gradient most wants it positive; inner loop: solve least squares on P and, while that drives some variable of
    P to <= 0, step from x towards that solution as far as x stays feasible and drop the variable that hits zero.
    Stops when no variable outside P would decrease the residual (the KKT conditions hold).
    """
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    # Variables that entered P but whose least-squares value came out <= 0: in exact arithmetic impossible, with
    # round-off it happens at the tolerance edge; they sit out until x next changes, so the loop cannot cycle.
    stuck = np.zeros(n, dtype=bool)
    # Gradient threshold relative to the problem's size (as in Lawson & Hanson and scipy): below it is noise.
    tol = 10.0 * max(m, n) * np.finfo(float).eps * np.abs(a).sum(axis=0).max() * np.abs(b).max()
    for _ in range(10 * n + 10):  # Lawson-Hanson needs a few passes per variable; the cap guards round-off
        w = a.T @ (b - a @ x)
        candidates = np.where(passive | stuck, -np.inf, w)
        j = int(np.argmax(candidates))
        if not candidates[j] > tol:
            break
        passive[j] = True
        s = _least_squares_on(a, b, passive)
        if s[j] <= 0:
            passive[j] = False
            stuck[j] = True
            continue
        while (s[passive] <= 0).any():
            blocking = np.flatnonzero(passive & (s <= 0))
            # x > 0 on P except the entering variable, whose s is > 0, so every denominator here is > 0.
            ratios = x[blocking] / (x[blocking] - s[blocking])
            alpha = ratios.min()
            x = x + alpha * (s - x)
            passive[blocking[np.argmin(ratios)]] = False  # exactly zero in theory; drop it whatever round-off says
            passive &= x > 0
            x[~passive] = 0.0
            s = _least_squares_on(a, b, passive)
        x = s
        stuck[:] = False
    return x


def fit_cost_model(
    measurements: Sequence[tuple[Sequence[SampleMeta], float]],
    *,
    modules: Sequence[str] | None = None,
    encoders: Sequence[str] = DEFAULT_ENCODERS,
    spec: PackingSpec = DEFAULT_PACKING,
) -> CostModel:
    """Calibrate a :class:`CostModel` (in seconds) with ``encoders`` and the LLM from measured step times.

    Each measurement is ``(samples, seconds)``: the samples one rank processed in one step and that step's
    measured compute time. The fit solves a non-negative least-squares problem on the per-step sums of the samples'
    features (:func:`fit_cost_model_to_features`). Only the coefficients of ``modules`` (default: every module) are
    fitted (the times must then cover exactly those modules' work); the others are zero.

    Raises ``ValueError`` for an unknown or repeated module, a malformed measurement, an empty sample list, a
    negative or non-finite time, fewer measurements than fitted coefficients, all-zero times, or a fitted module
    that no measured sample uses (its coefficients would be arbitrary: fit without it).
    If the features do not determine every coefficient (e.g. every image has the same size, so patches and
    pairs are proportional), the fit still predicts the measured shapes but a warning is logged.
    """
    names = (*encoders, "llm")
    modules = _checked_modules(names if modules is None else modules, names)
    _check_enough(len(measurements), modules)
    sums = np.empty((len(measurements), 2 * len(names)))
    times = np.empty(len(measurements))
    for i, measurement in enumerate(measurements):
        if not (isinstance(measurement, (tuple, list)) and len(measurement) == 2):
            raise ValueError(f"measurement {i} must be a (samples, seconds) pair, got {measurement!r}")
        samples, seconds = measurement
        if len(samples) == 0:
            raise ValueError(f"measurement {i} has no samples: a step's time needs the samples it processed")
        sums[i] = feature_matrix(samples, encoders, spec).sum(axis=0)
        times[i] = _checked_seconds(seconds, i)
    return _fit(sums, times, modules, names)


def fit_cost_model_to_features(features: np.ndarray, seconds: Sequence[float], *,
                               modules: Sequence[str] | None = None,
                               encoders: Sequence[str] = DEFAULT_ENCODERS) -> CostModel:
    """Calibrate a :class:`CostModel` (in seconds) from measured work described by its features.

    ``features[i]`` holds the features (:func:`~omni_lightning.balance.cost.feature_names` of ``encoders``) of what
    measurement ``i`` timed, e.g. a packed micro-batch's, which are the sums of its samples' features, and
    ``seconds[i]`` its measured time. Otherwise as :func:`fit_cost_model`, which this solves for.
    """
    names = (*encoders, "llm")
    modules = _checked_modules(names if modules is None else modules, names)
    sums = np.asarray(features, dtype=np.float64)
    if sums.ndim != 2 or sums.shape[1] != 2 * len(names) or sums.shape[0] != len(seconds):
        raise ValueError(f"features of shape {list(sums.shape)} must be [measurements={len(seconds)}, "
                         f"{2 * len(names)}] ({', '.join(feature_names(encoders))})")
    if not (np.isfinite(sums) & (sums >= 0)).all():
        raise ValueError("features must be finite and non-negative (token and attention-pair counts)")
    _check_enough(len(seconds), modules)
    return _fit(sums, np.array([_checked_seconds(t, i) for i, t in enumerate(seconds)]), modules, names)


def _checked_modules(modules: Sequence[str], names: tuple[str, ...]) -> tuple[str, ...]:
    modules = tuple(modules)
    if not modules or len(set(modules)) != len(modules) or not set(modules) <= set(names):
        raise ValueError(f"modules={list(modules)} must be distinct names among {list(names)}")
    return modules


def _check_enough(measurements: int, modules: tuple[str, ...]) -> None:
    needed = 2 * len(modules)
    if measurements < needed:
        raise ValueError(
            f"fitting {list(modules)} needs at least {needed} measurements (one per coefficient), got {measurements}"
        )


def _checked_seconds(seconds: object, i: int) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds):
        raise ValueError(f"measurement {i}: time {seconds!r} must be a finite number of seconds")
    if seconds < 0:
        raise ValueError(f"measurement {i}: time {seconds!r} is negative")
    return float(seconds)


def _fit(sums: np.ndarray, times: np.ndarray, modules: tuple[str, ...], names: tuple[str, ...]) -> CostModel:
    """Non-negative least squares of ``times`` on the ``modules`` columns of ``sums`` (both checked already)."""
    if not times.any():
        raise ValueError("every measured time is zero: nothing to calibrate the cost model against")
    columns = [2 * names.index(m) + k for m in modules for k in (0, 1)]
    a = sums[:, columns]
    scale = np.abs(a).max(axis=0)
    if unused := [m for i, m in enumerate(modules) if not scale[2 * i : 2 * i + 2].any()]:
        raise ValueError(
            f"no measured sample has {' or '.join(unused)} work, so its coefficients cannot be fitted; "
            f"pass modules= without {unused}"
        )
    # Columns scaled to a common range: summed pairs (~1e8 and up) and tokens (~1e3) would otherwise make the
    # least-squares sub-problems badly conditioned.
    a_scaled = a / scale
    t_scale = times.max()
    if np.linalg.matrix_rank(a_scaled) < len(columns):
        logger.warning(
            "cost model fit: the measured features do not determine all %d coefficients (e.g. tokens and "
            "attention pairs proportional); predictions away from the measured shapes may be off",
            len(columns),
        )
    x = _nnls(a_scaled, times / t_scale) * t_scale / scale

    coefficients = np.zeros(2 * len(names))
    coefficients[columns] = x
    residual = np.linalg.norm(sums @ coefficients - times) / np.linalg.norm(times)
    logger.debug("cost model fit on %d steps: relative residual %.3g", len(times), residual)
    return CostModel(**{name: ModuleCost(coefficients[2 * i], coefficients[2 * i + 1]) for i, name in enumerate(names)})
