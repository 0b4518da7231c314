"""What a reorder group's plan costs under the joint encoder-LLM pipeline, as the group's planner compares plans.

A plan's predicted cost per (rank, step) is the sum of its samples' costs, which is what a step costs where one
rank runs all of it. Under the joint pipeline (:class:`omni_lightning.runtime.joint.JointEncoders`) a step's encoder
items are inserted whole on the pipeline's stages, each beside the other stages' LLM work, so two huge images of one
step run side by side on two stages and cost the step about what one does, while the same two images in two steps
stall both. :func:`joint_step_times` models that, so that a plan spreading such items over a group's steps is not
preferred on the sum's word.
"""

from __future__ import annotations

import numpy as np

__all__ = ["joint_step_times", "joint_group_time"]


def joint_step_times(members: list[list[list[int]]], llm_costs: np.ndarray, encoder_costs: np.ndarray, *, pp: int,
                     micro_batches: int, encoder_peers: int = 1) -> np.ndarray:
    """Modelled time of each ``(rank, step)`` of a plan under the joint pipeline's 1F1B (pure).

    Args:
        members: the sample ids each ``[rank][step]`` trains.
        llm_costs, encoder_costs: each sample's LLM cost and its encoders' cost (forward and backward).
        pp: pipeline stages.
        micro_batches: micro-batches a step.
        encoder_peers: ranks of one stage that share a micro-batch's encoder items out between them, each encoding
            whole items (its tensor- and context-parallel peers).

    The LLM part is 1F1B's step over the stages: its work, plus ``pp - 1`` times its largest micro-batch for the
    fill and drain, which is at least an even share of the step and at least its largest sample, over ``pp``; each
    stage's share is split over its peers. The encoder part is the least that encoding the step's samples whole on
    its ``pp * encoder_peers`` ranks side by side takes: the larger of the even share and the largest sample's
    cost. A stage waits for its busiest peer at every collective of the LLM, so a step with one huge image stalls
    as long as one with a huge image on every peer: spreading a group's few huge samples over all its steps makes
    every step pay that stall. The resharder may split such an item over the data-parallel ranks, but only where
    the other ranks do not hold one at the same insertion, which a balanced plan, alike on every rank, makes rare;
    and a sample's items may go to several ranks (the loader does not see items): the model leaves both out, alike
    for every plan it compares. Both parts are in one rank's time, the costs' units over one rank. The model
    depends on which samples a rank-step holds, not on their micro-batches or order.
    """
    llm_costs = np.asarray(llm_costs, dtype=np.float64)
    encoder_costs = np.asarray(encoder_costs, dtype=np.float64)
    n_ranks = len(members)
    steps = len(members[0]) if n_ranks else 0
    if not n_ranks * steps:
        return np.zeros((n_ranks, steps))
    ids = np.fromiter((s for rank in members for step in rank for s in step), dtype=np.int64)
    sizes = np.fromiter((len(step) for rank in members for step in rank), dtype=np.int64, count=n_ranks * steps)
    cell = np.repeat(np.arange(n_ranks * steps), sizes)

    def total_and_largest(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        largest = np.zeros(n_ranks * steps)
        np.maximum.at(largest, cell, values[ids])
        return np.bincount(cell, weights=values[ids], minlength=n_ranks * steps), largest

    llm, llm_largest = total_and_largest(llm_costs)
    encoder, encoder_largest = total_and_largest(encoder_costs)
    pipeline = (llm + (pp - 1) * np.maximum(llm / micro_batches, llm_largest)) / pp
    return (pipeline / encoder_peers + np.maximum(encoder / (pp * encoder_peers), encoder_largest)).reshape(
        n_ranks, steps)


def joint_group_time(step_times: np.ndarray) -> float:
    """A group's time from its ``(rank, step)`` times: ranks step together, so the sum of each step's slowest."""
    return float(step_times.max(axis=0).sum()) if step_times.size else 0.0
