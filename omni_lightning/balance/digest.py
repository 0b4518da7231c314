"""A digest of an integer plan: what ranks that compute the same plan redundantly compare before they act on it.

Only the plan's integers go in (assignments, splits, orders), never the floating-point inputs it was computed
from: those may round differently on two machines, and what matters is whether the decisions agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

__all__ = ["plan_digest"]


def plan_digest(parts: Iterable[object]) -> int:
    """A signed 64-bit digest of ``parts``, each an integer or an array-like of integers (its length counts too, so
    ``[1, 2], [3]`` and ``[1], [2, 3]`` differ)."""
    hasher = hashlib.blake2b(digest_size=8)
    for part in parts:
        values = np.asarray(part)
        if values.size and values.dtype.kind not in "biu":  # an empty list is float64 to numpy: no values, no harm
            raise TypeError(f"a plan digest takes integers, got {values.dtype}: digest decisions, not their inputs")
        values = np.ascontiguousarray(values, dtype=np.int64).reshape(-1)
        hasher.update(np.int64(values.size).tobytes())
        hasher.update(values.tobytes())
    return int.from_bytes(hasher.digest(), "little", signed=True)
