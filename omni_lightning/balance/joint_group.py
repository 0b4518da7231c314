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

from omni_lightning.balance.pipeline_order import one_f_one_b_makespans

__all__ = ["joint_step_times", "joint_group_time"]


def joint_step_times(micro_batches: list[list[list[list[int]]]], llm_costs: np.ndarray, encoder_costs: np.ndarray,
                     *, pp: int, forward_share: float = 1 / 3, encoder_peers: int = 1) -> np.ndarray:
    """Modelled time of each ``(rank, step)`` of a plan under the joint pipeline's 1F1B (pure).

    Args:
        micro_batches: ``[rank][step][micro-batch]`` sample ids in run order, as
            :class:`~omni_lightning.balance.reorder.GroupPlan` holds them.
        llm_costs, encoder_costs: each sample's LLM cost and its encoders' cost (forward and backward).
        pp: pipeline stages.
        forward_share: the forward's share of a micro-batch's LLM cost.
        encoder_peers: ranks of one stage that share a micro-batch's encoder items out between them, each encoding
            whole items (its tensor- and context-parallel peers).

    The LLM part is the 1F1B step of the micro-batches' LLM costs (:func:`one_f_one_b_makespans`), each stage's
    share split over its peers: a heavy micro-batch lengthens the fill and drain of the step it holds. The encoder
    part is the least that encoding the step's samples whole on its ``pp * encoder_peers`` ranks side by side
    takes: the larger of the even share and the largest sample's cost. A stage waits for its busiest peer at every
    collective of the LLM, so a step with one huge image stalls as long as one with a huge image on every peer:
    spreading a group's few huge samples over all its steps makes every step pay that stall. The resharder may
    split such an item over the data-parallel ranks, but only where the other ranks do not hold one at the same
    insertion, which a balanced plan, alike on every rank, makes rare; and a sample's items may go to several ranks
    (the loader does not see items): the model leaves both out, alike for every plan it compares. Both parts are
    in one rank's time, the costs' units over one rank.
    """
    llm_costs = np.asarray(llm_costs, dtype=np.float64)
    encoder_costs = np.asarray(encoder_costs, dtype=np.float64)
    n_ranks = len(micro_batches)
    steps = len(micro_batches[0]) if n_ranks else 0
    if not n_ranks * steps:
        return np.zeros((n_ranks, steps))
    width = max(len(batches) for rank_steps in micro_batches for batches in rank_steps)
    llm = np.zeros((n_ranks * steps, max(width, 1)))
    cell, samples = [], []
    for rank, rank_steps in enumerate(micro_batches):
        for step, batches in enumerate(rank_steps):
            for j, mb in enumerate(batches):
                llm[rank * steps + step, j] = llm_costs[mb].sum() if mb else 0.0
                samples.extend(mb)
                cell.extend([rank * steps + step] * len(mb))
    pipeline = one_f_one_b_makespans(llm, pp, forward_share=forward_share)
    index, ids = np.asarray(cell, dtype=np.int64), np.asarray(samples, dtype=np.int64)
    encoder = np.bincount(index, weights=encoder_costs[ids], minlength=n_ranks * steps)
    largest = np.zeros(n_ranks * steps)
    np.maximum.at(largest, index, encoder_costs[ids])
    # Per rank, in the time one rank takes: a stage's LLM work is split over its peers, an item is encoded by one.
    return (pipeline / encoder_peers + np.maximum(encoder / (pp * encoder_peers), largest)).reshape(n_ranks, steps)


def joint_group_time(step_times: np.ndarray) -> float:
    """A group's time from its ``(rank, step)`` times: ranks step together, so the sum of each step's slowest."""
    return float(step_times.max(axis=0).sum()) if step_times.size else 0.0
