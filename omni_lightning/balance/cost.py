"""Per-sample cost model of the reference MLLM: a linear and a quadratic (attention) term per module.

Every module of the model (vision encoder, audio encoder, decoder LLM) does two kinds of work on a sample:

* work proportional to its **tokens**: projections, MLPs, convolutions, the projectors and the LM head run once
  per token (vision: per patch; audio: per downsampled frame; LLM: per sequence position);
* work proportional to its **attention pairs**: ``QK^T`` and ``AV`` touch every (query, key) pair an item
  attends over. Attention is per item (bidirectional over each image / video frame / audio clip, causal over
  each packed sample), so pairs grow with the *square* of item length, not of the packed micro-batch length.

So the cost of a sample is ``sum over modules of linear * tokens + quadratic * pairs``, i.e. the dot product
of six features with six coefficients (see :meth:`CostModel.features`). ``CostModel.from_config`` derives the
coefficients in training FLOPs from the model's shapes; ``fit_cost_model`` calibrates them, in seconds, from
measured step times by non-negative least squares. Only the *ratios* between costs matter for balancing, so
either unit works.

Why balance on predicted compute rather than on token counts: with long-tailed resolutions and lengths, two
samples with the same number of LLM tokens can differ several-fold in work (one 4096-patch image costs as
much attention as sixteen 256-patch images, and its tokens run through the ViT as well as the LLM). Balancing
token counts then leaves the ranks with the quadratic items as stragglers; balancing the predicted cost does
not. The prediction is a pure function of integer sample metadata, so every rank of a balance group computes
the same numbers from the same all-gathered metadata, without moving payloads or coordinating.

Pure numpy: no torch, no process groups (the model config is only read for its sizes).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the config module imports torch; the cost model only reads plain attributes from it
    from omni_lightning.balance.workload import SampleMeta
    from omni_lightning.models.config import ReferenceMLLMConfig

__all__ = [
    "MODULES",
    "FEATURES",
    "AUDIO_DOWNSAMPLE",
    "ModuleCost",
    "SampleCost",
    "CostModel",
    "feature_matrix",
    "fit_cost_model",
    "fit_cost_model_to_features",
]

logger = logging.getLogger(__name__)

MODULES = ("vision", "audio", "llm")
# Column order of ``features`` / ``coefficients``: (tokens, pairs) for each module in MODULES order.
FEATURES = ("vision_tokens", "vision_pairs", "audio_tokens", "audio_pairs", "llm_tokens", "llm_pairs")
# Mel frames per audio-encoder token: two stride-2 convolutions (ReferenceMLLMConfig requires downsample=4).
AUDIO_DOWNSAMPLE = 4

# Training FLOPs per forward FLOP: the backward of a matmul computes the input gradient and the weight gradient,
# each as expensive as the forward.
_TRAIN = 3.0
# A layer whose input is data (patch embedding, first audio convolution) needs no input gradient: autograd skips
# it for inputs that do not require grad, leaving forward + weight gradient.
_TRAIN_FIRST_LAYER = 2.0


def _check_coefficient(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}={value!r} must be finite and >= 0")
    return value


@dataclass(frozen=True)
class ModuleCost:
    """The cost of one module on one sample: ``linear * tokens + quadratic * attention_pairs``.

    Both coefficients are finite and non-negative (``ValueError`` otherwise). Override a module of a
    :class:`CostModel` with ``dataclasses.replace(model, vision=ModuleCost(...))``.
    """

    linear: float
    quadratic: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "linear", _check_coefficient(self.linear, "linear"))
        object.__setattr__(self, "quadratic", _check_coefficient(self.quadratic, "quadratic"))

    def __call__(self, tokens: float, pairs: float) -> float:
        """The cost of ``tokens`` tokens with ``pairs`` attention pairs."""
        return self.linear * tokens + self.quadratic * pairs


@dataclass(frozen=True)
class SampleCost:
    """The predicted cost of one sample in each module, in the unit of the :class:`CostModel` that made it."""

    vision: float
    audio: float
    llm: float

    @property
    def encoder(self) -> float:
        """Cost of the encoders (vision + audio): the work the encoder plan spreads over the encoder group."""
        return self.vision + self.audio

    @property
    def total(self) -> float:
        """Cost of the whole sample (encoders + LLM)."""
        return self.vision + self.audio + self.llm


def _features_of(meta: SampleMeta) -> tuple[int, int, int, int]:
    """(vision tokens, vision pairs, audio mel frames, LLM tokens) as exact integers.

    Inlines ``meta.vision_patches`` and ``meta.llm_tokens`` (same formulas) in one pass: ``feature_matrix`` runs
    this on every sample of a balance group, and the properties would walk the images twice and build a dict.
    """
    merge = dict(meta.merge)
    image_merge, video_merge = merge["image"], merge["video"]
    vision_tokens = vision_pairs = vision_llm = 0
    for h, w in meta.images:
        n = h * w
        vision_tokens += n
        vision_pairs += n * n  # bidirectional attention within each image
        vision_llm += n // image_merge
    frames = meta.video_frames
    if frames:
        h, w = meta.video_grid
        n = h * w
        vision_tokens += frames * n
        vision_pairs += frames * n * n  # each frame is its own attention item
        vision_llm += frames * (n // video_merge)
    audio = meta.audio_frames
    llm_tokens = 1 + meta.text_tokens + vision_llm + audio // merge["audio"]
    return vision_tokens, vision_pairs, audio, llm_tokens


def feature_matrix(metas: Iterable[SampleMeta]) -> np.ndarray:
    """The features of many samples as a float64 array ``[n, 6]`` (columns as in ``FEATURES``).

    Row ``i`` equals ``CostModel.features(metas[i])``; costs are then ``feature_matrix(metas) @ coefficients``.
    """
    rows = [_features_of(meta) for meta in metas]
    if not rows:
        return np.zeros((0, len(FEATURES)))
    raw = np.array(rows, dtype=np.float64)  # Python ints are exact; float64 holds pairs up to 2**53 exactly
    out = np.empty((len(rows), len(FEATURES)))
    out[:, 0] = raw[:, 0]
    out[:, 1] = raw[:, 1]
    audio_tokens = raw[:, 2] / AUDIO_DOWNSAMPLE
    out[:, 2] = audio_tokens
    out[:, 3] = audio_tokens * audio_tokens  # one clip per sample, bidirectional
    out[:, 4] = raw[:, 3]
    out[:, 5] = raw[:, 3] * (raw[:, 3] + 1) / 2  # causal: position i attends to i + 1 keys
    return out


def _encoder_block_flops(dim: int, mlp_ratio: float) -> float:
    """Forward matmul FLOPs per token of one ``EncoderBlock`` outside attention: qkv, proj, GELU MLP."""
    hidden = int(dim * mlp_ratio)  # as EncoderBlock builds its GeluMLP
    return 2.0 * dim * 3 * dim + 2.0 * dim * dim + 2.0 * (dim * hidden + hidden * dim)


def _attention_pair_flops(n_heads: int, head_dim: int, n_layers: int) -> float:
    """Training FLOPs per attention pair: QK^T and AV, each a multiply-add per head channel, in every layer."""
    return _TRAIN * n_layers * 2 * 2.0 * n_heads * head_dim


@dataclass(frozen=True)
class CostModel:
    """Predicted cost of a sample: a :class:`ModuleCost` for each of the vision encoder, audio encoder and LLM.

    Tokens and pairs per module (see :meth:`features`): vision tokens are patches (images and video frames),
    vision pairs ``sum (h*w)**2`` over images and frames; audio tokens are ``mel_frames / 4`` (after the two
    stride-2 convolutions), audio pairs their square; LLM tokens are ``meta.llm_tokens``, LLM pairs
    ``L * (L + 1) / 2`` (causal). Build one with :meth:`from_config` (FLOPs) or :func:`fit_cost_model`
    (seconds), or directly; change a module with ``dataclasses.replace``.
    """

    vision: ModuleCost
    audio: ModuleCost
    llm: ModuleCost

    def __post_init__(self) -> None:
        for name in MODULES:
            if not isinstance(getattr(self, name), ModuleCost):
                raise ValueError(f"{name} must be a ModuleCost, got {getattr(self, name)!r}")

    @classmethod
    def from_config(cls, config: ReferenceMLLMConfig) -> CostModel:
        """Coefficients in training FLOPs (forward + backward) of the reference MLLM built from ``config``.

        Counts matmul FLOPs only (2 per multiply-add; norms, activations, softmax and RoPE are a few percent at
        real sizes). Backward is twice the forward, except for the two layers that read raw data (patch
        embedding, first audio convolution), whose backward has no input gradient. Per token:

        * vision (per patch): patch embedding, ``n_layers`` encoder blocks (qkv, proj, MLP) and the projector,
          which runs on ``patches / merge`` merged tokens and is charged here per patch;
        * audio (per downsampled frame): both convolutions (the first runs on twice as many outputs), the
          encoder blocks and the projector;
        * LLM: q/k/v/o (grouped-query), SwiGLU (three matmuls) or, in MoE layers, the router plus ``top_k``
          experts, and the LM head.

        Per attention pair: ``2 matmuls * 2 FLOPs * n_heads * head_dim`` per layer, times 3 for training.
        """
        vis, aud, llm = config.vision, config.audio, config.llm

        patch_embed = 2.0 * vis.patch_dim * vis.dim
        # Projector GeluMLP(dim * merge -> llm.dim -> llm.dim) on patches / merge merged tokens.
        vis_projector = 2.0 * (vis.dim * vis.merge * llm.dim + llm.dim * llm.dim) / vis.merge
        vision = ModuleCost(
            linear=_TRAIN_FIRST_LAYER * patch_embed
            + _TRAIN * (vis.n_layers * _encoder_block_flops(vis.dim, vis.mlp_ratio) + vis_projector),
            quadratic=_attention_pair_flops(vis.n_heads, vis.dim // vis.n_heads, vis.n_layers),
        )

        # Conv1d(kernel 3, stride 2): conv1 has L/2 outputs, i.e. 2 per downsampled token; conv2 has 1.
        stride_outputs = AUDIO_DOWNSAMPLE // 2
        conv1 = stride_outputs * 2.0 * 3 * aud.n_mels * aud.dim
        conv2 = 2.0 * 3 * aud.dim * aud.dim
        aud_projector = 2.0 * (aud.dim * llm.dim + llm.dim * llm.dim)  # GeluMLP(dim -> llm.dim -> llm.dim)
        audio = ModuleCost(
            linear=_TRAIN_FIRST_LAYER * conv1
            + _TRAIN * (conv2 + aud.n_layers * _encoder_block_flops(aud.dim, aud.mlp_ratio) + aud_projector),
            quadratic=_attention_pair_flops(aud.n_heads, aud.dim // aud.n_heads, aud.n_layers),
        )

        q_width, kv_width = llm.n_heads * llm.head_dim, llm.n_kv_heads * llm.head_dim
        attention = 2.0 * llm.dim * (q_width + 2 * kv_width) + 2.0 * q_width * llm.dim  # wq, wk, wv; wo
        swiglu = 3 * 2.0 * llm.dim * llm.ffn_hidden  # w1, w3, w2
        moe = 2.0 * llm.dim * llm.n_experts + llm.moe_top_k * swiglu  # router + top_k experts per token
        layers = sum(attention + (moe if llm.is_moe_layer(i) else swiglu) for i in range(llm.n_layers))
        lm_head = 2.0 * llm.dim * llm.vocab_size  # logits at every position (the loss masks later)
        return cls(
            vision=vision,
            audio=audio,
            llm=ModuleCost(
                linear=_TRAIN * (layers + lm_head),
                quadratic=_attention_pair_flops(llm.n_heads, llm.head_dim, llm.n_layers),
            ),
        )

    @property
    def coefficients(self) -> np.ndarray:
        """The six coefficients ``[6]`` in ``FEATURES`` order, so that ``cost = features @ coefficients``."""
        return np.array([c for name in MODULES for c in (getattr(self, name).linear, getattr(self, name).quadratic)])

    @staticmethod
    def features(meta: SampleMeta) -> np.ndarray:
        """The six features of one sample (``FEATURES`` order): tokens and attention pairs of each module."""
        return feature_matrix([meta])[0]

    def sample_cost(self, meta: SampleMeta) -> SampleCost:
        """Predicted cost of one sample, per module."""
        vision, audio, llm = self.costs([meta])[0]
        return SampleCost(vision=float(vision), audio=float(audio), llm=float(llm))

    def total_cost(self, meta: SampleMeta) -> float:
        """Predicted cost of one sample, all modules together."""
        return self.sample_cost(meta).total

    def costs(self, metas: Iterable[SampleMeta]) -> np.ndarray:
        """Predicted per-module costs of many samples: float64 ``[n, 3]`` (columns vision, audio, llm)."""
        features = feature_matrix(metas).reshape(-1, len(MODULES), 2)
        return (features * self.coefficients.reshape(len(MODULES), 2)).sum(axis=2)


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
    modules: Sequence[str] = MODULES,
) -> CostModel:
    """Calibrate a :class:`CostModel` (in seconds) from measured step times.

    Each measurement is ``(samples, seconds)``: the samples one rank processed in one step and that step's
    measured compute time. The model predicts a step as the sum of its samples' costs, so the fit solves a
    non-negative least-squares problem on the per-step sums of the six features
    (:func:`fit_cost_model_to_features`). Only the coefficients of ``modules`` are fitted (the times must then
    cover exactly those modules' work); the others are zero.

    Raises ``ValueError`` for an unknown or repeated module, a malformed measurement, an empty sample list, a
    negative or non-finite time, fewer measurements than fitted coefficients, all-zero times, or a fitted module
    that no measured sample uses (its coefficients would be arbitrary: fit without it).
    If the features do not determine every coefficient (e.g. every image has the same size, so patches and
    pairs are proportional), the fit still predicts the measured shapes but a warning is logged.
    """
    modules = _checked_modules(modules)
    _check_enough(len(measurements), modules)
    sums = np.empty((len(measurements), len(FEATURES)))
    times = np.empty(len(measurements))
    for i, measurement in enumerate(measurements):
        if not (isinstance(measurement, (tuple, list)) and len(measurement) == 2):
            raise ValueError(f"measurement {i} must be a (samples, seconds) pair, got {measurement!r}")
        samples, seconds = measurement
        if len(samples) == 0:
            raise ValueError(f"measurement {i} has no samples: a step's time needs the samples it processed")
        sums[i] = feature_matrix(samples).sum(axis=0)
        times[i] = _checked_seconds(seconds, i)
    return _fit(sums, times, modules)


def fit_cost_model_to_features(features: np.ndarray, seconds: Sequence[float], *,
                               modules: Sequence[str] = MODULES) -> CostModel:
    """Calibrate a :class:`CostModel` (in seconds) from measured work described by its features.

    ``features[i]`` holds the six features (``FEATURES`` order) of what measurement ``i`` timed, e.g. a packed
    micro-batch's, which are the sums of its samples' features, and ``seconds[i]`` its measured time. Otherwise as
    :func:`fit_cost_model`, which this solves for: non-negative least squares on the columns of ``modules``, with
    the same checks.
    """
    modules = _checked_modules(modules)
    sums = np.asarray(features, dtype=np.float64)
    if sums.ndim != 2 or sums.shape[1] != len(FEATURES) or sums.shape[0] != len(seconds):
        raise ValueError(f"features of shape {list(sums.shape)} must be [measurements={len(seconds)}, "
                         f"{len(FEATURES)}] ({', '.join(FEATURES)})")
    if not (np.isfinite(sums) & (sums >= 0)).all():
        raise ValueError("features must be finite and non-negative (token and attention-pair counts)")
    _check_enough(len(seconds), modules)
    return _fit(sums, np.array([_checked_seconds(t, i) for i, t in enumerate(seconds)]), modules)


def _checked_modules(modules: Sequence[str]) -> tuple[str, ...]:
    modules = tuple(modules)
    if not modules or len(set(modules)) != len(modules) or not set(modules) <= set(MODULES):
        raise ValueError(f"modules={list(modules)} must be distinct names among {list(MODULES)}")
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


def _fit(sums: np.ndarray, times: np.ndarray, modules: tuple[str, ...]) -> CostModel:
    """Non-negative least squares of ``times`` on the ``modules`` columns of ``sums`` (both checked already)."""
    if not times.any():
        raise ValueError("every measured time is zero: nothing to calibrate the cost model against")
    columns = [2 * MODULES.index(m) + k for m in modules for k in (0, 1)]
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

    coefficients = np.zeros(len(FEATURES))
    coefficients[columns] = x
    residual = np.linalg.norm(sums @ coefficients - times) / np.linalg.norm(times)
    logger.debug("cost model fit on %d steps: relative residual %.3g", len(times), residual)
    return CostModel(*(ModuleCost(coefficients[2 * i], coefficients[2 * i + 1]) for i in range(len(MODULES))))
