"""The cluster-scale simulator: placements, memory, ablations, its dependence on the runtime planners, the CLI."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from omni_lightning.balance import allocation, reorder, reshard
from omni_lightning.balance.workload import load_workload
from omni_lightning.sim import one_f_one_b_bubble, replay_pipeline
from omni_lightning.sim.cluster import Cluster, Layout
from omni_lightning.sim.placements import OmniOptions, Scenario, Simulation
from omni_lightning.sim.presets import PRESETS, model_spec
from omni_lightning.sim.report import image_text_mix, placements, simulate_main
from omni_lightning.sim.schedules import joint_pipeline, one_f_one_b

LONG_TAIL = "vlm_dynres"  # long-tailed native-resolution images: most cost in the ViT


def _scenario(**layout: object) -> Scenario:
    base = Layout(tp=4, pp=2, micro_batches=4, seq_len=4096, recompute="full")
    return Scenario(model=model_spec("vit-2.4b", "llama-12b"), cluster=Cluster(gpus=64),
                    layout=replace(base, **layout), workload=load_workload(LONG_TAIL), steps=1, max_groups=1)


@pytest.fixture(scope="module")
def sim() -> Simulation:
    return Simulation(_scenario())


# What the simulator credited omni with before it modelled only what the runtime runs (issue 25).
OLD_MODEL = frozenset({"cp_sample_split", "replica_encoder_plan"})


def test_coupled_is_slower_than_omni_on_a_long_tail_with_the_old_assumptions() -> None:
    sim = Simulation(replace(_scenario(), assume=OLD_MODEL))
    coupled, omni = sim.coupled(), sim.omni()
    assert not coupled.oom and not omni.oom
    assert coupled.step_s >= omni.step_s
    assert coupled.imbalance > omni.imbalance


def test_each_ablation_is_no_better_balanced_with_the_old_assumptions() -> None:
    sim = Simulation(replace(_scenario(), assume=OLD_MODEL))
    omni = sim.omni()
    for options in (OmniOptions(multiplex=False), OmniOptions(reorder=False), OmniOptions(lssp=False)):
        ablated = sim.omni(options)
        assert ablated.imbalance >= omni.imbalance - 1e-9, ablated.name
    # Encoders confined to the first stage's GPUs, or samples left where they were read, cost time.
    assert sim.omni(OmniOptions(multiplex=False)).step_s > omni.step_s
    assert sim.omni(OmniOptions(reorder=False)).step_s > omni.step_s


def test_a_layout_that_cannot_fit_is_reported_oom() -> None:
    # GPT-175B without tensor or pipeline parallelism: its states alone exceed any GPU.
    scenario = replace(_scenario(tp=1, pp=1, micro_batches=1), model=model_spec("vit-1b", "gpt-175b"))
    sim = Simulation(scenario)
    for result in (sim.coupled(), sim.omni()):
        assert result.oom and result.memory_gib > scenario.cluster.memory_gib
        assert np.isinf(result.step_s)


def test_disaggregated_uses_the_pool_solver(sim: Simulation, monkeypatch: pytest.MonkeyPatch) -> None:
    result = sim.disaggregated()
    choice = allocation.solve_pools(sim.pool_problem())
    assert choice is not None and f"encoder pool {choice.encoder_gpus} GPUs" in result.detail
    monkeypatch.setattr(allocation, "solve_pools", lambda problem: None)
    assert sim.disaggregated().oom


def test_figures_move_with_the_planners(sim: Simulation, monkeypatch: pytest.MonkeyPatch) -> None:
    before = sim.omni()
    calls = []
    real_plan = reorder.plan_reorder_group

    def spy(*args: object, **kwargs: object) -> reorder.GroupPlan:
        calls.append(kwargs["n_ranks"])
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(reorder, "plan_reorder_group", spy)
    real_encoder_plan = reshard.plan_encoder_work
    # An encoder planner that keeps every item where it was loaded: the simulator must see the imbalance.
    monkeypatch.setattr(reshard, "plan_encoder_work",
                        lambda costs, owners, **kw: real_encoder_plan(costs, owners, **{**kw, "reshard": False}))
    after = Simulation(sim.scenario).omni()  # a fresh simulation: loader plans are cached per simulation
    assert calls == [sim.group]
    assert after.imbalance > before.imbalance
    assert after.step_s > before.step_s


def test_omnis_loader_shapes_1f1b_micro_batches_as_the_datamodule_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Omni's loader shapes its 1F1B micro-batches as ``OmniDataModule`` does under pp > 1: the ramp, refined by the
    search with ``pipeline_search`` (the same samples per rank, reshaped and reordered); disaggregated keeps
    DistTrain's order."""
    orders = []
    real_plan = reorder.plan_reorder_group

    def spy(*args: object, **kwargs: object) -> reorder.GroupPlan:
        orders.append(kwargs["config"].pipeline_order)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(reorder, "plan_reorder_group", spy)
    scenario = replace(_scenario(pp=4, micro_batches=8, seq_len=2048), steps=2)
    plain, search = Simulation(scenario), Simulation(replace(scenario, pipeline_search=True))
    plain.omni(), search.omni()
    assert orders == ["ramp", "search"]
    plans = [sim._omni_micro_batches(OmniOptions(), 0, 0)[0] for sim in (plain, search)]
    # The same samples on every rank, shaped and ordered differently by the search.
    assert [[sorted(p for batch in rank for p in batch)] for rank in plans[0]] == \
        [[sorted(p for batch in rank for p in batch)] for rank in plans[1]]
    assert plans[0] != plans[1]
    assert "with the 1F1B search" in search.sampling_note and "search" not in plain.sampling_note
    orders.clear()
    search.disaggregated()
    assert orders and set(orders) == {"disttrain"}


