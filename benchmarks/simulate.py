"""Cluster-scale predictions: the three placements on every workload from 512 to 8192 GPUs, and the papers' presets.

Runs :class:`omni_lightning.sim.placements.Simulation` (what ``omni-lightning simulate`` prints, one row per run),
with its defaults: every data-parallel rank simulated, step times the mean of 8 steps whose modality mix swings:

* every workload at ``--gpus`` (default 512 1024 4096 8192) with the MegaScale-Omni preset for that size
  (ViT-10B + GPT-175B from 512 GPUs);
* every workload at 512 GPUs with a single 16K sequence per data-parallel rank and step (preset omni-a's layout,
  one micro-batch): there whole-sample placement is held up by the largest sample, and the table shows that bound
  beside Omni's max/mean with long items split;
* every preset (MegaScale-Omni A-D, DistTrain's 72B) at its own GPU count on ``--preset-workload``, with the
  image:text sweep 1:9 ... 9:1 (disaggregated pools sized once for the workload's own mix).

    python benchmarks/simulate.py [--workload FILE ...] [--gpus 512 1024 4096 8192]

Writes ``results/simulate.txt``. Its last line is ``worst omni max/mean at 512 GPUs: Z; speedup vs coupled at
1k-8k GPUs: min X, vs disaggregated: min Y`` (Z over both 512-GPU tables).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from common import SHARED_WORKLOADS, default_workloads

from omni_lightning.balance.workload import load_workload
from omni_lightning.sim.cluster import Cluster
from omni_lightning.sim.placements import Scenario, Simulation
from omni_lightning.sim.presets import PRESETS, preset_for
from omni_lightning.sim.report import SWEEP, image_text_mix

RESULTS = Path(__file__).resolve().parent / "results"


def _speedups(sim: Simulation, disaggregated_problem: object = None
              ) -> tuple[float, float, float, float, float, str]:
    """Speedup vs coupled and vs disaggregated, omni's and coupled's max/mean, omni's step time, and the range of
    the per-step speedup vs coupled (how far the modality swing moves it)."""
    coupled, omni = sim.coupled(), sim.omni()
    disaggregated = sim.disaggregated(disaggregated_problem)  # type: ignore[arg-type]
    per_step = [c / o for c, o in zip(coupled.per_step_s, omni.per_step_s, strict=True)]
    return (coupled.step_s / omni.step_s, disaggregated.step_s / omni.step_s, omni.imbalance, coupled.imbalance,
            omni.step_s, f"{min(per_step):.2f}-{max(per_step):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", nargs="+", default=default_workloads())
    parser.add_argument("--gpus", nargs="+", type=int, default=[512, 1024, 4096, 8192])
    default_preset_workload = SHARED_WORKLOADS / "vlm_dynres.yaml"
    parser.add_argument("--preset-workload",
                        default=str(default_preset_workload) if default_preset_workload.exists() else "vlm_dynres")
    args = parser.parse_args()
    started = time.perf_counter()
    lines = [f"{'workload':<12}{'gpus':>6}  {'preset':<8}{'omni s':>8}{'vs coupled':>12}{'vs disagg':>11}"
             f"{'omni max/mean':>15}{'coupled max/mean':>18}{'vs coupled per step':>21}"]
    worst_balance, at_scale = 0.0, []
    for path in args.workload:
        for gpus in args.gpus:
            preset = preset_for(gpus)
            sim = Simulation(Scenario(model=preset.model, cluster=Cluster(gpus=gpus), layout=preset.layout,
                                      workload=load_workload(path)))
            coupled, disagg, balance, coupled_balance, step, per_step = _speedups(sim)
            lines.append(f"{Path(path).stem:<12}{gpus:>6}  {preset.name:<8}{step:>8.2f}{coupled:>12.3f}{disagg:>11.3f}"
                         f"{balance:>15.3f}{coupled_balance:>18.3f}{per_step:>21}")
            print(lines[-1], flush=True)
            if gpus == 512:
                worst_balance = max(worst_balance, balance)
            if 1024 <= gpus <= 8192:
                at_scale.append((coupled, disagg))
    lines.append("")
    lines.append("512 GPUs, one 16K sequence per data-parallel rank and step (omni-a layout, micro_batches=1)")
    lines.append(f"{'workload':<12}{'whole-sample bound':>20}{'omni max/mean':>15}{'coupled max/mean':>18}"
                 f"{'vs coupled':>12}{'vs disagg':>11}")
    small = PRESETS["omni-a"]
    for path in args.workload:
        sim = Simulation(Scenario(model=small.model, cluster=Cluster(gpus=512),
                                  layout=replace(small.layout, micro_batches=1), workload=load_workload(path)))
        coupled, disagg, balance, coupled_balance, *_ = _speedups(sim)
        worst_balance = max(worst_balance, balance)
        lines.append(f"{Path(path).stem:<12}{sim.whole_sample_bound:>20.3f}{balance:>15.3f}{coupled_balance:>18.3f}"
                     f"{coupled:>12.3f}{disagg:>11.3f}")
        print(lines[-1], flush=True)
    lines.append("")
    lines.append(f"presets on {Path(args.preset_workload).stem}, image:text sweep (speedup of omni vs coupled / vs "
                 "disaggregated; disaggregated pools sized once for the workload's own mix)")
    lines.append(f"{'preset':<15}{'gpus':>6}  " + "".join(f"{f'{m}:{t}':>14}" for m, t in SWEEP))
    spec = load_workload(args.preset_workload)
    for preset in PRESETS.values():
        base = Simulation(Scenario(model=preset.model, cluster=Cluster(gpus=preset.gpus), layout=preset.layout,
                                   workload=spec))
        problem = base.pool_problem()
        cells = []
        for media, text in SWEEP:
            sim = Simulation(replace(base.scenario, workload=image_text_mix(spec, media, text)))
            coupled, disagg, *_ = _speedups(sim, problem)
            cells.append(f"{coupled:.2f} / {disagg:.2f}")
        lines.append(f"{preset.name:<15}{preset.gpus:>6}  " + "".join(f"{c:>14}" for c in cells))
        print(lines[-1], flush=True)
    lines.append(f"({time.perf_counter() - started:.0f} s)")
    if at_scale:
        lines.append(f"worst omni max/mean at 512 GPUs: {worst_balance:.3f}; speedup vs coupled at 1k-8k GPUs: min "
                     f"{min(c for c, _ in at_scale):.3f}, vs disaggregated: min {min(d for _, d in at_scale):.3f}")
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "simulate.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
