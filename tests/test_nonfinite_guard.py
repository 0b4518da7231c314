"""Step decisions that could differ between ranks, taken the same way on all of them.

The non-finite guard: a NaN/inf loss or gradient on one rank is agreed by every rank, which then all skip the
optimizer step (weights and AdamW state unchanged, training goes on) or all stop with the same error. Each test
injects the fault on one rank only, at one step, in a 2-rank fork-started run of the tiny model.

An empty encoder batch needs no vote: a rank without media still runs every encoder on a dummy item, so it enters
the same FSDP collectives as its peers. Tested here without encoder balancing; with it (where the plan is shared),
``test_reshard_parity.py`` covers a text-only rank ("mixed") and a text-only step on every rank.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from lightning_runs import LEARNING_RATE, fit
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from omni_lightning import OmniModule, ReferenceMLLM, ReferenceMLLMConfig
from omni_lightning.batch import BYTE_ROLES
from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.module import initial_state_dict
from omni_lightning.parallel.dims import ParallelDims
from omni_lightning.parallel.layout import build_layout
from omni_lightning.parallel.settings import PipelineSettings, PlacementSettings
from omni_lightning.runtime.loss import next_token_loss_sum
from omni_lightning.runtime.step import build_step
from omni_lightning.strategies.nonfinite import _any_nonfinite_grad

# The byte tokens' roles (ids 0-3) and their first text id.
FIRST_TEXT_ID = BYTE_ROLES.first_free_id

pytestmark = pytest.mark.distributed

STEPS = 3
BAD_STEP = 1  # the trainer's global_step (0-based) at which the fault appears


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FaultyModule(OmniModule):
    """The tiny model, with a NaN loss (``fault="loss"``) or an inf gradient (``fault="grad"``) on one rank at
    ``BAD_STEP``; a ``FloatingPointError`` from the guard is written to ``error_rank{r}.txt`` before it propagates."""

    def __init__(self, *, fault: str, fault_rank: int, out_dir: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fault, self.fault_rank, self.out_dir = fault, fault_rank, Path(out_dir)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:
        out = super().training_step(batch, batch_idx)
        if self.trainer.global_step != BAD_STEP or self.trainer.global_rank != self.fault_rank:
            return out
        if self.fault == "loss":
            out["loss"] = out["loss"] * float("nan")
        else:  # under pipeline parallelism the schedule's backward already ran: poison one of this stage's grads
            weight = next(iter(self.model.llm.layers.values())).attention.wq.weight
            _local(weight.grad).view(-1)[0] = float("inf")
        return out

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().optimizer_step(*args, **kwargs)
        except FloatingPointError as error:
            (self.out_dir / f"error_rank{self.trainer.global_rank}.txt").write_text(str(error))
            # Every rank must get here: one that had not raised would be missing, and be named, after 30 s.
            dist.monitored_barrier(timeout=timedelta(seconds=30))
            raise


class RecordGuard(pl.Callback):
    """Every rank records its local weights after each step, AdamW's step counts, the skip counter and metric, and
    the guard's warnings, into ``guard_rank{r}.pt``."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.weights: list[torch.Tensor] = []
        self.warnings: list[str] = []

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        recorder = self

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                recorder.warnings.append(record.getMessage())

        logging.getLogger("omni_lightning.strategies.nonfinite").addHandler(Handler(logging.WARNING))

    def _snapshot(self, module: pl.LightningModule) -> None:
        self.weights.append(torch.cat([_local(p.data).flatten().clone() for p in module.model.parameters()]))

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._snapshot(module)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self._snapshot(module)

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        state = trainer.optimizers[0].state
        torch.save({
            "weights": self.weights,
            "adam_steps": sorted({int(s["step"]) for s in state.values()}),
            "skipped": trainer.strategy.skipped_steps,
            "metric": float(trainer.callback_metrics["guard/skipped_steps"]),
            "warnings": self.warnings,
        }, self.out_dir / f"guard_rank{trainer.global_rank}.pt")


def _run(out_dir: Path, shards: str, seed: Path, layout: dict[str, Any], fault: str, fault_rank: int) -> None:
    module = FaultyModule(model=ReferenceMLLMConfig.tiny(), learning_rate=LEARNING_RATE, init_checkpoint=str(seed),
                          fault=fault, fault_rank=fault_rank, out_dir=str(out_dir))
    fit(out_dir, shards, seed, layout=layout, max_steps=STEPS, devices=2, module=module,
        callbacks=[RecordGuard(out_dir)])


