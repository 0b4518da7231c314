"""Leaf types of a training step: token roles, the modalities and encoder formats a batch is packed by, and the
packed batch itself. Pure Python and numpy: every layer above reads these.

A *packed micro-batch* is a dict (:data:`PackedBatch`) of ``input_ids``, ``labels``, ``position_ids`` (``[tokens]``;
positions restart in every sample), ``cu_seqlens`` (int32 ``[samples + 1]``), ``keys`` and ``num_samples``, and for
every encoder ``e`` of the :class:`PackingSpec` each of its inputs ``n`` under :func:`input_key` ``(e, n)``
(``vision_patches``, ``vision_positions``, ``vision_grids``, ``audio_mels``, ``audio_lengths`` for the built-in
encoders), the items of all samples back to back in placeholder order. A pipeline step is a dict whose
``micro_batches`` lists the step's packed micro-batches in run order.

A sample's sequence is ``[BOS]``, then for every modality in the spec's order each of its media items as that
modality's placeholder token, once per encoder output (an image of ``h x w`` patches merged 2x2 gives ``h * w / 4``),
then the text. Labels are the next token where that token is text, :data:`IGNORE_INDEX` elsewhere.

Where a model *assembles* an encoder's outputs media item by media item before they fill the placeholders
(LLaVA-OneVision unpads an image's tiles into one map with a newline per row, and pools a video's frames; a
modality with :attr:`Modality.assembled_tokens`), a media item has that many placeholders instead, and the batch
also carries, under :func:`media_key` ``(e)``, the list of encoder ``e``'s media items in placeholder order, each as
``(modality name, MediaShape)``: what the model's assembly reads to lay their outputs out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

__all__ = [
    "AnyResolution",
    "BYTE_ROLES",
    "Encoded",
    "EncoderOutputs",
    "IGNORE_INDEX",
    "MediaShape",
    "PendingMedia",
    "SizedMedia",
    "EncoderFormat",
    "EncoderInput",
    "Modality",
    "GROUP_WORK_KEY",
    "PackedBatch",
    "PackingSpec",
    "TokenRoles",
    "input_key",
    "media_key",
    "media_shape",
    "media_source_size",
]

IGNORE_INDEX = -100

# A loader that plans a group of ranks' micro-batches together (the reorder stream) tells each micro-batch what every
# rank of that group trains beside it: ``{"ranks": the group's global ranks, "encoders": names, "work": int64 array
# [rank, feature]}``, each rank's cost features of its micro-batch (every encoder's stem tokens and pairs, then the
# LLM's tokens and pairs; see omni_lightning.balance.cost.work_features). Every member derives it from the same
# gathered metadata, so an encoder resharder over the same ranks can tell, without gathering item sizes, where
# resharding could not pay.
GROUP_WORK_KEY = "group_work"

PackedBatch = dict[str, Any]

# What an encoder stage hands the model for one micro-batch: for each encoder, its outputs in placeholder order. The
# first replaces the placeholders' embeddings; a model may want more per item (features it injects at deeper
# decoder layers, as Qwen3-VL's DeepStack does).
Encoded = Mapping[str, tuple["torch.Tensor", ...]]


class EncoderOutputs(Mapping[str, tuple["torch.Tensor", ...]]):
    """:data:`Encoded` as an encoder stage hands it to a model.

    Deliberately not a ``dict``: FSDP2 hooks its root's gradient reduction onto the tensors among the root's forward
    arguments, which it finds by flattening dicts, lists and tuples. Hooked there, the reduction would run once these
    outputs' gradients are ready, before the encoders' own parameters (and the token embedding) have theirs. A
    mapping of another type is one opaque argument.
    """

    def __init__(self, outputs: Mapping[str, tuple[torch.Tensor, ...]]) -> None:
        self._outputs = dict(outputs)

    def __getitem__(self, name: str) -> tuple[torch.Tensor, ...]:
        return self._outputs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._outputs)

    def __len__(self) -> int:
        return len(self._outputs)


MediaShape = tuple[int, ...]


@dataclass(frozen=True)
class PendingMedia:
    """A media item not decoded yet: its bytes and the array shape its header promises. Plans price it by that
    shape, so only the rank that trains it decodes it, after the plan
    (:meth:`omni_lightning.data.layouts.SampleReader.decode`). ``source_size`` is its own size before the processor
    resized it (an any-resolution image's ``(height, width)``), where its placeholders depend on it."""

    data: bytes
    shape: tuple[int, ...]
    member: str = ""
    source_size: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class SizedMedia:
    """A decoded media item with the size it had before the processor resized it: an any-resolution image's tiles
    ``[n, h, w, 3]`` with the image's own ``(height, width)``, from which LLaVA-OneVision lays out their outputs.
    Reads as its array (``np.asarray``)."""

    array: np.ndarray
    source_size: tuple[int, ...]

    def __array__(self, dtype: npt.DTypeLike = None, copy: bool | None = None) -> np.ndarray:
        array = self.array if dtype is None else self.array.astype(dtype, copy=False)
        return array.copy() if copy else array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)


