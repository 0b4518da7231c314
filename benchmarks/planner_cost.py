"""What each planner costs on adversarial specs at 512 data-parallel ranks and 32 micro-batches.

For each workload (by default ``workloads/few_giants.yaml``, a few giant videos among many tiny samples, and the
shared video_heavy spec) one step of every one of 512 ranks is drawn as the simulator draws it (ViT-10B +
GPT-175B, 8192-token micro-batches, the preset omni-d's cost model), and each planner runs on it as the loader or
the encoder stage runs it:

* ``plan_reorder_group`` over all 512 ranks (one step, pp 8): ``ramp`` (the simulator's default) and ``search``
  (``OmniDataModule``'s default under pipeline parallelism; the rank searches only its own rank-steps,
  ``searched_rank=0``, as the loader does); and under the joint pipeline, two steps planned together, where the
  group's plan competes with one balanced step by step (8 tensor-parallel peers a stage);
* ``plan_encoder_work`` over the 512 ranks' items of the step with ``enc_sp`` 8, moves and splits priced as the
  runtime's resharder prices them on a GPU (all encoders' items in one call);
* ``assign_encoder_items`` on the rank with the most encoder work (its 32 micro-batches over 8 stages);
* ``refine_for_1f1b`` alone on that rank's ramp of micro-batches;
* ``solve_pools`` (the disaggregated pools' sizing) for the workload's mix on 4096 GPUs.

CPU seconds (``time.process_time``: this machine's 2 cores are shared, so wall time says less) and the
evaluations each search counted against its :class:`~omni_lightning.balance.budget.WorkBudget` (limits in the
header). Each planner runs twice and must return the same plan (checked: the budget is a count, not a clock).

    python benchmarks/planner_cost.py [--workload FILE ...] [--ranks 512] [--micro-batches 32]

Writes ``results/planner_cost.txt``; its last line is ``slowest planner: NAME on SPEC, X CPU s``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import SHARED_WORKLOADS

from omni_lightning.balance import allocation, reorder, reshard
from omni_lightning.balance.budget import WorkBudget
from omni_lightning.balance.pipeline_order import (
    JOINT_ITEM_EVALUATIONS,
    assign_encoder_items,
    refine_for_1f1b,
    split_to_profile,
)
from omni_lightning.balance.workload import load_workload
from omni_lightning.sim.cluster import Cluster, Layout
from omni_lightning.sim.draws import SamplePool, draw_step
from omni_lightning.sim.placements import Scenario, Simulation
from omni_lightning.sim.presets import PRESETS

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _timed(plan: Callable[[], Any], same: Callable[[Any, Any], bool]) -> tuple[Any, float]:
    """Run ``plan`` twice; CPU seconds of the first run; raise if the two plans differ."""
    started = time.process_time()
    first = plan()
    seconds = time.process_time() - started
    if not same(first, plan()):
        raise AssertionError("two runs on the same inputs gave different plans")
    return first, seconds


PP, SEQ_LEN = 8, 8192


def _runtime_prices(pool: SamplePool, items: np.ndarray, traffic: list[reshard.EncoderTraffic], *, enc_sp: int
                    ) -> reshard.ItemPrices:
    """Each item's moves and splits priced as the runtime's resharder prices its encoder's items on a GPU (one call
    over every encoder's items here, where the runtime plans each encoder's alone: an upper bound on its cost)."""
    link = reshard.resolve_link("auto", "cuda", spans_nodes=True)  # 64-512 data-parallel ranks span nodes
    move, split = np.zeros(items.size), np.zeros((items.size, max(enc_sp.bit_length() - 1, 0)))
    for encoder, per_token in enumerate(traffic):
        mine = pool.item_encoder[items] == encoder
        priced = reshard.item_prices(pool.item_tokens[items[mine]], per_token, link, enc_sp=enc_sp)
        move[mine], split[mine] = priced.move, priced.split
    return reshard.ItemPrices(move, split, reshard.exchange_price(link))


def _measure(path: str, ranks: int, m: int, search_evaluations: int) -> list[tuple[str, float, str, str]]:
    """Every planner on one drawn step of ``ranks`` ranks of workload ``path``: (planner, CPU s, evaluations,
    detail) rows."""
    preset = PRESETS["omni-d"]
    spec = load_workload(path)
    sim = Simulation(Scenario(model=preset.model, cluster=Cluster(gpus=4096), layout=Layout(tp=8, pp=PP),
                              workload=spec, steps=1))
    pool = SamplePool.build(spec, sim.cost_model, seq_len=SEQ_LEN, seed=0, packing=preset.model.config.packing())
    draw = draw_step(pool, ranks=ranks, micro_batches=m, seq_len=SEQ_LEN, rng=np.random.default_rng([0, 1, 0]),
                     concentration=None)
    ids = np.concatenate(draw.samples)
    owners = np.concatenate([np.full(s.size, r) for r, s in enumerate(draw.samples)])
    costs, tokens = pool.llm[ids], pool.tokens[ids]
    rows = []
    for order in ("ramp", "search"):
        config = reorder.ReorderConfig(steps=1, micro_batches=m, token_budget=SEQ_LEN, pp=PP,
                                       pipeline_order=order)  # type: ignore[arg-type]

        def group(config: reorder.ReorderConfig = config) -> reorder.GroupPlan:
            return reorder.plan_reorder_group(costs, tokens, owners, np.zeros(ids.size), n_ranks=ranks,
                                              config=config, seed=0, epoch=0, group_index=0, searched_rank=0)

        plan, seconds = _timed(group, lambda a, b: a.micro_batches == b.micro_batches)
        rows.append((f"plan_reorder_group ({order})", seconds, f"{plan.evaluations:,}",
                     f"{ids.size} samples, {len(plan.leftover)} left over, max/mean {plan.imbalance:.3f}"))

    rows.append(_joint_group_row(pool, draw, ranks, m))

    items, position = pool.items_of(ids)
    item_costs = pool.item_cost[items]
    prices = _runtime_prices(pool, items, sim.encoder_traffic, enc_sp=8)
    enc, seconds = _timed(lambda: reshard.plan_encoder_work(item_costs, owners[position], n_ranks=ranks, enc_sp=8,
                                                            prices=prices),
                          lambda a, b: np.array_equal(a.rank_cost, b.rank_cost))
    rows.append(("plan_encoder_work (enc_sp 8)", seconds, "-",
                 f"{items.size} items, {enc.items_split} split, max/mean {enc.imbalance:.3f}"))

    # The rank with the most encoder work: its step's ramp of micro-batches, its items over the stages.
    heaviest = int(np.argmax(np.bincount(owners[position], weights=item_costs, minlength=ranks)))
    mine = ids[owners == heaviest]
    ramp, loads, _ = split_to_profile(list(range(mine.size)), pool.llm[mine], pool.tokens[mine], pp=PP,
                                      micro_batches=m, token_budget=SEQ_LEN)
    batch_of = np.zeros(mine.size, dtype=np.int64)
    for j, batch in enumerate(ramp):
        batch_of[batch] = j
    rank_items, rank_position = pool.items_of(mine)
    budgets: list[WorkBudget] = []

    def joint() -> np.ndarray:
        budgets.append(WorkBudget(JOINT_ITEM_EVALUATIONS))
        return assign_encoder_items(np.array(loads), batch_of[rank_position], pool.item_cost[rank_items] / 8, PP,
                                    budget=budgets[-1])

    _, seconds = _timed(joint, np.array_equal)
    rows.append(("assign_encoder_items (heaviest rank)", seconds, f"{budgets[0].used:,}",
                 f"{rank_items.size} items over {PP} stages"))

    def search() -> list[list[int]]:
        budgets.append(WorkBudget(search_evaluations))
        return refine_for_1f1b(ramp, pool.llm[mine], pool.tokens[mine], pp=PP, token_budget=SEQ_LEN,
                               budget=budgets[-1])

    _, seconds = _timed(search, lambda a, b: a == b)
    rows.append(("refine_for_1f1b (heaviest rank's ramp)", seconds, f"{budgets[-2].used:,}",
                 f"{mine.size} samples"))

    problem = sim.pool_problem()
    choice, seconds = _timed(lambda: allocation.solve_pools(problem), lambda a, b: a == b)
    rows.append(("solve_pools (4096 GPUs)", seconds, "-",
                 f"{choice.encoder_gpus} encoder GPUs" if choice else "no layout fits"))
    return rows


def _joint_group_row(pool: SamplePool, first: Any, ranks: int, m: int) -> tuple[str, float, str, str]:
    """``plan_reorder_group`` as the loader runs it under the joint pipeline: two steps planned together (the
    drawn one and a second draw), on each sample's whole cost with micro-batches balanced on its LLM cost, the
    group's plan competing with the step-by-step one on the joint pipeline's model."""
    second = draw_step(pool, ranks=ranks, micro_batches=m, seq_len=SEQ_LEN, rng=np.random.default_rng([0, 1, 1]),
                       concentration=None)
    ids = np.concatenate([*first.samples, *second.samples])  # each rank's reads of step 0 come before step 1's
    owners = np.concatenate([np.full(s.size, r) for draw in (first, second) for r, s in enumerate(draw.samples)])
    llm = pool.llm[ids]
    config = reorder.ReorderConfig(steps=2, micro_batches=m, token_budget=SEQ_LEN, pp=PP, pipeline_order="search",
                                   encoder_peers=8)

    def group() -> reorder.GroupPlan:
        return reorder.plan_reorder_group(llm + pool.encoder[ids], pool.tokens[ids], owners, np.zeros(ids.size),
                                          n_ranks=ranks, config=config, seed=0, epoch=0, group_index=0,
                                          micro_batch_costs=llm, searched_rank=0)

    plan, seconds = _timed(group, lambda a, b: a.micro_batches == b.micro_batches)
    return ("plan_reorder_group (joint, 2 steps)", seconds, f"{plan.evaluations:,}",
            f"{ids.size} samples, {len(plan.leftover)} left over, max/mean {plan.imbalance:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", nargs="+",
                        default=[str(HERE / "workloads" / "few_giants.yaml"),
                                 str(SHARED_WORKLOADS / "video_heavy.yaml")])
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--micro-batches", type=int, default=32)
    args = parser.parse_args()
    defaults = reorder.ReorderConfig(steps=1)
    lines = [f"{args.ranks} ranks x {args.micro_batches} micro-batches of {SEQ_LEN} tokens, pp {PP}; "
             f"{PRESETS['omni-d'].model.name} cost model; budgets: balancing {defaults.balance_evaluations:,} "
             f"evaluations per group, 1F1B search {defaults.search_evaluations:,} per rank-step, joint item plan "
             f"{JOINT_ITEM_EVALUATIONS:,} per step; CPU seconds of one run (each planner ran twice and gave the "
             "same plan)",
             f"{'workload':<12}{'planner':<40}{'CPU s':>8}{'evaluations':>14}  detail"]
    slowest = (0.0, "", "")
    for path in args.workload:
        name = Path(path).stem
        for planner, seconds, evaluations, detail in _measure(path, args.ranks, args.micro_batches,
                                                              defaults.search_evaluations):
            lines.append(f"{name:<12}{planner:<40}{seconds:>8.2f}{evaluations:>14}  {detail}")
            print(lines[-1], flush=True)
            slowest = max(slowest, (seconds, planner, name))
    lines.append(f"slowest planner: {slowest[1]} on {slowest[2]}, {slowest[0]:.2f} CPU s")
    text = "\n".join(lines)
    print(lines[-1])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "planner_cost.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
