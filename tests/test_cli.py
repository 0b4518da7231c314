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

import pytest
import yaml
from distributed import free_port

from omni_lightning import OmniDataModule, OmniStrategy
from omni_lightning.cli import OmniCLI, main

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
    imbalance = [float(r["balance/measured_imbalance"]) for r in rows if r.get("balance/measured_imbalance")]
    predicted = [float(r["balance/predicted_imbalance"]) for r in rows if r.get("balance/predicted_imbalance")]
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
