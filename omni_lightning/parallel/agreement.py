"""Checking that ranks which computed a plan redundantly computed the same one, before they act on it.

Every rank of a group derives the same plan from the same all-gathered integers, so no coordinator sends it. If two
machines rounded the plan's floating-point arithmetic differently, they would issue mismatched collectives (a hang)
or move payloads into the wrong buffers (silently wrong data). One all-gather of an 8-byte digest per plan turns
that into an immediate error on every rank, naming the plan and who disagrees.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from omni_lightning.parallel.compat import all_gather_single

__all__ = ["PlanDisagreement", "check_plans_agree"]


class PlanDisagreement(RuntimeError):
    """Ranks that must compute the same plan computed different ones."""


def check_plans_agree(what: str, digest: int, group: dist.ProcessGroup | None, *, device: torch.device) -> None:
    """Raise :class:`PlanDisagreement` on every member of ``group`` unless all of them pass the same ``digest`` of
    ``what`` (:func:`~omni_lightning.balance.digest.plan_digest`). ``device``: where the group's backend wants
    tensors (the compute device for NCCL, the CPU for gloo)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    size = dist.get_world_size(group)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    everyone = torch.empty(size, dtype=torch.int64, device=device)
    all_gather_single(everyone, mine, group=group)
    digests = everyone.tolist()
    if len(set(digests)) == 1:
        return
    by_digest: dict[int, list[int]] = {}
    for member, value in enumerate(digests):
        by_digest.setdefault(value, []).append(dist.get_global_rank(group, member))
    sides = "; ".join(f"ranks {ranks} computed {value & (2**64 - 1):016x}" for value, ranks in by_digest.items())
    raise PlanDisagreement(
        f"the {what} differs between ranks that must compute the same one ({sides}): their inputs or their "
        "floating-point arithmetic differ (another CPU or BLAS build?); stopping before a collective that would hang"
    )
