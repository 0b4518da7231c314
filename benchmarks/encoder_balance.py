"""Encoder balance per step: no resharding vs resharding whole items vs long-short sequence parallelism.

For each workload and rank count it draws ``--samples-per-step`` samples per rank for ``--steps`` steps, splits
them into encoder items (every image, every video frame and every audio clip is an item), prices the items with
the encoder cost model of a ViT-1B-class vision tower and a Whisper-sized audio encoder, and prints the mean over
steps of max/mean per-rank encoder cost for

* (a) no resharding: each rank encodes what it loaded;
* (b) resharding whole items (LPT over ranks, no sequence parallelism);
* (c) long-short SP: items above a rank's fair share split over SP groups of ``--enc-sp`` ranks, the rest LPT;

beside the lower bound max(mean load, largest item / enc_sp) / mean, all averaged over the steps. Its last line is
``worst long-short/bound: X``, the largest (c)/bound over all rows.

    python benchmarks/encoder_balance.py [--workload FILE ...] [--dp 8 64 512] [--enc-sp 8]
"""

from __future__ import annotations

import argparse

import numpy as np
from common import WORKLOAD_A, default_workloads

from omni_lightning.balance.cost import CostModel, meta_items
from omni_lightning.balance.reshard import encoder_lower_bound, plan_encoder_work
from omni_lightning.balance.workload import SampleMeta, load_workload, sample_metadata
from omni_lightning.models.flops import reference_cost_model

POOL = 1 << 14


def item_costs(meta: SampleMeta, model: CostModel) -> list[float]:
    """Encoder cost of every item of a sample: each image, each video frame, the audio clip."""
    items = meta_items(meta)
    return [float(c) for name in model.encoder_names for c in model.item_costs(name, items.get(name, []))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", nargs="+", default=default_workloads())
    parser.add_argument("--dp", nargs="+", type=int, default=[8, 64, 512])
    parser.add_argument("--enc-sp", type=int, default=8, help="largest SP degree (SP groups stay inside a node)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--samples-per-step", type=int, default=16, help="samples per rank and step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = reference_cost_model(WORKLOAD_A)
    worst = 0.0
    print(f"{'workload':<14}{'dp':>6}{'(a) none':>10}{'(b) whole':>11}{'(c) long-short':>16}{'bound':>8}"
          f"{'(c)/bound':>11}{'split/step':>12}")
    for path in args.workload:
        spec = load_workload(path)
        rng = np.random.default_rng(args.seed)
        pool = [item_costs(sample_metadata(spec, rng), model) for _ in range(POOL)]
        for dp in args.dp:
            enc_sp = min(args.enc_sp, dp)
            rows = []
            for _ in range(args.steps):
                picks = rng.integers(0, POOL, dp * args.samples_per_step)
                costs = np.array([c for i in picks for c in pool[i]])
                owners = np.repeat(np.arange(dp), [sum(len(pool[i]) for i in picks[r * args.samples_per_step:
                                                                                   (r + 1) * args.samples_per_step])
                                                   for r in range(dp)])
                if costs.size == 0:
                    continue
                mean = costs.sum() / dp
                none = plan_encoder_work(costs, owners, n_ranks=dp, reshard=False)
                whole = plan_encoder_work(costs, owners, n_ranks=dp, enc_sp=1)
                lssp = plan_encoder_work(costs, owners, n_ranks=dp, enc_sp=enc_sp)
                bound = encoder_lower_bound(costs, dp, enc_sp)
                rows.append((none.rank_cost.max() / mean, whole.rank_cost.max() / mean, lssp.rank_cost.max() / mean,
                             bound / mean, lssp.rank_cost.max() / bound, lssp.items_split))
            if not rows:
                print(f"{spec.name:<14}{dp:>6}  (no encoder items)")
                continue
            a, b, c, bound, ratio, split = np.mean(rows, axis=0)
            worst = max(worst, float(ratio))
            print(f"{spec.name:<14}{dp:>6}{a:>10.3f}{b:>11.3f}{c:>16.3f}{bound:>8.3f}{ratio:>11.4f}{split:>12.1f}")
    print(f"worst long-short/bound: {worst:.4f}")


if __name__ == "__main__":
    main()
