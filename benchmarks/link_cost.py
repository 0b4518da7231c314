"""Calibrate ``LinkCost`` for Gloo between CPU processes on this machine: what a collective and a byte cost a rank.

Starts ``--ranks`` fork-started Gloo processes (one intra-op thread each, as the benchmarks run) and measures, as
each rank's whole-process CPU time (a rank's Gloo threads do the copying and the socket work, not the caller):

* ``latency``: a small all-gather (8 integers a rank), per call, with the ranks arriving together, and again with
  them arriving ``--skew-ms`` apart at most (each computes a different random amount first, as ranks of a training
  step do): a rank waiting in a Gloo collective is not idle, so what a collective costs grows with the wait;
* ``bandwidth``: ``all_to_all_single`` of ``--megabytes`` per rank, bytes sent per second of CPU once the latency is
  taken off;
* ``flops_per_s``: the training thread's fp32 matmul rate on encoder-sized operands (``[2048, 96] @ [96, 384]``).

Prints the three and the ``LinkCost`` they make, beside the packaged ``CPU_GLOO``; writes
``benchmarks/results/link_cost.txt`` when run with ``> benchmarks/results/link_cost.txt``.

    python benchmarks/link_cost.py [--ranks 4] [--megabytes 4] [--skew-ms 20]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port

from omni_lightning.balance.reshard import CPU_GLOO, LinkCost


def _measure(rank: int, world: int, port: int, megabytes: float, calls: int, skew_blocks: int,
             skew_ms: float) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    small, gathered = torch.zeros(8, dtype=torch.int64), torch.zeros(8 * world, dtype=torch.int64)
    rows = int(megabytes * 2**20 / 4)
    payload, received = torch.ones(rows - rows % world), torch.empty(rows - rows % world)

    def process_cpu(call: object, n: int) -> float:
        for _ in range(3):  # warm-up
            call()
        dist.barrier()
        started = time.process_time()
        for _ in range(n):
            call()
        return (time.process_time() - started) / n

    latency = process_cpu(lambda: dist.all_gather_into_tensor(gathered, small), calls)
    # The same collective after a random amount of work (a different one on every rank): its CPU beyond the work's.
    rng = torch.Generator().manual_seed(rank)
    block_a, block_b = torch.randn(256, 256), torch.randn(256, 256)
    dist.barrier()
    work = total = 0.0
    for _ in range(calls // 3):
        started, thread_started = time.process_time(), time.thread_time()
        for _ in range(int(torch.randint(0, skew_blocks + 1, (1,), generator=rng))):
            block_a @ block_b
        work += time.thread_time() - thread_started
        dist.all_gather_into_tensor(gathered, small)
        total += time.process_time() - started
    skewed = (total - work) / (calls // 3)
    per_exchange = process_cpu(lambda: dist.all_to_all_single(received, payload), max(calls // 20, 5))
    sent = payload.numel() * 4 * (world - 1) / world  # what leaves this rank (its own block stays)
    a, b = torch.randn(2048, 96), torch.randn(96, 384)
    started, repeats = time.thread_time(), 200
    for _ in range(repeats):
        a @ b
    flops = 2 * 2048 * 96 * 384 * repeats / (time.thread_time() - started)
    figures = torch.tensor([latency, sent / max(per_exchange - latency, 1e-9), flops, skewed], dtype=torch.float64)
    dist.all_reduce(figures)
    figures /= world
    if rank == 0:
        latency, bandwidth, flops, skewed = figures.tolist()
        print(f"{world} Gloo ranks on {os.cpu_count()} cores, mean over ranks of whole-process CPU time:")
        print(f"latency     {latency * 1e6:8.0f} us per small collective, ranks arriving together")
        print(f"            {skewed * 1e6:8.0f} us per small collective, ranks arriving up to {skew_ms} ms apart")
        print(f"bandwidth   {bandwidth / 1e9:8.2f} GB/s per rank (all_to_all_single of {megabytes} MB)")
        print(f"flops_per_s {flops / 1e9:8.1f} GFLOP/s (fp32 matmul, one thread)")
        print(f"measured: {LinkCost(bandwidth=bandwidth, latency=latency, flops_per_s=flops)}")
        print(f"packaged: {CPU_GLOO}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--megabytes", type=float, default=4.0)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--skew-ms", type=float, default=20.0)
    args = parser.parse_args()
    # A 256 x 256 fp32 matmul is 34 MFLOP: about 0.5 ms of one core here.
    blocks = max(int(args.skew_ms / 0.5), 1)
    mp.start_processes(_measure, args=(args.ranks, free_port(), args.megabytes, args.calls, blocks, args.skew_ms),
                       nprocs=args.ranks, start_method="fork")


if __name__ == "__main__":
    main()
