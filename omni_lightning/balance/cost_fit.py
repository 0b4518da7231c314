"""The numerical fit behind :func:`~omni_lightning.balance.cost.fit_cost_model`: cost coefficients in seconds from
measured work, by non-negative least squares on the work's features (pure numpy).

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

__all__ = ["check_enough_measurements", "checked_modules", "checked_seconds", "fit_coefficients"]

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


def checked_modules(modules: Sequence[str], names: tuple[str, ...]) -> tuple[str, ...]:
    modules = tuple(modules)
    if not modules or len(set(modules)) != len(modules) or not set(modules) <= set(names):
        raise ValueError(f"modules={list(modules)} must be distinct names among {list(names)}")
    return modules


def check_enough_measurements(measurements: int, modules: tuple[str, ...]) -> None:
    needed = 2 * len(modules)
    if measurements < needed:
        raise ValueError(
            f"fitting {list(modules)} needs at least {needed} measurements (one per coefficient), got {measurements}"
        )


def checked_seconds(seconds: object, i: int) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds):
        raise ValueError(f"measurement {i}: time {seconds!r} must be a finite number of seconds")
    if seconds < 0:
        raise ValueError(f"measurement {i}: time {seconds!r} is negative")
    return float(seconds)


def fit_coefficients(sums: np.ndarray, times: np.ndarray, modules: tuple[str, ...], names: tuple[str, ...], *,
                     prior: np.ndarray | None = None) -> np.ndarray:
    """Coefficients (``linear, quadratic`` per module of ``names``) by non-negative least squares of ``times`` on
    the ``modules`` columns of the feature sums ``sums`` (both checked already); the other modules' are zero.

    ``prior`` (coefficients laid out as the result's, e.g. FLOPs) gives each module a shape to fall back on: a module
    whose fit leaves a coefficient at zero where ``prior``'s is positive keeps ``prior``'s ratio of its two
    coefficients, scaled by the fit. A zero there says the measurements cannot separate the module's two terms (a
    few noisy steps whose tokens and attention pairs grow together), not that the work is free: priced by the other
    term alone, a micro-batch of many short sequences would look almost free next to one long sequence.
    """
    if not times.any():
        raise ValueError("every measured time is zero: nothing to calibrate the cost model against")
    if unused := [m for m in modules if not sums[:, _columns(m, names)].any()]:
        raise ValueError(
            f"no measured sample has {' or '.join(unused)} work, so its coefficients cannot be fitted; "
            f"pass modules= without {unused}"
        )
    shaped: list[str] = []
    while True:
        coefficients, determined = _fit_shaped(sums, times, modules, names, shaped, prior)
        if prior is None:
            break
        # A term whose share of the largest measured time is at round-off level is a zero the solver left unclamped.
        negligible = sums.max(axis=0) * coefficients <= 1e-12 * times.max()
        lost = [m for m in modules if m not in shaped
                and (negligible[_columns(m, names)] & (prior[_columns(m, names)] > 0)).any()]
        if not lost:
            break
        logger.info("cost model fit: the measurements set a coefficient of %s to zero; fitting %s in the prior's "
                    "shape instead", lost, "it" if len(lost) == 1 else "them")
        shaped += lost
    if not determined:
        logger.warning(
            "cost model fit: the measured features do not determine all %d coefficients (e.g. tokens and "
            "attention pairs proportional); predictions away from the measured shapes may be off",
            2 * len(modules) - len(shaped),
        )
    residual = np.linalg.norm(sums @ coefficients - times) / np.linalg.norm(times)
    logger.debug("cost model fit on %d steps: relative residual %.3g", len(times), residual)
    return coefficients


def _columns(module: str, names: tuple[str, ...]) -> list[int]:
    """The feature columns (tokens, attention pairs) of ``module``."""
    return [2 * names.index(module), 2 * names.index(module) + 1]


def _fit_shaped(sums: np.ndarray, times: np.ndarray, modules: tuple[str, ...], names: tuple[str, ...],
                shaped: list[str], prior: np.ndarray | None) -> tuple[np.ndarray, bool]:
    """:func:`fit_coefficients`'s solve: two free coefficients per module, one scale of ``prior``'s for those in
    ``shaped``. Returns the coefficients and whether the measurements determine every unknown."""
    designs = []
    for module in modules:
        columns = _columns(module, names)
        if module in shaped:
            designs.append(sums[:, columns] @ prior[columns])
        else:
            designs += [sums[:, column] for column in columns]
    a = np.column_stack(designs)
    scale = np.abs(a).max(axis=0)
    # A module's columns all zero is rejected above; one of its two columns may be zero (no measured item had
    # attention pairs), whose coefficient the solve leaves at zero (with a prior, the module then takes its shape).
    scale[scale == 0] = 1.0
    # Columns scaled to a common range: summed pairs (~1e8 and up) and tokens (~1e3) would otherwise make the
    # least-squares sub-problems badly conditioned.
    a_scaled = a / scale
    t_scale = times.max()
    x = _nnls(a_scaled, times / t_scale) * t_scale / scale
    coefficients = np.zeros(2 * len(names))
    i = 0
    for module in modules:
        columns = _columns(module, names)
        if module in shaped:
            coefficients[columns] = x[i] * prior[columns]
            i += 1
        else:
            coefficients[columns] = x[i : i + 2]
            i += 2
    return coefficients, bool(np.linalg.matrix_rank(a_scaled) == a.shape[1])
