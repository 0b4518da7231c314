"""Lightning strategies."""

from omni_lightning.strategies.omni import OmniStrategy

__all__ = ["OmniStrategy"]
