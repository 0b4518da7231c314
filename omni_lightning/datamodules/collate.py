"""The name :class:`~omni_lightning.data.packing.DecodedSample` had in release 0.1, where the loader states of its
checkpoints pickled carried-over samples: kept so that those checkpoints resume."""

from omni_lightning.data.packing import DecodedSample

__all__ = ["DecodedSample"]
