"""Every tensor handed to a group that is NCCL in a GPU job is on the compute device (``device_discipline.py``).

``lightning_runs.fit`` runs every Lightning test under the check; here: the marking rules, a planted host tensor
that must fail, and the placements, monitors and checkpoint round trip run under it on purpose.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from device_discipline import device_discipline, is_host
from distributed import run_distributed
from lightning_runs import RecordRun, fit

from omni_lightning import OmniDataModule
from omni_lightning.monitor import LoadMonitor, ThroughputMonitor


def test_host_tensors_are_marked_and_moves_clear_the_mark() -> None:
    with device_discipline():
        host, placed = torch.zeros(3), torch.zeros(3, device="cpu")
        assert is_host(host) and not is_host(placed)
        assert is_host(torch.from_numpy(np.ones(2))) and is_host(torch.tensor([1, 2]))
        assert is_host(host + 1) and is_host(host[1:]) and is_host(torch.cat([host, host]))
        assert is_host(host.to(torch.float64))  # a dtype change stays where it was
        moved = host.to(placed.device)
        assert not is_host(moved) and not is_host(host.to(placed)) and not is_host(moved * 2)
        back = moved.cpu()  # a host copy, as in a GPU job (on the CPU, .cpu() would return the tensor itself)
        assert is_host(back) and back is not moved and not is_host(moved)
        assert not is_host(torch.zeros_like(host, device="cpu"))
        assert is_host(torch.zeros_like(host)) and not is_host(torch.empty_like(placed))
        placed.copy_(host)  # a transfer into a device buffer leaves it on the device
        assert not is_host(placed) and not is_host(placed[torch.tensor([0])])  # a host index keeps the values'


def _planted(rank: int, world: int) -> None:
    with device_discipline():
        dist.all_reduce(torch.ones(2, device="cpu"))  # explicit: fine
        gloo = dist.new_group(ranks=list(range(world)), backend="gloo")
        dist.all_reduce(torch.ones(2), group=gloo)  # host data on a group made for host data: fine
        with pytest.raises(RuntimeError, match="all_reduce on a group that is NCCL in a GPU job got host tensor"):
            dist.all_reduce(torch.ones(2))  # the planted host tensor
        with pytest.raises(RuntimeError, match="functional all_to_all_single_autograd"):
            import torch.distributed._functional_collectives as funcol

            funcol.all_to_all_single_autograd(torch.ones(world), None, None, dist.group.WORLD)


@pytest.mark.distributed
def test_a_planted_host_tensor_fails() -> None:
    run_distributed(_planted, 2)


class PlantHostTensor(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        dist.all_reduce(torch.zeros(1))


@pytest.mark.distributed
def test_a_planted_host_tensor_fails_a_lightning_run(tmp_path: Path, tiny_shards: str, seed_checkpoint: Path) -> None:
    with pytest.raises(Exception, match="NCCL in a GPU job got host tensor"):
        fit(tmp_path, tiny_shards, seed_checkpoint, layout={"dp_shard": 2}, devices=2, max_steps=1,
            callbacks=[PlantHostTensor()])


@pytest.mark.distributed
@pytest.mark.parametrize(("layout", "devices"), [
    ({"dp_shard": 2, "enc_sp": 2}, 2),
    ({"dp_shard": 2, "tp": 2}, 4),
    ({"pp": 2, "dp_shard": 1, "pp_microbatches": 4, "pp_calibration_steps": 1}, 2),
    ({"pp": 2, "dp_shard": 1, "pp_encoders": "first_stage"}, 2),
    ({"placement": "disaggregated", "encoder_world_size": 2, "enc_sp": 2}, 4),
], ids=["plain_sp", "tp", "pp_joint_calibrated", "pp_first_stage", "disaggregated"])
def test_placements_monitors_and_checkpoints_keep_device_discipline(layout: dict, devices: int, tmp_path: Path,
                                                                    tiny_shards: str, seed_checkpoint: Path) -> None:
    """Two steps with both monitors, a checkpoint, and a resume from it: all under the check (``fit``)."""
    callbacks = [RecordRun(tmp_path), LoadMonitor(), ThroughputMonitor(peak_flops=1e12),
                 pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)]
    data = OmniDataModule(tiny_shards, samples_per_step=2, group_steps=2)
    fit(tmp_path, tiny_shards, seed_checkpoint, layout=layout, devices=devices, max_steps=2, callbacks=callbacks,
        datamodule=data, log_every_n_steps=1)
    (checkpoint,) = (tmp_path / "ckpt").glob("*step=2.ckpt")
    fit(tmp_path / "resumed", tiny_shards, seed_checkpoint, layout=layout, devices=devices, max_steps=3,
        datamodule=OmniDataModule(tiny_shards, samples_per_step=2, group_steps=2),
        callbacks=[RecordRun(tmp_path / "resumed"), LoadMonitor()], ckpt_path=str(checkpoint))
