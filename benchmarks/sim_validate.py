"""Does the simulator's cost model predict what the CPU runs of ``e2e.py`` measured, rank by rank?

Reads ``results/e2e.json`` (written by ``python benchmarks/e2e.py --quick``: every rank's samples and measured
compute seconds per step, for configurations (a)-(d)), calibrates a cost model on the first half of the steps of
(a)-(c) with :func:`omni_lightning.balance.cost.fit_cost_model`, and predicts every (rank, step) of the second
half of all four configurations the way the simulator does: a rank's LLM cost is that of the samples it trained
on; its encoder cost is that of its own items, except under (d), where
:func:`omni_lightning.balance.reshard.plan_encoder_work` (the runtime's planner, long-short SP over the ranks)
decides which rank encodes which item. Reports Pearson r of predicted against measured per-rank seconds and the
relative error of the predicted step time (the slowest rank) per configuration.

    python benchmarks/sim_validate.py [--results benchmarks/results/e2e.json]

Its last line is ``pearson r: X, step-time relative error: Y`` (held-out steps, all configurations; the error is
the mean absolute one over steps).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from common import fit_to_runs

from omni_lightning.balance.cost import CostModel
from omni_lightning.balance.reshard import plan_encoder_work
from omni_lightning.balance.workload import SampleMeta

RESULTS = Path(__file__).resolve().parent / "results"


def encoder_items(metas: list[SampleMeta], model: CostModel) -> np.ndarray:
    """Predicted cost of every encoder item of these samples (each image or frame, each audio clip)."""
    costs = [model.vision(h * w, (h * w) ** 2) for meta in metas for h, w in meta.images]
    for meta in metas:
        if meta.audio_frames:
            tokens = meta.audio_frames / 4
            costs.append(model.audio(tokens, tokens**2))
    return np.array(costs)


def predict_step(per_rank: list[list[SampleMeta]], model: CostModel, *, reshard: bool, enc_sp: int) -> np.ndarray:
    """Predicted seconds of every rank for one step: LLM of its samples plus the encoder work it is given."""
    n = len(per_rank)
    llm = np.array([model.costs(metas)[:, 2].sum() if metas else 0.0 for metas in per_rank])
    items = [encoder_items(metas, model) for metas in per_rank]
    owners = np.concatenate([np.full(c.size, r) for r, c in enumerate(items)])
    costs = np.concatenate(items)
    plan = plan_encoder_work(costs, owners, n_ranks=n, enc_sp=enc_sp if reshard else 1, reshard=reshard)
    return llm + plan.rank_cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(RESULTS / "e2e.json"))
    args = parser.parse_args()
    record = json.loads(Path(args.results).read_text())
    runs = record["results"]
    if "per_rank_samples" not in runs["a"]:
        raise SystemExit(f"{args.results} has no per-rank samples: rerun python benchmarks/e2e.py --quick")
    enc_sp = int(record["args"]["enc_sp"])
    samples = {name: [[[SampleMeta.from_json(m) for m in rank] for rank in step] for step in run["per_rank_samples"]]
               for name, run in runs.items()}
    measured = {name: np.array(run["per_rank_step_s"]) for name, run in runs.items()}
    steps = len(measured["a"])
    half = steps // 2
    model, seen = fit_to_runs(runs, ("a", "b", "c"), slice(0, half))

    lines = [f"calibrated on steps 0-{half - 1} of (a)-(c) ({seen} rank-steps); held out: steps "
             f"{half}-{steps - 1}",
             f"{'config':<8}{'pearson r':>10}{'pred step':>12}{'meas step':>12}{'rel err':>9}"]
    all_pred, all_meas, errors = [], [], []
    for name in ("a", "b", "c", "d"):  # the multiplexed runs; (e)'s pools are the simulator's other placement
        pred = np.array([predict_step(samples[name][s], model, reshard=name == "d", enc_sp=enc_sp)
                         for s in range(half, steps)])
        meas = measured[name][half:]
        step_error = np.abs(pred.max(axis=1) - meas.max(axis=1)) / meas.max(axis=1)
        r = float(np.corrcoef(pred.ravel(), meas.ravel())[0, 1])
        lines.append(f"({name}){'':<5}{r:>10.3f}{pred.max(axis=1).mean() * 1e3:>10.1f}ms"
                     f"{meas.max(axis=1).mean() * 1e3:>10.1f}ms{step_error.mean():>9.3f}")
        all_pred.append(pred.ravel())
        all_meas.append(meas.ravel())
        errors.append(step_error)
    r_all = float(np.corrcoef(np.concatenate(all_pred), np.concatenate(all_meas))[0, 1])
    lines.append(f"pearson r: {r_all:.3f}, step-time relative error: {np.concatenate(errors).mean():.3f}")
    text = "\n".join(lines)
    print(text)
    (RESULTS / "sim_validate.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
