"""The encoder resharder's gather of item lengths: one fixed-width collective, a second when a rank has more items
than the row holds, and every rank reading every rank's lengths (and LLM work) either way."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from device_discipline import device_syncs
from distributed import run_distributed

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.runtime import reshard
from omni_lightning.runtime.reshard import Resharder

COSTS = {"vision": ModuleCost(1.0, 0.01), "audio": ModuleCost(2.0, 0.0)}
# Per call, per rank: (vision lengths, audio lengths). The second call's rank 1 overflows the row (capacity 64).
CALLS = [
    [([16, 4], [8]), ([4] * 10, []), ([], [12, 12])],
    [([4], []), ([8] * 70 + [64], [6] * 3), ([16] * 5, [])],
    [([4] * 70, [2]), ([], []), ([16], [3])],  # fits the grown capacity (74): one gather again
]
# Elements each rank sends per gather of lengths: the row (2 counts, the LLM's tokens and pairs, the capacity), then
# any overflow.
GATHERS = [[4 + 64], [4 + 64, 74 - 64], [4 + 74]]


def _expected_cost(lengths: list[int], cost: ModuleCost) -> float:
    x = np.asarray(lengths, dtype=np.float64)
    return float((cost.linear * x + cost.quadratic * x**2).sum())


def _plan_calls(rank: int, world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gathers = []
    gather = reshard.all_gather_single
    monkeypatch.setattr(reshard, "all_gather_single", lambda *a, **k: (gathers.append(a[1].numel()), gather(*a, **k)))
    resharder = Resharder(dist.group.WORLD, {}, COSTS, min_gain=float("inf"))  # plans, never moves: costs stay own
    for call, expected_gathers in zip(CALLS, GATHERS, strict=True):
        vision, audio = call[rank]
        gathers.clear()
        steps = resharder.plan({"vision": torch.tensor(vision, dtype=torch.int32),
                                "audio": torch.tensor(audio, dtype=torch.int32)}, {"vision": 4, "audio": 1})
        assert steps["vision"].own_items == len(vision) and steps["audio"].own_items == len(audio)
        for name, index in (("vision", 0), ("audio", 1)):
            expected = [_expected_cost(call[r][index], COSTS[name]) for r in range(world_size)]
            np.testing.assert_allclose(steps[name].unbalanced_cost, expected, rtol=1e-12)
        assert gathers == expected_gathers


@pytest.mark.distributed
def test_every_rank_reads_every_ranks_lengths_in_one_gather_unless_a_rank_overflows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    run_distributed(_plan_calls, 3, monkeypatch)


def _llm_work_sways_plan(rank: int, world_size: int) -> None:
    # Rank 0 holds two images and no LLM work; rank 1 no image and LLM work worth both images. Balancing the encoder
    # work alone sends one image to rank 1 (whose step then runs 30 against rank 0's 10); with the LLM as its base
    # the plan keeps both home (20 each).
    vision = torch.tensor([10, 10] if rank == 0 else [], dtype=torch.int64)
    llm_work = (0, 0) if rank == 0 else (20, 0)
    cost = {"vision": ModuleCost(1.0, 0.0)}
    alone = Resharder(dist.group.WORLD, {}, cost, min_gain=0.0).plan({"vision": vision}, {"vision": 1}, llm_work)
    assert alone["vision"].items_moved == 1
    based = Resharder(dist.group.WORLD, {}, cost, min_gain=0.0, llm=ModuleCost(1.0, 0.0))
    assert based.plan({"vision": vision}, {"vision": 1}, llm_work)["vision"].items_moved == 0
    # A quarter of a micro-batch's LLM work per rank (four context- and tensor-parallel peers): one image moves
    # again (peaks 10 and 15 against 20 at home).
    quartered = Resharder(dist.group.WORLD, {}, cost, min_gain=0.0, llm=ModuleCost(1.0, 0.0), llm_share=0.25)
    steps = quartered.plan({"vision": vision}, {"vision": 1}, llm_work)
    assert steps["vision"].items_moved == 1
    np.testing.assert_allclose(steps["vision"].predicted_cost, [10.0, 10.0])


@pytest.mark.distributed
def test_the_plan_balances_encoder_work_on_top_of_each_ranks_llm_work() -> None:
    run_distributed(_llm_work_sways_plan, 2)


def _plan_checks(rank: int, world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    checks = []
    check = reshard.check_plans_agree
    monkeypatch.setattr(reshard, "check_plans_agree", lambda *a, **k: (checks.append(a[0]), check(*a, **k)))
    resharder = Resharder(dist.group.WORLD, {}, COSTS)
    empty = torch.zeros(0, dtype=torch.int64)
    # Text only on every rank: the gathered counts (integers, the same on every rank) decide it; nothing to check.
    steps = resharder.plan({"vision": empty, "audio": empty}, {"vision": 4, "audio": 1})
    assert checks == [] and all(step.exchange is None for step in steps.values())
    # One image on the last rank alone: a priced plan, checked on every rank.
    vision = torch.tensor([16] if rank == world_size - 1 else [], dtype=torch.int64)
    resharder.plan({"vision": vision, "audio": empty}, {"vision": 4, "audio": 1})
    assert checks == ["encoder resharding plan"]


@pytest.mark.distributed
def test_a_micro_batch_without_items_skips_the_plan_check_and_one_with_an_item_anywhere_runs_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    run_distributed(_plan_checks, 3, monkeypatch)


def _word(ranks: tuple[int, ...], items: list[tuple[list[int], list[int]]], llm: list[tuple[int, int]]
          ) -> dict[str, object]:
    """The reorder stream's word: per rank, (vision, audio) stem tokens and pairs, then the LLM's tokens and pairs."""
    work = [[sum(v), sum(n * n for n in v), sum(a), sum(n * n for n in a), *work] for (v, a), work in
            zip(items, llm, strict=True)]
    return {"ranks": ranks, "encoders": ["vision", "audio"], "work": np.asarray(work, dtype=np.int64)}


def _loader_word(rank: int, world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gathers, checks = [], []
    gather, check = reshard.all_gather_single, reshard.check_plans_agree
    monkeypatch.setattr(reshard, "all_gather_single", lambda *a, **k: (gathers.append(a[1].numel()), gather(*a, **k)))
    monkeypatch.setattr(reshard, "check_plans_agree", lambda *a, **k: (checks.append(a[0]), check(*a, **k)))
    resharder = Resharder(dist.group.WORLD, {}, COSTS, min_gain=0.05, llm=ModuleCost(1.0, 0.0))
    everyone = tuple(range(world_size))
    multiples = {"vision": 4, "audio": 1}

    def plan(items: list[tuple[list[int], list[int]]], llm: list[tuple[int, int]], **word: object
             ) -> tuple[dict[str, str], dict[str, float]]:
        vision, audio = (torch.tensor(x, dtype=torch.int64) for x in items[rank])
        steps = resharder.plan({"vision": vision, "audio": audio}, multiples, llm[rank], group_work=word or None)
        return {name: repr(step) for name, step in steps.items()}, dict(resharder.stats)

    # Text only, and work the loader balanced (one image and as much LLM work per rank): the gather would plan
    # nothing that moves. The word tells so to every rank: nothing gathered or checked, the same steps and stats.
    for items, llm in (([([], [])] * world_size, [(40, 820)] * world_size),
                       ([([16], [8])] * world_size, [(30, 465)] * world_size)):
        gathered_steps, gathered_stats = plan(items, llm)
        gathers.clear(), checks.clear()
        steps, stats = plan(items, llm, **_word(everyone, items, llm))
        assert (gathers, checks) == ([], [])
        assert steps == gathered_steps and stats == {**gathered_stats, "size_gathers": 0.0}
        assert gathered_stats["size_gathers"] == 1.0
        # Given the lengths on the host too, such a plan reads nothing back from the device.
        vision, audio = (torch.tensor(x, dtype=torch.int64) for x in items[rank])
        with device_syncs() as syncs:
            hosted = resharder.plan({"vision": vision, "audio": audio}, multiples, llm[rank],
                                    group_work=_word(everyone, items, llm),
                                    host_lengths={"vision": np.asarray(items[rank][0], dtype=np.int64),
                                                  "audio": np.asarray(items[rank][1], dtype=np.int64)})
        assert syncs == [] and {name: repr(step) for name, step in hosted.items()} == steps
    # Two images on rank 0 alone: resharding may pay, so the word is no reason to skip the gather; nor is a word
    # about other ranks, or one that does not price an encoder.
    lopsided = [([64, 64], [])] + [([], [])] * (world_size - 1)
    llm = [(8, 36)] * world_size
    for word in (_word(everyone, lopsided, llm), _word(everyone[:1], [([], [])], llm[:1]),
                 {**_word(everyone, [([], [])] * world_size, llm), "encoders": ["vision"]}):
        gathers.clear()
        plan(lopsided, llm, **word)
        assert len(gathers) == 1
    # A word that misses what a rank holds is a loader out of step with the model: an error, not a wrong plan.
    with pytest.raises(RuntimeError, match=r"planned no vision item on rank \d+ .* but it holds 1"):
        plan([([32], [])] * world_size, llm, **_word(everyone, [([], [])] * world_size, llm))


@pytest.mark.distributed
def test_a_micro_batch_the_loader_balanced_gathers_nothing_and_plans_what_the_gather_would(
        monkeypatch: pytest.MonkeyPatch) -> None:
    run_distributed(_loader_word, 2, monkeypatch)
