"""Replay a pipeline step on dedicated hardware from each rank's action order and measured action durations.

A CPU test machine runs more pipeline ranks than it has cores, so wall-clock idle time there mixes pipeline
bubbles with waiting for a core. Each action's own compute time (thread CPU time) is not affected, so replaying the
recorded action order with those durations and the pipeline's dependencies gives the step as dedicated devices
would run it. Dependencies (transfers are taken as instantaneous):

* ``F`` (forward of micro-batch ``m``) on stage ``s > 0`` waits for stage ``s - 1``'s ``F`` of ``m``; on stage 0 it
  waits for every rank's ``E`` of ``m`` (the joint pipeline's encoder shares), where there are any;
* ``B`` (backward) on stage ``s`` waits for stage ``s + 1``'s ``B`` of ``m``;
* ``EB`` (encoder backward of a share) on a rank other than 0 waits for rank 0's ``G`` of ``m`` (the gradients);
* ``E`` and ``G`` wait for nothing but their own rank.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "ReplayResult", "one_f_one_b_bubble", "replay_pipeline", "waits_for"]


@dataclass(frozen=True)
class Action:
    """``kind`` is ``"F"``, ``"B"``, ``"E"``, ``"EB"`` or ``"G"`` (see the module docstring); ``index`` the
    micro-batch; ``seconds`` its duration on this rank."""

    kind: str
    index: int
    seconds: float


@dataclass
class ReplayResult:
    makespan: float
    busy: list[float]  # per stage

    @property
    def bubbles(self) -> list[float]:
        """Idle share of the step, per stage."""
        return [1.0 - b / self.makespan if self.makespan > 0 else 0.0 for b in self.busy]

    @property
    def bubble(self) -> float:
        """Idle share of all stages' time together."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan > 0 else 0.0


def one_f_one_b_bubble(stages: int, micro_batches: int) -> float:
    """The bubble of 1F1B (and GPipe) with uniform micro-batches and stages: ``(p - 1) / (m + p - 1)``."""
    return (stages - 1) / (micro_batches + stages - 1)


def waits_for(stage: int, kind: str, index: int, stages: int,
              encoded: set[tuple[int, int]]) -> list[tuple[int, str, int]]:
    """The ``(stage, kind, micro-batch)`` actions that action ``kind`` of micro-batch ``index`` on ``stage`` waits
    for (the module docstring's rules); ``encoded`` holds the ``(rank, micro-batch)`` pairs that have an ``E``.
    Shared with the vectorised step-time models of :mod:`omni_lightning.balance.pipeline_order`, so that they and this
    replay cannot drift apart."""
    if kind == "F" and stage > 0:
        return [(stage - 1, "F", index)]
    if kind == "F":
        return [(r, "E", index) for r in range(stages) if (r, index) in encoded]
    if kind == "B" and stage < stages - 1:
        return [(stage + 1, "B", index)]
    if kind == "EB" and stage > 0:
        return [(0, "G", index)]
    return []


def replay_pipeline(actions: list[list[Action]]) -> ReplayResult:
    """Start every action as soon as its rank is free and its dependencies are met (stage order = list order)."""
    stages = len(actions)
    end: dict[tuple[int, str, int], float] = {}
    encoded = {(s, a.index) for s in range(stages) for a in actions[s] if a.kind == "E"}
    clock = [0.0] * stages
    position = [0] * stages
    busy = [sum(a.seconds for a in rank) for rank in actions]

    while any(position[s] < len(actions[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] >= len(actions[s]):
                continue
            action = actions[s][position[s]]
            needed = waits_for(s, action.kind, action.index, stages, encoded)
            if any(key not in end for key in needed):
                continue
            start = max([clock[s], *(end[key] for key in needed)])
            clock[s] = start + action.seconds
            end[(s, action.kind, action.index)] = clock[s]
            position[s] += 1
            progressed = True
        if not progressed:
            raise ValueError("the recorded action orders deadlock: some action waits on one that never runs")
    return ReplayResult(max(clock), busy)
