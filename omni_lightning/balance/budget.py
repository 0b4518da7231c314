"""A deterministic work budget for the planners' searches.

Several ranks run the same plan redundantly and must arrive at the same result, so a search may not stop by a
clock (ranks differ in speed and load): it stops when it has *evaluated* a fixed number of candidates, keeping the
best plan so far. Counts depend only on the inputs, so every rank stops at the same plan, and the bound on the
count bounds the planner's cost whatever the workload.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WorkBudget"]


@dataclass
class WorkBudget:
    """A count of evaluations a search may still make.

    ``limit``: evaluations allowed in all; ``used``: evaluations made so far (a candidate priced or replayed counts
    one). A search asks :meth:`take` before evaluating a batch of candidates and stops, keeping its best plan so
    far, when the answer is no. One budget may be shared by several searches of one plan, so that the plan's whole
    cost is bounded.
    """

    limit: int
    used: int = 0

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"limit={self.limit} must be at least 0")

    @property
    def left(self) -> int:
        """Evaluations still allowed."""
        return max(self.limit - self.used, 0)

    @property
    def exhausted(self) -> bool:
        return self.used >= self.limit

    def take(self, evaluations: int) -> bool:
        """Spend ``evaluations`` if that many are left (``True``); otherwise spend nothing (``False``)."""
        if evaluations > self.left:
            return False
        self.used += evaluations
        return True