@pytest.mark.parametrize(
    ("layout", "fault", "reported"),
    [
        # FSDP spreads rank 1's NaN into both ranks' gradient shards; the loss flag names where it started.
        ({"dp_shard": 2}, "loss", "non-finite loss on rank(s) [1]; non-finite gradients on rank(s) [0, 1]"),
        # Pipeline stages hold different weights: only rank 1's gradients are bad, yet rank 0 skips its step too.
        ({"pp": 2, "dp_shard": 1}, "grad", "non-finite gradients on rank(s) [1]"),
    ],
    ids=["fsdp_nan_loss", "pipeline_inf_grad"],
)
def test_every_rank_skips_the_step(layout: dict[str, Any], fault: str, reported: str, tmp_path: Path,
                                   tiny_shards: str, seed_checkpoint: Path) -> None:
    _run(tmp_path, tiny_shards, seed_checkpoint, layout, fault, fault_rank=1)
    for rank in range(2):
        record = torch.load(tmp_path / f"guard_rank{rank}.pt", weights_only=True)
        weights = record["weights"]  # before training, then after each step
        assert len(weights) == STEPS + 1
        for step in range(STEPS):
            changed = not torch.equal(weights[step + 1], weights[step])
            assert changed == (step != BAD_STEP), f"rank {rank}, step {step}: weights changed={changed}"
            assert torch.isfinite(weights[step + 1]).all(), f"rank {rank}: non-finite weights after step {step}"
        assert record["adam_steps"] == [STEPS - 1]  # AdamW never saw the skipped step
        assert record["skipped"] == 1 and record["metric"] == 1.0
        if rank == 0:
            assert record["warnings"] == [f"skipped optimizer step at global_step={BAD_STEP} on every rank: "
                                          f"{reported} (1 skipped so far)"]
        else:  # the report comes once, from rank 0
            assert record["warnings"] == []


def test_every_rank_stops_with_the_same_error(tmp_path: Path, tiny_shards: str, seed_checkpoint: Path) -> None:
    with pytest.raises(Exception, match=r"non-finite loss on rank\(s\) \[0\]"):
        _run(tmp_path, tiny_shards, seed_checkpoint, {"dp_shard": 2, "on_nonfinite": "stop"}, "loss", fault_rank=0)
    messages = {(tmp_path / f"error_rank{rank}.txt").read_text() for rank in range(2)}
    (message,) = messages  # both ranks raised, with the same message
    assert message.startswith(f"non-finite loss on rank(s) [0]; non-finite gradients on rank(s) [0, 1] at "
                              f"global_step={BAD_STEP}: stopping on every rank")
    assert not list(tmp_path.glob("guard_rank*.pt"))  # training did not go on anywhere


def _samples(rank: int) -> list[DecodedSample]:
    """Rank 0 has an image and an audio clip; rank 1 only text: its encoder batches are empty."""
    rng = np.random.default_rng(rank)
    text = rng.integers(FIRST_TEXT_ID, 256, 10 + rank)
    if rank == 1:
        return [DecodedSample("text", text, [], None)]
    image = rng.integers(0, 256, (4 * 14, 2 * 14, 3), dtype=np.uint8)
    return [DecodedSample("media", text, [image], rng.standard_normal((16, 80)).astype(np.float32))]


def _step_with_an_empty_encoder_batch(rank: int, world: int) -> None:
    config = ReferenceMLLMConfig.tiny()
    layout = build_layout(ParallelDims(world_size=world, dp_shard=world), "cpu", pipeline=PipelineSettings(),
                          placement=PlacementSettings(), reshard=False)
    with torch.device("meta"):
        model = ReferenceMLLM(config)
    build_step(model, layout, device=torch.device("cpu"))
    model.to_empty(device="cpu")
    set_model_state_dict(model, initial_state_dict(config, seed=5),
                         options=StateDictOptions(full_state_dict=True, strict=True))
    batch = pack_samples(_samples(rank))
    loss_sum, tokens = next_token_loss_sum(model(batch), batch["labels"])
    total_tokens = tokens.float().clone()
    dist.all_reduce(total_tokens)
    (loss_sum * world / total_tokens).backward()  # FSDP averages over the ranks
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}

    reference = ReferenceMLLM(config)
    reference.load_state_dict(initial_state_dict(config, seed=5))
    union = pack_samples([s for r in range(world) for s in _samples(r)])
    ref_sum, ref_tokens = next_token_loss_sum(reference(union), union["labels"])
    (ref_sum / ref_tokens).backward()
    for name, p in reference.named_parameters():
        error = (grads[name] - p.grad).norm().item()
        assert error <= 1e-4 * p.grad.norm().item() + 1e-8, f"rank {rank}: gradient of {name} differs by {error:.3g}"


def test_a_rank_without_media_joins_the_encoders_collectives() -> None:
    """FSDP over 2 ranks, no encoder balancing, rank 1 text-only: the step completes (no rank waits in a collective
    the other skipped) and every gradient, encoders' included, equals one process running both ranks' samples."""
    run_distributed(_step_with_an_empty_encoder_batch, 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None], ids=["nan", "inf", "-inf", "finite"])
def test_gradient_check_finds_any_non_finite_value(bad: float | None) -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 0, 5)]  # an empty shard, as an FSDP rank may hold
    for p in params:
        p.grad = torch.ones_like(p)
    if bad is not None:
        params[2].grad[4] = bad
    assert int(_any_nonfinite_grad(params, torch.device("cpu"))) == (bad is not None)
    assert int(_any_nonfinite_grad([params[1]], torch.device("cpu"))) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None], ids=["nan", "inf", "finite"])
def test_gradient_check_is_exact_where_the_sum_of_squares_overflows(dtype: torch.dtype, bad: float | None) -> None:
    """Finite gradients whose 2-norm overflows (the check's fast path) are still finite; a non-finite one among them
    is still found."""
    huge = torch.full((4,), 1e30, dtype=dtype)
    assert not torch.isfinite(torch._foreach_norm([huge], 2)[0]).item()  # the case is the overflowing one
    param = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
    param.grad = huge.clone()
    if bad is not None:
        param.grad[1] = bad
    assert int(_any_nonfinite_grad([param], torch.device("cpu"))) == (bad is not None)
