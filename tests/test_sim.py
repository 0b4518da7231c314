"""The pipeline replay: exact on uniform 1F1B, and it honours every dependency kind."""

from __future__ import annotations

import pytest

from omni_lightning.sim import Action, one_f_one_b_bubble, replay_pipeline


def _one_f_one_b(stage: int, stages: int, micro_batches: int, forward: float, backward: float) -> list[Action]:
    warmup = min(stages - stage - 1, micro_batches)
    actions = [Action("F", m, forward) for m in range(warmup)]
    done_forward, done_backward = warmup, 0
    while done_backward < micro_batches:
        if done_forward < micro_batches:
            actions.append(Action("F", done_forward, forward))
            done_forward += 1
        actions.append(Action("B", done_backward, backward))
        done_backward += 1
    return actions


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 4), (4, 8), (4, 32), (8, 8)])
def test_uniform_one_f_one_b_has_the_theoretical_bubble(stages: int, micro_batches: int) -> None:
    result = replay_pipeline([_one_f_one_b(s, stages, micro_batches, 1.0, 2.0) for s in range(stages)])
    assert result.makespan == pytest.approx((micro_batches + stages - 1) * 3.0)
    assert result.bubble == pytest.approx(one_f_one_b_bubble(stages, micro_batches))


def test_stage_zero_waits_for_every_encoder_share_and_shares_for_gradients() -> None:
    # Stage 1 encodes micro-batch 0's share slowly (5 s): stage 0's forward of 0 cannot start before it ends.
    stage0 = [Action("E", 0, 1.0), Action("F", 0, 1.0), Action("B", 0, 1.0), Action("G", 0, 0.0), Action("EB", 0, 1.0)]
    stage1 = [Action("E", 0, 5.0), Action("F", 0, 1.0), Action("B", 0, 1.0), Action("EB", 0, 1.0)]
    result = replay_pipeline([stage0, stage1])
    # E(5) -> F0 (6) -> F1 (7) -> B1 (8) -> B0 (9) -> G (9) -> EB on both (10)
    assert result.makespan == pytest.approx(10.0)
    assert result.busy == [4.0, 8.0]


def test_an_order_that_cannot_run_is_reported() -> None:
    with pytest.raises(ValueError, match="deadlock"):
        replay_pipeline([[Action("B", 0, 1.0)], [Action("F", 1, 1.0)]])
