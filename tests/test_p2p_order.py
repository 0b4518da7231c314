"""NCCL's matching rule, checked on gloo: between a pair of ranks, the point-to-point operations of a group meet in
the order they are issued (tags are ignored), so both sides must issue them in the same order.

A recorder wraps the runtime's point-to-point calls (the joint pipeline's and the disaggregated pools' streams) on
every rank; after a few steps of uneven items, for every group and pair, the sequence one side issued towards the
other must be the other side's sequence with sends and receives swapped, operation by operation, with the same
shape and dtype. Gloo would match out-of-order operations by tag and hide the difference; NCCL would hang or
deliver one message into another's buffer.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning_runs import RecordRun, fit

from omni_lightning import OmniDataModule
from omni_lightning.runtime import joint, pool

pytestmark = pytest.mark.distributed


class _Recorder:
    """``torch.distributed`` for the runtime modules, with every point-to-point operation logged as
    ``[group, peer, "send" | "recv", shape, dtype]`` (peer as a global rank)."""

    def __init__(self) -> None:
        self.log: list[list[Any]] = []

    def module(self) -> types.SimpleNamespace:
        proxy = types.SimpleNamespace(**{name: getattr(dist, name) for name in dir(dist) if not name.startswith("__")})
        for name, kind in (("isend", "send"), ("send", "send"), ("irecv", "recv"), ("recv", "recv")):
            setattr(proxy, name, self._wrap(getattr(dist, name), kind))
        return proxy

    def _wrap(self, op: Any, kind: str) -> Any:
        def recorded(tensor: torch.Tensor, *args: Any, group: dist.ProcessGroup | None = None, **kwargs: Any) -> Any:
            peer = kwargs.get("dst", kwargs.get("src", args[0] if args else None))
            for local in ("group_dst", "group_src"):
                if kwargs.get(local) is not None:
                    peer = dist.get_global_rank(group, kwargs[local])
            name = (group or dist.group.WORLD).group_name
            self.log.append([name, int(peer), kind, list(tensor.shape), str(tensor.dtype)])
            return op(tensor, *args, group=group, **kwargs)

        return recorded


class WriteLog(pl.Callback):
    def __init__(self, recorder: _Recorder, out_dir: Path) -> None:
        self.recorder, self.out_dir = recorder, out_dir

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        path = self.out_dir / f"p2p_rank{trainer.global_rank}.json"
        path.write_text(json.dumps(self.recorder.log))


def assert_pairs_issue_alike(logs: dict[int, list[list[Any]]]) -> int:
    """Every pair's sequences mirror each other within each group; returns how many operations were checked."""
    checked = 0
    swap = {"send": "recv", "recv": "send"}
    for rank, log in logs.items():
        for peer in {entry[1] for entry in log}:
            for group in {entry[0] for entry in log}:
                mine = [(kind, shape, dtype) for g, p, kind, shape, dtype in log if g == group and p == peer]
                theirs = [(swap[kind], shape, dtype) for g, p, kind, shape, dtype in logs[peer]
                          if g == group and p == rank]
                for k, (a, b) in enumerate(zip(mine, theirs, strict=False)):
                    assert a == b, (f"group {group}: operation {k} between ranks {rank} and {peer} is {a} on "
                                    f"rank {rank} but {b} on rank {peer}")
                assert len(mine) == len(theirs), f"group {group}: ranks {rank}, {peer} issue {len(mine)} vs " \
                                                 f"{len(theirs)} operations"
                checked += len(mine)
    return checked


@pytest.mark.parametrize(("layout", "devices"), [
    ({"pp": 2, "dp_shard": 1, "pp_microbatches": 4}, 2),
    ({"pp": 2, "dp_shard": 1, "pp_microbatches": 3, "pp_schedule": "GPipe"}, 2),
    ({"pp": 2, "dp_shard": 2, "pp_microbatches": 2, "enc_sp": 2}, 4),
    ({"placement": "disaggregated", "encoder_world_size": 1}, 4),  # one encoder rank serves three LLM ranks
    ({"placement": "disaggregated", "encoder_world_size": 2, "enc_sp": 2}, 4),
    ({"placement": "disaggregated", "encoder_world_size": 2, "pp": 2, "dp_shard": 1, "pp_microbatches": 4}, 4),
], ids=["joint_1f1b", "joint_gpipe", "joint_dp2_sp2", "pool_fan_in", "pool_2x2_sp2", "pool_llm_pp2"])
def test_point_to_point_operations_meet_in_issue_order(layout: dict, devices: int, tmp_path: Path,
                                                       tiny_shards: str, seed_checkpoint: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _Recorder()
    for module in (joint, pool):
        monkeypatch.setattr(module, "dist", recorder.module())
    data = OmniDataModule(tiny_shards, samples_per_step=3, group_steps=3)
    fit(tmp_path, tiny_shards, seed_checkpoint, layout=layout, devices=devices, max_steps=3, datamodule=data,
        callbacks=[RecordRun(tmp_path), WriteLog(recorder, tmp_path)])
    logs = {r: json.loads((tmp_path / f"p2p_rank{r}.json").read_text()) for r in range(devices)}
    assert assert_pairs_issue_alike(logs) > 0


def test_the_check_catches_two_directions_issued_out_of_order() -> None:
    """What one group carrying both directions can do: each side receives first, and NCCL deadlocks."""
    logs = {0: [["g", 1, "recv", [4], "torch.float32"], ["g", 1, "send", [2], "torch.int64"]],
            1: [["g", 0, "recv", [2], "torch.int64"], ["g", 0, "send", [4], "torch.float32"]]}
    with pytest.raises(AssertionError, match="operation 0 between ranks 0 and 1"):
        assert_pairs_issue_alike(logs)
    swapped = {0: logs[0], 1: [logs[1][1], logs[1][0]]}
    assert assert_pairs_issue_alike(swapped) == 4
