"""Loss and gradient parity: OmniStrategy layouts on 4 CPU ranks against one process running the global batch.

Tolerance: per-step losses within 1e-4 relative, gradients within 1e-4 of their norm. The layouts compute the
same mathematics; they differ only in the order of fp32 additions (FSDP's reduce-scatter averages, TP's partial
sums, HSDP's two-level reduction, the sharded AdamW update), each of which perturbs results by ~1e-7 relative.
Ten AdamW steps at lr 1e-3 amplify that to ~1e-6 here; 1e-4 leaves headroom while still catching any real
error (a wrongly scaled loss, a missing gradient reduction or data split differently move losses by > 1e-2).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning_runs import LEARNING_RATE, GradientPresence, RecordBatches, RecordRun, fit, reference_run

from omni_lightning import OmniDataModule, OmniModule, ReferenceMLLM, ReferenceMLLMConfig
from omni_lightning.runtime.loss import next_token_loss_sum

pytestmark = pytest.mark.distributed

STEPS = 10
LAYOUTS = {
    "dp_shard4": {"dp_shard": 4},
    "dp_shard2_tp2": {"dp_shard": 2, "tp": 2},
    "dp_replicate2_dp_shard2": {"dp_replicate": 2, "dp_shard": 2},
    "tp4": {"dp_shard": 1, "tp": 4},
    "dp_shard2_cp2": {"dp_shard": 2, "cp": 2},
    "cp2_tp2": {"dp_shard": 1, "cp": 2, "tp": 2},
}


def _dp_size(layout: dict[str, int]) -> int:
    return layout.get("dp_replicate", 1) * layout.get("dp_shard", 1)


@pytest.fixture(scope="module")
def references(tiny_shards: str, seed_checkpoint: Path) -> dict[int, tuple[list[float], dict[str, torch.Tensor]]]:
    sizes = {_dp_size(layout) for layout in LAYOUTS.values()}
    return {dp: reference_run(tiny_shards, seed_checkpoint, dp_size=dp, steps=STEPS) for dp in sorted(sizes)}


def _assert_grads_match(grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor], what: str) -> None:
    assert grads.keys() == ref_grads.keys()
    for param, ref in ref_grads.items():
        error = (grads[param] - ref).norm().item()
        assert error <= 1e-4 * ref.norm().item() + 1e-8, f"{what}: gradient of {param} differs by {error:.3g}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(
    name: str, tmp_path: Path, tiny_shards: str, seed_checkpoint: Path, references: dict
) -> None:
    layout = LAYOUTS[name]
    fit(tmp_path, tiny_shards, seed_checkpoint, layout=layout, max_steps=STEPS,
        callbacks=[RecordRun(tmp_path, grads=True)])
    ref_losses, ref_grads = references[_dp_size(layout)]
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert [int(k) for k in losses] == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor(list(losses.values())), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    _assert_grads_match(torch.load(tmp_path / "grads.pt", weights_only=True), ref_grads, name)


def test_gradient_accumulation_skips_intermediate_reduction(
    tmp_path: Path, tiny_shards: str, seed_checkpoint: Path
) -> None:
    """Two accumulated micro-batches on dp_shard=2: FSDP skips the first reduction and the step still matches."""
    steps, accumulate = 3, 2
    fit(tmp_path, tiny_shards, seed_checkpoint, layout={"dp_shard": 2}, devices=2, max_steps=steps,
        accumulate_grad_batches=accumulate, callbacks=[RecordRun(tmp_path, grads=True), GradientPresence(tmp_path)])
    # Without gradient sync FSDP2 keeps unreduced gradients on its unsharded buffers: no sharded .grad yet.
    assert json.loads((tmp_path / "grad_presence.json").read_text()) == [False, True] * steps
    ref_losses, ref_grads = reference_run(tiny_shards, seed_checkpoint, dp_size=2, steps=steps, accumulate=accumulate)
    losses = json.loads((tmp_path / "batch_losses.json").read_text())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    _assert_grads_match(torch.load(tmp_path / "grads.pt", weights_only=True), ref_grads, "accumulation")


def test_eight_ranks_fsdp_cp_tp_with_encoder_sp(tmp_path: Path, tiny_shards: str, seed_checkpoint: Path,
                                                references: dict) -> None:
    """dp_shard=2 x cp=2 x tp=2 on 8 ranks, encoder items resharded and split over both data-parallel ranks."""
    layout = {"dp_shard": 2, "cp": 2, "tp": 2, "enc_sp": 2}
    fit(tmp_path, tiny_shards, seed_checkpoint, layout=layout, devices=8, max_steps=STEPS,
        callbacks=[RecordRun(tmp_path, grads=True)])
    ref_losses, ref_grads = references[2]
    losses = json.loads((tmp_path / "losses.json").read_text())
    torch.testing.assert_close(torch.tensor(list(losses.values())), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    _assert_grads_match(torch.load(tmp_path / "grads.pt", weights_only=True), ref_grads, "8 ranks")


def _step_gradients(seed_checkpoint: Path, batches: list[dict], *, by_step_tokens: bool) -> dict[str, torch.Tensor]:
    """One process's gradient of a step given as micro-batches: divided by the loss tokens of the whole step, or
    (Lightning's default) the mean over micro-batches of each one's token-mean loss."""
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    model.load_state_dict(torch.load(seed_checkpoint, weights_only=True))
    sums, counts = zip(*(next_token_loss_sum(model(batch), batch["labels"]) for batch in batches), strict=True)
    if by_step_tokens:
        loss = torch.stack(sums).sum() / torch.stack(counts).sum()
    else:  # two ranks' micro-batch i together make one global micro-batch i
        half = len(batches) // 2
        loss = sum((sums[i] + sums[i + half]) / (counts[i] + counts[i + half]) for i in range(half)) / half
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_accumulation_weights_every_token_of_the_step_equally(
    tmp_path: Path, tiny_shards: str, seed_checkpoint: Path
) -> None:
    """OmniDataModule(micro_batches=2) + accumulate_grad_batches=2 on dp_shard=2: the step's gradient is that of the
    step's summed token losses over its loss tokens, however unevenly the micro-batches split those tokens."""
    data = OmniDataModule(tiny_shards, samples_per_step=4, group_steps=2, micro_batches=2)
    fit(tmp_path, tiny_shards, seed_checkpoint, layout={"dp_shard": 2}, devices=2, max_steps=1, datamodule=data,
        accumulate_grad_batches=2, callbacks=[RecordRun(tmp_path, grads=True), RecordBatches(tmp_path)])
    batches = [b for r in range(2) for b in torch.load(tmp_path / f"batches_rank{r}.pt", weights_only=False)]
    assert len(batches) == 4 and all(b["step"]["micro_batches"] == 2 for b in batches)
    tokens = [int((b["labels"] != -100).sum()) for b in batches]
    assert len(set(tokens)) > 1, f"micro-batches hold equal loss tokens {tokens}: the test could not tell"
    grads = torch.load(tmp_path / "grads.pt", weights_only=True)
    _assert_grads_match(grads, _step_gradients(seed_checkpoint, batches, by_step_tokens=True), "step tokens")
    equal_weights = _step_gradients(seed_checkpoint, batches, by_step_tokens=False)
    with pytest.raises(AssertionError):  # Lightning's equal weighting is measurably different here
        _assert_grads_match(grads, equal_weights, "equal weights")


def test_accumulation_must_match_planned_micro_batches(tmp_path: Path, tiny_shards: str,
                                                       seed_checkpoint: Path) -> None:
    data = OmniDataModule(tiny_shards, samples_per_step=4, group_steps=2, micro_batches=1)
    with pytest.raises(Exception, match=r"set OmniDataModule\(micro_batches=2\)"):
        fit(tmp_path, tiny_shards, seed_checkpoint, layout={"dp_shard": 2}, devices=2, max_steps=1, datamodule=data,
            accumulate_grad_batches=2)


class _PerturbNonZeroRanks(pl.Callback):
    """Before configure_model, give every rank but 0 different weights, as unseeded per-rank construction would."""

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        if trainer.global_rank != 0:
            with torch.no_grad():
                for p in module._built_model[0].parameters():
                    p.add_(torch.randn_like(p))


def test_user_built_model_starts_from_rank_zero_weights(tmp_path: Path, tiny_shards: str) -> None:
    torch.manual_seed(7)
    built = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    seed_file = tmp_path / "built.pt"
    torch.save(built.state_dict(), seed_file)
    module = OmniModule(built, learning_rate=LEARNING_RATE)
    fit(tmp_path, tiny_shards, seed_file, layout={"dp_shard": 2, "tp": 2}, max_steps=3, module=module,
        callbacks=[RecordRun(tmp_path), _PerturbNonZeroRanks()])
    ref_losses, _ = reference_run(tiny_shards, seed_file, dp_size=2, steps=3)
    losses = json.loads((tmp_path / "losses.json").read_text())
    torch.testing.assert_close(torch.tensor(list(losses.values())), torch.tensor(ref_losses), rtol=1e-4, atol=0)
