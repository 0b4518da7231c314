"""Run a function on a gloo world of fork-started processes (raw torch.distributed tests)."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=90))
    fn(rank, world_size, *args)
    # Not destroyed on error on purpose: destroying with pending collectives can block (feasibility.md, pitfall 5).
    dist.destroy_process_group()


def run_distributed(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fork-started gloo ranks; re-raise any rank's error."""
    mp.start_processes(
        _worker, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True, start_method="fork"
    )