def test_omni_plans_group_steps_at_a_time_as_the_loader_does(monkeypatch: pytest.MonkeyPatch) -> None:
    planned = []
    real_plan = reorder.plan_reorder_group

    def spy(*args: object, **kwargs: object) -> reorder.GroupPlan:
        planned.append(kwargs["config"].steps)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(reorder, "plan_reorder_group", spy)
    sim = Simulation(replace(_scenario(group_steps=2), steps=3))
    result = sim.omni()
    assert planned == [2, 1]  # steps 0-1 together, then step 2
    assert len(result.per_step_s) == 3 and not result.oom
    # Every read of steps 0-1 (the pools repeat samples: reads, not samples) trains once, in one of the two steps.
    pieces_trained = []
    for step in range(2):
        micro, pieces, ids = sim._omni_micro_batches(OmniOptions(), step, 0)
        pieces_trained += [p for rank in micro for batch in rank for p in batch]
    assert len(pieces_trained) == len(set(pieces_trained)) == len(pieces)
    assert {pieces[p][0] for p in pieces_trained} == set(range(ids.size))
    assert ids.size == sum(d.samples[r].size for d in sim.draws[:2] for r in range(sim.group))


@pytest.mark.parametrize("even", [False, True])
def test_omni_spares_the_first_stage_the_last_micro_batches_encoder_work(monkeypatch: pytest.MonkeyPatch,
                                                                         even: bool) -> None:
    """As JointEncoders plans it: stage 0's encoder backward of the last pp micro-batches would follow its last LLM
    backward, so the simulated first stage has no encoder work there. With ``even_encoder_slices`` its GPUs' work
    goes evenly into the insertions before, and the other stages keep theirs spread over every micro-batch; by
    default each insertion holds the whole items planned there, so insertions differ."""
    from omni_lightning.sim import placements

    inserted = []
    real = placements.joint_pipeline

    def spy(forward: list, backward: list, encode: list, encode_backward: list) -> list:
        inserted.append((np.array(encode), np.array(encode_backward)))
        return real(forward, backward, encode, encode_backward)

    monkeypatch.setattr(placements, "joint_pipeline", spy)
    Simulation(replace(_scenario(micro_batches=6),
                       assume=frozenset({"even_encoder_slices"} if even else set()))).omni()
    assert inserted
    for encode, encode_backward in inserted:
        for work in (encode, encode_backward):
            assert (work[0, -2:] == 0).all()
            if even:
                assert work[0, :-2].min() > 0 and np.ptp(work[0, :-2]) == 0
                assert work[1].min() > 0 and np.ptp(work[1]) == 0
    if not even:
        assert any(np.ptp(encode[1]) > 0 for encode, _ in inserted)  # whole items: uneven insertions


