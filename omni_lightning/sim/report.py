"""``omni-lightning simulate``: the placements side by side, the ablation, an optional image:text sweep.

    omni-lightning simulate --workload FILE --gpus N [--preset NAME] [--sweep] [--jobs J] [--tp 8 --pp 8 ...]

Prints the scenario, one row per placement (step time, ratio to omni, max/mean per-GPU compute, memory per GPU or
OOM), the ablation rows (omni with multiplexing, reordering or LSSP off), and with ``--sweep`` the step times at
image:text 1:9 ... 9:1 with the disaggregated pools sized once for the workload's own mix. The last two lines are
``omni max/mean: Z`` and ``predicted speedup vs coupled: X, vs disaggregated: Y`` (``oom`` where a baseline does
not fit). The placements are independent and deterministic: ``--jobs`` computes them in that many forked
processes side by side, which changes no figure.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from omni_lightning.balance.workload import WorkloadSpec, load_workload
from omni_lightning.sim.cluster import Cluster
from omni_lightning.sim.placements import ASSUMPTIONS, OmniOptions, PlacementResult, Scenario, Simulation
from omni_lightning.sim.presets import PRESETS, preset_for

__all__ = ["default_jobs", "format_speedups", "image_text_mix", "placements", "simulate_main"]

SWEEP = ((1, 9), (3, 7), (5, 5), (7, 3), (9, 1))
# The rows, by name, as the processes of ``--jobs`` share them out, the longest first: omni's ablation without LSSP
# reuses omni's loader and item plans, so the two run in one process.
_ABLATIONS = {"no multiplexing": OmniOptions(multiplex=False), "no reordering": OmniOptions(reorder=False),
              "no LSSP": OmniOptions(lssp=False)}
_TASKS = (("omni", "no LSSP"), ("no multiplexing",), ("no reordering",), ("disaggregated",), ("coupled",))
_forked: Simulation | None = None  # what forked processes compute on (copied, not pickled, into them)
_LAYOUT_FLAGS = ("tp", "pp", "cp", "micro_batches", "seq_len", "enc_sp", "recompute", "reorder_group",
                 "group_steps")


def image_text_mix(spec: WorkloadSpec, media: float, text: float) -> WorkloadSpec:
    """``spec`` with text at ``text / (media + text)`` of the samples and its media modalities sharing the rest in
    their original proportions. Raises ``ValueError`` if ``spec`` lacks text or media."""
    modalities = spec.modalities
    media_names = [name for name in modalities if name != "text"]
    if "text" not in modalities or not media_names:
        raise ValueError(f"workload {spec.name!r} needs text and at least one media modality for an image:text sweep")
    media_weight = sum(modalities[name].weight for name in media_names)
    weights = {"text": text / (media + text)}
    weights.update({name: media / (media + text) * modalities[name].weight / media_weight for name in media_names})
    return replace(spec, name=f"{spec.name} {media:g}:{text:g}",
                   modalities={name: replace(m, weight=weights[name]) for name, m in modalities.items()})


def _ratio(base: PlacementResult, omni: PlacementResult) -> str:
    if base.oom:
        return "oom"
    return "n/a" if omni.oom else f"{base.step_s / omni.step_s:.3f}"


def format_speedups(coupled: PlacementResult, disaggregated: PlacementResult, omni: PlacementResult) -> str:
    """The last line of ``simulate``."""
    return f"predicted speedup vs coupled: {_ratio(coupled, omni)}, vs disaggregated: {_ratio(disaggregated, omni)}"


def _row(result: PlacementResult, omni: PlacementResult) -> str:
    step = "OOM" if result.oom else f"{result.step_s:8.2f}"
    ratio = "-" if result.oom or omni.oom else f"{result.step_s / omni.step_s:.3f}"
    return (f"{result.name:<28}{step:>9}{ratio:>9}{result.imbalance:>10.3f}{result.memory_gib:>9.1f}  "
            f"{result.detail}")


def _placement(sim: Simulation, name: str) -> PlacementResult:
    if name == "coupled":
        return sim.coupled()
    if name == "disaggregated":
        return sim.disaggregated()
    return sim.omni(_ABLATIONS.get(name, OmniOptions()))


def _rows_of(sim: Simulation, names: Sequence[str]) -> list[PlacementResult]:
    return [_placement(sim, name) for name in names]


def _forked_rows(names: Sequence[str]) -> list[PlacementResult]:
    return _rows_of(_forked, names)


def default_jobs() -> int:
    """The CPUs this process may run on (at most one per group of rows) on Linux; elsewhere 1, since forking a
    process that has imported torch is safe on Linux alone."""
    if sys.platform != "linux":
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), len(_TASKS)))


def _jobs_problem(jobs: int) -> str | None:
    """Why ``jobs`` processes cannot compute the rows here, or ``None``."""
    if jobs < 1:
        return "at least one process computes the rows"
    if jobs > 1 and sys.platform != "linux":
        return "the rows are computed in forked processes on Linux only"
    return None


def placements(sim: Simulation, jobs: int = 1) -> dict[str, PlacementResult]:
    """Every row of the report by name (``"coupled"``, ``"disaggregated"``, ``"omni"`` and its ablations
    ``"no multiplexing"``, ``"no reordering"``, ``"no LSSP"``), computed in ``jobs`` forked processes (1: this one).
    The same figures either way: each placement is a pure function of the simulation's scenario."""
    global _forked
    if problem := _jobs_problem(jobs):
        raise ValueError(f"jobs={jobs}: {problem}")
    if jobs == 1:
        results = [_rows_of(sim, task) for task in _TASKS]
    else:
        _forked = sim
        pool = ProcessPoolExecutor(min(jobs, len(_TASKS)), mp_context=multiprocessing.get_context("fork"))
        try:
            results = list(pool.map(_forked_rows, _TASKS))
        except BaseException:
            pool.shutdown(cancel_futures=True)  # the first failure ends the run, not the last row
            raise
        finally:
            pool.shutdown()
            _forked = None
    return {name: result for task, rows in zip(_TASKS, results, strict=True)
            for name, result in zip(task, rows, strict=True)}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-lightning simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", required=True, help="workload YAML (or a bundled preset name)")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model and layout (default: the largest "
                        "MegaScale-Omni preset with at most --gpus GPUs)")
    parser.add_argument("--steps", type=int, default=Scenario.steps,
                        help="simulated steps (the step times are their mean)")
    parser.add_argument("--groups", type=int, default=0, help="reorder groups simulated per step (0: all, i.e. "
                        "every data-parallel rank; fewer is quicker but leaves out stragglers)")
    parser.add_argument("--pipeline-search", action="store_true",
                        help="omni's loader also refines each rank-step's ramp of micro-batches by a local search on "
                             "the 1F1B step time, as OmniDataModule(pipeline_order='search') does (slower to "
                             "simulate)")
    parser.add_argument("--concentration", type=float, default=10.0,
                        help="Dirichlet concentration of the per-step modality mix (0: the spec's fixed mix)")
    parser.add_argument("--sweep", action="store_true", help="also sweep image:text from 1:9 to 9:1")
    parser.add_argument("--assume", action="append", choices=ASSUMPTIONS, default=[],
                        help="credit omni with a capability the runtime does not have (repeatable): cp_sample_split "
                             "(samples split over data-parallel ranks as context-parallel pieces), "
                             "replica_encoder_plan (encoder items planned over every GPU of a reorder group; implies "
                             "even slices), even_encoder_slices (encoder work spread evenly over the insertions)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=None,
                        help="processes computing the rows side by side (default: on Linux the CPUs this process may "
                             "use, at most 5, elsewhere 1; the figures are the same for any number)")
    for flag in _LAYOUT_FLAGS:
        kind = str if flag == "recompute" else int
        parser.add_argument(f"--{flag.replace('_', '-')}", type=kind, default=None, help="override the preset layout")
    cluster = Cluster(gpus=1)
    parser.add_argument("--tflops", type=float, default=cluster.flops / 1e12, help="peak bf16 TFLOP/s per GPU")
    parser.add_argument("--mfu", type=float, default=cluster.mfu)
    parser.add_argument("--memory-gib", type=float, default=cluster.memory_gib)
    parser.add_argument("--intra-gbps", type=float, default=cluster.intra_node_gbps, help="NVLink GB/s per GPU")
    parser.add_argument("--inter-gbps", type=float, default=cluster.inter_node_gbps, help="network GB/s per GPU")
    return parser


