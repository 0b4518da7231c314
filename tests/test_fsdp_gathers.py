"""FSDP2 as the runtime applies it gathers each unit's weights no more often than ``fully_shard``'s defaults do, and
the forward's last block once a step."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from distributed import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.models.parallelize import parallelize_reference
from omni_lightning.runtime.loss import next_token_loss_sum


def _batch(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    sample = DecodedSample("s", rng.integers(4, 256, 9).astype(np.int32),
                           [rng.integers(0, 256, (28, 56, 3), dtype=np.uint8)],
                           rng.standard_normal((8, 80)).astype(np.float16))
    return pack_samples([sample])


def _count_gathers(rank: int, world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gathers: Counter[tuple[str, str]] = Counter()
    unshard = _fsdp_param_group.FSDPParamGroup.unshard

    def counting_unshard(group: Any, async_op: bool = False) -> None:
        if group._all_gather_result is None and not group.is_unsharded:  # what unshard gathers for
            gathers[group._module_fqn or "root", group._training_state.name] += 1
        unshard(group, async_op)

    monkeypatch.setattr(_fsdp_param_group.FSDPParamGroup, "unshard", counting_unshard)
    torch.manual_seed(0)
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    parallelize_reference(model, fsdp_mesh=init_device_mesh("cpu", (world_size,)))
    steps = 2
    for step in range(steps):
        batch = _batch(step)
        # As the runtime's step runs it: the encoder stage through the model's hooked method, then the forward.
        encoded = model.encoder_stage(lambda batch=batch: model.encode(batch))
        loss_sum, count = next_token_loss_sum(model(batch, encoded), batch["labels"])
        (loss_sum / count).backward()
    # The root (embeddings, head, stems) stays gathered from the encoder stage through the forward, where
    # resharding it after each forward method gathered it for each and again for the backward. (FSDP may still
    # gather it again in the backward when the encoder stage's gradients arrive after those of the forward's inputs,
    # which is when FSDP reduces and reshards a unit.) The forward's last block, whose backward runs first, stays
    # gathered from its forward to its backward. Every other block: once in the forward, once in the backward.
    assert gathers.pop(("root", "FORWARD")) == steps
    assert gathers.pop(("root", "PRE_BACKWARD"), 0) <= steps
    last = f"llm.layers.{len(model.llm.layers) - 1}"
    assert gathers.pop((last, "FORWARD")) == steps
    blocks = {fqn for fqn, _ in gathers}
    assert len(blocks) == len(model.llm.layers) - 1 + sum(len(e.blocks) for e in model.encoders.values())
    assert gathers == Counter({(fqn, state): steps for fqn in blocks for state in ("FORWARD", "PRE_BACKWARD")})


def test_the_root_is_gathered_once_for_the_encoder_stage_and_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    run_distributed(_count_gathers, 2, monkeypatch)
