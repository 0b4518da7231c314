"""Balance of the loader plan at cluster scale: naive split vs LLM-only balancing vs grouped reordering.

For each workload and data-parallel size it draws ``steps x samples_per_step`` samples per rank from the workload
spec, prices them with the cost model of a ViT-1B + LLaMA-12B-class MLLM (MegaScale-Omni's workload A), and
prints max/mean predicted (rank, step) cost for

* naive: every rank trains on what it read, in arrival order (what a plain data loader does);
* llm-only: the grouped planner balancing LLM cost alone (what an LLM-only balancer would do);
* grouped: the grouped planner on the full per-sample cost, in reorder groups of ``--group`` ranks;

beside the lower bound max(mean load, largest sample) / mean, and, because ranks wait for each other every step,
the time each plan takes relative to perfect balance: sum over steps of the busiest rank / (total work / ranks).
It also times planning one reorder group and one
global plan over the largest data-parallel size. The last line is ``worst grouped/bound: X``, the largest ratio of
grouped max cost to the bound over rows with 64 or more ranks.

    python benchmarks/balance.py [--workload FILE ...] [--dp 8 64 512] [--group 8]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import WORKLOAD_A, default_workloads

from omni_lightning.balance.cost import feature_matrix
from omni_lightning.balance.reorder import (
    ReorderConfig,
    lower_bound,
    plan_in_place,
    plan_reorder_group,
    reorder_group_ranks,
)
from omni_lightning.balance.workload import load_workload, sample_metadata
from omni_lightning.models.flops import reference_cost_model

POOL = 1 << 16  # distinct samples drawn per workload; larger jobs resample from them


def step_costs(plan_micro_batches: list, costs: np.ndarray) -> np.ndarray:
    """Cost of every (rank, step) of a plan under ``costs`` (which may differ from what the plan balanced)."""
    return np.array(
        [[sum(costs[mb].sum() for mb in step) for step in rank] for rank in plan_micro_batches], dtype=np.float64
    )


def plan_groups(
    balance_costs: np.ndarray, true_costs: np.ndarray, tokens: np.ndarray, dp: int, group: int, config: ReorderConfig
) -> np.ndarray:
    """Plan every reorder group independently; return the true (rank, step) costs of the whole job."""
    per_rank = balance_costs.size // dp
    result = np.zeros((dp, config.steps))
    for index, ranks in enumerate(reorder_group_ranks(dp, group)):
        ids = np.arange(ranks[0] * per_rank, (ranks[-1] + 1) * per_rank)
        owners = np.repeat(np.arange(len(ranks)), per_rank)
        plan = plan_reorder_group(balance_costs[ids], tokens[ids], owners, tokens[ids], n_ranks=len(ranks),
                                  config=config, seed=0, epoch=0, group_index=index)
        result[ranks] = step_costs(plan.micro_batches, true_costs[ids])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", nargs="+", default=default_workloads())
    parser.add_argument("--dp", nargs="+", type=int, default=[8, 64, 512])
    parser.add_argument("--group", type=int, default=8, help="ranks per reorder group")
    parser.add_argument("--steps", type=int, default=64, help="steps planned together")
    parser.add_argument("--samples-per-step", type=int, default=16, help="samples per rank and step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = reference_cost_model(WORKLOAD_A)
    config = ReorderConfig(steps=args.steps)
    per_rank = args.steps * args.samples_per_step
    worst = 0.0
    print(f"{'workload':<14}{'dp':>6}{'naive':>9}{'llm-only':>10}{'grouped':>9}{'bound':>8}{'grouped/bound':>15}"
          f"{'time/ideal: naive':>19}{'llm-only':>10}{'grouped':>9}")
    for path in args.workload:
        spec = load_workload(path)
        rng = np.random.default_rng(args.seed)
        metas = [sample_metadata(spec, rng) for _ in range(POOL)]
        module_costs = model.costs(metas)
        pool_total, pool_llm = module_costs.sum(axis=1), module_costs[:, 2]
        pool_tokens = feature_matrix(metas)[:, 4].astype(np.int64)
        for dp in args.dp:
            pick = rng.integers(0, POOL, dp * per_rank)
            total, llm, tokens = pool_total[pick], pool_llm[pick], pool_tokens[pick]
            owners = np.repeat(np.arange(dp), per_rank)
            group = min(args.group, dp)
            naive = plan_in_place(total, tokens, owners, n_ranks=dp, config=config).step_cost
            llm_only = plan_groups(llm, total, tokens, dp, group, config)
            grouped = plan_groups(total, total, tokens, dp, group, config)
            mean = total.sum() / (dp * args.steps)
            bound = lower_bound(total, dp * args.steps)
            ratio = grouped.max() / bound
            if dp >= 64:
                worst = max(worst, ratio)
            ideal = total.sum() / dp
            print(f"{spec.name:<14}{dp:>6}{naive.max() / mean:>9.3f}{llm_only.max() / mean:>10.3f}"
                  f"{grouped.max() / mean:>9.3f}{bound / mean:>8.3f}{ratio:>15.4f}"
                  f"{naive.max(axis=0).sum() / ideal:>19.3f}{llm_only.max(axis=0).sum() / ideal:>10.3f}"
                  f"{grouped.max(axis=0).sum() / ideal:>9.3f}")

    timing_group = 8
    n = timing_group * per_rank
    costs = np.random.default_rng(1).lognormal(0.0, 1.0, n)
    tokens = np.random.default_rng(2).integers(16, 4096, n)
    started = time.process_time()
    plan_reorder_group(costs, tokens, np.repeat(np.arange(timing_group), per_rank), tokens, n_ranks=timing_group,
                       config=config, seed=0, epoch=0, group_index=0)
    group_ms = (time.process_time() - started) * 1e3
    big = max(args.dp)
    n = big * per_rank
    costs = np.random.default_rng(3).lognormal(0.0, 1.0, n)
    tokens = np.random.default_rng(4).integers(16, 4096, n)
    started = time.process_time()
    plan_reorder_group(costs, tokens, np.repeat(np.arange(big), per_rank), tokens, n_ranks=big, config=config,
                       seed=0, epoch=0, group_index=0)
    global_s = time.process_time() - started
    print(f"plan one reorder group ({timing_group} ranks x {args.steps} steps x {args.samples_per_step} samples): "
          f"{group_ms:.1f} ms CPU")
    print(f"plan globally over {big} ranks (same steps and samples): {global_s:.2f} s CPU")
    print(f"worst grouped/bound: {worst:.4f}")


if __name__ == "__main__":
    main()
