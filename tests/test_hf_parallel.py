"""The whole machinery on the Hugging Face families: pipeline (every schedule, the joint encoder-LLM pipeline and
encoders on the first stage), context, expert and encoder sequence parallelism, with FSDP2, HSDP and TP, each run
against one process running the family's own ``*ForConditionalGeneration`` on the same global batches.

Tolerances: losses within 1e-4 relative of the HF model and first-step gradients within 1e-4 of each tensor's
largest entry, as in ``test_hf_families.py``: the layouts sum the same terms in other orders (FSDP's reductions,
the pipeline's micro-batch accumulation, context parallelism's gathered keys and per-sample softmax, Ulysses'
head-split attention), each rounding at fp32's 6e-8 relative, over 3 steps of AdamW at a learning rate of 1e-3.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import soundfile
import torch
from hf_processors import save_tiny_qwen3_vl_moe, save_tiny_qwen_omni_thinker, save_tiny_qwen_vl
from lightning_runs import RecordBatches, RecordRun, fit, merged_grads
from test_hf_families import CAPTIONS, LEARNING_RATE, _hf_model, _image, hf_step_loss

from omni_lightning import OmniDataModule, OmniModule
from omni_lightning.data.jsonl import write_shard
from omni_lightning.models.pretrained import build_pretrained

transformers = pytest.importorskip("transformers")


def _wav(seconds: float, pitch: float) -> bytes:
    out = io.BytesIO()
    wave = np.sin(np.linspace(0, pitch * seconds, int(16000 * seconds))).astype(np.float32) * 0.3
    soundfile.write(out, wave, 16000, format="WAV")
    return out.getvalue()


@pytest.fixture(scope="module")
def mixed_shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Image-text pairs of several sizes (one in four large) and dialogues with two images, or an image and a clip
    of 1-3 s (a family that hears nothing skips those, as it would in training): 2 shards of 8."""
    out = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(7)
    for shard in range(2):
        samples = []
        for i in range(8):
            # One large image in four, so that the encoder stage has long items to split.
            key, (h, w) = f"mixed{shard}{i}", (int(x) for x in rng.integers(*((220, 300) if i % 4 == 0 else (24, 120)),
                                                                               2))
            if i % 4 == 1:
                dialogue = {"messages": [{"role": "user", "content": "<image><image> Compare them."},
                                         {"role": "assistant", "content": CAPTIONS[i % len(CAPTIONS)]}],
                            "images": ["0.png", "1.png"]}
                samples.append({"__key__": key, "json": json.dumps(dialogue).encode(), "0.png": _image(h, w, i),
                                "1.png": _image(w, h, i + 50)})
            elif i % 4 == 3:
                dialogue = {"messages": [{"role": "user", "content": "<image> <audio> What is it?"},
                                         {"role": "assistant", "content": "A cat and a tone."}],
                            "images": ["0.png"], "audios": ["0.wav"]}
                samples.append({"__key__": key, "json": json.dumps(dialogue).encode(), "0.png": _image(h, w, i),
                                "0.wav": _wav(1.0 + shard + i / 4, 400 + 100 * i)})
            else:
                samples.append({"__key__": key, "png": _image(h, w, shard * 8 + i),
                                "txt": CAPTIONS[(shard + i) % len(CAPTIONS)].encode()})
        write_shard(out / f"mixed-{shard:06d}.tar", samples)
    return str(out / "mixed-{000000..000001}.tar")


def _checkpoint(family: str, path: Path) -> Path:
    """A tiny checkpoint of ``family`` whose image processor keeps large images large (up to 128 merged tokens), so
    that some items are long enough to be split."""
    if family == "qwen2_5_omni_thinker":
        saved = save_tiny_qwen_omni_thinker(path)
    elif family == "qwen3_vl_moe":
        saved = save_tiny_qwen3_vl_moe(path)
    else:
        saved = save_tiny_qwen_vl(path, family, layers=4)
    config = json.loads((saved / "preprocessor_config.json").read_text())
    config["size"]["longest_edge"] = config["patch_size"] ** 2 * 4 * 128
    (saved / "preprocessor_config.json").write_text(json.dumps(config))
    return saved


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per family, written on first use."""
    made: dict[str, Path] = {}

    class Lazy(dict):
        def __missing__(self, family: str) -> Path:
            made[family] = _checkpoint(family, tmp_path_factory.mktemp(family))
            return made[family]

    return Lazy()


# name: (family, layout, ranks, data-parallel ranks, samples per step). Each parallelism at least twice, each family
# at least twice.
MATRIX: dict[str, tuple[str, dict[str, Any], int, int]] = {
    "qwen2_vl-pp-1f1b-joint": ("qwen2_vl", {"pp": 2, "dp_shard": 1}, 2, 1),
    "qwen2_vl-cp": ("qwen2_vl", {"cp": 2, "dp_shard": 1}, 2, 1),
    "qwen2_5_vl-pp-gpipe-first-stage": ("qwen2_5_vl", {"pp": 2, "dp_shard": 1, "pp_schedule": "GPipe",
                                                       "pp_encoders": "first_stage"}, 2, 1),
    "qwen2_5_vl-enc_sp": ("qwen2_5_vl", {"dp_shard": 2, "enc_sp": 2, "encoder_reshard": True}, 2, 2),
    "qwen2_5_omni_thinker-enc_sp": ("qwen2_5_omni_thinker", {"dp_shard": 2, "enc_sp": 2, "encoder_reshard": True},
                                    2, 2),
    "qwen3_vl_moe-fsdp": ("qwen3_vl_moe", {"dp_shard": 2}, 2, 2),
    "qwen3_vl_moe-ep": ("qwen3_vl_moe", {"dp_shard": 2, "ep": 2}, 2, 2),
    "qwen3_vl_moe-pp-ep": ("qwen3_vl_moe", {"pp": 2, "dp_shard": 2, "ep": 2}, 4, 2),
}


class RecordEncoderPlans(pl.Callback):
    """Rank 0 records each step's encoder plan statistics (``reshard/*``: items split, items moved ...)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.plans = out_dir, []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.plans.append(dict(module.step.encoder_stats))
        if trainer.global_rank == 0:
            (self.out_dir / "plans.json").write_text(json.dumps(self.plans))


