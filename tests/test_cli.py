"""The ``omni-lightning`` command: the README's main job, a registered strategy name, a YAML strategy, and a
user's own data module."""

from __future__ import annotations

import csv
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from distributed import free_port

from omni_lightning import OmniDataModule, OmniStrategy
from omni_lightning.cli import OmniCLI, main
from omni_lightning.data.resumable import commit_consumed

REPO = Path(__file__).resolve().parents[1]
MAIN_CONFIG = REPO / "examples" / "tiny_omni.yaml"


@pytest.mark.slow
def test_main_job_from_the_readme(tmp_path: Path) -> None:
    """``omni-lightning fit --config examples/tiny_omni.yaml`` on 4 processes, shortened, in a scratch directory."""
    command = [
        sys.executable, "-m", "omni_lightning.cli", "fit", "--config", str(MAIN_CONFIG),
        "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.log_every_n_steps", "1",
        "--data.init_args.synthetic.num_shards", "4", "--data.init_args.synthetic.samples_per_shard", "16",
        "--data.init_args.shards", "data/tiny_omni/train-{000000..000001}.tar",
        "--data.init_args.val_shards", "data/tiny_omni/train-{000002..000003}.tar",
        "--data.init_args.samples_per_step", "2", "--data.init_args.group_steps", "2",
    ]
    env = {**os.environ, "MASTER_PORT": str(free_port()), "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "`Trainer.fit` stopped: `max_steps=4` reached." in result.stderr + result.stdout
    assert sorted(p.name for p in (tmp_path / "data" / "tiny_omni").glob("*.tar")) == [
        f"train-{i:06d}.tar" for i in range(4)
    ]
    (metrics_file,) = (tmp_path / "lightning_logs").glob("version_*/metrics.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    train_losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(train_losses) == 4 and all(0 < loss < 10 for loss in train_losses)
    assert any(r.get("val/loss") for r in rows)
    imbalance = [float(r["load/measured_imbalance"]) for r in rows if r.get("load/measured_imbalance")]
    predicted = [float(r["reorder/predicted_imbalance"]) for r in rows if r.get("reorder/predicted_imbalance")]
    assert len(imbalance) == 4 and all(x >= 1.0 for x in imbalance) and all(x >= 1.0 for x in predicted)


def _parse(args: list[str]) -> OmniCLI:
    return OmniCLI(args=args, run=False)


def test_registered_strategy_name() -> None:
    cli = _parse(["--config", str(MAIN_CONFIG), "--trainer.strategy", "omni", "--trainer.devices", "2"])
    assert isinstance(cli.trainer.strategy, OmniStrategy)
    assert cli.trainer.strategy.parallel_dims.dp_shard_size == 2


def test_yaml_class_path_with_init_args(tmp_path: Path) -> None:
    config = yaml.safe_load(MAIN_CONFIG.read_text())
    config["trainer"]["strategy"] = {
        "class_path": "omni_lightning.OmniStrategy",
        "init_args": {"dp_replicate": 2, "tp": 2, "launcher": "fork", "timeout": 60},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = _parse(["--config", str(path)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, OmniStrategy)
    assert (strategy.parallel_dims.dp_replicate, strategy.parallel_dims.dp_shard_size, strategy.parallel_dims.tp) == (
        2, 1, 2,
    )
    assert isinstance(cli.datamodule, OmniDataModule)


def test_user_datamodule_trains_through_the_cli(tmp_path: Path) -> None:
    """``--data.class_path`` swaps in a user's module; TP peers read the same data via the strategy's dp rank."""
    os.environ["MASTER_PORT"] = str(free_port())
    main([
        "fit",
        "--trainer.accelerator", "cpu", "--trainer.devices", "4", "--trainer.max_steps", "3",
        "--trainer.default_root_dir", str(tmp_path),
        "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.strategy", "omni_lightning.OmniStrategy",
        "--trainer.strategy.dp_shard", "2", "--trainer.strategy.tp", "2", "--trainer.strategy.launcher", "fork",
        "--trainer.callbacks+", "lightning_runs.RecordRun", "--trainer.callbacks.out_dir", str(tmp_path),
        "--data.class_path", "user_data.RandomMultimodalDataModule", "--data.init_args.samples_per_batch", "3",
    ])
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert sorted(map(int, losses)) == [1, 2, 3]


@pytest.mark.parametrize("cls, prefix", [(OmniStrategy, "--trainer.strategy."), (OmniDataModule, "--data.")])
def test_fit_help_documents_every_argument(cls: type, prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    help_text = capsys.readouterr().out
    names = [name for name in inspect.signature(cls.__init__).parameters if name != "self"]
    described = set(re.findall(rf"^  ({re.escape(prefix)}\w+): \S", help_text, flags=re.MULTILINE))
    assert described == {prefix + name for name in names}
    assert "(undocumented)" not in help_text


def test_print_config_shows_the_resolved_job(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(MAIN_CONFIG), "--trainer.strategy.tp", "1", "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "omni_lightning.OmniStrategy"
    assert strategy["init_args"]["tp"] == 1 and strategy["init_args"]["dp_shard"] == 2
    assert config["data"]["init_args"]["samples_per_step"] == 4


@pytest.mark.distributed
def test_user_sample_source_is_balanced_across_ranks(tmp_path: Path, seed_checkpoint: Path) -> None:
    """A subclass that only overrides ``train_samples`` gets grouped reordering across the data-parallel ranks:
    rank 0's source yields even sample numbers and rank 1's odd ones, and the plan moves some between them."""
    from lightning_runs import RecordBatches, fit
    from user_data import InMemoryOmniData

    fit(tmp_path, "unused", seed_checkpoint, layout={"dp_shard": 2}, devices=2, max_steps=4,
        datamodule=InMemoryOmniData(samples_per_step=4), callbacks=[RecordBatches(tmp_path)])
    for rank in (0, 1):
        numbers = [int(key.split("-")[1]) for batch in torch.load(tmp_path / f"batches_rank{rank}.pt",
                                                                  weights_only=False) for key in batch["keys"]]
        assert numbers and any(n % 2 != rank for n in numbers), f"rank {rank} trained only on its own samples"


def test_user_sample_source_resumes_exactly() -> None:
    """The loader position of a user's source is checkpointed like the shards': resuming after 3 batches
    continues with the batches the uninterrupted loader yields."""
    from user_data import InMemoryOmniData

    def loader(state: dict | None = None) -> Any:
        data = InMemoryOmniData(samples_per_step=4)
        data.setup("fit")
        batches = data.train_dataloader()
        if state is not None:
            batches.load_state_dict(state)
        return batches

    uninterrupted = loader()
    keys = [batch["keys"] for batch, _ in zip(uninterrupted, range(7), strict=False)]
    first = loader()
    for batch, _ in zip(first, range(3), strict=False):
        commit_consumed(batch)
    resumed = [batch["keys"] for batch, _ in zip(loader(first.state_dict()), range(4), strict=False)]
    assert resumed == keys[3:]
