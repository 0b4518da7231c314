"""The Hugging Face families' own forward as the reference runs are checked against: tiny checkpoints' inputs as
each family's processor would give them, the family's loss of a step (its load-balancing loss included), and a
fork-launched run under a layout compared with one process training the family's ``*ForConditionalGeneration`` on
the same global batches."""

from __future__ import annotations

import importlib
import io
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
import transformers
from lightning_runs import RecordBatches, RecordRun, fit, merged_grads
from PIL import Image

from omni_lightning import OmniDataModule, OmniModule
from omni_lightning.balance.cost import ModuleCost
from omni_lightning.batch import IGNORE_INDEX
from omni_lightning.models.pretrained import build_pretrained

CAPTIONS = ["A cat sits on a mat.", "The left one is red, the right one is blue.", "Describe the picture please.",
            "What happens? A cat jumps.", "这只猫可爱吗？是的，非常可爱！"]
LEARNING_RATE = 1e-3


FAMILIES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
            "qwen2_5_omni_thinker": "Qwen2_5OmniThinkerForConditionalGeneration",
            "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
            "llava_onevision": "LlavaOnevisionForConditionalGeneration"}


def image_bytes(height: int, width: int, seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    family = json.loads((path / "config.json").read_text())["model_type"]
    return getattr(transformers, FAMILIES[family]).from_pretrained(str(path), dtype=dtype).eval()


def untied(checkpoint: Path, out: Path) -> Path:
    """``checkpoint`` with its LM head a copy of its tied embedding (what tensor parallelism needs), else itself."""
    import shutil

    hf = hf_model(checkpoint)
    if not hf.config.tie_word_embeddings:
        return checkpoint
    config = hf.config
    config.tie_word_embeddings = config.get_text_config().tie_word_embeddings = False
    untied = type(hf)(config)
    untied.load_state_dict({**hf.state_dict(), "lm_head.weight": hf.lm_head.weight.detach().clone()})
    untied.save_pretrained(out)
    for file in checkpoint.iterdir():
        if not (out / file.name).exists():
            shutil.copy(file, out / file.name)
    return out


def _llava_tiles(rows: torch.Tensor, count: int, config: Any) -> torch.Tensor:
    """``count`` tiles ``[count, 3, tile, tile]`` of LLaVA-OneVision from their packed patch rows, the pixels the
    tower's convolution never reads (past its whole patches) zero."""
    vision = config.vision_config
    side, patch, tile = vision.image_size // vision.patch_size, vision.patch_size, vision.image_size
    pixels = rows.reshape(count, side, side, 3, patch, patch).permute(0, 3, 1, 4, 2, 5).reshape(
        count, 3, side * patch, side * patch)
    return F.pad(pixels, (0, tile - side * patch, 0, tile - side * patch))


def llava_tokens(modality: str, shape: tuple[int, ...], config: Any) -> int:
    """The features the model itself lays out for a media item (its own ``pack_image_features``)."""
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    if modality == "video":
        return shape[0] * (-(-side // 2)) ** 2 + 1
    (features,), _ = LlavaOnevisionModel.pack_image_features(
        SimpleNamespace(config=config), [torch.zeros(shape[0], side * side, 1)], [shape[3:5]],
        image_newline=torch.zeros(1), vision_aspect_ratio=config.vision_aspect_ratio)
    return features.shape[0]


def _llava_inputs(batch: dict[str, Any], config: Any) -> list[dict[str, torch.Tensor]]:
    """Each packed sample as LLaVA-OneVision takes it: its ids, its images' tiles with their sizes and how many
    images it has (the model lays out one that shares its sample otherwise), its videos' frames."""
    per_item = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
    media, row, samples = list(batch["vision_media"]), 0, []
    for start, end in itertools.pairwise(batch["cu_seqlens"].tolist()):
        ids = batch["input_ids"][start:end]
        inputs: dict[str, Any] = {"input_ids": ids[None], "labels": batch["labels"][start:end],
                                  "attention_mask": torch.ones_like(ids)[None]}
        left = {"image": int((ids == config.image_token_id).sum()), "video": int((ids == config.video_token_id).sum())}
        pixels: dict[str, list[torch.Tensor]] = {"image": [], "video": []}
        sizes = []
        while any(left.values()):
            modality, shape = media.pop(0)
            pixels[modality].append(_llava_tiles(batch["vision_patches"][row : row + shape[0] * per_item], shape[0],
                                                 config))
            row += shape[0] * per_item
            sizes += [list(shape[3:5])] if modality == "image" else []
            left[modality] -= llava_tokens(modality, shape, config)
        if pixels["image"]:
            inputs |= {"pixel_values": torch.cat(pixels["image"]), "image_sizes": torch.tensor(sizes),
                       "batch_num_images": torch.tensor([len(sizes)])}
        if pixels["video"]:
            inputs["pixel_values_videos"] = torch.stack(pixels["video"])
        samples.append(inputs)
    return samples


def hf_inputs(batch: dict[str, Any], config: Any) -> list[dict[str, torch.Tensor]]:
    """Each packed sample as the HF model takes it: its ids, its token types, and its items' pixel rows and
    ``(t, h, w)`` grids (an image one item, a video as many temporal patches as its placeholders cover), and for
    the thinker its clips' features with their masks (LLaVA-OneVision's: :func:`_llava_inputs`)."""
    if config.model_type == "llava_onevision":
        return _llava_inputs(batch, config)
    image_id, video_id = config.image_token_id, config.video_token_id
    grids, rows = batch["vision_grids"].tolist(), batch["vision_patches"]
    cu, item, row, clip, frame = batch["cu_seqlens"].tolist(), 0, 0, 0, 0
    samples = []
    for start, end in itertools.pairwise(cu):
        ids = batch["input_ids"][start:end]
        inputs: dict[str, Any] = {"input_ids": ids[None], "mm_token_type_ids": (
            (ids == image_id).long() + 2 * (ids == video_id).long())[None], "labels": batch["labels"][start:end],
            "attention_mask": torch.ones_like(ids)[None]}  # the thinker computes its positions only with a mask
        for kind, token in (("image", image_id), ("video", video_id)):
            left, grid_thw, pixels = int((ids == token).sum()), [], []
            while left > 0:
                h, w = grids[item]
                frames = 1 if kind == "image" else left // (h * w // 4)
                pixels.append(rows[row : row + frames * h * w])
                grid_thw.append([frames, h, w])
                left, item, row = left - frames * h * w // 4, item + frames, row + frames * h * w
            if grid_thw:
                suffix = "" if kind == "image" else "_videos"
                inputs[f"pixel_values{suffix}"] = torch.cat(pixels)
                inputs[f"{kind}_grid_thw"] = torch.tensor(grid_thw)
        clips = int((ids == getattr(config, "audio_token_id", -1)).sum())
        if clips:  # the thinker's audio: one padded row of features per clip, with its mask
            lengths, mels = batch["audio_lengths"].tolist(), []
            while clips > 0:
                frames = lengths[clip]
                mels.append(batch["audio_mels"][frame : frame + frames])
                clips, clip, frame = clips - frames // 4, clip + 1, frame + frames
            longest = max(m.shape[0] for m in mels)
            inputs["input_features"] = torch.stack([F.pad(m, (0, 0, 0, longest - m.shape[0])).t() for m in mels])
            inputs["feature_attention_mask"] = torch.stack(
                [torch.arange(longest) < m.shape[0] for m in mels]).long()
        samples.append(inputs)
    return samples


def hf_loss_sum(hf: Any, samples: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, int]:
    total, count = torch.zeros(()), 0
    for inputs in samples:
        labels = inputs["labels"]
        logits = hf(**{k: v for k, v in inputs.items() if k != "labels"}).logits[0]
        total = total + F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        count += int((labels != IGNORE_INDEX).sum())
    return total, count


def hf_step_loss(hf: Any, micro: list[tuple[dict[str, Any], ...]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF model's loss of one step: its token losses over every loss token of the step, plus, for a family that
    trains its load-balancing loss, ``router_aux_loss_coef`` times the family's own ``load_balancing_loss_func``
    over each micro-batch's global batch (its samples' router logits, layer by layer), averaged over the
    micro-batches. Returns it and the mean token loss alone (what the runs log)."""
    text = getattr(hf.config, "text_config", hf.config)
    routed = bool(getattr(text, "output_router_logits", False))
    total, count, aux = torch.zeros(()), 0, []
    for batches in micro:
        logits_by_layer: list[list[torch.Tensor]] = []
        for batch in batches:
            for inputs in hf_inputs(batch, hf.config):
                labels = inputs.pop("labels")
                out = hf(**inputs, output_router_logits=True) if routed else hf(**inputs)
                total = total + F.cross_entropy(out.logits[0].float(), labels, ignore_index=IGNORE_INDEX,
                                                reduction="sum")
                count += int((labels != IGNORE_INDEX).sum())
                if routed:
                    logits_by_layer.append(list(out.router_logits))
        if routed and logits_by_layer:
            balancing = importlib.import_module(type(hf).__module__).load_balancing_loss_func
            layers = tuple(torch.cat(per_layer) for per_layer in zip(*logits_by_layer, strict=True))
            aux.append(balancing(layers, text.num_experts, text.num_experts_per_tok))
    ce = total / count
    return (ce + text.router_aux_loss_coef * torch.stack(aux).mean() if aux else ce), ce


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
    if int(layout.get("enc_sp", 1)) > 1:
        # Priced with the LLM free, the resharder evens out the encoder work alone and splits these tiny models'
        # long items, whose parity with the HF model is what the SP layouts check (on the LLM's work as a base, the
        # plan would keep them whole).
        layout = {"cost_model": module.cost_model().replace(llm=ModuleCost(0.0, 0.0)), **layout}
    fit(tmp_path, shards, Path("unused"), layout=layout, devices=ranks, max_steps=steps, module=module,
        datamodule=data, callbacks=[RecordRun(tmp_path, grads=True), RecordBatches(tmp_path),
                                    RecordEncoderPlans(tmp_path)])
    if int(layout.get("enc_sp", 1)) > 1:  # long items were split over the SP blocks
        plans = json.loads((tmp_path / "plans.json").read_text())
        assert sum(plan.get("items_split", 0) for plan in plans) > 0, plans
    losses = json.loads((tmp_path / "losses.json").read_text())
    per_rank = [torch.load(tmp_path / f"batches_rank{r}.pt", weights_only=False) for r in range(ranks)]
    hf = hf_model(checkpoint).train()
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
    # The first step's gradients, parameter by parameter under the family's own names: 1e-4 of the largest entry
    # of each, as the layouts sum the same terms in other orders; gradients that are zero but for rounding (a key
    # projection's bias: softmax ignores a shift of all of a query's scores) within 1e-7 of the largest of all.
    ours = merged_grads(tmp_path)
    noise = 1e-7 * max(float(g.abs().max()) for g in first.values())
    stored = build_pretrained(checkpoint, module.config.roles).checkpoint_names
    assert set(first) <= {stored[name] for name in ours}, set(first) - {stored[name] for name in ours}
    for name, grad in ours.items():
        if stored[name] not in first:  # a tower no sample used (audio on images): its dummy pass adds nothing
            assert not grad.any(), name
            continue
        reference = first[stored[name]]
        torch.testing.assert_close(grad, reference, rtol=0, atol=1e-4 * float(reference.abs().max()) + noise,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _data_parallel_representatives(layout: dict[str, Any], ranks: int, dp: int) -> list[int]:
    """One rank of each data-parallel group on the first pipeline stage (its pipeline, tensor- and
    context-parallel peers hold the same samples)."""
    pp = int(layout.get("pp", 1))
    per_stage = ranks // pp
    return list(range(0, per_stage, per_stage // dp))
