"""Does the simulator's cost model predict what the CPU runs of ``e2e.py`` measured, rank by rank?

Reads ``results/e2e.json`` (written by ``python benchmarks/e2e.py --quick``: every rank's samples and measured
compute seconds per step, for configurations (a)-(d)) and predicts every (rank, step) of the second half of the
steps of all four configurations with two cost models:

* the simulator's own: :func:`omni_lightning.models.flops.reference_cost_model` of e2e's model, training FLOPs,
  turned into seconds by one throughput (FLOP/s of this CPU: measured seconds over predicted FLOPs of the first
  half of (a)-(c)), as the simulator divides FLOPs by a cluster's effective FLOP/s; nothing else is fitted, so
  this says how far the simulator's model of where time goes is from the CPU's;
* for comparison, a cost model fitted per module to the first half of (a)-(c)
  (:func:`omni_lightning.balance.cost.fit_cost_model`), what a calibrated run would use.

Either way the prediction goes the way the simulator's goes: a rank's LLM cost is that of the samples it trained
on; its encoder cost is that of its own items, except under (d), where
:func:`omni_lightning.balance.reshard.plan_encoder_work` (the runtime's planner, long-short SP over the ranks)
decides which rank encodes which item, on top of each rank's LLM work, as the runtime's resharder does. Reports
Pearson r of predicted against measured per-rank seconds and the relative error of the predicted step time (the
slowest rank) per configuration.

    python benchmarks/sim_validate.py [--results benchmarks/results/e2e.json]

Its last line is ``simulator FLOPs model: pearson r X, step-time relative error Y; fitted model: pearson r Z,
step-time relative error W`` (held-out steps, all configurations; the error is the mean absolute one over steps).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from common import fit_to_runs
from e2e import CONFIG

from omni_lightning.balance.cost import CostModel
from omni_lightning.balance.reshard import plan_encoder_work
from omni_lightning.balance.workload import SampleMeta
from omni_lightning.models.flops import reference_cost_model

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
    # As the runtime's resharder plans: encoder work on top of each rank's LLM work.
    plan = plan_encoder_work(costs, owners, n_ranks=n, enc_sp=enc_sp if reshard else 1, reshard=reshard, base=llm)
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
    if half == 0:
        raise SystemExit(f"{args.results} times {steps} step(s): the fit needs at least 2, one half to calibrate on "
                         "and one to hold out (rerun e2e.py with more steps than --warmup)")
    fitted, seen = fit_to_runs(runs, ("a", "b", "c"), slice(0, half))
    flops = reference_cost_model(CONFIG)

    def predict(model: CostModel, name: str, step_range: range) -> np.ndarray:
        return np.array([predict_step(samples[name][s], model, reshard=name == "d", enc_sp=enc_sp)
                         for s in step_range])

    # One throughput for the FLOPs model, from the calibration half (what a cluster's effective FLOP/s is to it).
    calibration = [(predict(flops, name, range(half)), measured[name][:half]) for name in ("a", "b", "c")]
    flop_rate = sum(float(f.sum()) for f, _ in calibration) / sum(float(m.sum()) for _, m in calibration)
    lines = [f"held out: steps {half}-{steps - 1}; simulator FLOPs model at {flop_rate / 1e9:.2f} GFLOP/s (training "
             f"FLOPs over measured seconds, steps 0-{half - 1} of (a)-(c)); fitted model calibrated on the same "
             f"{seen} rank-steps"]
    summary = []
    for label, model, scale in (("simulator FLOPs model", flops, 1 / flop_rate), ("fitted model", fitted, 1.0)):
        lines.append(label)
        lines.append(f"{'config':<8}{'pearson r':>10}{'pred step':>12}{'meas step':>12}{'rel err':>9}")
        all_pred, all_meas, errors = [], [], []
        for name in ("a", "b", "c", "d"):  # the multiplexed runs; (e)'s pools are the simulator's other placement
            pred = predict(model, name, range(half, steps)) * scale
            meas = measured[name][half:]
            step_error = np.abs(pred.max(axis=1) - meas.max(axis=1)) / meas.max(axis=1)
            r = float(np.corrcoef(pred.ravel(), meas.ravel())[0, 1])
            lines.append(f"({name}){'':<5}{r:>10.3f}{pred.max(axis=1).mean() * 1e3:>10.1f}ms"
                         f"{meas.max(axis=1).mean() * 1e3:>10.1f}ms{step_error.mean():>9.3f}")
            all_pred.append(pred.ravel())
            all_meas.append(meas.ravel())
            errors.append(step_error)
        r_all = float(np.corrcoef(np.concatenate(all_pred), np.concatenate(all_meas))[0, 1])
        summary.append(f"{label}: pearson r {r_all:.3f}, step-time relative error "
                       f"{np.concatenate(errors).mean():.3f}")
    lines.append("; ".join(summary))
    text = "\n".join(lines)
    print(text)
    (RESULTS / "sim_validate.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
