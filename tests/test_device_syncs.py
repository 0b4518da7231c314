"""What a step makes the host wait for on an accelerator, counted on CPU (``device_discipline.device_syncs``).

Each read of a device tensor, and each blocking copy to the device, waits for every kernel queued before it: the host
stops running ahead of the device. The step's own bookkeeping (the loss's scale, the step's counts, cutting a batch
into micro-batches) must add none per sample or micro-batch, and none between the forward and the backward.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from device_discipline import device_syncs

from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.modalities import DEFAULT_PACKING
from omni_lightning.models.adapters.hf_qwen2_vl import _item_grids
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.runtime.encoders import LocalEncoders
from omni_lightning.runtime.items import split_micro_batches
from omni_lightning.runtime.loss import StepLoss, next_token_loss_sum
from omni_lightning.runtime.step import PlainStep


def _samples(n: int, seed: int = 0) -> list[DecodedSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        images = [rng.integers(0, 256, (28, 28 * int(rng.integers(1, 3)), 3), dtype=np.uint8)
                  for _ in range(int(rng.integers(0, 3)))]
        audio = rng.standard_normal((4 * int(rng.integers(2, 5)), 80)).astype(np.float16) if i % 3 == 0 else None
        out.append(DecodedSample(f"s{i}", rng.integers(4, 256, int(rng.integers(3, 12))).astype(np.int32), images,
                                 audio))
    return out


def test_the_counter_sees_reads_and_blocking_copies_and_not_queued_work() -> None:
    on_device = torch.arange(6)
    with device_syncs() as syncs:
        total = on_device.sum() * 2  # queued work
        host = torch.tensor([1.0, 2.0])
        host.to("cpu", non_blocking=True)
        assert not syncs
        float(total)
        on_device.tolist()
        host.to("cpu")
        torch.tensor([3], device="cpu")
        on_device[:2].cpu()
    assert syncs == ["__float__", "tolist", "to(device)", "tensor(device=)", "cpu"]


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_cutting_a_batch_into_micro_batches_reads_the_device_as_often_for_many_samples_as_for_few(
        micro_batches: int) -> None:
    reads = []
    for n in (2, 12):
        batch = pack_samples(_samples(n))
        with device_syncs() as syncs:
            split_micro_batches(batch, micro_batches, DEFAULT_PACKING)
        reads.append(list(syncs))
    assert reads[0] == reads[1]
    # The bounds, each encoder's per-item inputs, and every encoder's placeholder counts in one read.
    per_item_inputs = sum(len(fmt.per_item_names) for fmt in DEFAULT_PACKING.encoders)
    assert len(reads[0]) == 2 + per_item_inputs


def test_a_step_waits_for_the_device_where_the_models_own_forward_does_and_nowhere_else() -> None:
    """The loss is scaled by the step's token count on the device: no read between the forward and the backward,
    and the host's counts travel in a copy that does not wait."""
    torch.manual_seed(0)
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    samples = _samples(5, seed=1)

    def batch() -> dict:  # a fresh batch each time: the bounds' host copy is cached per tensor
        packed = pack_samples(samples)
        return {**packed, "step": {"loss_tokens": 40}}

    reference = batch()
    with device_syncs() as forward_syncs:
        next_token_loss_sum(model(reference, model.encode(reference)), model.local_labels(reference))
    step, fresh = PlainStep(model, LocalEncoders(model)), batch()  # made before: Lightning moved it to the device
    with device_syncs() as step_syncs:
        result = step.run(fresh, train=True, accumulate=1)
    assert step_syncs == forward_syncs
    # The model's own forward: one read of each attention's bounds (the LLM's and each encoder's) and of the audio
    # stem's clip lengths, which it cuts the clips by; no blocking copy.
    assert forward_syncs == ["tolist"] * (1 + len(model.encoders) + 1)
    result.loss.backward()


def test_a_scale_on_the_device_gives_the_scale_of_the_number() -> None:
    loss_sum = torch.tensor(12.0, requires_grad=True)
    for tokens in (0.0, 3.0, 40.0):
        on_device = StepLoss(torch.tensor(tokens, dtype=torch.float64), 4, weight=0.5)(loss_sum)
        number = StepLoss(tokens, 4, weight=0.5)(loss_sum)
        assert on_device.dtype == loss_sum.dtype and torch.equal(on_device, number)


def test_qwen2_5_vl_reads_its_items_grids_in_one_read_however_many_items() -> None:
    rng = np.random.default_rng(3)
    shapes = [(2, 3), (0, 0), (5, 1), (4, 4), (1, 7)]  # an empty item among them: it has no grid
    positions = torch.cat([torch.cartesian_prod(torch.arange(r), torch.arange(c))[rng.permutation(r * c)]
                           for r, c in shapes if r])
    positions = torch.cat([positions, torch.full((positions.shape[0], 1), 9)], dim=1)  # a column the grid ignores
    bounds = tuple(np.concatenate([[0], np.cumsum([r * c for r, c in shapes])]).tolist())
    with device_syncs() as syncs:
        grids = _item_grids(positions, bounds)
    assert syncs == ["cpu"]
    assert grids.tolist() == [[1, r, c] for r, c in shapes if r]
    assert _item_grids(positions[:0], (0, 0)).shape == (0, 3)
