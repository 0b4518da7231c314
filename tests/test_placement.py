"""Pure logic of the disaggregated placement: who serves whom, item shares and orders, and the pool size."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from omni_lightning.balance.allocation import (
    ModuleShape,
    PoolChoice,
    encoder_pool_size,
    pool_problem,
    pool_step_time,
)
from omni_lightning.balance.workload import load_workload
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.flops import reference_cost_model
from omni_lightning.parallel.dims import ParallelDims
from omni_lightning.parallel.placement import PoolLayout
from omni_lightning.runtime.pool import arrival_order, item_owners
from omni_lightning.strategies.pool_size import size_encoder_pool

WORKLOADS = ("vlm_dynres", "text_heavy", "omni_mix", "video_heavy")


@st.composite
def layouts(draw: st.DrawFn) -> PoolLayout:
    tp, cp = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    dp_replicate, dp_shard = draw(st.integers(1, 2)), draw(st.integers(1, 4))
    llm = ParallelDims(world_size=tp * cp * dp_replicate * dp_shard, dp_replicate=dp_replicate, dp_shard=dp_shard,
                       cp=cp, tp=tp)
    return PoolLayout(llm, draw(st.integers(1, 9)))


@given(layouts())
def test_every_llm_rank_is_served_and_every_encoder_rank_serves(layout: PoolLayout) -> None:
    dp, pool = layout.llm.dp, layout.encoder_world_size
    served = {e: layout.served_by(e) for e in layout.encoder_ranks}
    assert all(served.values()), "an encoder rank with nothing to encode"
    for d in range(dp):
        servers = layout.serving(d)
        assert servers and all(layout.is_encoder_rank(e) for e in servers)
        assert all(d in served[e] for e in servers)
        # fan-out: the pool's ranks are spread as evenly as possible; fan-in: one server each
        assert len(servers) in ({pool // dp, -(-pool // dp)} if pool >= dp else {1})
    # each encoder rank's clients are spread as evenly as possible too
    assert max(map(len, served.values())) - min(map(len, served.values())) <= 1


@given(layouts())
def test_consumers_are_the_tp_and_cp_peers_of_a_data_parallel_rank(layout: PoolLayout) -> None:
    llm = layout.llm
    seen: list[int] = []
    for d in range(llm.dp):
        consumers = layout.consumers(d)
        assert len(consumers) == llm.tp * llm.cp
        assert all(layout.dp_rank_of(r) == d for r in consumers)
        seen += consumers
    assert sorted(seen) == list(range(llm.world_size))
    assert not any(layout.is_encoder_rank(r) for r in seen)


def test_pool_layout_rejects_an_empty_pool_and_foreign_ranks() -> None:
    with pytest.raises(ValueError, match="at least one encoder rank"):
        PoolLayout(ParallelDims(world_size=2), 0)
    layout = PoolLayout(ParallelDims(world_size=2), 2)
    with pytest.raises(ValueError, match="belongs to the LLM pool"):
        layout.served_by(1)
    with pytest.raises(ValueError, match="outside the world"):
        layout.is_encoder_rank(4)


@given(st.lists(st.integers(1, 40), max_size=12), st.integers(1, 4), st.randoms(use_true_random=False))
def test_arrival_order_undoes_the_concatenation_by_server(rows: list[int], servers: int, rnd) -> None:
    owner = np.array([rnd.randrange(servers) for _ in rows], dtype=np.int64)
    items = [np.full(r, i) for i, r in enumerate(rows)]  # each row holds its item's number
    arrived = np.concatenate([items[i] for s in range(servers) for i in np.flatnonzero(owner == s)] or [[]])
    restored = arrived[arrival_order(np.array(rows), owner, servers)]
    np.testing.assert_array_equal(restored, np.concatenate(items or [[]]))


def test_item_owners_balance_a_micro_batch_by_cost() -> None:
    config = ReferenceMLLMConfig.tiny()
    costs = reference_cost_model(config)
    batch = {"vision_grids": torch.tensor([[16, 16], [4, 4], [4, 4], [8, 8]]),
             "audio_lengths": torch.tensor([64, 8])}
    owners = item_owners(batch, config.packing(), dict(costs.encoders), 2)
    vision, audio = owners["vision"], owners["audio"]
    assert vision[0] != vision[3], "the two largest images on one server"
    assert set(vision.tolist()) | set(audio.tolist()) == {0, 1}
    single = item_owners(batch, config.packing(), dict(costs.encoders), 1)
    assert not any(o.any() for o in single.values())


def _problem(workload: str, world: int) -> object:
    config = ReferenceMLLMConfig.tiny()
    shape = ModuleShape(params=1e6, layers=4, dim=64)
    return pool_problem(reference_cost_model(config), load_workload(workload),
                        world_size=world, memory_bytes=math.inf, device_flops=1.0, intra_node_bandwidth=math.inf,
                        sequences=world, seq_len=4096, encoder=shape, llm=shape, samples=256)


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("world,unit", [(4, 1), (8, 2), (12, 3)])
def test_encoder_pool_size_is_the_best_split(workload: str, world: int, unit: int) -> None:
    problem = _problem(workload, world)
    chosen = encoder_pool_size(problem, llm_unit=unit)
    times = {world - n: pool_step_time(problem, PoolChoice(1, world - n, 1, 1, n))
             for n in range(unit, world, unit)}  # brute force over every split
    assert times[chosen] == min(times.values())
    assert (world - chosen) % unit == 0


def test_encoder_pool_size_follows_the_encoder_share() -> None:
    sizes = {w: size_encoder_pool(ReferenceMLLMConfig.tiny(), w,
                                  world_size=16, llm_unit=1, tp=1) for w in WORKLOADS}
    assert sizes["vlm_dynres"] > sizes["text_heavy"], sizes


def test_encoder_pool_size_refuses_what_cannot_split() -> None:
    with pytest.raises(ValueError, match="no split of 2 ranks"):
        encoder_pool_size(_problem("omni_mix", 2), llm_unit=2)
    with pytest.raises(ValueError, match="multiple of tp\\*pp"):
        encoder_pool_size(_problem("omni_mix", 8), llm_unit=3, tp=2)


def test_strategy_sizes_the_encoder_pool_with_the_solver() -> None:
    """OmniStrategy(encoder_world_size=None) takes the solver's size for the model and workload, once it knows the
    model; the LLM pool's degrees then cover the rest of the world."""
    import lightning.pytorch as pl

    from omni_lightning import OmniModule, OmniStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=8, logger=False, enable_checkpointing=False,
                         strategy=OmniStrategy(launcher="fork", placement="disaggregated", pool_workload="vlm_dynres"))
    config = ReferenceMLLMConfig.tiny()
    trainer.strategy._lightning_module = OmniModule(config)
    layout = trainer.strategy.pool_layout
    expected = size_encoder_pool(config, "vlm_dynres", world_size=8, llm_unit=1, tp=1)
    assert layout is not None and layout.encoder_world_size == expected
    assert trainer.strategy.parallel_dims.world_size == 8 - expected