def simulate_main(argv: list[str]) -> None:
    """``omni-lightning simulate`` (see the module docstring)."""
    parser = _parser()
    args = parser.parse_args(argv)
    jobs = min(default_jobs() if args.jobs is None else args.jobs, len(_TASKS))
    if problem := _jobs_problem(jobs):
        parser.error(f"--jobs {args.jobs}: {problem}")
    started = time.perf_counter()
    preset = PRESETS[args.preset] if args.preset else preset_for(args.gpus)
    overrides = {flag: getattr(args, flag) for flag in _LAYOUT_FLAGS if getattr(args, flag) is not None}
    layout = replace(preset.layout, **overrides)
    cluster = Cluster(gpus=args.gpus, flops=args.tflops * 1e12, mfu=args.mfu, memory_gib=args.memory_gib,
                      intra_node_gbps=args.intra_gbps, inter_node_gbps=args.inter_gbps)
    spec = load_workload(args.workload)
    scenario = Scenario(model=preset.model, cluster=cluster, layout=layout, workload=spec, steps=args.steps,
                        max_groups=args.groups or None, concentration=args.concentration or None, seed=args.seed,
                        pipeline_search=args.pipeline_search, assume=frozenset(args.assume))
    sim = Simulation(scenario)
    print(f"workload {spec.name}; model {preset.model.name} ({preset.name} layout); {args.gpus} GPUs: tp {layout.tp}, "
          f"pp {layout.pp}, cp {layout.cp}, dp {sim.dp}, {layout.micro_batches} x {layout.seq_len} tokens per "
          f"data-parallel rank and step, recompute {layout.recompute}; {args.tflops:g} TFLOP/s x MFU {args.mfu:g}, "
          f"{args.memory_gib:g} GiB, {args.intra_gbps:g}/{args.inter_gbps:g} GB/s intra/inter-node")
    print(f"{sim.sampling_note}; modality mix per step ~ Dirichlet({args.concentration:g} x spec weights)"
          if args.concentration else sim.sampling_note)
    print(f"omni assumes: {', '.join(sorted(args.assume))} (capabilities the runtime does not have)" if args.assume
          else "omni as the runtime runs it (no --assume)")
    rows = placements(sim, jobs)
    coupled, disaggregated, omni = rows["coupled"], rows["disaggregated"], rows["omni"]
    print(f"{'placement':<28}{'step s':>9}{'vs omni':>9}{'max/mean':>10}{'GiB/GPU':>9}  detail")
    for result in (coupled, disaggregated, omni):
        print(_row(result, omni))
    print("ablation: omni with one mechanism off")
    for name in _ABLATIONS:
        print(_row(rows[name], omni))
    if not (coupled.oom or omni.oom):
        per_step = [c / o for c, o in zip(coupled.per_step_s, omni.per_step_s, strict=True)]
        print(f"speedup vs coupled per step: {min(per_step):.3f} to {max(per_step):.3f} over {len(per_step)} steps "
              "(the figures are ratios of mean step times)")
    if args.sweep:
        _sweep(scenario, sim)
    print(f"whole-sample bound on max/mean over data-parallel ranks (largest sample or the mean, over the mean): "
          f"{sim.whole_sample_bound:.3f}")
    print(f"({time.perf_counter() - started:.1f} s, the rows in {jobs} process{'es' if jobs > 1 else ''})")
    print(f"omni max/mean: {omni.imbalance:.3f}")
    print(format_speedups(coupled, disaggregated, omni))


def _sweep(scenario: Scenario, base: Simulation) -> None:
    """Step times at each image:text mix, the disaggregated pools sized once for the workload's own mix."""
    problem = base.pool_problem()
    print("image:text sweep (disaggregated pools sized once, for the workload's own mix)")
    print(f"{'mix':<8}{'coupled':>10}{'disagg':>10}{'omni':>10}{'vs coupled':>12}{'vs disagg':>11}"
          f"{'omni max/mean':>15}")
    for media, text in SWEEP:
        sim = Simulation(replace(scenario, workload=image_text_mix(scenario.workload, media, text)))
        coupled, disaggregated, omni = sim.coupled(), sim.disaggregated(problem), sim.omni()
        cells = ["OOM" if r.oom else f"{r.step_s:.2f}" for r in (coupled, disaggregated, omni)]
        print(f"{media}:{text:<6}{cells[0]:>10}{cells[1]:>10}{cells[2]:>10}{_ratio(coupled, omni):>12}"
              f"{_ratio(disaggregated, omni):>11}{omni.imbalance:>15.3f}")