def media_shape(item: Any) -> tuple[int, ...]:
    """The array shape of a media item, decoded or pending."""
    return tuple(item.shape) if isinstance(item, PendingMedia | SizedMedia) else tuple(np.shape(item))


def media_source_size(item: Any) -> tuple[int, ...]:
    """A media item's size before the processor resized it, where it carries one (else ``()``)."""
    return tuple(item.source_size) if isinstance(item, PendingMedia | SizedMedia) else ()


def input_key(encoder: str, name: str) -> str:
    """The key of encoder ``encoder``'s input ``name`` in a packed batch (``vision_patches``)."""
    return f"{encoder}_{name}"


def media_key(encoder: str) -> str:
    """The key of the list of encoder ``encoder``'s media items in a packed batch (``vision_media``), present where
    the model assembles that encoder's outputs (see the module's docstring)."""
    return f"{encoder}_media"


@dataclass(frozen=True)
class TokenRoles:
    """Token ids that are not text: padding, the start of a sample (``None`` where the tokenizer has none), the end
    of one, and each modality's placeholder (several modalities may share one id, as image and video do in the byte
    roles).

    The byte roles (the default) keep ids 0-3 for these, so a byte tokenizer's text starts at :attr:`first_free_id`.
    A real tokenizer's roles (:func:`omni_lightning.data.processor.load_processor`) are ordinary ids of its
    vocabulary: its samples come rendered, with their targets marked, so no id range is reserved.
    """

    pad: int = 0
    bos: int | None = 1
    placeholders: tuple[tuple[str, int], ...] = (("image", 2), ("video", 2), ("audio", 3))
    eos: int | None = None

    def __post_init__(self) -> None:
        ids = {"pad": self.pad, "bos": self.bos, "eos": self.eos,
               **{f"placeholder {m}": i for m, i in self.placeholders}}
        for name, value in ids.items():
            if value is None and name in ("bos", "eos"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"token role {name} must be a non-negative integer id, got {value!r}")
        names = [m for m, _ in self.placeholders]
        if len(set(names)) != len(names):
            raise ValueError(f"modalities {names} have more than one placeholder each")
        # pad, bos and eos may coincide (GPT-2-style vocabularies have one <|endoftext|> for all three).
        if {self.pad, self.bos, self.eos} & {i for _, i in self.placeholders}:
            raise ValueError(f"pad ({self.pad}), bos ({self.bos}) and eos ({self.eos}) must differ from the "
                             f"placeholders {dict(self.placeholders)}")

    def has_placeholder(self, modality: str) -> bool:
        return any(name == modality for name, _ in self.placeholders)

    def placeholder(self, modality: str) -> int:
        """The placeholder id of ``modality``."""
        for name, token in self.placeholders:
            if name == modality:
                return token
        raise ValueError(f"no placeholder token for modality {modality!r}; the roles name "
                         f"{[m for m, _ in self.placeholders]}")

    @property
    def special_ids(self) -> np.ndarray:
        """Every id with a role but the end of a sample, sorted: never text, never a target."""
        return np.unique([i for i in (self.pad, self.bos, *(i for _, i in self.placeholders)) if i is not None])

    @property
    def filler(self) -> int:
        """The one token of a filler micro-batch (a step with fewer samples than micro-batches)."""
        return self.pad if self.bos is None else self.bos

    @property
    def first_free_id(self) -> int:
        """The smallest id above every role (where a byte tokenizer's text starts)."""
        return int(self.special_ids.max()) + 1