def _micro_batches(batch: dict[str, Any]) -> list[dict[str, Any]]:
    return batch.get("micro_batches", [batch])


def run_against_hf(tmp_path: Path, checkpoint: Path, shards: str, layout: dict[str, Any], ranks: int, dp: int,
                   *, steps: int = 3, samples_per_step: int = 2, **module_kwargs: Any) -> None:
    """Train ``steps`` steps under ``layout`` and check losses and first-step gradients against the HF model
    trained on the same global batches (each step's samples wherever reordering put them)."""
    module = OmniModule(pretrained=str(checkpoint), learning_rate=LEARNING_RATE, **module_kwargs)
    data = OmniDataModule(shards, samples_per_step=samples_per_step, group_steps=2)
    fit(tmp_path, shards, Path("unused"), layout=layout, devices=ranks, max_steps=steps, module=module,
        datamodule=data, callbacks=[RecordRun(tmp_path, grads=True), RecordBatches(tmp_path),
                                    RecordEncoderPlans(tmp_path)])
    if int(layout.get("enc_sp", 1)) > 1:  # long items were split over the SP blocks
        plans = json.loads((tmp_path / "plans.json").read_text())
        assert sum(plan.get("items_split", 0) for plan in plans) > 0, plans
    losses = json.loads((tmp_path / "losses.json").read_text())
    per_rank = [torch.load(tmp_path / f"batches_rank{r}.pt", weights_only=False) for r in range(ranks)]
    hf = _hf_model(checkpoint).train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.0)
    readers = _data_parallel_representatives(layout, ranks, dp)
    expected = []
    for step in range(steps):
        # The global batch of each micro-batch index: that micro-batch of every data-parallel rank.
        micro = list(zip(*(_micro_batches(per_rank[rank][step]) for rank in readers), strict=True))
        loss, ce = hf_step_loss(hf, micro)
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            first = {name: p.grad.clone() for name, p in hf.named_parameters() if p.grad is not None}
        optimizer.step()
        expected.append(float(ce))
    got = torch.tensor([losses[str(s + 1)] for s in range(steps)])
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-4, atol=0)
    ours = merged_grads(tmp_path)
    stored = build_pretrained(checkpoint, module.config.roles).checkpoint_names
    assert set(first) <= {stored[name] for name in ours}, set(first) - {stored[name] for name in ours}
    for name, grad in ours.items():
        if stored[name] not in first:  # a tower no sample used (audio on images): its dummy pass adds nothing
            assert not grad.any(), name
            continue
        reference = first[stored[name]]
        torch.testing.assert_close(grad, reference, rtol=0, atol=1e-4 * float(reference.abs().max()) + 1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _data_parallel_representatives(layout: dict[str, Any], ranks: int, dp: int) -> list[int]:
    """One rank of each data-parallel group on the first pipeline stage (its pipeline, tensor- and
    context-parallel peers hold the same samples)."""
    pp = int(layout.get("pp", 1))
    per_stage = ranks // pp
    return list(range(0, per_stage, per_stage // dp))


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MATRIX))
def test_a_family_under_a_layout_is_one_process_running_the_hf_model(name: str, tmp_path: Path,
                                                                     checkpoints: dict[str, Path],
                                                                     mixed_shards: str) -> None:
    family, layout, ranks, dp = MATRIX[name]
    run_against_hf(tmp_path, checkpoints[family], mixed_shards, layout, ranks, dp, samples_per_step=4)
