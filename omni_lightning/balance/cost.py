"""Per-sample cost model: a linear and a quadratic (attention) term per module of the model.

Every module (each encoder, the decoder LLM) does two kinds of work on a sample:

* work proportional to its **tokens**: projections, MLPs, convolutions, the projectors and the LM head run once
  per token (vision: per patch; audio: per downsampled frame; LLM: per sequence position);
* work proportional to its **attention pairs**: ``QK^T`` and ``AV`` touch every (query, key) pair an item
  attends over. Attention is per item (bidirectional over each image / video frame / audio clip, causal over
  each packed sample), so pairs grow with the *square* of item length, not of the packed micro-batch length.

So the cost of some work is ``sum over modules of linear * tokens + quadratic * pairs``: the dot product of its
features (:func:`work_features`: tokens and pairs of every encoder, then of the LLM) with the model's coefficients.
The same function prices a sample, a packed micro-batch and a single encoder item for every planner. The model
family derives the coefficients in training FLOPs from its shapes (``ReferenceMLLM.cost_model()``);
:func:`fit_cost_model` calibrates them in seconds. Only the *ratios* between costs
matter for balancing, so either unit works.

Why balance on predicted compute rather than on token counts: with long-tailed resolutions and lengths, two
samples with the same number of LLM tokens can differ several-fold in work (one 4096-patch image costs as
much attention as sixteen 256-patch images, and its tokens run through the ViT as well as the LLM). Balancing
token counts then leaves the ranks with the quadratic items as stragglers; balancing the predicted cost does
not. The prediction is a pure function of integer sample sizes, so every rank of a reorder group computes
the same numbers from the same all-gathered sizes, without moving payloads or coordinating.

Pure numpy: no torch, no process groups.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_lightning.balance.cost_fit import (
    check_enough_measurements,
    checked_modules,
    checked_seconds,
    fit_coefficients,
)
from omni_lightning.balance.workload import SampleMeta
from omni_lightning.batch import PackingSpec
from omni_lightning.modalities import DEFAULT_PACKING

__all__ = [
    "DEFAULT_ENCODERS",
    "CostModel",
    "ModuleCost",
    "feature_matrix",
    "feature_names",
    "fit_cost_model",
    "fit_cost_model_to_features",
    "meta_items",
    "meta_llm_tokens",
    "sample_features",
    "work_features",
]

# The encoders of the reference model, in feature order; every cost model lists its own.
DEFAULT_ENCODERS = ("vision", "audio")


def _check_coefficient(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}={value!r} must be finite and >= 0")
    return value


@dataclass(frozen=True)
class ModuleCost:
    """The cost of one module on some work: ``linear * tokens + quadratic * attention_pairs``.

    Both coefficients are finite and non-negative (``ValueError`` otherwise). Change a module of a
    :class:`CostModel` with ``model.replace(vision=ModuleCost(...))``.
    """

    linear: float
    quadratic: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "linear", _check_coefficient(self.linear, "linear"))
        object.__setattr__(self, "quadratic", _check_coefficient(self.quadratic, "quadratic"))

    def scaled(self, factor: float) -> ModuleCost:
        """Both coefficients times ``factor`` (another unit, or another share of the work)."""
        return ModuleCost(self.linear * factor, self.quadratic * factor)

    def __call__(self, tokens: float, pairs: float) -> float:
        """The cost of ``tokens`` tokens with ``pairs`` attention pairs."""
        return self.linear * tokens + self.quadratic * pairs


def feature_names(encoders: Sequence[str]) -> tuple[str, ...]:
    """Column names of the features of a model with these encoders: ``(e_tokens, e_pairs)`` per encoder, then
    ``llm_tokens, llm_pairs``."""
    return tuple(f"{name}_{kind}" for name in (*encoders, "llm") for kind in ("tokens", "pairs"))


def work_features(encoders: Sequence[str], items: Mapping[str, Iterable[int]], sequences: Iterable[int]) -> np.ndarray:
    """The features of some work (one sample, a packed micro-batch): for every encoder in ``encoders`` order, the
    stem tokens of its ``items`` and their bidirectional attention pairs (``sum n``, ``sum n**2``), then the LLM's
    tokens and causal pairs over its ``sequences`` (``sum L``, ``sum L (L + 1) / 2``). Exact integers up to 2**53.

    Raises ``ValueError`` for items of an encoder not in ``encoders``: their work would go unpriced.
    """
    return np.array(_feature_row(encoders, items, sequences), dtype=np.float64)


def _feature_row(encoders: Sequence[str], items: Mapping[str, Iterable[int]], sequences: Iterable[int]) -> list[int]:
    if unknown := sorted(set(items) - set(encoders)):
        raise ValueError(f"items of encoder(s) {unknown} that the cost model does not price (it has {list(encoders)})")
    row: list[int] = []
    for name in encoders:
        sizes = [int(n) for n in items.get(name, ())]
        row += [sum(sizes), sum([n * n for n in sizes])] if sizes else [0, 0]
    lengths = [int(n) for n in sequences]
    row += [sum(lengths), sum([n * (n + 1) // 2 for n in lengths])]
    return row


def meta_items(meta: SampleMeta, spec: PackingSpec = DEFAULT_PACKING) -> dict[str, list[int]]:
    """Each encoder's items of a sample described by its metadata, in stem tokens, by the modalities' rules."""
    items: dict[str, list[int]] = {}
    for name, shapes in meta.media_shapes().items():
        modality = spec.modality(name)
        for shape in shapes:
            items.setdefault(modality.encoder, []).extend(modality.item_tokens(shape, spec))
    return items


def meta_llm_tokens(meta: SampleMeta, spec: PackingSpec = DEFAULT_PACKING) -> int:
    """The LLM tokens of a sample described by its metadata: :attr:`SampleMeta.llm_tokens` (a workload counts a
    video's tokens frame by frame), with the video's frames grouped into the spec's temporal patches."""
    if not meta.video_frames or spec.temporal_patch_size == 1:
        return meta.llm_tokens
    rows, cols = meta.video_grid
    per_item = rows * cols // meta.merge_factor("video")
    items = -(-meta.video_frames // spec.temporal_patch_size)
    return meta.llm_tokens - (meta.video_frames - items) * per_item


def sample_features(meta: SampleMeta, encoders: Sequence[str] = DEFAULT_ENCODERS,
                    spec: PackingSpec = DEFAULT_PACKING) -> np.ndarray:
    """The features of one sample described by its metadata (its LLM tokens by :func:`meta_llm_tokens`)."""
    return work_features(encoders, meta_items(meta, spec), [meta_llm_tokens(meta, spec)])


def feature_matrix(metas: Iterable[SampleMeta], encoders: Sequence[str] = DEFAULT_ENCODERS,
                   spec: PackingSpec = DEFAULT_PACKING) -> np.ndarray:
    """The features of many samples as a float64 array ``[n, 2 * (encoders + 1)]``: row ``i`` is
    :func:`sample_features` of sample ``i``, summed over all items at once (planners price every sample of a reorder
    group)."""
    metas = list(metas)
    column = {name: 2 * i for i, name in enumerate(encoders)}
    modalities = {m.name: m for m in spec.modalities}
    rows: list[int] = []
    columns: list[int] = []
    tokens: list[int] = []
    llm = np.empty(len(metas))
    for row, meta in enumerate(metas):
        for name, shapes in meta.media_shapes().items():
            modality = modalities[name] if name in modalities else spec.modality(name)  # the latter raises
            if modality.encoder not in column:
                raise ValueError(f"items of encoder {modality.encoder!r} that the cost model does not price (it has "
                                 f"{list(encoders)})")
            for shape in shapes:
                sizes = modality.item_tokens(shape, spec)
                rows += [row] * len(sizes)
                columns += [column[modality.encoder]] * len(sizes)
                tokens += sizes
        llm[row] = meta_llm_tokens(meta, spec)
    out = np.zeros((len(metas), 2 * (len(encoders) + 1)))
    at, n = (np.array(rows, dtype=np.int64), np.array(columns, dtype=np.int64)), np.array(tokens, dtype=np.float64)
    np.add.at(out, at, n)
    np.add.at(out, (at[0], at[1] + 1), n * n)
    out[:, -2], out[:, -1] = llm, llm * (llm + 1) / 2
    return out


class CostModel:
    """Predicted cost of work: a :class:`ModuleCost` for every encoder (by name, in feature order) and the LLM.

    ``CostModel(vision=ModuleCost(...), audio=ModuleCost(...), llm=ModuleCost(...))``; a model with more encoders
    names them all. Encoders are read as attributes (``cost_model.vision``) or from :attr:`encoders`.
    """

    def __init__(self, *, llm: ModuleCost, **encoders: ModuleCost) -> None:
        for name, cost in (*encoders.items(), ("llm", llm)):
            if not isinstance(cost, ModuleCost):
                raise ValueError(f"{name} must be a ModuleCost, got {cost!r}")
        self._encoders = dict(encoders)
        self._llm = llm

    @property
    def llm(self) -> ModuleCost:
        return self._llm

    @property
    def encoders(self) -> Mapping[str, ModuleCost]:
        return dict(self._encoders)

    def __getattr__(self, name: str) -> ModuleCost:
        encoders = self.__dict__.get("_encoders", {})
        if name in encoders:
            return encoders[name]
        raise AttributeError(f"{type(self).__name__} has no module {name!r}; it has {[*encoders, 'llm']}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CostModel) and (self._encoders, self._llm) == (other._encoders, other._llm)

    def __hash__(self) -> int:
        return hash((tuple(self._encoders.items()), self._llm))

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}={cost!r}" for name, cost in (*self._encoders.items(), ("llm", self._llm)))
        return f"CostModel({parts})"

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (self._encoders, self._llm)

    @property
    def encoder_names(self) -> tuple[str, ...]:
        return tuple(self._encoders)

    @property
    def modules(self) -> tuple[str, ...]:
        """Module names in feature order: the encoders, then ``"llm"``."""
        return (*self._encoders, "llm")

    @property
    def feature_names(self) -> tuple[str, ...]:
        return feature_names(self.encoder_names)

    def module(self, name: str) -> ModuleCost:
        return self._llm if name == "llm" else getattr(self, name)

    def replace(self, **modules: ModuleCost) -> CostModel:
        """A copy with some modules' costs replaced (every name must be one of :attr:`modules`)."""
        if unknown := sorted(set(modules) - set(self.modules)):
            raise ValueError(f"no module(s) {unknown} in {list(self.modules)}")
        return CostModel(**{name: modules.get(name, self.module(name)) for name in self.modules})

    @property
    def coefficients(self) -> np.ndarray:
        """The coefficients in feature order, so that ``cost = features @ coefficients``."""
        return np.array([c for name in self.modules for c in (self.module(name).linear, self.module(name).quadratic)])

    def module_costs(self, features: np.ndarray) -> np.ndarray:
        """Per-module costs ``[n, modules]`` of feature rows ``[n, 2 * modules]``."""
        features = np.asarray(features, dtype=np.float64).reshape(-1, len(self.modules), 2)
        return (features * self.coefficients.reshape(len(self.modules), 2)).sum(axis=2)

    def costs(self, metas: Iterable[SampleMeta], spec: PackingSpec = DEFAULT_PACKING) -> np.ndarray:
        """Predicted per-module costs ``[n, modules]`` of samples described by their metadata."""
        return self.module_costs(feature_matrix(metas, self.encoder_names, spec))

    def sample_cost(self, meta: SampleMeta, spec: PackingSpec = DEFAULT_PACKING) -> dict[str, float]:
        """Predicted cost of one sample in each module."""
        return dict(zip(self.modules, self.costs([meta], spec)[0].tolist(), strict=True))

    def total_cost(self, meta: SampleMeta, spec: PackingSpec = DEFAULT_PACKING) -> float:
        """Predicted cost of one sample, all modules together."""
        return float(self.costs([meta], spec).sum())

    def item_costs(self, encoder: str, tokens: np.ndarray) -> np.ndarray:
        """Predicted cost of each of an encoder's items of ``tokens`` stem tokens (its attention is within it)."""
        tokens = np.asarray(tokens, dtype=np.float64)
        cost = getattr(self, encoder)
        return cost.linear * tokens + cost.quadratic * tokens**2


def _rebuild(encoders: dict[str, ModuleCost], llm: ModuleCost) -> CostModel:
    return CostModel(llm=llm, **encoders)


def fit_cost_model(
    measurements: Sequence[tuple[Sequence[SampleMeta], float]],
    *,
    modules: Sequence[str] | None = None,
    encoders: Sequence[str] = DEFAULT_ENCODERS,
    spec: PackingSpec = DEFAULT_PACKING,
    prior: CostModel | None = None,
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
    ``prior`` (a cost model of the same modules, e.g. FLOPs') gives each module the ratio of its two coefficients to
    fall back on where the measurements drive one of them to zero (see
    :func:`~omni_lightning.balance.cost_fit.fit_coefficients`).
    """
    names = (*encoders, "llm")
    modules = checked_modules(names if modules is None else modules, names)
    check_enough_measurements(len(measurements), modules)
    sums = np.empty((len(measurements), 2 * len(names)))
    times = np.empty(len(measurements))
    for i, measurement in enumerate(measurements):
        if not (isinstance(measurement, (tuple, list)) and len(measurement) == 2):
            raise ValueError(f"measurement {i} must be a (samples, seconds) pair, got {measurement!r}")
        samples, seconds = measurement
        if len(samples) == 0:
            raise ValueError(f"measurement {i} has no samples: a step's time needs the samples it processed")
        sums[i] = feature_matrix(samples, encoders, spec).sum(axis=0)
        times[i] = checked_seconds(seconds, i)
    return _from_coefficients(fit_coefficients(sums, times, modules, names, prior=_prior(prior, names)), names)


def fit_cost_model_to_features(features: np.ndarray, seconds: Sequence[float], *,
                               modules: Sequence[str] | None = None,
                               encoders: Sequence[str] = DEFAULT_ENCODERS,
                               prior: CostModel | None = None) -> CostModel:
    """Calibrate a :class:`CostModel` (in seconds) from measured work described by its features.

    ``features[i]`` holds the features (:func:`feature_names` of ``encoders``) of what
    measurement ``i`` timed, e.g. a packed micro-batch's, which are the sums of its samples' features, and
    ``seconds[i]`` its measured time. Otherwise as :func:`fit_cost_model`, which this solves for.
    """
    names = (*encoders, "llm")
    modules = checked_modules(names if modules is None else modules, names)
    sums = np.asarray(features, dtype=np.float64)
    if sums.ndim != 2 or sums.shape[1] != 2 * len(names) or sums.shape[0] != len(seconds):
        raise ValueError(f"features of shape {list(sums.shape)} must be [measurements={len(seconds)}, "
                         f"{2 * len(names)}] ({', '.join(feature_names(encoders))})")
    if not (np.isfinite(sums) & (sums >= 0)).all():
        raise ValueError("features must be finite and non-negative (token and attention-pair counts)")
    check_enough_measurements(len(seconds), modules)
    times = np.array([checked_seconds(t, i) for i, t in enumerate(seconds)])
    return _from_coefficients(fit_coefficients(sums, times, modules, names, prior=_prior(prior, names)), names)


def _prior(prior: CostModel | None, names: tuple[str, ...]) -> np.ndarray | None:
    """``prior``'s coefficients in the fit's layout; raises ``ValueError`` where its modules are not ``names``."""
    if prior is None:
        return None
    if prior.modules != names:
        raise ValueError(f"the prior's modules {list(prior.modules)} must be the fit's {list(names)}")
    return prior.coefficients


def _from_coefficients(coefficients: np.ndarray, names: tuple[str, ...]) -> CostModel:
    return CostModel(**{name: ModuleCost(coefficients[2 * i], coefficients[2 * i + 1]) for i, name in enumerate(names)})