BYTE_ROLES = TokenRoles()


@dataclass(frozen=True)
class EncoderInput:
    """One input tensor of an encoder: its rows are either one per item (``per_item``: image grids, clip lengths)
    or :attr:`EncoderFormat.rows_per_token` per stem token of an item (patches, mel frames), concatenated item after
    item. ``trailing`` is its shape after the rows, ``dtype`` a numpy dtype name."""

    name: str
    per_item: bool
    dtype: str
    trailing: Callable[[PackingSpec], tuple[int, ...]]


@dataclass(frozen=True)
class EncoderFormat:
    """How an encoder's items sit in a packed batch.

    ``item_tokens(per_item, spec)`` gives each item's stem tokens (the tokens its attention runs over) from its
    per-item inputs (numpy, by name: small, so the sizes are read without touching pixels); ``rows_per_token`` the
    rows of every per-token input per stem token; ``tokens_per_output`` the stem tokens merged into one output
    embedding (one placeholder).
    """

    name: str
    inputs: tuple[EncoderInput, ...]
    item_tokens: Callable[[Mapping[str, np.ndarray], PackingSpec], np.ndarray]
    rows_per_token: Callable[[PackingSpec], int]
    tokens_per_output: Callable[[PackingSpec], int]

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)

    def empty(self, spec: PackingSpec) -> tuple[np.ndarray, ...]:
        """Inputs of no item."""
        return tuple(np.zeros((0, *i.trailing(spec)), dtype=i.dtype) for i in self.inputs)

    @property
    def per_item_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs if i.per_item)

    def item_rows(self, per_item: Mapping[str, np.ndarray], spec: PackingSpec) -> list[np.ndarray]:
        """For every input, the rows each item takes in it, from the per-item inputs."""
        tokens = np.asarray(self.item_tokens(per_item, spec), dtype=np.int64)
        per_token = tokens * self.rows_per_token(spec)
        return [np.ones_like(tokens) if i.per_item else per_token for i in self.inputs]


@dataclass(frozen=True)
class Modality:
    """One kind of media and how it becomes encoder items (see :mod:`omni_lightning.modalities` for the built-in ones).

    Args:
        name: the modality (``"image"``); its placeholder is ``TokenRoles.placeholder(name)``.
        encoder: the encoder that encodes it (several modalities may share one).
        shape: a decoded media item's size in encoder units (an image's patch grid), from the item alone; raises
            ``ValueError`` naming the problem if it cannot be packed.
        item_tokens: the stem tokens of each encoder item a media item of that size becomes (a video of ``F``
            frames is ``ceil(F / temporal patch)`` items); the planners read sizes from metadata through it.
        build: the media item as encoder inputs, one array per input of its encoder's format, in that order.
        assembled_tokens: where the model assembles a media item's encoder outputs into another sequence before
            they fill its placeholders (LLaVA-OneVision's unpadded tiles with a newline per row, its pooled video
            frames): that sequence's length, from the size alone. ``None``: one placeholder per encoder output.
    """

    name: str
    encoder: str
    shape: Callable[[Any, PackingSpec], MediaShape]
    item_tokens: Callable[[MediaShape, PackingSpec], list[int]]
    build: Callable[[Any, PackingSpec], tuple[np.ndarray, ...]]
    assembled_tokens: Callable[[MediaShape, PackingSpec], int] | None = None


