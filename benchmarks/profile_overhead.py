"""Where each configuration's training-thread CPU goes: cProfile of every rank's training thread, (a)-(d) side by side.

Trains ``benchmarks/e2e.py``'s configurations (a) Lightning's ModelParallelStrategy, (b) OmniStrategy with balancing
off, (c) grouped reordering and (d) grouped reordering with encoder resharding/LSSP on the same synthetic shards,
``--repeats`` times each, interleaved (a b c d a b c d ...), and profiles each rank's training thread with
``cProfile`` timed by ``time.thread_time`` from the first step after the warm-up to the end. It prints, per
configuration, the training thread's profiled CPU per rank-step (the mean over the repeats) and that CPU by library
(``omni_lightning``, ``torch``, ``lightning``, the rest), then the functions whose own time (``tottime``) differs most
from (a)'s. The profiler's per-call cost inflates Python-heavy code, so a configuration that makes more Python calls
reads worse here than unprofiled: a difference that does not show here is not a per-call overhead.

The loader's own threads (planning, shard reading, decoding) are not profiled: ``benchmarks/e2e.py`` counts their CPU
as the *loader* part of each rank-step (``mean rank CPU`` in its result files, split train + loader + comm).

    python benchmarks/profile_overhead.py [--workload FILE] [--steps 16] [--repeats 2] [--top 15] [--out NAME]

Results go to ``benchmarks/results/profile_overhead.json`` (``--out``). The last line is
``profiled training-thread CPU per rank-step vs (a): (b) X, (c) Y, (d) Z``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from e2e import CONFIGURATIONS, RESULTS, add_training_arguments, run, spread, write_shards

NAMES = "abcd"
LIBRARIES = ("omni_lightning", "lightning", "torch")  # first match wins: omni_lightning's path holds "lightning"
FunctionKey = tuple[str, int, str]  # pstats' (file, line, function)


class _ProfileTrainingThread(pl.Callback):
    """cProfile of this rank's training thread from batch ``start`` to the end of training, dumped per rank."""

    def __init__(self, start: int, path_template: str) -> None:
        self.start, self.path_template = start, path_template
        self.profile = cProfile.Profile(time.thread_time)

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int
                             ) -> None:
        if batch_idx == self.start:
            self.profile.enable()

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.profile.disable()
        self.profile.dump_stats(self.path_template.format(rank=trainer.global_rank))


def library(filename: str) -> str:
    """The library a profiled function belongs to, from its source file (built-ins are ``torch``'s C calls or
    Python's)."""
    return next((name for name in LIBRARIES if f"/{name}/" in filename), "other")


def own_times(paths: list[Path]) -> dict[FunctionKey, float]:
    """Each function's own time (seconds) summed over the profiles in ``paths``."""
    stats = pstats.Stats(*(str(path) for path in paths))
    return {key: row[2] for key, row in stats.stats.items()}  # type: ignore[attr-defined]


def summarize(profiles: list[list[Path]], rank_steps: int) -> dict[str, Any]:
    """One configuration's repeats (each a list of per-rank profiles) as per-rank-step milliseconds."""
    per_repeat = [own_times(paths) for paths in profiles]
    functions: dict[FunctionKey, float] = {}
    for times in per_repeat:
        for key, seconds in times.items():
            functions[key] = functions.get(key, 0.0) + seconds * 1e3 / rank_steps / len(per_repeat)
    libraries: dict[str, float] = {}
    for (filename, _, _), ms in functions.items():
        libraries[library(filename)] = libraries.get(library(filename), 0.0) + ms
    return {
        "repeats_ms": [sum(times.values()) * 1e3 / rank_steps for times in per_repeat],
        "total_ms": sum(functions.values()),
        "libraries_ms": dict(sorted(libraries.items())),
        "functions_ms": functions,
    }


def label(key: FunctionKey) -> str:
    """A profiled function as ``file:line(name)``, the file from its library's root."""
    filename, line, function = key
    owner = library(filename)
    if owner != "other":
        filename = owner + filename.rsplit(f"/{owner}", 1)[1]
    return f"{filename}:{line}({function})" if line else function


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_arguments(parser)  # benchmarks/e2e.py's: the same runs, warm-up steps not profiled
    parser.add_argument("--top", type=int, default=15, help="functions listed")
    parser.add_argument("--out", default="profile_overhead", help="name of the result file under benchmarks/results/")
    args = parser.parse_args()
    if args.repeats < 2 or not 0 < args.warmup < args.steps:
        raise SystemExit("--repeats must be at least 2 (two runs of (a) are the noise) and --warmup between 1 and "
                         "--steps - 1")
    torch.set_num_threads(1)
    rank_steps = args.ranks * (args.steps - args.warmup)
    profiles: dict[str, list[list[Path]]] = {name: [] for name in NAMES}
    with tempfile.TemporaryDirectory() as scratch:
        shards = write_shards(args, scratch)
        for repeat in range(args.repeats):
            for name in NAMES:
                template = f"{scratch}/{name}_{repeat}_{{rank}}.prof"
                run(name, shards, args, Path(scratch), callbacks=(_ProfileTrainingThread(args.warmup, template),))
                profiles[name].append([Path(template.format(rank=rank)) for rank in range(args.ranks)])
        results = {name: summarize(profiles[name], rank_steps) for name in NAMES}
    base = results["a"]
    keys = set().union(*(result["functions_ms"] for result in results.values()))
    differing = sorted(keys, key=lambda key: -max(abs(results[name]["functions_ms"].get(key, 0.0)
                                                      - base["functions_ms"].get(key, 0.0)) for name in "bcd"))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps({
        "args": vars(args),
        "results": {name: {**{k: v for k, v in result.items() if k != "functions_ms"},
                           "top_functions_ms": {label(key): result["functions_ms"].get(key, 0.0)
                                                for key in differing[:args.top]}}
                    for name, result in results.items()},
    }, indent=2))
    print(f"{Path(args.workload).stem}: {args.ranks} ranks, {args.steps} steps (first {args.warmup} not profiled), "
          f"{args.repeats} interleaved repeats; profiled training-thread CPU per rank-step, mean over the repeats")
    for name in NAMES:
        result = results[name]
        print(f"({name}) {CONFIGURATIONS[name]:<58} {result['total_ms']:7.1f} ms "
              f"(repeats {', '.join(f'{ms:.1f}' for ms in result['repeats_ms'])}; "
              + ", ".join(f"{lib} {ms:.1f}" for lib, ms in result["libraries_ms"].items()) + ")")
    first, second = base["repeats_ms"][:2]
    print(f"noise (a) vs (a): {spread(first, second) * 100:.1f}% (two repeats, each alone)")
    print(f"functions whose own time differs most from (a)'s, ms per rank-step: {'  '.join(f'({n})' for n in NAMES)}")
    for key in differing[:args.top]:
        print("  " + "  ".join(f"{results[name]['functions_ms'].get(key, 0.0):6.2f}" for name in NAMES)
              + f"  {label(key)}")
    print("profiled training-thread CPU per rank-step vs (a): " + ", ".join(
        f"({name}) {results[name]['total_ms'] / base['total_ms']:.3f}x" for name in "bcd"))


if __name__ == "__main__":
    main()
