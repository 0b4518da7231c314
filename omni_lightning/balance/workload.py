"""Workload specs: the modality mix and length distributions of a dynamic multimodal training workload.

A spec is a small YAML file (see ``balance/workloads/*.yaml`` for the bundled presets)::

    name: omni_mix
    description: ...
    merge: {image: 4, video: 4, audio: 4}
    modalities:
      text:  {weight: 0.35, text_tokens: {dist: lognormal, mu: 6.0, sigma: 0.9, min: 16, max: 8192}}
      image: {weight: 0.45, text_tokens: ..., images: ..., patches: ...}
      video: {weight: 0.10, text_tokens: ..., frames: ..., patches_per_frame: ...}
      audio: {weight: 0.10, text_tokens: ..., seconds: ...}

Sizes are counts before the encoder: 14x14-pixel patches, video frames, seconds of audio (100 mel frames per
second); ``merge`` is the factor from encoder outputs to LLM tokens (4 = a 2x2 spatial merge for vision, 4 mel
frames per token for audio). ``sample_metadata`` draws one sample's shape (``SampleMeta``) from a spec; the
shard generator, the benchmarks and the planners' cost model all work from these shapes.

This module is pure Python + numpy so planners and tools can use it without torch.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import yaml

__all__ = [
    "MODALITIES",
    "MEL_FRAMES_PER_SECOND",
    "WORKLOADS_DIR",
    "Distribution",
    "LogNormal",
    "Uniform",
    "UniformInt",
    "Choice",
    "Const",
    "ModalitySpec",
    "WorkloadSpec",
    "SampleMeta",
    "available_workloads",
    "check_sampling_args",
    "load_workload",
    "min_llm_tokens",
    "sample_metadata",
]

MODALITIES = ("text", "image", "video", "audio")
MEDIA_MODALITIES = ("image", "video", "audio")
MEL_FRAMES_PER_SECOND = 100
VISION_MERGES = (1, 4)

WORKLOADS_DIR = Path(__file__).parent / "workloads"

# Fields each modality must (and may) have besides ``weight``.
_MODALITY_FIELDS: dict[str, tuple[str, ...]] = {
    "text": ("text_tokens",),
    "image": ("text_tokens", "images", "patches"),
    "video": ("text_tokens", "frames", "patches_per_frame"),
    "audio": ("text_tokens", "seconds"),
}
# Counts are rounded but never scaled; a sample of that modality needs at least one image/frame.
_COUNT_FIELDS = ("images", "frames")

# The C loader is ~10x faster; both are safe loaders (no arbitrary Python objects).
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# Aspect ratios (w / h) of drawn patch grids are log-uniform in this range.
_MIN_ASPECT, _MAX_ASPECT = 0.5, 2.0


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _unknown(keys: Iterable[Any], allowed: Iterable[str]) -> list[str]:
    # str() first: YAML keys may be ints or None, which neither sort with strings nor read well in a message.
    return sorted(str(k) for k in set(keys) - set(allowed))


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Distribution:
    """A distribution of one length in a workload spec; ``Distribution.parse`` builds the right subclass."""

    kind: ClassVar[str] = ""
    _kinds: ClassVar[dict[str, type[Distribution]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Distribution._kinds[cls.kind] = cls

    @classmethod
    def parse(cls, raw: Any, where: str = "distribution") -> Distribution:
        """Build a distribution from its YAML mapping (``{dist: kind, **params}``).

        Raises ``ValueError`` prefixed with ``where`` for an unknown kind, missing or unknown parameters, and
        parameters that do not make sense (``min > max``, ``p`` not summing to 1, ...).
        """
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: expected a mapping like {{dist: lognormal, ...}}, got {raw!r}")
        params = dict(raw)
        kind = params.pop("dist", None)
        if not isinstance(kind, str) or kind not in cls._kinds:
            raise ValueError(f"{where}: unknown distribution {kind!r}; expected one of {sorted(cls._kinds)}")
        sub = cls._kinds[kind]
        names = {f.name for f in fields(sub)}
        required = {f.name for f in fields(sub) if f.default is MISSING}
        if missing := sorted(required - params.keys()):
            raise ValueError(f"{where}: {kind} is missing parameter(s) {missing}")
        if unknown := _unknown(params, names):
            raise ValueError(f"{where}: {kind} has unknown parameter(s) {unknown}; expected {sorted(names)}")
        try:
            return sub(**params)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    def sample(self, rng: np.random.Generator) -> float:
        """Draw one value."""
        raise NotImplementedError

    @property
    def bounds(self) -> tuple[float, float]:
        """The smallest and largest value ``sample`` can return."""
        raise NotImplementedError


@dataclass(frozen=True)
class LogNormal(Distribution):
    """``exp(N(mu, sigma))`` clipped to ``[min, max]``."""

    kind: ClassVar[str] = "lognormal"
    mu: float
    sigma: float
    min: float = 0.0
    max: float = math.inf

    def __post_init__(self) -> None:
        object.__setattr__(self, "mu", _number(self.mu, "mu"))
        object.__setattr__(self, "sigma", _number(self.sigma, "sigma"))
        object.__setattr__(self, "min", _number(self.min, "min"))
        # An absent max means unclipped; an explicit one must be a finite number.
        if self.max != math.inf:
            object.__setattr__(self, "max", _number(self.max, "max"))
        if self.sigma < 0:
            raise ValueError(f"sigma={self.sigma} must be >= 0")
        if self.min > self.max:
            raise ValueError(f"min={self.min} > max={self.max}")

    def sample(self, rng: np.random.Generator) -> float:
        return float(np.clip(math.exp(rng.normal(self.mu, self.sigma)), self.min, self.max))

    @property
    def bounds(self) -> tuple[float, float]:
        return self.min, self.max


@dataclass(frozen=True)
class Uniform(Distribution):
    """Reals uniform in ``[low, high)``."""

    kind: ClassVar[str] = "uniform"
    low: float
    high: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "low", _number(self.low, "low"))
        object.__setattr__(self, "high", _number(self.high, "high"))
        if self.low > self.high:
            raise ValueError(f"low={self.low} > high={self.high}")

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.uniform(self.low, self.high))

    @property
    def bounds(self) -> tuple[float, float]:
        return self.low, self.high


@dataclass(frozen=True)
class UniformInt(Distribution):
    """Integers uniform in ``[low, high]`` (both inclusive)."""

    kind: ClassVar[str] = "uniform_int"
    low: int
    high: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "low", _integer(self.low, "low"))
        object.__setattr__(self, "high", _integer(self.high, "high"))
        if self.low > self.high:
            raise ValueError(f"low={self.low} > high={self.high}")

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.integers(self.low, self.high, endpoint=True))

    @property
    def bounds(self) -> tuple[float, float]:
        return float(self.low), float(self.high)


@dataclass(frozen=True)
class Choice(Distribution):
    """One of ``values`` with probabilities ``p`` (equal if omitted)."""

    kind: ClassVar[str] = "choice"
    values: tuple[float, ...]
    p: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.values, (list, tuple)) or not self.values:
            raise ValueError(f"values must be a non-empty list, got {self.values!r}")
        object.__setattr__(self, "values", tuple(_number(v, "values[]") for v in self.values))
        if self.p is None:
            return
        if not isinstance(self.p, (list, tuple)) or len(self.p) != len(self.values):
            raise ValueError(f"p must be a list of {len(self.values)} probabilities (one per value), got {self.p!r}")
        p = tuple(_number(q, "p[]") for q in self.p)
        if any(q < 0 for q in p):
            raise ValueError(f"p={list(p)} has a negative probability")
        if abs(sum(p) - 1.0) > 1e-6:
            raise ValueError(f"p={list(p)} sums to {sum(p):g}, not 1")
        # numpy's tolerance on the sum is far tighter than the one above; renormalise so YAML rounding passes.
        object.__setattr__(self, "p", tuple(q / sum(p) for q in p))

    def sample(self, rng: np.random.Generator) -> float:
        return self.values[int(rng.choice(len(self.values), p=self.p))]

    @property
    def bounds(self) -> tuple[float, float]:
        return min(self.values), max(self.values)


@dataclass(frozen=True)
class Const(Distribution):
    """Always ``value``."""

    kind: ClassVar[str] = "const"
    value: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", _number(self.value, "value"))

    def sample(self, rng: np.random.Generator) -> float:
        return self.value

    @property
    def bounds(self) -> tuple[float, float]:
        return self.value, self.value


@dataclass(frozen=True)
class ModalitySpec:
    """One modality of a workload: its (normalised) weight in the mix and the distributions of its lengths.

    Only the fields of that modality are set: ``images``/``patches`` for image, ``frames``/``patches_per_frame``
    for video, ``seconds`` for audio.
    """

    name: str
    weight: float
    text_tokens: Distribution
    images: Distribution | None = None
    patches: Distribution | None = None
    frames: Distribution | None = None
    patches_per_frame: Distribution | None = None
    seconds: Distribution | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """A parsed, validated workload spec.

    ``merge`` holds a factor for each of image, video and audio (1 where the file gives none); ``modalities``
    keeps the file's order and has weights that sum to 1.
    """

    name: str
    description: str
    merge: dict[str, int]
    modalities: dict[str, ModalitySpec]


def available_workloads() -> list[str]:
    """Names of the bundled workload presets (usable as ``load_workload(name)``)."""
    return sorted(p.stem for p in WORKLOADS_DIR.glob("*.yaml"))


def load_workload(spec: str | os.PathLike[str]) -> WorkloadSpec:
    """Load a workload from a YAML file path or a bundled preset name (``"omni_mix"``, ``"vlm_dynres"``, ...).

    A path that exists wins over a preset of the same name. Raises ``FileNotFoundError`` if ``spec`` is neither,
    and ``ValueError`` naming the file and field for a malformed spec.
    """
    path = Path(spec)
    if not path.is_file():
        if isinstance(spec, str) and spec in available_workloads():
            path = WORKLOADS_DIR / f"{spec}.yaml"
        else:
            raise FileNotFoundError(
                f"workload {str(spec)!r} is neither a file nor a bundled preset ({', '.join(available_workloads())})"
            )
    try:
        raw = yaml.load(path.read_text(), Loader=_YAML_LOADER)
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from None
    return _parse_workload(raw, str(path), default_name=path.stem)


def _parse_workload(raw: Any, source: str, *, default_name: str) -> WorkloadSpec:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{source}: expected a mapping with name, description, merge and modalities")
    if unknown := _unknown(raw, {"name", "description", "merge", "modalities"}):
        raise ValueError(f"{source}: unknown top-level key(s) {unknown}")
    name = raw.get("name", default_name)
    description = raw.get("description", "")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{source}: name must be a non-empty string, got {name!r}")
    if not isinstance(description, str):
        raise ValueError(f"{source}: description must be a string, got {description!r}")
    merge = _parse_merge({} if raw.get("merge") is None else raw["merge"], source)

    modalities_raw = raw.get("modalities")
    if not isinstance(modalities_raw, Mapping) or not modalities_raw:
        raise ValueError(f"{source}: modalities must be a non-empty mapping of {list(MODALITIES)}")
    parsed = [_parse_modality(modality, body, source) for modality, body in modalities_raw.items()]
    total = sum(m.weight for m in parsed)
    modalities = {m.name: replace(m, weight=m.weight / total) for m in parsed}
    return WorkloadSpec(name=name, description=description, merge=merge, modalities=modalities)


def _parse_merge(raw: Any, source: str) -> dict[str, int]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{source}: merge must be a mapping like {{image: 4, audio: 4}}, got {raw!r}")
    if unknown := _unknown(raw, MEDIA_MODALITIES):
        raise ValueError(f"{source}: merge has unknown modality(ies) {unknown}; only {list(MEDIA_MODALITIES)} merge")
    merge = dict.fromkeys(MEDIA_MODALITIES, 1)
    for modality, factor in raw.items():
        merge[modality] = _check_merge(modality, factor, f"{source}: merge.{modality}")
    return merge


def _check_merge(modality: str, factor: Any, where: str) -> int:
    if isinstance(factor, bool) or not isinstance(factor, numbers.Integral):
        raise ValueError(f"{where} must be an integer, got {factor!r}")
    if modality in ("image", "video") and factor not in VISION_MERGES:
        raise ValueError(f"{where}={factor}: vision merge must be 1 (none) or 4 (2x2 spatial)")
    if factor < 1:
        raise ValueError(f"{where}={factor} must be a positive integer")
    return int(factor)


def _parse_modality(name: Any, raw: Any, source: str) -> ModalitySpec:
    where = f"{source}: modalities.{name}"
    if name not in MODALITIES:
        raise ValueError(f"{where}: unknown modality; expected one of {list(MODALITIES)}")
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping with weight and {list(_MODALITY_FIELDS[name])}")
    expected = _MODALITY_FIELDS[name]
    if missing := [f for f in ("weight", *expected) if f not in raw]:
        raise ValueError(f"{where}: missing field(s) {missing}")
    if unknown := _unknown(raw, {"weight", *expected}):
        raise ValueError(f"{where}: unknown field(s) {unknown}; a {name} sample has weight and {list(expected)}")
    try:
        weight = _number(raw["weight"], "weight")
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if weight <= 0:
        raise ValueError(f"{where}.weight={weight} must be positive")
    dists: dict[str, Distribution] = {}
    for field_name in expected:
        dist = Distribution.parse(raw[field_name], f"{where}.{field_name}")
        low, high = dist.bounds
        if field_name in _COUNT_FIELDS and low < 1:
            raise ValueError(
                f"{where}.{field_name}: can be {low:g}; a {name} sample needs at least 1 (set min/low >= 1)"
            )
        if low < 0:
            raise ValueError(f"{where}.{field_name}: can be negative ({low:g}); lengths must be >= 0")
        if high <= 0:
            raise ValueError(f"{where}.{field_name}: is never positive (at most {high:g})")
        dists[field_name] = dist
    return ModalitySpec(name=name, weight=weight, **dists)


@dataclass(frozen=True)
class SampleMeta:
    """The shape of one sample: its modality, text length and media sizes in encoder units.

    ``images`` holds each image's patch grid ``(h, w)``; video frames share one grid ``video_grid`` (``(0, 0)``
    without video); ``audio_frames`` counts mel frames. ``merge`` holds ``(modality, factor)`` pairs for image,
    video and audio (sorted, missing ones filled with 1) so the object stays hashable; see ``merge_factor``.
    """

    modality: str
    text_tokens: int
    images: tuple[tuple[int, int], ...] = ()
    video_frames: int = 0
    video_grid: tuple[int, int] = (0, 0)
    audio_frames: int = 0
    merge: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise ValueError(f"modality {self.modality!r} is not one of {list(MODALITIES)}")
        merge_in = dict(self.merge)
        if unknown := _unknown(merge_in, MEDIA_MODALITIES):
            raise ValueError(f"merge has unknown modality(ies) {unknown}")
        merge = {m: _check_merge(m, merge_in.get(m, 1), f"merge.{m}") for m in MEDIA_MODALITIES}
        object.__setattr__(self, "merge", tuple(sorted(merge.items())))

        text_tokens = _integer(self.text_tokens, "text_tokens")
        if text_tokens < 1:
            raise ValueError(f"text_tokens={text_tokens} must be >= 1 (every sample carries text)")
        object.__setattr__(self, "text_tokens", text_tokens)
        object.__setattr__(
            self, "images", tuple(_grid_of(g, f"images[{i}]", merge["image"]) for i, g in enumerate(self.images))
        )
        frames = _integer(self.video_frames, "video_frames")
        if frames < 0:
            raise ValueError(f"video_frames={frames} must be >= 0")
        object.__setattr__(self, "video_frames", frames)
        if frames == 0:
            if not isinstance(self.video_grid, (list, tuple)) or tuple(self.video_grid) != (0, 0):
                raise ValueError(f"video_grid={self.video_grid!r} must be (0, 0) without video frames")
            object.__setattr__(self, "video_grid", (0, 0))
        else:
            object.__setattr__(self, "video_grid", _grid_of(self.video_grid, "video_grid", merge["video"]))
        audio = _integer(self.audio_frames, "audio_frames")
        if audio < 0 or audio % merge["audio"]:
            raise ValueError(
                f"audio_frames={audio} must be a non-negative multiple of the audio merge {merge['audio']}"
            )
        object.__setattr__(self, "audio_frames", audio)

    def merge_factor(self, modality: str) -> int:
        """The merge factor of ``modality`` (``"image"``, ``"video"`` or ``"audio"``)."""
        return dict(self.merge)[modality]

    @property
    def merge_dict(self) -> dict[str, int]:
        """``merge`` as a ``{modality: factor}`` dict."""
        return dict(self.merge)

    def media_shapes(self) -> dict[str, list[tuple[int, ...]]]:
        """The sample's media items by modality, in the sizes :class:`~omni_lightning.batch.Modality` rules read:
        images as patch grids ``(h, w)``, a video as ``(frames, h, w)``, a clip as ``(mel_frames,)``."""
        shapes: dict[str, list[tuple[int, ...]]] = {}
        if self.images:
            shapes["image"] = [tuple(grid) for grid in self.images]
        if self.video_frames:
            shapes["video"] = [(self.video_frames, *self.video_grid)]
        if self.audio_frames:
            shapes["audio"] = [(self.audio_frames,)]
        return shapes

    @cached_property
    def vision_patches(self) -> int:
        """Patches the vision encoder sees: all images plus all video frames."""
        h, w = self.video_grid
        return sum(ih * iw for ih, iw in self.images) + self.video_frames * h * w

    @cached_property
    def llm_tokens(self) -> int:
        """Sequence length in the LLM: BOS, text, one token per merged vision unit and per merged audio unit."""
        merge = self.merge_dict
        h, w = self.video_grid
        return (
            1
            + self.text_tokens
            + sum(ih * iw // merge["image"] for ih, iw in self.images)
            + self.video_frames * (h * w // merge["video"])
            + self.audio_frames // merge["audio"]
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the derived ``vision_patches``/``llm_tokens`` included for readers without this code)."""
        return {
            "modality": self.modality,
            "text_tokens": self.text_tokens,
            "images": [list(g) for g in self.images],
            "video_frames": self.video_frames,
            "video_grid": list(self.video_grid),
            "audio_frames": self.audio_frames,
            "merge": self.merge_dict,
            "vision_patches": self.vision_patches,
            "llm_tokens": self.llm_tokens,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SampleMeta:
        """Inverse of ``to_json``.

        Keys other than those ``to_json`` writes (e.g. a shard's ``class_id``) are ignored; ``vision_patches`` and
        ``llm_tokens``, if present, must agree with the sizes. Raises ``ValueError`` for missing keys, wrong types
        and impossible values.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"sample metadata must be a mapping, got {type(data).__name__}")
        required = ("modality", "text_tokens", "images", "video_frames", "video_grid", "audio_frames", "merge")
        if missing := [k for k in required if k not in data]:
            raise ValueError(f"sample metadata is missing key(s) {missing}")
        images, merge = data["images"], data["merge"]
        if not isinstance(images, (list, tuple)):
            raise ValueError(f"images must be a list of [h, w] grids, got {images!r}")
        if not isinstance(merge, Mapping):
            raise ValueError(f"merge must be a mapping of modality to factor, got {merge!r}")
        meta = cls(
            modality=data["modality"],
            text_tokens=data["text_tokens"],
            images=tuple(images),
            video_frames=data["video_frames"],
            video_grid=data["video_grid"],
            audio_frames=data["audio_frames"],
            merge=tuple(merge.items()),
        )
        for derived in ("vision_patches", "llm_tokens"):
            if derived in data and data[derived] != getattr(meta, derived):
                raise ValueError(f"{derived}={data[derived]!r} disagrees with the sizes ({getattr(meta, derived)})")
        return meta


def _grid_of(grid: Any, name: str, merge: int) -> tuple[int, int]:
    if not isinstance(grid, (list, tuple)) or len(grid) != 2:
        raise ValueError(f"{name} must be an (h, w) pair, got {grid!r}")
    h, w = _integer(grid[0], f"{name} h"), _integer(grid[1], f"{name} w")
    if h < 1 or w < 1:
        raise ValueError(f"{name}=({h}, {w}) must have positive sides")
    if merge == 4 and (h % 2 or w % 2):
        raise ValueError(f"{name}=({h}, {w}) cannot be merged 2x2: both sides must be even")
    return h, w


def min_llm_tokens(spec: WorkloadSpec) -> int:
    """The shortest sequence every modality of ``spec`` can be cut down to (BOS + 1 text token + 1 media token)."""
    return 2 if set(spec.modalities) == {"text"} else 3


def _draw_grid(patches: float, rng: np.random.Generator, merge: int) -> tuple[int, int]:
    # Always draw the aspect, even for tiny grids, so the number of rng draws does not depend on the sizes.
    aspect = math.exp(rng.uniform(math.log(_MIN_ASPECT), math.log(_MAX_ASPECT)))  # w / h
    unit = 2 if merge == 4 else 1
    h = max(unit, unit * round(math.sqrt(patches / aspect) / unit))
    w = max(unit, unit * round(math.sqrt(patches * aspect) / unit))
    return h, w


def _draw_media(
    modality: ModalitySpec, merge: dict[str, int], count: int, rng: np.random.Generator, scale: float
) -> SampleMeta:
    # The media of one sample, with a single text token: its llm_tokens - 2 is what the media costs.
    pairs = tuple(merge.items())
    if modality.name == "image":
        assert modality.patches is not None
        patches = modality.patches
        grids = tuple(_draw_grid(patches.sample(rng) * scale, rng, merge["image"]) for _ in range(count))
        return SampleMeta(modality="image", text_tokens=1, images=grids, merge=pairs)
    if modality.name == "video":
        assert modality.patches_per_frame is not None
        grid = _draw_grid(modality.patches_per_frame.sample(rng) * scale, rng, merge["video"])
        return SampleMeta(modality="video", text_tokens=1, video_frames=count, video_grid=grid, merge=pairs)
    if modality.name == "audio":
        assert modality.seconds is not None
        unit = merge["audio"]
        frames = max(1, round(modality.seconds.sample(rng) * scale * MEL_FRAMES_PER_SECOND))
        return SampleMeta(modality="audio", text_tokens=1, audio_frames=-(-frames // unit) * unit, merge=pairs)
    return SampleMeta(modality=modality.name, text_tokens=1, merge=pairs)


def check_sampling_args(spec: WorkloadSpec, *, length_scale: float, max_llm_tokens: int | None) -> None:
    """Raise ``ValueError`` unless ``sample_metadata(spec, rng, length_scale=..., max_llm_tokens=...)`` can work."""
    if isinstance(length_scale, bool) or not (
        isinstance(length_scale, numbers.Real) and math.isfinite(length_scale) and length_scale > 0
    ):
        raise ValueError(f"length_scale={length_scale!r} must be a positive finite number")
    if max_llm_tokens is None:
        return
    if isinstance(max_llm_tokens, bool) or not isinstance(max_llm_tokens, numbers.Integral):
        raise ValueError(f"max_llm_tokens={max_llm_tokens!r} must be an integer or None")
    if max_llm_tokens < min_llm_tokens(spec):
        raise ValueError(
            f"max_llm_tokens={max_llm_tokens} is too small for workload {spec.name!r}: a sample needs at least"
            f" {min_llm_tokens(spec)} tokens (BOS, one text token and one media token)"
        )


def sample_metadata(
    spec: WorkloadSpec,
    rng: np.random.Generator,
    *,
    length_scale: float = 1.0,
    max_llm_tokens: int | None = None,
) -> SampleMeta:
    """Draw one sample's shape from ``spec``: a modality by weight, then its lengths.

    ``length_scale`` multiplies every drawn size (text tokens, patches, patches per frame, seconds) before
    rounding, but not the counts (images per sample, video frames), so small CPU runs keep the workload's mix.
    Patch counts become ``(h, w)`` grids with a log-uniform aspect ratio in [0.5, 2] and both sides even when the
    merge is 4; audio becomes mel frames rounded up to a whole number of merge units.

    With ``max_llm_tokens``, an over-long sample is cut to fit: text shrinks first (down to 1 token); if the media
    alone is too long, it is redrawn at half the size (halving again until it fits; if even the smallest grids
    cannot fit, the image/frame count is halved first), and the text then takes what room is left, up to its
    drawn length. Everything is a function of ``rng`` alone. Raises ``ValueError`` if ``max_llm_tokens`` is below
    ``min_llm_tokens(spec)``.
    """
    check_sampling_args(spec, length_scale=length_scale, max_llm_tokens=max_llm_tokens)
    names = list(spec.modalities)
    modality = spec.modalities[names[int(rng.choice(len(names), p=[spec.modalities[n].weight for n in names]))]]
    text_tokens = max(1, round(modality.text_tokens.sample(rng) * length_scale))
    count = 0
    if modality.name == "image":
        assert modality.images is not None
        count = round(modality.images.sample(rng))
    elif modality.name == "video":
        assert modality.frames is not None
        count = round(modality.frames.sample(rng))
    media = _draw_media(modality, spec.merge, count, rng, length_scale)

    if max_llm_tokens is not None and media.llm_tokens - 1 + text_tokens > max_llm_tokens:
        budget = max_llm_tokens - 2  # room for media once BOS and one text token are in
        if media.llm_tokens - 2 > budget:
            # At the smallest grid every image/frame still costs one token, so only fewer of them can fit.
            while count > budget:
                count = (count + 1) // 2
            scale = length_scale
            while media.llm_tokens - 2 > budget:
                scale /= 2
                media = _draw_media(modality, spec.merge, count, rng, scale)
        text_tokens = min(text_tokens, max_llm_tokens - (media.llm_tokens - 1))
    return replace(media, text_tokens=text_tokens)
