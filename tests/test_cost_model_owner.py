"""One price list for every plan: ``OmniStrategy(cost_model=...)`` prices ``OmniDataModule``'s reorder and the
resharder's plan (its encoders and its LLM base) alike; without it both price the model's FLOPs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning_runs import fit

from omni_lightning import OmniDataModule
from omni_lightning.balance.cost import CostModel, ModuleCost
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.flops import reference_cost_model

FLOPS = reference_cost_model(ReferenceMLLMConfig.tiny())
# A calibrated model in which vision is cheap against the LLM (as on the CPU, where FLOPs overprice the encoders).
CALIBRATED = CostModel(vision=ModuleCost(FLOPS.vision.linear / 3, FLOPS.vision.quadratic / 3), audio=FLOPS.audio,
                       llm=ModuleCost(FLOPS.llm.linear * 2, FLOPS.llm.quadratic * 2))


class _RecordPrices(pl.Callback):
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        resharder = module.step.source.resharder
        record = {"loader": trainer.datamodule.cost_model.coefficients.tolist(),
                  "vision": [resharder.costs["vision"].linear, resharder.costs["vision"].quadratic],
                  "llm": [resharder.llm.linear, resharder.llm.quadratic]}
        (self.out_dir / f"prices{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.distributed
@pytest.mark.parametrize("given", [None, CALIBRATED])
def test_the_strategys_cost_model_prices_the_loader_and_the_resharder(tmp_path: Path, tiny_shards: str,
                                                                       seed_checkpoint: Path,
                                                                       given: CostModel | None) -> None:
    layout: dict[str, Any] = {"dp_shard": 2, "encoder_reshard": True}
    if given is not None:
        layout["cost_model"] = given
    fit(tmp_path, tiny_shards, seed_checkpoint, layout=layout, max_steps=1, devices=2,
        datamodule=OmniDataModule(tiny_shards, samples_per_step=2, group_steps=1), callbacks=[_RecordPrices(tmp_path)])
    expected = given or FLOPS
    for rank in range(2):
        record = json.loads((tmp_path / f"prices{rank}.json").read_text())
        assert record["loader"] == pytest.approx(expected.coefficients.tolist())
        assert record["vision"] == pytest.approx([expected.vision.linear, expected.vision.quadratic])
        assert record["llm"] == pytest.approx([expected.llm.linear, expected.llm.quadratic])
