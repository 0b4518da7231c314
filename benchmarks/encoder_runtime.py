"""Measured encoder balance of the reference model's encoders on fork-started gloo ranks, side by side.

Every rank streams its own shards of an image/video-heavy synthetic workload and, step by step, runs the vision
and audio encoders forward and backward on its micro-batch (the LLM is left out: it is what grouped reordering
balances). Two configurations alternate on the same micro-batches:

* ``none``: each rank encodes what it loaded (what a data-parallel job does without resharding);
* ``long-short``: :class:`~omni_lightning.runtime.reshard.Resharder` reshards items every step,
  splitting long ones over ``--enc-sp`` ranks with Ulysses attention.

Per step it takes each rank's thread CPU time (a rank blocked in a collective uses none, so this models dedicated
hardware on a machine that runs more ranks than it has cores) and prints the mean over steps of max/mean across
ranks. The resharding's own time is the extra CPU it adds over ``none`` (planning, index bookkeeping, the
all-to-alls, Ulysses), as a share of the step. Then the memory check: the largest item of the run alone, encoded on
one rank and split over ``--enc-sp`` ranks; the activation bytes saved for backward on the busiest rank. Last, the
encoder work of tensor-parallel peers (``tp=2``: pairs of ranks holding the same samples), alternating on the same
micro-batches: ``duplicated`` (each peer encodes all of them, as before the peers split their items) against
``split`` (:class:`~omni_lightning.runtime.encoders.LocalEncoders` with the peers: each encodes its share, the
outputs are all-gathered and the encoders' gradients summed over the pair).

    python benchmarks/encoder_runtime.py [--workload vlm_dynres] [--ranks 4] [--enc-sp 4] [--steps 24]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port

from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.data.shards import expand_shards
from omni_lightning.data.streaming import ShardStream
from omni_lightning.data.synthetic import make_synthetic_shards
from omni_lightning.models.config import AudioEncoderConfig, LLMConfig, ReferenceMLLMConfig, VisionEncoderConfig
from omni_lightning.models.flops import reference_cost_model
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.parallel.dims import ParallelDims
from omni_lightning.parallel.layout import build_meshes
from omni_lightning.runtime.encoders import LocalEncoders
from omni_lightning.runtime.peers import SamplePeers
from omni_lightning.runtime.reshard import Resharder

RESULTS = Path(__file__).parent / "results" / "encoder_runtime.json"

# Encoders wide enough that their matmuls, not Python overhead, dominate a CPU step; the LLM is not run.
CONFIG = ReferenceMLLMConfig(
    vision=VisionEncoderConfig(dim=128, n_layers=2, n_heads=4),
    audio=AudioEncoderConfig(n_mels=80, dim=128, n_layers=2, n_heads=4),
    llm=LLMConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, ffn_hidden=64),
)


def _encode(source: LocalEncoders, batch: dict[str, Any]) -> None:
    """Every encoder forward, then backward from a loss on their outputs: the encoder work of a training step."""
    source.start([batch], train=True)
    encoded = source.outputs(0)
    sum(outputs[0].square().sum() for outputs in encoded.values()).backward()


def _saved_bytes(fn: Any, exclude: list[torch.Tensor]) -> tuple[Any, int]:
    """Run ``fn`` and count the bytes of distinct storages autograd saves for backward, inputs excluded."""
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        try:
            pointer = t.untyped_storage().data_ptr()
        except RuntimeError:  # a tensor without its own storage (e.g. a collective's pending result)
            total += t.numel() * t.element_size()
            return t
        if pointer not in seen:
            seen.add(pointer)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def _memory(model: ReferenceMLLM, resharder: Resharder, rank: int, grid: tuple[int, int]) -> dict[str, int]:
    """Saved activation bytes of one ``grid`` image encoded by rank 0 alone, and split by the balancer."""
    rows, cols = grid
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (rows * 14, cols * 14, 3), dtype=np.uint8)
    sample = DecodedSample("largest", np.array([10, 11, 12]), [image] if rank == 0 else [])
    batch = pack_samples([sample])
    inputs = [batch["vision_patches"], batch["vision_positions"]]
    _, alone = _saved_bytes(lambda: model.vision(*inputs, batch["vision_grids"]) if rank == 0 else None, inputs)
    balancer = resharder
    steps = balancer.plan({"vision": batch["vision_grids"].prod(1)}, {"vision": model.vision.tokens_per_output})
    _, split = _saved_bytes(
        lambda: balancer.encode(model.vision, (*inputs, batch["vision_grids"]), steps["vision"]), inputs
    )
    chunks = steps["vision"].exchange.chunks
    return {"alone": alone, "split": split, "degree": len(chunks[0].lengths) if chunks else 1}


def _worker(rank: int, size: int, port: int, paths: list[str], args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=600))
    meshes = build_meshes(ParallelDims(world_size=size, dp_shard=size, enc_sp=args.enc_sp), "cpu")
    torch.manual_seed(0)
    model = ReferenceMLLM(CONFIG)
    # No FSDP: only the encoders' own compute is measured, with the resharder the runtime would build.
    costs = reference_cost_model(CONFIG)
    resharder = Resharder(meshes.encoder_group, meshes.encoder_sp_blocks, dict(costs.encoders), enc_sp=args.enc_sp)
    sources = {"none": LocalEncoders(model), "long-short": LocalEncoders(model, resharder)}
    stream = iter(ShardStream(paths, dp_rank=rank, dp_size=size, batch_size=args.samples_per_step))
    records: dict[str, list[list[float]]] = {"none": [], "long-short": []}
    splits, moved = [], []
    largest = 0
    for step in range(args.warmup + args.steps):
        batch = next(stream)
        grids = batch["vision_grids"]
        largest = max(largest, int(grids.prod(1).max()) if grids.numel() else 0)
        for name in ("none", "long-short") if step % 2 else ("long-short", "none"):
            dist.barrier()
            cpu, wall = time.thread_time(), time.perf_counter()
            _encode(sources[name], batch)
            seconds = torch.tensor([time.thread_time() - cpu, time.perf_counter() - wall], dtype=torch.float64)
            everyone = [torch.zeros_like(seconds) for _ in range(size)]
            dist.all_gather(everyone, seconds)
            if step >= args.warmup:
                records[name].append([float(t[0]) for t in everyone] + [max(float(t[1]) for t in everyone)])
                if name == "long-short":
                    splits.append(resharder.stats["items_split"])
                    moved.append(resharder.stats["items_moved"])
    tp_records = _tensor_parallel_peers(model, paths, rank, size, args)
    largest_tensor = torch.tensor([largest])
    dist.all_reduce(largest_tensor, op=dist.ReduceOp.MAX)
    side = int(np.sqrt(int(largest_tensor) / 4)) * 2 or 2  # a square grid with even sides and about as many patches
    memory = _memory(model, resharder, rank, (side, side))
    busiest = torch.tensor([memory["alone"], memory["split"]], dtype=torch.float64)
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.update(records=records, splits=splits, moved=moved, memory=busiest.tolist(), side=side,
                   degree=memory["degree"], tp=tp_records)
    dist.destroy_process_group()


def _tensor_parallel_peers(model: ReferenceMLLM, paths: list[str], rank: int, size: int, args: argparse.Namespace
                           ) -> dict[str, list[float]]:
    """Per step, the slowest rank's encoder CPU seconds when the pairs (0, 1), (2, 3), ... are tensor-parallel
    peers: ``duplicated`` and ``split``, alternating on each pair's same micro-batch."""
    pairs = [dist.new_group([r, r + 1]) for r in range(0, size - 1, 2)]  # every rank takes part in every new_group
    pair = pairs[rank // 2]
    peers = SamplePeers(group=pair, cp_group=None, tp_group=pair)
    sources = {"duplicated": LocalEncoders(model), "split": LocalEncoders(model, peers=peers)}
    stream = iter(ShardStream(paths, dp_rank=rank // 2, dp_size=size // 2, batch_size=args.samples_per_step))
    records: dict[str, list[float]] = {"duplicated": [], "split": []}
    for step in range(args.warmup + args.steps):
        batch = next(stream)
        for name in ("split", "duplicated") if step % 2 else ("duplicated", "split"):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            cpu = time.thread_time()
            _encode(sources[name], batch)
            sources[name].sync_gradients()
            seconds = torch.tensor([time.thread_time() - cpu], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                records[name].append(float(seconds))
    return records


def _imbalance(rows: list[list[float]]) -> float:
    cpu = np.array([r[:-1] for r in rows])
    return float(np.mean(cpu.max(axis=1) / cpu.mean(axis=1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="vlm_dynres")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--enc-sp", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--samples-per-step", type=int, default=2)
    parser.add_argument("--length-scale", type=float, default=0.1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        per_shard = (args.steps + args.warmup) * args.samples_per_step
        make_synthetic_shards(scratch, workload=args.workload, num_shards=args.ranks, samples_per_shard=per_shard,
                              length_scale=args.length_scale, max_llm_tokens=4096)
        paths = expand_shards(scratch)
        port = free_port()
        out = mp.Manager().dict()
        mp.start_processes(_worker, args=(args.ranks, port, paths, args, out), nprocs=args.ranks, start_method="fork")
    records = out["records"]
    none, long_short = (np.array(records[k]) for k in ("none", "long-short"))
    overhead = long_short[:, :-1].sum() / none[:, :-1].sum() - 1.0
    alone, split = out["memory"]
    result = {
        "args": vars(args),
        "imbalance_none": _imbalance(records["none"]),
        "imbalance_long_short": _imbalance(records["long-short"]),
        "step_cpu_max_mean_s": {k: float(np.mean(np.array(v)[:, :-1].max(axis=1))) for k, v in records.items()},
        "step_wall_mean_s": {k: float(np.mean(np.array(v)[:, -1])) for k, v in records.items()},
        "reshard_overhead_share": float(overhead),
        "items_split_per_step": float(np.mean(out["splits"])),
        "items_moved_per_step": float(np.mean(out["moved"])),
        "memory_largest_item": {"grid": out["side"], "alone_bytes": alone, "split_bytes": split,
                                "degree": out["degree"], "reduction": alone / split if split else None},
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"{args.workload}: {args.ranks} ranks, enc_sp={args.enc_sp}, {args.steps} steps, "
          f"{args.samples_per_step} samples per rank and step")
    print(f"items split per step {result['items_split_per_step']:.2f}, moved {result['items_moved_per_step']:.2f}")
    for name in ("none", "long-short"):
        print(f"{name:<11} slowest rank CPU {result['step_cpu_max_mean_s'][name] * 1e3:7.1f} ms/step, "
              f"wall {result['step_wall_mean_s'][name] * 1e3:7.1f} ms/step")
    print(f"resharding's own time (extra CPU over none): {overhead:.1%} of the step")
    side = out["side"]
    print(f"largest item ({side}x{side} patches) saved activations: alone {alone / 2**20:.2f} MiB, "
          f"split {out['degree']} ways {split / 2**20:.2f} MiB on the busiest rank ({alone / max(split, 1):.2f}x less)")
    tp = {name: float(np.mean(rows)) for name, rows in out["tp"].items()}
    result["tp2_encoder_cpu_s"] = {**tp, "speedup": tp["duplicated"] / tp["split"]}
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"tp=2 peers, slowest rank's encoder CPU: duplicated {tp['duplicated'] * 1e3:.1f} ms/step, split "
          f"{tp['split'] * 1e3:.1f} ms/step ({tp['duplicated'] / tp['split']:.2f}x less)")
    print(f"measured encoder max/mean: none {result['imbalance_none']:.3f}, "
          f"long-short {result['imbalance_long_short']:.3f}")


if __name__ == "__main__":
    main()
