"""OmniModule outside OmniStrategy: a subclass that builds its model in its own ``configure_model``."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from omni_lightning import OmniModule, ReferenceMLLM, WebDataModule
from omni_lightning.module import initial_state_dict


class _OwnModel(OmniModule):
    """What a user writes to build (and, under ModelParallelStrategy, wrap) the model themselves."""

    def configure_model(self) -> None:
        if self.model is None:
            model = ReferenceMLLM(self.config)
            model.load_state_dict(initial_state_dict(self.config, seed=self.hparams.init_seed))
            self.model = model


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: dict, batch: dict,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["global_loss"]))


def _train(module: OmniModule, shards: str) -> list[float]:
    losses = _Losses()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[losses])
    trainer.fit(module, datamodule=WebDataModule(shards, batch_size=2, seed=0))
    return losses.losses


def test_a_model_built_in_a_subclass_trains_as_the_built_in_one(tiny_shards: str) -> None:
    """The subclass's model encodes inside its own forward; the losses equal the module's own build's (same weights,
    same data; only the order of float sums may differ, hence 1e-6)."""
    torch.manual_seed(0)
    own = _train(_OwnModel(init_seed=1), tiny_shards)
    torch.manual_seed(0)
    built_in = _train(OmniModule(init_seed=1), tiny_shards)
    assert len(own) == 3
    torch.testing.assert_close(own, built_in, rtol=1e-6, atol=0)


def test_mixed_precision_in_one_process_without_a_process_group(tiny_shards: str) -> None:
    """``param_dtype`` under a plain Trainer (no process group, so no FSDP): the forward runs under autocast, the
    weights stay fp32, and the losses stay within bf16's reach of fp32's (1e-2; a wrong loss would be far off)."""
    torch.manual_seed(0)
    mixed = OmniModule(init_seed=1, param_dtype="bfloat16")
    losses = _train(mixed, tiny_shards)
    torch.manual_seed(0)
    full = _train(OmniModule(init_seed=1), tiny_shards)
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    torch.testing.assert_close(losses, full, rtol=1e-2, atol=0)
    assert losses != full  # bf16 really ran
