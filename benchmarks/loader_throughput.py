"""Loader throughput with grouped reordering against plain webdataset streaming, side by side.

Starts ``--ranks`` fork-started gloo processes (no model). Each rank reads its shards and produces packed
micro-batches, first with the plain per-rank stream (read, decode, pack: what ``WebDataModule`` does), then with
``OmniDataModule``'s balancing loop (read, decode, all-gather metadata, plan, exchange payloads, pack), for the
same number of samples, alternating ``--repeats`` times. Prints samples/s of each and their ratio, from the
slowest rank's thread CPU time (the dedicated-hardware model of DESIGN.md: this machine runs more ranks than it
has cores, and a rank blocked in a collective uses no CPU), and from wall time for reference.

    python benchmarks/loader_throughput.py [--workload omni_mix] [--ranks 4] [--batches 64]
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port
from torchdata.stateful_dataloader import StatefulDataLoader

from omni_lightning.data.reorder_stream import ReorderedStream, ReorderSettings
from omni_lightning.data.shards import expand_shards
from omni_lightning.data.streaming import SampleStream, ShardStream
from omni_lightning.data.synthetic import make_synthetic_shards
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.flops import reference_cost_model


def _identity(item: object) -> object:
    return item


def _time(batches: object, count: int) -> tuple[float, float]:
    """(thread CPU seconds, wall seconds) to draw ``count`` batches."""
    cpu, wall = time.thread_time(), time.perf_counter()
    iterator = iter(batches)
    for _ in range(count):
        next(iterator)
    return time.thread_time() - cpu, time.perf_counter() - wall


def _plain(paths: list[str], rank: int, size: int, args: argparse.Namespace) -> tuple[float, float]:
    return _time(ShardStream(paths, dp_rank=rank, dp_size=size, batch_size=args.samples_per_step), args.batches)


def _balanced(paths: list[str], rank: int, size: int, args: argparse.Namespace) -> tuple[float, float]:
    samples = SampleStream(paths, dp_rank=rank, dp_size=size, batch_size=1, on_bad_sample="skip")
    loader = StatefulDataLoader(samples, batch_size=None, collate_fn=_identity)
    settings = ReorderSettings(samples_per_step=args.samples_per_step, group_steps=args.group_steps)
    stream = ReorderedStream(loader, group=dist.group.WORLD, group_index=0,
                            cost_model=reference_cost_model(ReferenceMLLMConfig.tiny()), settings=settings)
    return _time(stream, args.batches)


def _worker(rank: int, size: int, port: int, paths: list[str], args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=300))
    timings: dict[str, list[list[float]]] = {"plain": [], "balanced": []}
    for _ in range(args.repeats):
        for name, fn in (("plain", _plain), ("balanced", _balanced)):
            dist.barrier()
            seconds = torch.tensor(fn(paths, rank, size, args))
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the job moves at its slowest rank
            timings[name].append(seconds.tolist())
    if rank == 0:
        out.update(timings)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="omni_mix")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--batches", type=int, default=64, help="micro-batches per rank and measurement")
    parser.add_argument("--samples-per-step", type=int, default=8)
    parser.add_argument("--group-steps", type=int, default=8)
    parser.add_argument("--length-scale", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        shard_count = 2 * args.ranks
        per_shard = args.batches * args.samples_per_step // 2 + args.samples_per_step
        make_synthetic_shards(scratch, workload=args.workload, num_shards=shard_count, samples_per_shard=per_shard,
                              length_scale=args.length_scale, max_llm_tokens=512)
        paths = expand_shards(scratch)
        port = free_port()
        out = mp.Manager().dict()
        mp.start_processes(_worker, args=(args.ranks, port, paths, args, out), nprocs=args.ranks, start_method="fork")
    samples = args.batches * args.samples_per_step * args.ranks
    (plain_cpu, plain_wall), (balanced_cpu, balanced_wall) = (min(out[k]) for k in ("plain", "balanced"))
    print(f"{samples} samples, best of {args.repeats}; slowest rank's CPU time (wall time in brackets)")
    print(f"plain streaming:    {samples / plain_cpu:8.1f} samples/s ({samples / plain_wall:.1f} wall)")
    print(f"grouped reordering: {samples / balanced_cpu:8.1f} samples/s ({samples / balanced_wall:.1f} wall)")
    print(f"wall-time throughput reordered/plain: {plain_wall / balanced_wall:.3f}")
    print(f"throughput reordered/plain: {plain_cpu / balanced_cpu:.3f}")


if __name__ == "__main__":
    main()
