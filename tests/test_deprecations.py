"""Release 0.1's names (``balance`` for both the loader's reorder and the encoder stage's reshard) keep working as
deprecated aliases that warn once, and 0.1's example configs still train."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from distributed import free_port
from lightning.fabric.utilities.rank_zero import LightningDeprecationWarning

from omni_lightning import OmniDataModule, OmniStrategy, datamodules, deprecations
from omni_lightning.cli import OmniCLI, _renamed_flag
from omni_lightning.data.packing import pack_samples
from omni_lightning.data.reorder_stream import ReorderSettings
from omni_lightning.datamodules import collate
from omni_lightning.modalities import packing_spec
from omni_lightning.models.config import AUDIO_ID, BOS_ID, FIRST_TEXT_ID, IMAGE_ID, PAD_ID
from omni_lightning.monitor import BalanceMonitor, LoadMonitor

REPO = Path(__file__).resolve().parents[1]
LEGACY = REPO / "tests" / "fixtures" / "legacy_configs"


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the first use of an old name in its process."""
    monkeypatch.setattr(deprecations, "_warned", set())


def _deprecations(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, LightningDeprecationWarning)]


def test_strategy_encoder_balance_is_encoder_reshard() -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        strategies = [OmniStrategy(encoder_balance=False), OmniStrategy(encoder_balance=False)]
    assert [s._encoder_reshard for s in strategies] == [False, False]
    (message,) = _deprecations(record)  # once, however often
    assert "encoder_balance" in message and "encoder_reshard" in message
    assert OmniStrategy(encoder_balance=True, encoder_reshard=True)._encoder_reshard is True
    with pytest.raises(ValueError, match="encoder_reshard=True and its deprecated name encoder_balance=False"):
        OmniStrategy(encoder_reshard=True, encoder_balance=False)
    with pytest.raises(ValueError, match="drop encoder_reshard=False"):
        OmniStrategy(dp_shard=4, enc_sp=2, encoder_balance=False)


def test_data_module_old_arguments_are_the_new_ones() -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        old = OmniDataModule("x.tar", workload_balance="none", balance_group_size=None)
    assert (old.settings.reorder, old.reorder_group_size) == (False, None)
    assert len(_deprecations(record)) == 2
    new = OmniDataModule("x.tar", reorder="none", reorder_group_size=None)
    assert (new.settings, new.reorder_group_size) == (old.settings, old.reorder_group_size)
    default = OmniDataModule("x.tar")
    assert (default.settings.reorder, default.reorder_group_size) == (True, 8)
    assert OmniDataModule("x.tar", balance_group_size=2).reorder_group_size == 2
    with pytest.raises(ValueError, match="reorder_group_size=4 and its deprecated name balance_group_size=2"):
        OmniDataModule("x.tar", reorder_group_size=4, balance_group_size=2)
    with pytest.raises(ValueError, match="reorder='sorted' must be 'grouped' or 'none'"):
        OmniDataModule("x.tar", workload_balance="sorted")  # type: ignore[arg-type]


def test_metrics_are_logged_under_both_names_until_switched_off() -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        named = deprecations.with_deprecated_names({"reorder/predicted_imbalance": 1.5, "reshard/items_moved": 2.0,
                                                    "load/measured_imbalance": 1.1, "train/loss": 3.0})
        deprecations.with_deprecated_names({"reorder/skipped": 0.0})
    assert named == {"reorder/predicted_imbalance": 1.5, "reshard/items_moved": 2.0, "load/measured_imbalance": 1.1,
                     "train/loss": 3.0, "balance/predicted_imbalance": 1.5, "encoder/items_moved": 2.0,
                     "balance/measured_imbalance": 1.1}
    assert len(_deprecations(record)) == 3  # one per renamed family
    metrics = {"load/measured_imbalance": 1.0}
    assert LoadMonitor()._named(metrics) == metrics
    with pytest.warns(LightningDeprecationWarning, match="BalanceMonitor is deprecated, use .*LoadMonitor"):
        monitor = BalanceMonitor()
    assert isinstance(monitor, LoadMonitor)
    assert monitor._named(metrics) == {**metrics, "balance/measured_imbalance": 1.0}


def test_simulate_balance_group_flag_is_reorder_group() -> None:
    with pytest.warns(LightningDeprecationWarning, match="--balance-group is deprecated"):
        assert _renamed_flag("--balance-group") == "--reorder-group"
    assert _renamed_flag("--balance-group=4") == "--reorder-group=4"
    assert _renamed_flag("--groups") == "--groups"


def test_release_0_1_imports_still_work() -> None:
    with pytest.warns(LightningDeprecationWarning, match="BalanceSettings is deprecated"):
        assert datamodules.BalanceSettings is ReorderSettings
    assert (PAD_ID, BOS_ID, IMAGE_ID, AUDIO_ID, FIRST_TEXT_ID) == (0, 1, 2, 3, 4)
    image = np.zeros((32, 32, 3), np.uint8)
    sample = collate.DecodedSample("s", np.array([5, 6]), images=[image])
    old, new = collate.pack_samples([sample], patch_size=16), pack_samples([sample], packing_spec(patch_size=16))
    assert old.keys() == new.keys() and all(
        (old[k] == new[k]).all() for k in old if hasattr(old[k], "shape"))
    with pytest.raises(ValueError, match="not a whole number of 14-pixel patches"):
        collate.check_packable(sample)


def test_readme_lists_every_renamed_name() -> None:
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \|", readme, flags=re.MULTILINE)
    assert dict(rows) == deprecations.RENAMED


def test_old_configs_parse_to_the_same_job() -> None:
    old = OmniCLI(args=["--config", str(LEGACY / "tiny_omni.yaml")], run=False)
    new = OmniCLI(args=["--config", str(REPO / "examples" / "tiny_omni.yaml")], run=False)
    assert old.datamodule.reorder_group_size is None and old.datamodule.settings == new.datamodule.settings
    assert any(isinstance(c, BalanceMonitor) for c in old.trainer.callbacks)
    old_jsonl = OmniCLI(args=["--config", str(LEGACY / "jsonl.yaml")], run=False)
    assert any(isinstance(c, BalanceMonitor) for c in old_jsonl.trainer.callbacks)


@pytest.mark.slow
def test_old_main_job_config_still_trains(tmp_path: Path) -> None:
    """0.1's ``examples/tiny_omni.yaml``, shortened as the README test shortens today's: it trains, says which
    names are deprecated, and its metrics keep their old names beside the new."""
    command = [
        sys.executable, "-m", "omni_lightning.cli", "fit", "--config", str(LEGACY / "tiny_omni.yaml"),
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.log_every_n_steps", "1",
        "--data.init_args.synthetic.num_shards", "4", "--data.init_args.synthetic.samples_per_shard", "8",
        "--data.init_args.shards", "data/tiny_omni/train-{000000..000001}.tar",
        "--data.init_args.val_shards", "data/tiny_omni/train-{000002..000003}.tar",
        "--data.init_args.samples_per_step", "2", "--data.init_args.group_steps", "2",
    ]
    env = {**os.environ, "MASTER_PORT": str(free_port()), "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "balance_group_size=...) is deprecated" in result.stderr
    assert "BalanceMonitor is deprecated" in result.stderr
    (metrics_file,) = (tmp_path / "lightning_logs").glob("version_*/metrics.csv")
    columns = set(next(csv.DictReader(metrics_file.open())).keys())
    assert {"load/measured_imbalance", "balance/measured_imbalance", "reorder/predicted_imbalance",
            "balance/predicted_imbalance", "reshard/items_moved", "encoder/items_moved"} <= columns
