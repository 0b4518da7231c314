"""Release 0.1's module of decoded samples and packing, kept so that its checkpoints resume (their loader states
pickle carried-over samples as ``omni_lightning.datamodules.collate.DecodedSample``) and its imports still work:
:func:`pack_samples` and :func:`check_packable` take 0.1's keyword arguments. New code uses
:mod:`omni_lightning.data.packing` with a :class:`~omni_lightning.batch.PackingSpec`."""

from typing import Any

from omni_lightning.data import packing
from omni_lightning.data.packing import DecodedSample
from omni_lightning.modalities import packing_spec

__all__ = ["DecodedSample", "check_packable", "pack_samples"]


def check_packable(sample: DecodedSample, *, patch_size: int = 14, vision_merge: int = 4,
                   audio_downsample: int = 4) -> None:
    """:func:`omni_lightning.data.packing.check_packable` with the packing of these sizes."""
    packing.check_packable(sample, packing_spec(patch_size=patch_size, vision_merge=vision_merge,
                                                audio_downsample=audio_downsample))


def pack_samples(samples: list[DecodedSample], *, patch_size: int = 14, vision_merge: int = 4,
                 audio_downsample: int = 4) -> dict[str, Any]:
    """:func:`omni_lightning.data.packing.pack_samples` with the packing of these sizes."""
    return packing.pack_samples(samples, packing_spec(patch_size=patch_size, vision_merge=vision_merge,
                                                      audio_downsample=audio_downsample))
