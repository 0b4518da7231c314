"""Per-stage action orders of one pipeline step, for :func:`omni_lightning.sim.replay_pipeline`.

* :func:`one_f_one_b`: 1F1B (stage ``s`` of ``p`` runs ``p - 1 - s`` warm-up forwards, then alternates, then drains).
  Encoders on stage 0 (the coupled placement) are folded into stage 0's forward and backward durations.
* :func:`joint_pipeline`: the same 1F1B order with the encoder insertions of
  :class:`omni_lightning.runtime.joint.JointEncoders` (uniform on-demand insertion): stage ``s > 0``
  encodes its share of micro-batch ``m + s + 1`` just before its forward of ``m`` (the first ``s + 1`` shares before
  the step starts) and backpropagates its share of ``m - p``; stage 0 encodes its share of ``m`` in line, sends the
  gradients of ``m`` (``G``) as soon as its backward of ``m`` produced them, and backpropagates its own share of
  ``m - p`` before its forward of ``m``; what is left runs after the schedule. (The runtime keeps stage 0's
  share of the last ``p`` micro-batches at zero; callers choose the shares, and the simulator's Omni placement
  does the same.)
"""

from __future__ import annotations

from collections.abc import Sequence

from omni_lightning.balance.pipeline_replay import Action

__all__ = ["joint_pipeline", "one_f_one_b", "one_f_one_b_order"]


def one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """``("F" | "B", micro_batch)`` in the order stage ``stage`` runs them under 1F1B."""
    warmup = min(stages - 1 - stage, micro_batches)
    order = [("F", m) for m in range(warmup)]
    for i in range(micro_batches - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", m) for m in range(micro_batches - warmup, micro_batches)]


def one_f_one_b(forward: Sequence[Sequence[float]], backward: Sequence[Sequence[float]]) -> list[list[Action]]:
    """1F1B actions from per-stage, per-micro-batch durations ``forward[s][m]`` and ``backward[s][m]``."""
    stages, micro = len(forward), len(forward[0])
    return [[Action(kind, m, (forward if kind == "F" else backward)[s][m])
             for kind, m in one_f_one_b_order(s, stages, micro)] for s in range(stages)]


def joint_pipeline(forward: Sequence[Sequence[float]], backward: Sequence[Sequence[float]],
                   encode: Sequence[Sequence[float]], encode_backward: Sequence[Sequence[float]]
                   ) -> list[list[Action]]:
    """1F1B with encoder shares inserted as the joint pipeline does (module docstring); ``encode[s][m]`` and
    ``encode_backward[s][m]`` are stage ``s``'s encoder forward and backward of micro-batch ``m``'s share."""
    stages, micro = len(forward), len(forward[0])
    lag = stages  # 1F1B has finished m - p's backward on stage 0 when it starts m's forward
    actions: list[list[Action]] = []
    for s in range(stages):
        ahead = s + 1 if s > 0 else 0
        rank = [Action("E", m, encode[s][m]) for m in range(min(ahead, micro))]
        done: set[int] = set()
        for kind, m in one_f_one_b_order(s, stages, micro):
            if kind == "B":
                rank.append(Action("B", m, backward[s][m]))
                if s == 0:
                    rank.append(Action("G", m, 0.0))
                continue
            if m - lag >= 0:
                rank.append(Action("EB", m - lag, encode_backward[s][m - lag]))
                done.add(m - lag)
            if s == 0:
                rank.append(Action("E", m, encode[s][m]))
            elif m + ahead < micro:
                rank.append(Action("E", m + ahead, encode[s][m + ahead]))
            rank.append(Action("F", m, forward[s][m]))
        for m in range(micro):
            if m not in done:
                rank.append(Action("EB", m, encode_backward[s][m]))
        actions.append(rank)
    return actions
