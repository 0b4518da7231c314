"""Fine-tuning controls: frozen parts, per-part learning rates, weight decay that skips norms, biases and embeddings,
optimizer and schedule as module arguments (and the CLI's ``--optimizer`` / ``--lr_scheduler`` linked to them), and
the warm-up-then-cosine schedule.

The distributed rows train 3 steps of the tiny reference model on 2 ranks with a frozen vision tower, halved LLM
learning rate and weight decay, and compare the losses with one process applying the same groups to the same
global batch (1e-4 relative: the layouts only reduce in other orders); frozen parameters must come out unchanged
and without optimizer state.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning_runs import BATCH_SIZE, LEARNING_RATE, RecordRun, assert_resumes_under, fit
from test_cli import MAIN_CONFIG, _parse

from omni_lightning import OmniModule, ReferenceMLLM, ReferenceMLLMConfig, WarmupCosineLR, WebDataModule
from omni_lightning.data.packing import pack_samples
from omni_lightning.runtime.loss import next_token_loss_sum
from omni_lightning.runtime.optim import apply_lr_multipliers, freeze_parts, parameter_groups, part_of

ENCODERS = ("vision", "audio")
MULTIPLIERS, DECAY = {"llm": 0.5}, 0.1
PROJECTORS_ONLY = ("vision", "audio", "llm")  # LLaVA's first stage: align the projectors


def test_parts_name_the_towers_the_projectors_and_the_llm() -> None:
    assert part_of("vision.blocks.0.qkv.weight", ENCODERS) == "vision"
    assert part_of("vision.projector.fc1.weight", ENCODERS) == "projector"
    assert part_of("audio._checkpoint_wrapped_module.projector.fc2.bias", ENCODERS) == "projector"
    assert part_of("llm.layers.1._checkpoint_wrapped_module.attention.wq.weight", ENCODERS) == "llm"
    assert part_of("depth.stem.weight", (*ENCODERS, "depth")) == "depth"


def test_groups_hold_trainable_parameters_with_decay_only_on_matrices() -> None:
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    freeze_parts(model, ["vision", "audio"], ENCODERS)
    groups = parameter_groups(model, ENCODERS, weight_decay=0.1, lr_multipliers={"projector": 2.0})
    names = {id(p): n for n, p in model.named_parameters()}
    grouped = [names[id(p)] for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert not any(part_of(n, ENCODERS) in ("vision", "audio") for n in grouped)
    for group in groups:
        members = [names[id(p)] for p in group["params"]]
        projector = {part_of(n, ENCODERS) == "projector" for n in members}
        assert projector == {group["lr_multiplier"] == 2.0}
        no_decay = {n.endswith(".bias") or "norm" in n or n == "llm.tok_embeddings.weight" for n in members}
        assert no_decay == {group["weight_decay"] == 0.0}
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    apply_lr_multipliers(optimizer)
    assert sorted({g["lr"] for g in optimizer.param_groups}) == [1e-3, 2e-3]
    assert all("lr_multiplier" not in g for g in optimizer.param_groups)  # saved state keeps its usual keys


def test_bad_part_names_and_freezing_everything_are_refused() -> None:
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    with pytest.raises(ValueError, match=r"freeze names \['decoder'\], which are not parts of the model: choose from "
                                         r"\['vision', 'projector', 'audio', 'llm'\]"):
        freeze_parts(model, ["decoder"], ENCODERS)
    with pytest.raises(ValueError, match="nothing would train"):
        freeze_parts(model, ["vision", "audio", "projector", "llm"], ENCODERS)
    module = OmniModule(lr_multipliers={"text": 0.1})
    with pytest.raises(ValueError, match=r"lr_multipliers names \['text'\]"):
        module.configure_model()


def test_warmup_cosine_schedule() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = WarmupCosineLR(optimizer, warmup_steps=4, max_steps=12, min_lr_ratio=0.1)
    rates = []
    for _ in range(14):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[:5] == pytest.approx([0.25, 0.4375, 0.625, 0.8125, 1.0])
    assert rates[8] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert rates[12:] == pytest.approx([0.1, 0.1])
    assert all(a >= b for a, b in zip(rates[4:], rates[5:], strict=False))
    with pytest.raises(ValueError, match="warmup_steps <= max_steps"):
        WarmupCosineLR(optimizer, warmup_steps=5, max_steps=3)


def test_cli_links_optimizer_and_schedule_to_the_module() -> None:
    cli = _parse(["--config", str(MAIN_CONFIG), "--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.05",
                  "--lr_scheduler", "omni_lightning.WarmupCosineLR", "--lr_scheduler.warmup_steps", "2",
                  "--lr_scheduler.max_steps", "10", "--model.freeze", "[audio]", "--model.lr_multipliers",
                  "{llm: 0.5}"])
    module = cli.model
    module.configure_model()
    with pytest.warns(UserWarning) as warned:  # the example config sets learning_rate and warmup_steps
        configured = module.configure_optimizers()
    messages = " | ".join(str(w.message) for w in warned)
    assert "learning_rate=0.002, weight_decay=0.0: the optimizer's own learning rate" in messages
    assert "warmup_steps=5: the scheduler is used" in messages
    optimizer, schedule = configured["optimizer"], configured["lr_scheduler"]
    assert isinstance(optimizer, torch.optim.SGD) and isinstance(schedule["scheduler"], WarmupCosineLR)
    assert schedule["interval"] == "step"
    assert sorted({g["initial_lr"] for g in optimizer.param_groups}) == [0.025, 0.05]
    trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, param in module.model.named_parameters():
        assert (id(param) in trained) == (part_of(name, ENCODERS) != "audio"), name


def test_the_module_defaults_keep_working_and_say_which_wins() -> None:
    module = OmniModule(warmup_steps=3, lr_scheduler=lambda opt: torch.optim.lr_scheduler.ConstantLR(opt))
    module.configure_model()
    with pytest.warns(UserWarning, match="warmup_steps=3: the scheduler is used"):
        configured = module.configure_optimizers()
    assert isinstance(configured["optimizer"], torch.optim.AdamW)
    assert {g["initial_lr"] for g in configured["optimizer"].param_groups} == {1e-3}


# ------------------------------------------------------------------------------------------- distributed parity


class RecordFrozen(pl.Callback):
    """Rank 0 writes, after training: whether every frozen parameter is unchanged and stateless in the optimizer,
    and that some trained parameter changed."""

    def __init__(self, out_dir: Path, seed_checkpoint: Path, freeze: tuple[str, ...]) -> None:
        self.out_dir, self.initial = out_dir, torch.load(seed_checkpoint, weights_only=True)
        self.freeze = freeze

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        report: dict[str, Any] = {"frozen_changed": [], "frozen_with_state": [], "trained_changed": 0}
        for name, param in module.model.named_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            frozen = part_of(name, ENCODERS) in self.freeze
            changed = not torch.equal(full.detach(), self.initial[name])
            if frozen and changed:
                report["frozen_changed"].append(name)
            if frozen and (param in optimizer.state or param.requires_grad or local.grad is not None):
                report["frozen_with_state"].append(name)
            report["trained_changed"] += int(not frozen and changed)
        if trainer.global_rank == 0:
            (self.out_dir / "frozen.json").write_text(json.dumps(report))


def _reference(shards: str, seed_checkpoint: Path, steps: int, dp_size: int, freeze: tuple[str, ...]) -> list[float]:
    """One process, the global batch of the ``dp_size`` data-parallel ranks, the same parameter groups."""
    data = WebDataModule(shards, batch_size=BATCH_SIZE)
    streams = [data.stream(shards, dp_rank=r, dp_size=dp_size, num_workers=0).iter_samples() for r in range(dp_size)]
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    model.load_state_dict(torch.load(seed_checkpoint, weights_only=True))
    freeze_parts(model, freeze, ENCODERS)
    optimizer = torch.optim.AdamW(parameter_groups(model, ENCODERS, weight_decay=DECAY, lr_multipliers=MULTIPLIERS),
                                  lr=LEARNING_RATE, betas=(0.9, 0.95))
    apply_lr_multipliers(optimizer)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        batch = pack_samples([next(stream) for stream in streams for _ in range(BATCH_SIZE)])
        total, count = next_token_loss_sum(model(batch), batch["labels"])
        (total / count).backward()
        losses.append(float(total / count))
        optimizer.step()
    return losses


@pytest.mark.distributed
@pytest.mark.parametrize(("layout", "freeze"), [({"dp_shard": 2}, ("vision",)), ({"tp": 2, "dp_shard": 1}, ("vision",)),
                                                ({"pp": 2, "dp_shard": 1}, ("vision",)),
                                                ({"pp": 2, "dp_shard": 1}, PROJECTORS_ONLY)],
                         ids=["fsdp", "tp", "pp-joint", "pp-joint-projectors-only"])
def test_frozen_parts_and_lr_multipliers_train_as_one_process(layout: dict[str, int], freeze: tuple[str, ...],
                                                              tmp_path: Path, tiny_shards: str,
                                                              seed_checkpoint: Path) -> None:
    module = OmniModule(ReferenceMLLMConfig.tiny(), learning_rate=LEARNING_RATE, weight_decay=DECAY,
                        init_checkpoint=str(seed_checkpoint), freeze=freeze, lr_multipliers=MULTIPLIERS)
    data = WebDataModule(tiny_shards, batch_size=BATCH_SIZE)
    fit(tmp_path, tiny_shards, seed_checkpoint, layout=layout, devices=2, max_steps=3, module=module,
        datamodule=data, callbacks=[RecordRun(tmp_path), RecordFrozen(tmp_path, seed_checkpoint, freeze)])
    report = json.loads((tmp_path / "frozen.json").read_text())
    assert report["frozen_changed"] == [] and report["frozen_with_state"] == [] and report["trained_changed"] > 0
    losses = json.loads((tmp_path / "losses.json").read_text())
    # tp and pp peers read the same samples: one data-parallel rank.
    expected = _reference(tiny_shards, seed_checkpoint, 3, layout.get("dp_shard", 1), freeze)
    torch.testing.assert_close(torch.tensor([losses[s] for s in "123"]), torch.tensor(expected), rtol=1e-4, atol=0)


@pytest.mark.distributed
def test_a_run_with_frozen_parts_resumes_exactly_under_another_layout(tmp_path: Path, tiny_shards: str,
                                                                     seed_checkpoint: Path) -> None:
    assert_resumes_under(
        tmp_path, tiny_shards, seed_checkpoint, saved={"tp": 2, "dp_shard": 2}, resumed={"pp": 2, "dp_shard": 2},
        module=lambda: OmniModule(ReferenceMLLMConfig.tiny(), learning_rate=LEARNING_RATE, weight_decay=DECAY,
                                  init_checkpoint=str(seed_checkpoint), freeze=("audio", "projector"),
                                  lr_multipliers=MULTIPLIERS))
