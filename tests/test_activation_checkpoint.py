"""Activation checkpointing and compiled MLPs change neither the loss, the gradients nor any parameter name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning_runs import LEARNING_RATE, RecordRun, fit, merged_grads
from test_monitor import mixed_samples
from test_parity import _assert_grads_match

from omni_lightning import OmniModule, ReferenceMLLM
from omni_lightning.data.packing import pack_samples
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.parallel.activation_checkpoint import apply_ac, apply_compile
from omni_lightning.runtime.loss import next_token_loss_sum


def _loss_and_grads(model: ReferenceMLLM, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss_sum, count = next_token_loss_sum(model(batch), batch["labels"])
    (loss_sum / count).backward()
    return loss_sum.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _saved_bytes(model: ReferenceMLLM, batch: dict) -> int:
    """Bytes the forward keeps for the backward outside checkpointed regions."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(batch)
    return total


def test_checkpointing_keeps_fewer_activations() -> None:
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    batch = pack_samples(mixed_samples()[0])
    kept = _saved_bytes(model, batch)
    apply_ac([*model.llm.layers.values(), *model.vision.blocks, *model.audio.blocks])
    assert _saved_bytes(model, batch) < kept / 2


@pytest.mark.parametrize("ac, backend", [(True, None), (False, "aot_eager"), (True, "aot_eager")])
def test_same_loss_gradients_and_names(ac: bool, backend: str | None) -> None:
    torch.manual_seed(0)
    reference = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    changed = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    changed.load_state_dict(reference.state_dict())
    blocks = [*changed.llm.layers.values(), *changed.vision.blocks, *changed.audio.blocks]
    if backend is not None:
        apply_compile(blocks, backend)
    if ac:
        apply_ac(blocks)
    assert list(changed.state_dict()) == list(reference.state_dict())
    batch = pack_samples(mixed_samples()[0])
    expected_loss, expected = _loss_and_grads(reference, batch)
    loss, grads = _loss_and_grads(changed, batch)
    torch.testing.assert_close(loss, expected_loss)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.distributed
def test_checkpointed_blocks_under_fsdp_and_tensor_parallelism(tmp_path: Path, tiny_shards: str,
                                                                seed_checkpoint: Path) -> None:
    """dp_shard=2 x tp=2 with every block checkpointed: the first step's gradients equal those of the same
    layout without checkpointing (FSDP gathers the weights again for the recomputation)."""
    for ac in (False, True):
        module = OmniModule(ReferenceMLLMConfig.tiny(), learning_rate=LEARNING_RATE,
                            init_checkpoint=str(seed_checkpoint), activation_checkpointing=ac)
        fit(tmp_path / str(ac), tiny_shards, seed_checkpoint, layout={"dp_shard": 2, "tp": 2}, max_steps=1,
            module=module, callbacks=[RecordRun(tmp_path / str(ac), grads=True)])
    _assert_grads_match(merged_grads(tmp_path / "True"), merged_grads(tmp_path / "False"), "checkpointed")
