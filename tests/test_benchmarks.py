"""Every benchmark still runs: each script, with arguments small enough for a few seconds, in a copy of
``benchmarks/`` (the scripts write their results beside themselves, and the committed results must not change).

A benchmark calls into the library the way no unit test does (``collectives.py`` once broke for days, unnoticed,
when ``e2e.run`` began reading an argument it did not build); a run that ends with its documented last line is the
check. The figures of these runs mean nothing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY_E2E = ["--ranks", "2", "--group-steps", "1", "--warmup", "1", "--repeats", "2", "--samples-per-step", "2"]

# script -> (arguments, what its last line starts with)
RUNS: dict[str, tuple[list[str], str]] = {
    # Two timed steps: sim_validate.py fits on one and holds out the other.
    "e2e.py": ([*TINY_E2E, "--steps", "3", "--no-pools", "--out", "smoke"], "modeled speedup (d)/(a): "),
    "e2e_hf.py": (["--ranks", "2", "--dialogues", "16", "--samples-per-step", "2", "--group-steps", "1", "--repeats",
                   "2"], "modeled speedup (g)/(f): "),
    "collectives.py": (["--workload", "vlm_dynres", "--configs", "c"], ""),
    "profile_overhead.py": ([*TINY_E2E, "--steps", "2", "--top", "3", "--out", "smoke"],
                            "profiled training-thread CPU per rank-step vs (a): "),
    "plan_ahead.py": (["--ranks", "2", "--steps", "2", "--group-steps", "1", "--warmup", "1", "--repeats", "2",
                       "--micro-batches", "2", "--samples-per-step", "2", "--out", "smoke"],
                      "critical-path step (s)/(p): "),
    "guard_cost.py": (["--calls", "2", "--repeats", "1"], "guard gradient check per step: "),
    "attention_items.py": (["--items", "2", "--repeats", "1"], "attention forward+backward, "),
    "link_cost.py": (["--ranks", "2", "--megabytes", "0.01", "--calls", "3"], ""),
    "planner_cost.py": (["--workload", "vlm_dynres", "--ranks", "16", "--micro-batches", "2"], "slowest planner: "),
    "simulate_4096.py": (["--workload", "vlm_dynres", "--gpus", "64"], "slowest simulate --gpus "),
    "allocation.py": (["--gpus", "64"], "slowest sizing of "),
    "balance.py": (["--dp", "4", "--steps", "2", "--samples-per-step", "4"], "worst grouped/bound: "),
    "encoder_balance.py": (["--dp", "4", "--steps", "2", "--samples-per-step", "4"], "worst long-short/bound: "),
    "encoder_runtime.py": (["--ranks", "2", "--enc-sp", "2", "--steps", "2", "--warmup", "1"], ""),
    "loader_balance.py": (["--ranks", "2", "--steps", "2", "--group-steps", "1", "--warmup", "1"], ""),
    "loader_throughput.py": (["--ranks", "2", "--batches", "2", "--repeats", "1"], ""),
    "pipeline.py": (["--stages", "2", "--micro-batches", "2", "--steps", "1", "--repeats", "1"],
                    "joint bubble/theoretical: "),
}


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scripts and workload specs, without the committed results, beside the checkout's ``examples/`` (which
    builds the tiny Hugging Face checkpoints)."""
    root = tmp_path_factory.mktemp("checkout")
    target = root / "benchmarks"
    target.mkdir()
    for path in BENCHMARKS.glob("*.py"):
        shutil.copy(path, target)
    shutil.copytree(BENCHMARKS / "workloads", target / "workloads")
    (target / "results").mkdir()
    (root / "examples").symlink_to(BENCHMARKS.parent / "examples", target_is_directory=True)
    return target


def _run(copy: Path, script: str, arguments: list[str]) -> str:
    done = subprocess.run([sys.executable, str(copy / script), *arguments], cwd=copy, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{script} {' '.join(arguments)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def test_every_benchmark_is_run_here() -> None:
    """A new benchmark gets a smoke run. Not here: gpu_smoke.py (its dry run has a test of its own), sim_validate.py
    (it reads what e2e.py's smoke run writes: run after it below), and what runs a minute or more at its smallest:
    simulate.py (every preset at its own GPU count) and soak.py (a kill, a resize and a resume)."""
    elsewhere = {"common.py", "gpu_smoke.py", "sim_validate.py", "simulate.py", "soak.py"}
    assert {p.name for p in BENCHMARKS.glob("*.py")} - elsewhere == set(RUNS)


@pytest.mark.parametrize("script", sorted(RUNS))
def test_benchmark_runs(copy: Path, script: str) -> None:
    arguments, last_line = RUNS[script]
    stdout = _run(copy, script, arguments)
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, f"{script} printed nothing"
    assert lines[-1].startswith(last_line), f"{script}'s last line: {lines[-1]!r}"
    if script == "e2e.py":  # the simulator's cost model against the runs it just measured
        validated = _run(copy, "sim_validate.py", ["--results", str(copy / "results" / "smoke.json")])
        assert validated.strip().splitlines()[-1].startswith("simulator FLOPs model: pearson r "), validated