def test_omni_by_default_plans_what_the_runtime_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """No sample is split over data-parallel ranks, and each insertion's items are planned over the data-parallel
    ranks (not every GPU of the reorder group); with the assumptions, both come back."""
    from omni_lightning.sim import placements

    groups: list[int] = []
    real = placements.reshard.plan_encoder_work

    def spy(costs: np.ndarray, owners: np.ndarray, **kwargs: object) -> reshard.EncoderPlan:
        groups.append(int(kwargs["n_ranks"]))  # type: ignore[call-overload]
        return real(costs, owners, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(placements.reshard, "plan_encoder_work", spy)
    layout = Layout(tp=4, pp=2, micro_batches=4, seq_len=4096, recompute="full")
    for assume in (frozenset(), OLD_MODEL):
        groups.clear()
        sim = Simulation(replace(_scenario(), assume=assume))
        sim.omni()
        expected = sim.ranks if not assume else sim.group * layout.model_parallel
        assert groups and set(groups) == {expected}, assume
        pieces = [sim._omni_micro_batches(OmniOptions(), step, 0)[1] for step in range(len(sim.draws))]
        split = any(share < 1.0 for step in pieces for _, share in step)
        assert split == bool(assume)


@pytest.mark.parametrize(("pp", "multiplex"), [(2, True), (2, False), (1, True)])
def test_omni_prices_samples_and_encoder_work_as_the_runtime_does(monkeypatch: pytest.MonkeyPatch, pp: int,
                                                                  multiplex: bool) -> None:
    """The loader balances each sample's whole cost (``OmniDataModule`` prices LLM and encoders); under the joint
    pipeline a step's micro-batches balance the LLM's alone. Without a pipeline, the resharder plans each GPU's
    encoder work on top of its share of the micro-batch's LLM work; in a pipeline, the encoder work alone (this
    workload has one encoder; a second is planned on top of the first: see
    test_omni_plans_each_encoders_items_in_turn_priced_as_the_runtime_resharder)."""
    from omni_lightning.sim import placements

    loader, bases = [], []
    real_reorder, real_plan = reorder.plan_reorder_group, placements.reshard.plan_resharding

    def spy_reorder(costs: np.ndarray, *args: object, **kwargs: object) -> reorder.GroupPlan:
        loader.append((np.array(costs), kwargs.get("micro_batch_costs")))
        return real_reorder(costs, *args, **kwargs)  # type: ignore[arg-type]

    def spy_plan(costs: np.ndarray, owners: np.ndarray, **kwargs: object) -> reshard.EncoderPlan:
        bases.append(np.array(kwargs["base"]))
        return real_plan(costs, owners, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(reorder, "plan_reorder_group", spy_reorder)
    monkeypatch.setattr(placements.reshard, "plan_resharding", spy_plan)
    sim = Simulation(_scenario(pp=pp, micro_batches=4))
    sim.omni(OmniOptions(multiplex=multiplex))
    _, _, ids = sim._omni_micro_batches(OmniOptions(multiplex=multiplex), 0, 0)
    (costs, micro_batch_costs), = loader
    np.testing.assert_allclose(costs, sim.pool.llm[ids] + sim.pool.encoder[ids])
    if pp > 1 and multiplex:
        np.testing.assert_allclose(micro_batch_costs, sim.pool.llm[ids])
    else:
        assert micro_batch_costs is None
    assert bases and all((base > 0).all() if pp == 1 else not base.any() for base in bases)


def test_joint_pipeline_without_encoders_is_1f1b() -> None:
    stages, micro = 4, 8
    forward = [[1.0] * micro for _ in range(stages)]
    backward = [[2.0] * micro for _ in range(stages)]
    zeros = [[0.0] * micro for _ in range(stages)]
    plain = replay_pipeline(one_f_one_b(forward, backward))
    assert plain.bubble == pytest.approx(one_f_one_b_bubble(stages, micro))
    assert replay_pipeline(joint_pipeline(forward, backward, zeros, zeros)).makespan == pytest.approx(plain.makespan)
    # Encoder work spread over every stage costs less than the same work on stage 0 alone.
    encode = [[0.5] * micro for _ in range(stages)]
    joint = replay_pipeline(joint_pipeline(forward, backward, encode, encode)).makespan
    first = [[f + (4 * 1.0 if s == 0 else 0.0) for f in row] for s, row in enumerate(forward)]
    assert joint < replay_pipeline(one_f_one_b(first, backward)).makespan


def test_image_text_mix() -> None:
    spec = image_text_mix(load_workload("omni_mix"), 9, 1)
    weights = {name: m.weight for name, m in spec.modalities.items()}
    assert weights["text"] == pytest.approx(0.1)
    assert sum(weights.values()) == pytest.approx(1.0)
    assert weights["image"] / weights["video"] == pytest.approx(0.45 / 0.10)
    with pytest.raises(ValueError, match="media"):
        image_text_mix(replace(spec, modalities={"text": spec.modalities["text"]}), 1, 1)


def test_cli_prints_the_table_and_ends_with_the_speedups(capsys: pytest.CaptureFixture[str]) -> None:
    simulate_main(["--workload", LONG_TAIL, "--gpus", "64", "--preset", "omni-a", "--steps", "1", "--groups", "1",
                   "--seq-len", "4096"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"predicted speedup vs coupled: (\d+\.\d{3}|oom), vs disaggregated: (\d+\.\d{3}|oom)",
                        lines[-1])
    assert re.fullmatch(r"omni max/mean: \d+\.\d{3}", lines[-2])
    for name in ("coupled", "disaggregated", "omni", "omni, no multiplexing", "omni, no reordering", "omni, no LSSP"):
        assert any(line.startswith(name + " ") for line in lines), name
    assert PRESETS["omni-a"].model.name in lines[0]
    assert any(line.startswith("whole-sample bound") for line in lines)
    assert any(line.startswith("speedup vs coupled per step: ") for line in lines)


def test_the_rows_are_the_same_computed_in_forked_processes(capsys: pytest.CaptureFixture[str]) -> None:
    """``--jobs`` shares the rows out to forked processes; every figure is what one process prints."""
    argv = ["--workload", LONG_TAIL, "--gpus", "64", "--preset", "omni-a", "--steps", "1", "--groups", "1",
            "--seq-len", "4096"]
    printed = []
    for jobs in ("1", "3"):
        simulate_main([*argv, "--jobs", jobs])
        printed.append([line for line in capsys.readouterr().out.splitlines() if not line.startswith("(")])
    assert printed[0] == printed[1]
    with pytest.raises(ValueError, match="jobs=0"):
        placements(Simulation(_scenario()), jobs=0)


def test_every_data_parallel_rank_is_simulated_by_default_and_a_sample_only_leaves_out_stragglers() -> None:
    scenario = replace(_scenario(reorder_group=2), steps=2)  # 8 data-parallel ranks in 4 reorder groups
    sampled = Simulation(scenario)  # max_groups=1
    full = Simulation(replace(scenario, max_groups=None))
    assert Scenario.max_groups is None and Scenario.steps > 2
    assert (sampled.ranks, full.ranks) == (2, full.dp) and full.dp == 8
    # Every step draws the same reads for the ranks both simulate: the others can only add stragglers to it.
    for step in range(2):
        for a, b in zip(sampled.draws[step].samples, full.draws[step].samples, strict=False):
            assert np.array_equal(a, b)
    assert all(f >= s for f, s in zip(full.coupled().per_step_s, sampled.coupled().per_step_s, strict=True))


def test_whole_sample_bound_is_the_largest_sample_when_ranks_get_few() -> None:
    sim = Simulation(_scenario(micro_batches=1, seq_len=16384))
    draw = sim.draws[0]
    costs = [sim.pool.llm[s] + sim.pool.encoder[s] for s in draw.samples]
    mean = sum(c.sum() for c in costs) / len(costs)
    expected = max(1.0, max(c.max() for c in costs) / mean)
    assert sim.whole_sample_bound == pytest.approx(expected)


def test_the_simulator_counts_each_encoders_traffic_as_the_runtime_resharder_does() -> None:
    from omni_lightning.models.config import ReferenceMLLMConfig
    from omni_lightning.models.mllm import ReferenceMLLM
    from omni_lightning.runtime.step import _encoder_traffic
    from omni_lightning.sim.placements import _traffic_of

    config = ReferenceMLLMConfig()
    model = ReferenceMLLM(config)
    for name in ("vision", "audio"):
        assert _traffic_of(config, name) == _encoder_traffic(model.encoders[name], model.output_width(name), 2), name


@pytest.mark.parametrize(("pp", "gpus_per_node", "link"), [(1, 8, reshard.GPU_NETWORK), (2, 8, reshard.GPU_NETWORK),
                                                            (2, 64, reshard.GPU_NVLINK)])
def test_omni_plans_each_encoders_items_in_turn_priced_as_the_runtime_resharder(
        monkeypatch: pytest.MonkeyPatch, pp: int, gpus_per_node: int, link: reshard.LinkCost) -> None:
    """Per insertion, the simulator calls the runtime resharder's own decision (``plan_resharding``) once per
    encoder with items, in the model's encoder order, with that encoder's items alone, priced by its traffic over
    the link the runtime prices on a GPU (the network for an encoder group spanning nodes, NVLink inside one), each
    on top of the insertion's base and the encoders planned before it."""
    from omni_lightning.sim import placements

    calls: list[object] = []  # per insertion: its base, then (lengths, traffic, link, prices, costs, kwargs, plan)
    real_prices, real_plan = placements.reshard.item_prices, placements.reshard.plan_resharding
    real_insertion = Simulation._resharder_plan

    def spy_insertion(self: Simulation, items: np.ndarray, owners: np.ndarray, n_ranks: int, enc_sp: int,
                      base: np.ndarray, link: reshard.LinkCost) -> reshard.EncoderPlan:
        calls.append(["insertion", np.array(base)])
        return real_insertion(self, items, owners, n_ranks, enc_sp, base, link)

    def spy_prices(lengths: np.ndarray, traffic: reshard.EncoderTraffic, link: reshard.LinkCost,
                   **kwargs: object) -> reshard.ItemPrices:
        prices = real_prices(lengths, traffic, link, **kwargs)
        calls.append([np.array(lengths), traffic, link, prices])
        return prices

    def spy_plan(costs: np.ndarray, owners: np.ndarray, **kwargs: object) -> reshard.EncoderPlan:
        plan = real_plan(costs, owners, **kwargs)
        calls[-1] += [np.array(costs), kwargs, plan]
        return plan

    monkeypatch.setattr(Simulation, "_resharder_plan", spy_insertion)
    monkeypatch.setattr(placements.reshard, "item_prices", spy_prices)
    monkeypatch.setattr(placements.reshard, "plan_resharding", spy_plan)
    scenario = replace(_scenario(pp=pp, enc_sp=2), cluster=Cluster(gpus=64, gpus_per_node=gpus_per_node))
    sim = Simulation(replace(scenario, workload=load_workload("omni_mix")))
    sim.omni()
    traffic = {name: placements._traffic_of(sim.scenario.model.config, name) for name in ("vision", "audio")}
    order, seen, moved = list(traffic), [], 0
    for call in calls:
        if isinstance(call[0], str):
            base, last = call[1], -1
            continue
        lengths, item_traffic, priced_over, prices, costs, kwargs, plan = call
        assert priced_over == link and kwargs["prices"] is prices and kwargs["min_gain"] == 0.05
        (name,) = [name for name, t in traffic.items() if t == item_traffic]
        assert order.index(name) > last, "encoders planned out of the model's order"
        last = order.index(name)
        np.testing.assert_allclose(costs, sim.cost_model.module(name)(lengths, lengths.astype(np.float64) ** 2))
        np.testing.assert_allclose(kwargs["base"], base)
        base = base + plan.rank_cost
        seen.append(name)
        moved += plan.moved
    assert set(seen) == {"vision", "audio"} and moved


@pytest.mark.parametrize("multiplex", [True, False])
def test_omni_splits_a_stages_items_between_its_peers_as_the_runtime_does(monkeypatch: pytest.MonkeyPatch,
                                                                         multiplex: bool) -> None:
    """Each stage's items of a micro-batch and encoder go to its cp * tp peers as ``split_items`` sends them
    (``JointEncoders._assign_peers``, ``LocalEncoders``): LPT from equal loads, the labels turned by the replica."""
    from omni_lightning.balance.pipeline_order import split_items

    plans = []
    real = Simulation._stage_and_peer

    def spy(self: Simulation, llm_cost: np.ndarray, micro_batch: np.ndarray, costs: np.ndarray,
            encoder: np.ndarray, options: OmniOptions, replica: int) -> tuple[np.ndarray, np.ndarray]:
        stage, peer = real(self, llm_cost, micro_batch, costs, encoder, options, replica)
        plans.append((micro_batch, costs, encoder, replica, stage, peer))
        return stage, peer

    monkeypatch.setattr(Simulation, "_stage_and_peer", spy)
    sim = Simulation(replace(_scenario(), max_groups=None))
    sim.omni(OmniOptions(multiplex=multiplex))
    peers = sim.scenario.layout.tp * sim.scenario.layout.cp
    assert {replica for *_, replica, _, _ in plans} == set(range(sim.ranks))
    for micro_batch, costs, encoder, replica, stage, peer in plans:
        assert (stage > 0).any() == multiplex
        for m, e, s in {(int(m), int(e), int(s)) for m, e, s in zip(micro_batch, encoder, stage, strict=True)}:
            mine = np.flatnonzero((micro_batch == m) & (encoder == e) & (stage == s))
            np.testing.assert_array_equal(peer[mine], split_items(costs[mine], peers, replica))
