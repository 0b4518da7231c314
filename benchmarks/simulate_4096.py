"""How long ``omni-lightning simulate --gpus 4096`` takes on every workload spec, shared and adversarial.

Runs the command as a user would, one spec after another, with its default ``--jobs`` (on Linux, forked processes
computing the report's rows side by side, one per CPU, at most 5; the report's timing line says how many), and
records its wall-clock and CPU seconds (user + system time of the command and the processes it forked) beside the
machine's load average, since this machine is shared.
Each run's whole output goes to ``results/simulate_4096_<spec>.txt``; the table to ``results/simulate_4096.txt``.

    python benchmarks/simulate_4096.py [--workload FILE ...] [--gpus 4096]

The last line is ``slowest simulate --gpus 4096: X s wall, Y CPU s (SPEC)``; the goal is under 150 s on every spec.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import default_workloads

RESULTS = Path(__file__).resolve().parent / "results"
ADVERSARIAL = sorted(str(p) for p in (Path(__file__).resolve().parent / "workloads").glob("*.yaml"))


def _run(workload: str, gpus: int) -> tuple[float, float, list[str]]:
    """Wall and CPU seconds of one simulation, and what it printed."""
    # The console script's own module, under this interpreter: an environment run without activating it has no
    # omni-lightning on its PATH.
    command = [sys.executable, "-m", "omni_lightning.cli", "simulate", "--workload", workload, "--gpus", str(gpus)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode:
        raise SystemExit(f"simulate on {workload} failed (exit {done.returncode}):\n{done.stderr}")
    shown = ["$ omni-lightning simulate --workload " + os.path.relpath(workload) + f" --gpus {gpus}",
             *done.stdout.splitlines(),
             f"exit 0; wall {wall:.2f} s, CPU {cpu:.2f} s; load average at the end ({os.cpu_count()} shared cores): "
             + " ".join(f"{x:.2f}" for x in os.getloadavg())]
    return wall, cpu, shown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", nargs="+", default=default_workloads() + ADVERSARIAL)
    parser.add_argument("--gpus", type=int, default=4096)
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    rows, slowest = [f"{'workload':<14}{'wall s':>8}{'CPU s':>8}  {'load':>5}  result"], (0.0, 0.0, "")
    for workload in args.workload:
        wall, cpu, shown = _run(workload, args.gpus)
        spec = Path(workload).stem
        (RESULTS / f"simulate_{args.gpus}_{spec}.txt").write_text("\n".join(shown) + "\n")
        rows.append(f"{spec:<14}{wall:>8.1f}{cpu:>8.1f}  {os.getloadavg()[0]:>5.2f}  {shown[-2]}")
        print(rows[-1], flush=True)
        slowest = max(slowest, (wall, cpu, spec))
    rows.append(f"slowest simulate --gpus {args.gpus}: {slowest[0]:.1f} s wall, {slowest[1]:.1f} CPU s ({slowest[2]})")
    print(rows[-1])
    (RESULTS / f"simulate_{args.gpus}.txt").write_text(
        f"$ python benchmarks/simulate_4096.py --gpus {args.gpus}\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
