"""How fast the disaggregated placement's pool sizing is: DistTrain's 72B MLLM on 1296 GPUs.

Builds the sizing problem of each workload (mean encoder and LLM work per step, priced with the cost model of
ViT-H + Llama3-70B, a batch of 1296 // 32 * 8 sequences of 8K tokens) and times
:func:`omni_lightning.balance.allocation.solve_pools` on it (best of 5), printing the chosen pools.

    python benchmarks/allocation.py [--gpus 1296] [--workload FILE ...]

Its last line is ``slowest sizing of N GPUs: X s`` (DistTrain reports under a second at 1296 GPUs).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import default_workloads

from omni_lightning.balance import allocation
from omni_lightning.balance.workload import load_workload
from omni_lightning.models.flops import reference_cost_model
from omni_lightning.sim.cluster import Cluster, encoder_params, llm_params
from omni_lightning.sim.presets import PRESETS

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=1296)
    parser.add_argument("--workload", nargs="+", default=default_workloads())
    args = parser.parse_args()
    preset = PRESETS["disttrain-72b"]
    config, layout = preset.model.config, preset.layout
    cluster = Cluster(gpus=args.gpus)
    model = reference_cost_model(config)
    lines = [f"{preset.model.name}, {args.gpus} GPUs, recompute {layout.recompute}"]
    slowest = 0.0
    for path in args.workload:
        problem = allocation.pool_problem(
            model, load_workload(path), world_size=args.gpus, memory_bytes=cluster.usable_bytes,
            device_flops=cluster.effective_flops, intra_node_bandwidth=cluster.intra_node_gbps * 1e9,
            sequences=args.gpus // layout.model_parallel * layout.micro_batches, seq_len=layout.seq_len,
            encoder=allocation.ModuleShape(encoder_params(config, "vision") + encoder_params(config, "audio"),
                                           config.vision.n_layers, config.vision.dim),
            llm=allocation.ModuleShape(llm_params(config), config.llm.n_layers, config.llm.dim),
            recompute=layout.recompute)
        seconds = []
        for _ in range(5):
            started = time.perf_counter()
            choice = allocation.solve_pools(problem)
            seconds.append(time.perf_counter() - started)
        slowest = max(slowest, min(seconds))
        pools = "no layout fits" if choice is None else (
            f"encoder pool {choice.encoder_gpus} (tp {choice.tp_enc} x dp {choice.dp_enc}), LLM pool "
            f"{choice.llm_gpus} (tp {choice.tp} x pp {choice.pp} x dp {choice.dp}), predicted step "
            f"{allocation.pool_step_time(problem, choice):.2f} s")
        lines.append(f"{Path(path).stem:<12} {min(seconds) * 1e3:7.1f} ms  {pools}")
    lines.append(f"slowest sizing of {args.gpus} GPUs: {slowest:.3f} s")
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "allocation.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
