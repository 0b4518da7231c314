"""Pool sizing of the disaggregated placement: the solver against brute force over every split of small worlds."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_lightning.balance.allocation import (
    PP_DEGREES,
    TP_DEGREES,
    ModuleShape,
    PoolChoice,
    PoolProblem,
    pool_memory,
    pool_problem,
    pool_step_time,
    solve_pools,
)
from omni_lightning.balance.cost import CostModel, ModuleCost
from omni_lightning.balance.workload import load_workload

GIB = float(1 << 30)


def _problem(world: int, encoder_share: float, memory_gib: float, sequences: int) -> PoolProblem:
    total = 1e18
    return PoolProblem(
        world_size=world, memory_bytes=memory_gib * GIB, device_flops=4e14, intra_node_bandwidth=4e11,
        encoder_flops=total * encoder_share, llm_flops=total * (1 - encoder_share), encoder_tokens=2e6,
        sequences=sequences, seq_len=4096, encoder=ModuleShape(2e9, 32, 2048), llm=ModuleShape(3e10, 48, 6144),
        recompute="full")


def _brute_force(problem: PoolProblem) -> float:
    """The best predicted step time over every encoder pool size and every degree, no shortcut."""
    best = math.inf
    world = problem.world_size
    for n_enc in range(1, world):
        for tp_enc in TP_DEGREES:
            if n_enc % tp_enc:
                continue
            for tp, pp in itertools.product(TP_DEGREES, PP_DEGREES):
                if pp > problem.llm.layers:
                    continue
                for dp in range(1, min(problem.sequences, (world - n_enc) // (tp * pp)) + 1):
                    choice = PoolChoice(tp_enc=tp_enc, dp_enc=n_enc // tp_enc, tp=tp, pp=pp, dp=dp)
                    if max(pool_memory(problem, choice)) <= problem.memory_bytes:
                        best = min(best, pool_step_time(problem, choice))
    return best


@settings(max_examples=25, deadline=None)
@given(world=st.integers(2, 40), encoder_share=st.floats(0.02, 0.9), memory_gib=st.floats(8, 120),
       sequences=st.integers(1, 48))
def test_solver_matches_brute_force(world: int, encoder_share: float, memory_gib: float, sequences: int) -> None:
    problem = _problem(world, encoder_share, memory_gib, sequences)
    choice = solve_pools(problem)
    best = _brute_force(problem)
    if choice is None:
        assert best == math.inf
        return
    assert choice.encoder_gpus + choice.llm_gpus <= world
    assert max(pool_memory(problem, choice)) <= problem.memory_bytes
    assert pool_step_time(problem, choice) == pytest.approx(best, rel=1e-12)


def test_more_encoder_work_gets_a_larger_encoder_pool() -> None:
    light = solve_pools(_problem(256, 0.05, 80, 64))
    heavy = solve_pools(_problem(256, 0.6, 80, 64))
    assert light is not None and heavy is not None
    assert heavy.encoder_gpus > light.encoder_gpus


def test_no_layout_fits_gives_none() -> None:
    assert solve_pools(_problem(16, 0.3, 0.5, 8)) is None


def test_problem_from_a_workload_spec() -> None:
    model = CostModel(vision=ModuleCost(1e9, 1e5), audio=ModuleCost(1e9, 1e5), llm=ModuleCost(2e10, 1e6))
    problem = pool_problem(model, load_workload("vlm_dynres"), world_size=64, memory_bytes=70 * GIB,
                           device_flops=4e14, intra_node_bandwidth=4e11, sequences=32, seq_len=8192,
                           encoder=ModuleShape(1e9, 32, 1664), llm=ModuleShape(1.2e10, 40, 5120), samples=256)
    # Every LLM token of the step is priced, and a vision-heavy workload has real encoder work.
    assert problem.llm_flops >= 2e10 * 32 * 8192
    assert problem.encoder_flops > 0 and problem.encoder_tokens > 0
    assert solve_pools(problem) is not None


def test_rejects_impossible_problems() -> None:
    with pytest.raises(ValueError, match="world_size"):
        _problem(1, 0.5, 80, 4)
    with pytest.raises(ValueError, match="recompute"):
        PoolProblem(world_size=8, memory_bytes=1.0, device_flops=1.0, intra_node_bandwidth=1.0, encoder_flops=1.0,
                    llm_flops=1.0, encoder_tokens=1.0, sequences=1, seq_len=1, encoder=ModuleShape(1, 1, 1),
                    llm=ModuleShape(1, 1, 1), recompute="some")
