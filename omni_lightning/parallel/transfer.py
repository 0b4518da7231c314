"""Host-built values onto the compute device without making the host wait for it.

A blocking copy to an accelerator (``torch.tensor(data, device=...)``, ``.to(device)``) first waits for every kernel
queued before it, so a step that builds index tensors on the host (exchange orders, item selections, dummy items)
would stop the host's run-ahead at each of them. :func:`to_device` copies without that wait: the source is staged
by the copy call itself, so the host may drop or change it as soon as the call returns.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["to_device"]


def to_device(data: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (a list, a NumPy array, a host tensor) as a tensor on ``device``, copied without waiting for the
    device's queued work."""
    return torch.as_tensor(data, dtype=dtype).to(device, non_blocking=True)