@dataclass(frozen=True)
class AnyResolution:
    """LLaVA-OneVision's any-resolution layout (LLaVA-NeXT's, with its ``anyres_max`` bound): an image alone in its
    sample is encoded whole at ``tile`` pixels, then fitted into the best of the ``pinpoints`` canvases
    (``(height, width)``, whole tiles) and encoded tile by tile; the tiles' outputs are unpadded back to the image's
    aspect, scaled down to about ``max_tiles`` tiles' worth and given a newline embedding per row. An image sharing
    its sample is one tile with one newline; a video's frames are pooled 2x2 with one newline per video."""

    tile: int
    pinpoints: tuple[tuple[int, int], ...]
    max_tiles: int

    def __post_init__(self) -> None:
        if self.tile < 1 or self.max_tiles < 1:
            raise ValueError(f"tile={self.tile} and max_tiles={self.max_tiles} must be positive")
        if not self.pinpoints or any(h < self.tile or w < self.tile or h % self.tile or w % self.tile
                                     for h, w in self.pinpoints):
            raise ValueError(f"image_grid_pinpoints {[list(p) for p in self.pinpoints]} must be whole multiples of "
                             f"the tile side {self.tile}")


@dataclass(frozen=True)
class PackingSpec:
    """How samples pack into micro-batches: token roles, the modalities in sequence order, their encoders' formats,
    and the sizes the encoders cut media by (pixels per patch side, vision tokens merged into one, frames per
    temporal patch, mel frames per audio token). Build the built-in one with
    :func:`omni_lightning.modalities.packing_spec`."""

    modalities: tuple[Modality, ...]
    encoders: tuple[EncoderFormat, ...]
    roles: TokenRoles = BYTE_ROLES
    patch_size: int = 14
    vision_merge: int = 4
    temporal_patch_size: int = 1
    audio_downsample: int = 4
    # How pixels are normalised into patches: the processor's mean and std (0.5 and 0.5: to [-1, 1]).
    pixel_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    pixel_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    # The model's any-resolution layout of images (LLaVA-OneVision), which its image and video modalities follow.
    any_resolution: AnyResolution | None = None

    def __post_init__(self) -> None:
        for name in ("patch_size", "vision_merge", "temporal_patch_size", "audio_downsample"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.vision_merge not in (1, 4):
            raise ValueError(f"vision_merge={self.vision_merge} must be 1 or 4 (a 2x2 spatial merge)")
        encoders = [e.name for e in self.encoders]
        if len(set(encoders)) != len(encoders):
            raise ValueError(f"encoders {encoders} are not distinct")
        modalities = [m.name for m in self.modalities]
        if len(set(modalities)) != len(modalities):
            raise ValueError(f"modalities {modalities} are not distinct")
        for modality in self.modalities:
            if modality.encoder not in encoders:
                raise ValueError(f"modality {modality.name!r} is encoded by {modality.encoder!r}, which is not one of "
                                 f"the encoders {encoders}")
            self.roles.placeholder(modality.name)

    @property
    def encoder_names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.encoders)

    @property
    def modality_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.modalities)

    def modality(self, name: str) -> Modality:
        for modality in self.modalities:
            if modality.name == name:
                return modality
        raise ValueError(f"unknown modality {name!r}; this packing has {list(self.modality_names)}")

    def encoder(self, name: str) -> EncoderFormat:
        for encoder in self.encoders:
            if encoder.name == name:
                return encoder
        raise ValueError(f"unknown encoder {name!r}; this packing has {list(self.encoder_names)}")

    def placeholder_ids(self, encoder: str) -> tuple[int, ...]:
        """The placeholder ids whose positions take ``encoder``'s outputs (in sequence order, whichever the id)."""
        return tuple(sorted({self.roles.placeholder(m.name) for m in self.modalities if m.encoder == encoder}))

    @property
    def assembled_encoders(self) -> tuple[str, ...]:
        """The encoders whose outputs the model assembles per media item (a packed batch lists their media)."""
        return tuple(dict.fromkeys(m.encoder for m in self.modalities if m.assembled_tokens is not None))

    def media_placeholders(self, modality: Modality, shape: MediaShape) -> int:
        """Placeholder tokens of a media item of ``shape``: its encoder outputs, or as many as the model assembles
        them into (:attr:`Modality.assembled_tokens`)."""
        if modality.assembled_tokens is not None:
            return modality.assembled_tokens(shape, self)
        merge = self.encoder(modality.encoder).tokens_per_output(self)
        return sum(tokens // merge for tokens in modality.item_tokens(shape, self))
