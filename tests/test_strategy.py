"""OmniStrategy contract: registration, early layout errors, launcher, timeouts, sampler split, no-sync."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

import omni_lightning
from omni_lightning import OmniStrategy
from omni_lightning.parallel.dims import ParallelDims
from omni_lightning.parallel.layout import OmniLayout
from omni_lightning.strategies import omni as omni_module


def test_registered_as_omni() -> None:
    assert "omni" in StrategyRegistry.available_strategies()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="omni", logger=False)
    assert isinstance(trainer.strategy, OmniStrategy)
    assert trainer.strategy.parallel_dims == ParallelDims(world_size=2)
    assert omni_lightning.OmniStrategy is OmniStrategy


@pytest.mark.parametrize(
    ("devices", "kwargs", "message"),
    [
        (6, {"tp": 4}, r"world size 6 is not divisible by .* = 4"),
        (4, {"dp_shard": 4, "tp": 2}, r"= 8 must equal the world size 4"),
        (8, {"dp_shard": 4, "cp": 1, "tp": 2, "ep": 8}, r"ep=8 must divide dp_shard\*cp = 4\*1"),
        (6, {"dp_shard": 3, "tp": 2, "enc_sp": 2}, r"enc_sp=2 must divide the data-parallel size"),
    ],
)
def test_bad_layout_fails_before_any_process_group(devices: int, kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pl.Trainer(accelerator="cpu", devices=devices, strategy=OmniStrategy(**kwargs), logger=False)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, "tp must be a positive integer"),
        ({"dp_shard": 0}, "dp_shard must be a positive integer or -1"),
        ({"dp_shard": 2, "ep": 4}, "ep=4 must divide dp_shard"),
        ({"launcher": "thread"}, "launcher='thread'"),
        ({"timeout": 0}, "timeout=0"),
        ({"dp_shard": 4, "enc_sp": 3}, "enc_sp=3 must be a power of two"),
        ({"dp_shard": 4, "enc_sp": 2, "encoder_reshard": False}, "drop encoder_reshard=False"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OmniStrategy(**kwargs)


@pytest.mark.parametrize(("devices", "kwargs", "expected"), [
    (1, {}, False), (2, {}, True), (2, {"tp": 2}, False), (4, {"tp": 2}, True), (2, {"encoder_reshard": False}, False),
])
def test_encoder_reshard_defaults_to_several_data_parallel_ranks(devices: int, kwargs: dict, expected: bool) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=OmniStrategy(**kwargs), logger=False)
    assert trainer.strategy.encoder_reshard is expected


def test_launcher_choice() -> None:
    fork = pl.Trainer(accelerator="cpu", devices=2, strategy=OmniStrategy(launcher="fork"), logger=False)
    assert isinstance(fork.strategy.launcher, _MultiProcessingLauncher)
    assert fork.strategy.launcher._start_method == "fork"
    script = pl.Trainer(accelerator="cpu", devices=2, strategy=OmniStrategy(), logger=False)
    assert isinstance(script.strategy.launcher, _SubprocessScriptLauncher)  # resolving ckpt_path="last" first


def test_timeout_reaches_init_process_group() -> None:
    strategy = OmniStrategy(timeout=42)
    pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    with mock.patch("torch.distributed.init_process_group") as init, \
            mock.patch("torch.distributed.is_initialized", return_value=False):
        strategy._setup_distributed()
    assert init.call_args.kwargs["timeout"] == timedelta(seconds=42)
    assert init.call_args.args[0] == "gloo"


def test_meshes_are_unavailable_before_setup() -> None:
    with pytest.raises(RuntimeError, match="only after setup_environment"):
        _ = OmniStrategy().meshes


def test_sampler_follows_the_data_parallel_rank_not_the_global_rank() -> None:
    strategy = OmniStrategy(tp=2)
    pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    meshes = mock.Mock()
    meshes.local_rank.side_effect = lambda name: {"dp": 1}[name]
    strategy._layout = OmniLayout(strategy.parallel_dims, meshes, strategy.pipeline_settings,
                                  strategy.placement_settings, rank=0, reshard=False)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


def test_block_backward_sync_toggles_fsdp_gradient_sync() -> None:
    strategy = OmniStrategy()
    strategy.model = object()
    calls = []
    with mock.patch.object(omni_module, "set_gradient_sync", side_effect=lambda m, on: calls.append(on)):
        with strategy.block_backward_sync():
            assert calls == [False]
        assert calls == [False, True]
