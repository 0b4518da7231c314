"""Hugging Face multimodal checkpoints, whole: a tiny Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni thinker and LLaVA-OneVision
written with ``save_pretrained`` (model, tokenizer with its chat template, PIL image processor), loaded with
``OmniModule(pretrained=DIR)`` as a user's checkpoint is, compute exactly what the family's
``*ForConditionalGeneration`` computes.

Tolerances: logits within 1e-5 of the HF forward in fp32 (the same modules; only the attention runs per item
instead of over one padded sequence, and the packed batch sums in another order), the loss within 2e-2 relative in
bf16 (bf16 keeps 8 bits of mantissa: each of the 4 layers' matmuls and norms rounds to about 4e-3), distributed
losses within 1e-4 relative of one process (FSDP reduces the same gradients in another order).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import soundfile
import torch
import torch.nn.functional as F
from hf_processors import (
    save_tiny_llava_onevision,
    save_tiny_qwen3_vl_moe,
    save_tiny_qwen_omni_thinker,
    save_tiny_qwen_vl,
)
from hf_runs import (
    CAPTIONS,
    FAMILIES,
    LEARNING_RATE,
    hf_inputs,
    hf_loss_sum,
    hf_model,
    image_bytes,
    llava_tokens,
    run_against_hf,
    untied,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning_runs import RecordBatches, RecordRun, fit
from PIL import Image

from omni_lightning import OmniDataModule, OmniModule
from omni_lightning.batch import IGNORE_INDEX
from omni_lightning.data.jsonl import write_shard
from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.data.shards import expand_shards
from omni_lightning.data.streaming import open_shard
from omni_lightning.models.adapters.hf_qwen2_vl import mrope_positions
from omni_lightning.models.pretrained import SUPPORTED_FAMILIES, build_pretrained

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=list(FAMILIES))
def qwen2_vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint directory of each family (named for the first; every test runs on each). LLaVA-OneVision's ties
    its LM head to its embedding, as its real checkpoints do."""
    if request.param == "qwen2_5_omni_thinker":
        return save_tiny_qwen_omni_thinker(tmp_path_factory.mktemp(request.param))
    if request.param == "qwen3_vl_moe":
        return save_tiny_qwen3_vl_moe(tmp_path_factory.mktemp(request.param))
    if request.param == "llava_onevision":
        return save_tiny_llava_onevision(tmp_path_factory.mktemp(request.param))
    return save_tiny_qwen_vl(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def pair_shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Image-text pairs of several sizes, as collection tools write them: 2 shards of 12."""
    out = tmp_path_factory.mktemp("pairs")
    rng = np.random.default_rng(1)
    for shard in range(2):
        samples = []
        for i in range(12):
            h, w = (int(x) for x in rng.integers(20, 120, 2))
            samples.append({"__key__": f"pair{shard}{i:02d}", "png": image_bytes(h, w, shard * 12 + i),
                            "txt": CAPTIONS[(shard + i) % len(CAPTIONS)].encode()})
        write_shard(out / f"pairs-{shard:06d}.tar", samples)
    return str(out / "pairs-{000000..000001}.tar")


def _batch(data: OmniDataModule, raws: list[dict[str, Any]]) -> dict[str, Any]:
    reader = data.reader()
    return pack_samples([reader.decode(reader(raw)) for raw in raws], data.packing)


def _raw(pattern: str) -> list[dict[str, Any]]:
    return [raw for path in expand_shards(pattern) for raw in open_shard(path)]


def _loaded(qwen2_vl: Path, **kwargs: Any) -> tuple[OmniModule, OmniDataModule]:
    """The module and a data module reading with the checkpoint's processor, as Lightning's setup hands them."""
    module = OmniModule(pretrained=str(qwen2_vl), **kwargs)
    module.configure_model()
    data = OmniDataModule("unused", processor=str(qwen2_vl))
    data._adopt_model_packing(module)
    return module, data


def test_logits_equal_the_hf_forward_sample_by_sample_and_packed(qwen2_vl: Path, pair_shards: str) -> None:
    module, data = _loaded(qwen2_vl)
    hf = hf_model(qwen2_vl)
    batch = _batch(data, _raw(pair_shards)[:5])
    samples = hf_inputs(batch, hf.config)
    # The pixels are the processor's own (its PIL implementation on the same image bytes).
    processor = transformers.AutoImageProcessor.from_pretrained(str(qwen2_vl), backend="pil")
    first = processor(Image.open(io.BytesIO(_raw(pair_shards)[0]["png"])), return_tensors="pt")["pixel_values"]
    ours = samples[0]["pixel_values"]
    if hf.config.model_type == "llava_onevision":  # its tiles, as far as the tower's whole patches read them
        vision = hf.config.vision_config
        read = vision.image_size // vision.patch_size * vision.patch_size
        ours, first = ours[..., :read, :read], first[0, ..., :read, :read]
    torch.testing.assert_close(ours, first, rtol=0, atol=0)
    with torch.no_grad():
        packed = module.model(batch)
        alone = torch.cat([hf(**{k: v for k, v in s.items() if k != "labels"}).logits[0] for s in samples])
        torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
        ours = F.cross_entropy(packed, batch["labels"], ignore_index=IGNORE_INDEX)
        total, count = hf_loss_sum(hf, samples)
    torch.testing.assert_close(ours, total / count, rtol=1e-6, atol=0)


def test_video_items_and_their_temporal_positions_equal_the_hf_forward(qwen2_vl: Path) -> None:
    """Videos in temporal patches of 2 frames (the processor's video path needs torchvision, so the frames are
    packed here; the rows are laid out as Qwen2-VL's own). LLaVA-OneVision's frames are one tile each, pooled."""
    if "qwen3" in qwen2_vl.name:
        pytest.skip("Qwen3-VL lays a video out frame by frame between timestamps, which the data side does not write")
    module, data = _loaded(qwen2_vl)
    hf = hf_model(qwen2_vl)
    config, rng = hf.config, np.random.default_rng(0)
    tiled = data.packing.any_resolution is not None
    sizes = [(4, 42, 42), (3, 42, 42), (1, 42, 42)] if tiled else [(4, 56, 56), (3, 28, 84), (2, 56, 28)]
    samples = []
    for key, (frames, h, w) in enumerate(sizes):
        video = rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8)
        tokens = llava_tokens("video", (frames, 3, 3), config) if tiled else -(-frames // 2) * (h // 28) * (w // 28)
        wrappers = [] if tiled else [config.vision_start_token_id, config.vision_end_token_id]
        ids = np.concatenate([rng.integers(10, 200, 3), wrappers[:1], [config.video_token_id] * tokens, wrappers[1:],
                              rng.integers(10, 200, 4)]).astype(np.int64)
        targets = np.zeros(len(ids), dtype=bool)
        targets[-4:] = True
        samples.append(DecodedSample(f"video{key}", ids, media={"video": [video]}, targets=targets,
                                     media_order=[("video", 0)]))
    batch = pack_samples(samples, data.packing)
    inputs = hf_inputs(batch, config)
    if hasattr(module.model.llm, "video_fps"):  # Qwen2.5-VL, the thinker: positions count seconds of video
        module.model.llm.video_fps = 0.5
        key = "video_second_per_grid" if "omni" in config.model_type else "second_per_grid_ts"
        for one in inputs:
            one[key] = torch.tensor([2 / 0.5])
    with torch.no_grad():
        alone = torch.cat([hf(**{k: v for k, v in s.items() if k != "labels"}).logits[0] for s in inputs])
        torch.testing.assert_close(module.model(batch), alone, rtol=0, atol=1e-5)


@settings(max_examples=30, deadline=None, database=None, derandomize=True)
@given(layout=st.lists(st.tuples(st.sampled_from(["text", "image", "video"]), st.integers(1, 4), st.integers(1, 3),
                                 st.integers(1, 3)), min_size=1, max_size=5), samples=st.integers(1, 3))
def test_mrope_positions_equal_get_rope_index(layout: list[tuple[str, int, int, int]], samples: int) -> None:
    """Any run of text, images and videos (grids in merged tokens), split over packed samples."""
    config = transformers.Qwen2VLConfig(image_token_id=1, video_token_id=2, vision_start_token_id=3)
    with torch.device("meta"):
        model = transformers.Qwen2VLModel(config)
    ids, grids, cu, expected = [], [], [0], []
    for s in range(samples):
        sample, images, videos = [], [], []
        for kind, t, h, w in layout[s % len(layout):] + layout[: s % len(layout)]:
            if kind == "text":
                sample += [5] * (t + h)
                continue
            frames = 1 if kind == "image" else t
            sample += [3] + [1 if kind == "image" else 2] * (frames * h * w) + [5]
            grids += [[2 * h, 2 * w]] * frames
            (images if kind == "image" else videos).append([frames, 2 * h, 2 * w])
        sample = torch.tensor(sample)
        types = (sample == 1).long() + 2 * (sample == 2).long()
        position, _ = model.get_rope_index(sample[None], types[None], torch.tensor(images) if images else None,
                                           torch.tensor(videos) if videos else None)
        expected.append(position[:, 0])
        ids.append(sample)
        cu.append(cu[-1] + len(sample))
    got = mrope_positions(torch.cat(ids), torch.tensor(cu), torch.tensor(grids).reshape(-1, 2), image_id=1,
                          video_id=2, merge=2)
    torch.testing.assert_close(got, torch.cat(expected, dim=1))


def test_bf16_loss_is_the_hf_loss_within_bf16_rounding(qwen2_vl: Path, pair_shards: str) -> None:
    module, data = _loaded(qwen2_vl)
    module.model.to(torch.bfloat16)
    batch = _batch(data, _raw(pair_shards)[:4])
    hf = hf_model(qwen2_vl)
    with torch.no_grad():
        ours = F.cross_entropy(module.model(batch).float(), batch["labels"], ignore_index=IGNORE_INDEX)
        total, count = hf_loss_sum(hf, hf_inputs(batch, hf.config))
    assert not torch.equal(ours, total / count)  # bf16 took effect
    torch.testing.assert_close(ours, total / count, rtol=2e-2, atol=0)


def test_audio_is_heard_by_the_thinker_and_refused_by_families_that_hear_nothing(qwen2_vl: Path) -> None:
    """A dialogue with a clip and an image: the thinker's logits equal its HF forward (features from the clip's
    own decode, as Whisper's extractor computes them, and the tower's chunks of 2 * n_window frames: 2.3 s makes
    several); a family without an audio encoder refuses the sample by name (a counted skip in training), although
    its tokenizer has an audio token."""
    module, data = _loaded(qwen2_vl)
    out = io.BytesIO()
    wave = np.sin(np.linspace(0, 900, 36800)).astype(np.float32) * 0.3
    soundfile.write(out, wave, 16000, format="WAV")
    dialogue = {"messages": [{"role": "user", "content": "<image> <audio> What is it?"},
                             {"role": "assistant", "content": "A cat and a tone."}],
                "images": ["0.png"], "audios": ["0.wav"]}
    raw = {"__key__": "heard", "json": json.dumps(dialogue).encode(), "0.wav": out.getvalue(),
           "0.png": image_bytes(40, 70, 3)}
    hf = hf_model(qwen2_vl)
    if not hasattr(hf.config, "audio_token_id"):
        assert [m.name for m in data.packing.modalities] == ["image", "video"]
        with pytest.raises(ValueError, match=r"modality 'audio' \(0.wav\) has no encoder in this model"):
            data.reader()(raw)
        return
    batch = _batch(data, [raw])
    assert int(batch["audio_lengths"][0]) > 2 * 2 * hf.config.audio_config.n_window  # several chunks
    (inputs,) = hf_inputs(batch, hf.config)
    with torch.no_grad():
        torch.testing.assert_close(module.model(batch), hf(**{k: v for k, v in inputs.items() if k != "labels"}
                                                            ).logits[0], rtol=0, atol=1e-5)


def test_a_family_not_supported_is_refused_naming_the_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "blip-2"}))
    supported = re.escape(str(list(SUPPORTED_FAMILIES)))
    with pytest.raises(ValueError, match=rf"'blip-2' checkpoint; the supported families are {supported}"):
        OmniModule(pretrained=str(tmp_path))
    with pytest.raises(ValueError, match="has no config.json"):
        OmniModule(pretrained=str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="either model or pretrained"):
        OmniModule(object(), pretrained=str(tmp_path))  # type: ignore[arg-type]


# (layout, ranks, data-parallel ranks): each parallelism the HF families take, the encoder stage's resharding of
# whole items between the data-parallel ranks included.
# FSDP2 runs with encoder resharding (the same FSDP, items moved between its ranks), HSDP with TP.
LAYOUTS = {
    "tp": ({"tp": 2, "dp_shard": 1}, 2, 1),
    "fsdp-encoder-reshard": ({"dp_shard": 2, "encoder_reshard": True}, 2, 2),
    "hsdp-tp": ({"dp_replicate": 2, "dp_shard": 1, "tp": 2}, 4, 2),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_under_a_layout_is_one_process_running_the_hf_model(name: str, tmp_path: Path, qwen2_vl: Path,
                                                                     pair_shards: str) -> None:
    """The data module is given no processor: it reads with the checkpoint's. Three steps against the HF model
    itself trained on the same global batches (each step's samples, wherever reordering put them). Tensor
    parallelism takes a tied checkpoint (LLaVA-OneVision's) untied."""
    layout, ranks, dp = LAYOUTS[name]
    if layout.get("tp", 1) > 1:
        qwen2_vl = untied(qwen2_vl, tmp_path / "untied")
    run_against_hf(tmp_path, qwen2_vl, pair_shards, layout, ranks, dp)


@pytest.mark.distributed
def test_a_checkpoint_of_a_sharded_layout_exports_to_what_from_pretrained_reads(tmp_path: Path, qwen2_vl: Path,
                                                                               pair_shards: str) -> None:
    """FSDP on 2 ranks writes a sharded checkpoint; ``omni-lightning export-hf`` writes the family's format from it
    alone, and the family's own class loads it with the trained weights: its logits are the trained module's."""
    import lightning.pytorch as pl
    import torch.distributed.checkpoint as dcp

    from omni_lightning.cli import main
    from omni_lightning.data.processor import load_processor

    module = OmniModule(pretrained=str(qwen2_vl), learning_rate=LEARNING_RATE)
    fit(tmp_path, pair_shards, Path("unused"), layout={"dp_shard": 2}, devices=2, max_steps=2, module=module,
        datamodule=OmniDataModule(pair_shards, samples_per_step=2, group_steps=2),
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)])
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")
    main(["export-hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "exported")])
    exported = hf_model(tmp_path / "exported")
    assert load_processor(tmp_path / "exported").roles == load_processor(qwen2_vl).roles  # its processor travels

    trained, data = _loaded(qwen2_vl)
    state = {f"model.{k}": v for k, v in trained.model.state_dict().items()}
    dcp.load({"state_dict": state}, checkpoint_id=checkpoint)
    trained.model.load_state_dict({k[len("model."):]: v for k, v in state.items()})
    assert not torch.equal(trained.model.llm.output.weight, hf_model(qwen2_vl).lm_head.weight)  # it trained
    batch = _batch(data, _raw(pair_shards)[:4])
    with torch.no_grad():
        alone = torch.cat([exported(**{k: v for k, v in s.items() if k != "labels"}).logits[0]
                           for s in hf_inputs(batch, exported.config)])
        torch.testing.assert_close(trained.model(batch), alone, rtol=0, atol=1e-5)
    with pytest.raises(SystemExit):  # a checkpoint of the reference model has no family to export to
        main(["export-hf", "--checkpoint", str(tmp_path / "nothing.ckpt"), "--out", str(tmp_path / "x")])


@pytest.mark.distributed
def test_readme_hf_demo_fine_tunes_exports_and_loads(tmp_path: Path) -> None:
    """The README's chain for Hugging Face models: demo conversations, a tiny Qwen2.5-VL with the demo's tokenizer,
    2 steps on 2 processes (its audio clip skipped), export-hf, from_pretrained."""
    import os
    import subprocess
    import sys

    from distributed import free_port

    from omni_lightning.cli import main

    repo = Path(__file__).resolve().parents[1]
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(repo / "examples" / "make_demo_conversations.py"), str(data / "demo_chat"),
                    "--dialogues", "24"], check=True, capture_output=True)
    main(["make-shards", "--from-conversations", str(data / "demo_chat" / "dialogues.json"), "--media-root",
          str(data / "demo_chat" / "media"), "--out", str(data / "demo_chat" / "shards"), "--samples-per-shard", "12"])
    subprocess.run([sys.executable, str(repo / "examples" / "make_tiny_hf_vlm.py"), str(data / "tiny_qwen2_5_vl"),
                    "--tokenizer", str(data / "demo_chat" / "processor")], check=True, capture_output=True)
    os.environ["MASTER_PORT"] = str(free_port())
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the config's paths are relative to the repository root, as in the README
    try:
        main(["fit", "--config", str(repo / "examples" / "hf_vlm.yaml"), "--trainer.max_steps", "2",
              "--trainer.strategy.launcher", "fork", "--trainer.enable_progress_bar", "false",
              "--trainer.logger", "false", "--data.init_args.group_steps", "2"])
        main(["export-hf", "--checkpoint", "checkpoints/hf_vlm/last.ckpt", "--out", "data/tuned_qwen2_5_vl"])
    finally:
        os.chdir(cwd)
    tuned = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(data / "tuned_qwen2_5_vl"))
    original = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(data / "tiny_qwen2_5_vl"))
    assert torch.equal(tuned.model.visual.blocks[0].attn.qkv.weight, original.model.visual.blocks[0].attn.qkv.weight)
    assert not torch.equal(tuned.lm_head.weight, original.lm_head.weight)  # frozen tower, trained decoder


def test_the_loaded_model_prices_reordering_and_throughput(qwen2_vl: Path) -> None:
    """The cost model of a loaded family is its modules' own (the tower, merger and decoder sizes), which the data
    module's reordering and ThroughputMonitor take by default, not the reference model's of some config."""
    from omni_lightning.models.flops import reference_cost_model

    module = OmniModule(pretrained=str(qwen2_vl))
    view = module._model_view()
    cost = module.cost_model()
    # Everything that runs trains (layers kept only for export are idle, not frozen): the FLOPs are the modules' own.
    passes = view.training_passes()
    assert (passes["vision"], passes["llm"]) == (3.0, 3.0)
    assert (cost.vision, cost.llm) == (view.vision.cost(), view.llm.cost())
    if any(p.requires_grad for p in view.audio.parameters()):  # the thinker's own audio tower, not a stand-in
        assert passes["audio"] == 3.0 and cost.audio == view.audio.cost()
    assert cost.vision != reference_cost_model(module.config).vision
    data = OmniDataModule("unused")
    data.trainer = SimpleNamespace(lightning_module=module)  # type: ignore[assignment]
    assert data._model_cost_model().llm == cost.llm


# A checkpoint of one layout resumed under another of the same data-parallel size (4 ranks each): pp -> tp, cp -> pp
# (joint), tp -> HSDP x cp, pp x ep -> tp (experts re-sharded, tokens split over TP). LLaVA-OneVision loads and saves
# through the same code.
RESUMES = {
    "qwen2_vl": ({"pp": 2, "dp_shard": 2}, {"dp_shard": 2, "tp": 2}),
    "qwen2_5_vl": ({"dp_shard": 2, "cp": 2}, {"pp": 2, "dp_shard": 2}),
    "qwen2_5_omni_thinker": ({"dp_shard": 2, "tp": 2}, {"dp_replicate": 2, "cp": 2}),
    "qwen3_vl_moe": ({"pp": 2, "dp_shard": 2, "ep": 2}, {"dp_shard": 2, "tp": 2}),
}


@pytest.mark.distributed
def test_a_family_resumes_exactly_under_another_layout(tmp_path: Path, qwen2_vl: Path, pair_shards: str) -> None:
    """A checkpoint resumed under another layout (:data:`RESUMES`) starts from exactly the weights and AdamW moments
    it saved, and steps 4-6 lose what the uninterrupted run lost."""
    from lightning_runs import assert_resumes_under

    family = json.loads((qwen2_vl / "config.json").read_text())["model_type"]
    if family not in RESUMES:
        pytest.skip(f"{family} saves and loads through the code the resumes of {sorted(RESUMES)} test")
    saved, resumed = RESUMES[family]
    if not any(layout.get(name, 1) > 1 for layout in (saved, resumed) for name in ("pp", "tp")):
        checkpoint = qwen2_vl
    else:
        checkpoint = untied(qwen2_vl, tmp_path / "untied")
    # Reordering plans a pipeline's steps for its schedule, so a switch in or out of one trains the same samples
    # in other steps; each rank training what it read keeps the steps the same, which is what the check compares.
    reorder = "none" if saved.get("pp", 1) != resumed.get("pp", 1) else "grouped"
    assert_resumes_under(
        tmp_path, pair_shards, Path("unused"), saved=saved, resumed=resumed,
        module=lambda: OmniModule(pretrained=str(checkpoint), learning_rate=LEARNING_RATE),
        datamodule=lambda: OmniDataModule(pair_shards, samples_per_step=2, group_steps=2, reorder=reorder))


@pytest.mark.slow
def test_fresh_rank_processes_hold_their_shard_not_the_model(tmp_path: Path) -> None:
    """4 ranks started fresh by Lightning (not forked from a parent holding the model) load a 125 MiB checkpoint:
    rank 0 reads it once (through transformers) and sends every rank its quarter, so the other ranks' resident
    memory grows by far less than one copy of the model while it is built and loaded (by their quarter and one
    whole tensor at a time in transit)."""
    import os
    import subprocess
    import sys

    from distributed import free_port

    # Many layers and a small vocabulary: as in real models, no single tensor is a large part of the whole.
    checkpoint = save_tiny_qwen_vl(tmp_path / "large", hidden=512, layers=12, vocab_size=4096)
    for shard in range(4):  # one data shard per rank
        write_shard(tmp_path / f"pairs-{shard:06d}.tar", [
            {"__key__": f"p{shard}{i}", "png": image_bytes(28, 56, shard * 2 + i), "txt": CAPTIONS[i].encode()}
            for i in range(2)])
    model_bytes = 4 * sum(p.numel() for p in hf_model(checkpoint).parameters())
    assert model_bytes > 120 * 2**20
    env = {**os.environ, "MASTER_PORT": str(free_port()), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    shards = str(tmp_path / "pairs-{000000..000003}.tar")
    result = subprocess.run([sys.executable, str(Path(__file__).parent / "peak_rss_job.py"), str(checkpoint), shards,
                             str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rss_rank{r}.json").read_text()) for r in range(4)]
    assert len({rank["local_parameters"] for rank in ranks}) == 1  # each holds a quarter
    for rank, grown in enumerate((r["grew"] for r in ranks[1:]), start=1):
        assert grown < model_bytes / 2, f"rank {rank} grew {grown >> 20} MiB, the model is {model_bytes >> 20} MiB"


@pytest.mark.distributed
def test_a_whole_qwen2_5_omni_trains_and_exports_its_thinker(tmp_path: Path, pair_shards: str) -> None:
    """A whole Qwen2.5-Omni checkpoint (the thinker's weights under ``thinker.``): the thinker loads and computes as
    the HF thinker does, trains, and exports as a thinker checkpoint the thinker class loads."""
    import lightning.pytorch as pl

    from omni_lightning.cli import main

    whole = save_tiny_qwen_omni_thinker(tmp_path / "whole", whole=True)
    config = transformers.AutoConfig.from_pretrained(str(whole))
    hf = transformers.Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
        str(whole), config=config.thinker_config, key_mapping={r"^thinker\.": ""}).eval()
    module, data = _loaded(whole)
    batch = _batch(data, _raw(pair_shards)[:3])
    with torch.no_grad():
        alone = torch.cat([hf(**{k: v for k, v in s.items() if k != "labels"}).logits[0]
                           for s in hf_inputs(batch, hf.config)])
        torch.testing.assert_close(module.model(batch), alone, rtol=0, atol=1e-5)
    fit(tmp_path, pair_shards, Path("unused"), layout={"dp_shard": 2}, devices=2, max_steps=1,
        module=OmniModule(pretrained=str(whole), learning_rate=LEARNING_RATE),
        datamodule=OmniDataModule(pair_shards, samples_per_step=2, group_steps=1),
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1)])
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")
    main(["export-hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "thinker")])
    assert json.loads((tmp_path / "thinker" / "config.json").read_text())["model_type"] == "qwen2_5_omni_thinker"
    exported = transformers.Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(str(tmp_path / "thinker"))
    assert not torch.equal(exported.lm_head.weight, hf.lm_head.weight)  # trained


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen_vl(tmp_path_factory.mktemp("lora_qwen2_5_vl"), "qwen2_5_vl")


def _peft_reference(checkpoint: Path, module: OmniModule) -> Any:
    """The HF model with the same adapters (peft's own layers, our initial values) and the same frozen weights."""
    from peft import LoraConfig, inject_adapter_in_model

    from omni_lightning.models.lora import lora_initial_state

    hf = hf_model(checkpoint).train()
    inject_adapter_in_model(LoraConfig(**LORA), hf.model.language_model)
    hf.lm_head.requires_grad_(False)  # the decoder's head is the decoder's: frozen under LoRA, as ours
    initial = lora_initial_state(module._model_view(), module.hparams.init_seed)
    with torch.no_grad():
        for name, value in initial.items():
            hf.get_parameter("model.language_model." + name.removeprefix("llm.")).copy_(value)
    return hf


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["fsdp-encoder-reshard", "tp"])
def test_lora_trains_the_adapters_as_peft_does_under_fsdp_and_tp(name: str, tmp_path: Path, qwen2_5_vl: Path,
                                                                  pair_shards: str) -> None:
    """Column- and row-parallel projections with adapters (q, v, o and the MLP's down projection) on 2 ranks
    against the HF model with peft's adapters on one process: the same losses over 3 steps, the decoder's own
    weights unchanged."""
    layout, ranks, dp = LAYOUTS[name]
    make = lambda: OmniModule(pretrained=str(qwen2_5_vl), lora=LORA, learning_rate=LEARNING_RATE)  # noqa: E731
    fit(tmp_path, pair_shards, Path("unused"), layout=layout, devices=ranks, max_steps=3, module=make(),
        datamodule=OmniDataModule(pair_shards, samples_per_step=2, group_steps=2),
        callbacks=[RecordRun(tmp_path), RecordBatches(tmp_path)])
    losses = json.loads((tmp_path / "losses.json").read_text())
    per_rank = [torch.load(tmp_path / f"batches_rank{r}.pt", weights_only=False) for r in range(ranks)]
    hf = _peft_reference(qwen2_5_vl, make())
    optimizer = torch.optim.AdamW([p for p in hf.parameters() if p.requires_grad], lr=LEARNING_RATE,
                                  betas=(0.9, 0.95), weight_decay=0.0)
    expected = []
    for step in range(3):
        total, count = torch.zeros(()), 0
        for batch in [per_rank[r][step] for r in range(0, ranks, ranks // dp)]:
            part, n = hf_loss_sum(hf, hf_inputs(batch, hf.config))
            total, count = total + part, count + n
        optimizer.zero_grad()
        (total / count).backward()
        optimizer.step()
        expected.append(float(total / count))
    torch.testing.assert_close(torch.tensor([losses[s] for s in "123"]), torch.tensor(expected), rtol=1e-4, atol=0)


@pytest.mark.distributed
def test_lora_resumes_exactly_under_another_layout(tmp_path: Path, qwen2_5_vl: Path, pair_shards: str) -> None:
    """Adapters trained sharded over 2 FSDP ranks x 2 TP ranks (their B matrices split with their projections),
    resumed from step 3 replicated over 2 ranks x 2 TP ranks: their weights and AdamW moments come back, so steps
    4-6 lose what the uninterrupted run lost."""
    from lightning_runs import assert_resumes_under

    assert_resumes_under(
        tmp_path, pair_shards, Path("unused"), saved={"dp_shard": 2, "tp": 2}, resumed={"dp_replicate": 2, "tp": 2},
        module=lambda: OmniModule(pretrained=str(qwen2_5_vl), lora=LORA, learning_rate=LEARNING_RATE),
        datamodule=lambda: OmniDataModule(pair_shards, samples_per_step=2, group_steps=2))


@pytest.mark.distributed
def test_lora_exports_merged_or_as_a_peft_adapter(tmp_path: Path, qwen2_5_vl: Path, pair_shards: str) -> None:
    """Adapters trained on a frozen tower: --merge-lora writes the family's format with them folded in, and
    --adapter-only a peft adapter that PeftModel puts on the original checkpoint; both give the trained module's
    logits. Without a choice, and --adapter-only where other parts trained, export refuses."""
    import lightning.pytorch as pl
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel

    from omni_lightning.cli import main

    def make(**kwargs: Any) -> OmniModule:
        return OmniModule(pretrained=str(qwen2_5_vl), lora=LORA, learning_rate=LEARNING_RATE, **kwargs)

    runs = {}
    for run, freeze in (("frozen", ("vision", "projector")), ("towers", ())):
        fit(tmp_path / run, pair_shards, Path("unused"), layout={"dp_shard": 2}, devices=2, max_steps=2,
            module=make(freeze=freeze), datamodule=OmniDataModule(pair_shards, samples_per_step=2, group_steps=2),
            callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / run / "ckpt", every_n_train_steps=2)])
        (runs[run],) = (tmp_path / run / "ckpt").glob("*.ckpt")
    checkpoint = runs["frozen"]
    main(["export-hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "merged"), "--merge-lora"])
    main(["export-hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "adapter"), "--adapter-only"])
    for argv in (["--out", str(tmp_path / "x")], ["--out", str(tmp_path / "y"), "--adapter-only"]):
        with pytest.raises(SystemExit):
            main(["export-hf", "--checkpoint", str(runs["towers"] if "--adapter-only" in argv else checkpoint),
                  *argv])

    trained, data = _loaded(qwen2_5_vl, lora=LORA)
    state = {f"model.{k}": v for k, v in trained.model.state_dict().items()}
    dcp.load({"state_dict": state}, checkpoint_id=checkpoint)
    trained.model.load_state_dict({k[len("model."):]: v for k, v in state.items()})
    assert trained.model.llm.layers["0"].self_attn.q_proj.lora_B.default.weight.abs().sum() > 0  # it trained
    batch = _batch(data, _raw(pair_shards)[:3])
    merged = hf_model(tmp_path / "merged")
    adapted = PeftModel.from_pretrained(hf_model(qwen2_5_vl), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        expected = trained.model(batch)
        for exported in (merged, adapted):
            alone = torch.cat([exported(**{k: v for k, v in s.items() if k != "labels"}).logits[0]
                               for s in hf_inputs(batch, merged.config)])
            torch.testing.assert_close(expected, alone, rtol=0, atol=1e-5)


def test_a_family_fits_every_parallelism_it_has(qwen2_vl: Path) -> None:
    """Pipeline, context and encoder sequence parallelism fit every family (``test_hf_parallel.py`` trains them);
    expert parallelism needs experts, which the dense families lack: a clear error before any process starts."""
    from omni_lightning.models.parallelize import check_model_fits_layout
    from omni_lightning.parallel import ParallelDims

    model = OmniModule(pretrained=str(qwen2_vl))._model_view()
    tied = bool(getattr(model.llm, "tied", False))
    for layout in ({"cp": 2}, {"enc_sp": 2}, *(() if tied else ({"pp": 2}, {"tp": 2}))):
        check_model_fits_layout(model, ParallelDims(world_size=4, dp_shard=-1, **layout), reshard=True)
    if tied:  # tensor and pipeline parallelism would untie the head from the embedding
        for layout in ({"pp": 2}, {"tp": 2}):
            with pytest.raises(ValueError, match="build the model with tie_word_embeddings=False"):
                check_model_fits_layout(model, ParallelDims(world_size=4, dp_shard=-1, **layout))
    if getattr(model.llm, "n_experts", 0):
        check_model_fits_layout(model, ParallelDims(world_size=4, dp_shard=-1, ep=2))
        return
    with pytest.raises(ValueError, match=r"ep=2 shards MoE experts but the LLM has no MoE layers \(.* is dense\)"):
        check_model_fits_layout(model, ParallelDims(world_size=4, dp_shard=-1, ep=2))


def test_a_checkpoint_stored_in_bf16_trains_fp32_master_weights(qwen2_vl: Path, tmp_path: Path) -> None:
    """Released checkpoints are stored in bf16; the optimizer must still update fp32 weights (bf16 compute is
    ``param_dtype``'s business). They start at exactly the stored values."""
    import shutil

    stored = tmp_path / "bf16"
    hf_model(qwen2_vl, dtype=torch.bfloat16).save_pretrained(stored)
    for file in qwen2_vl.iterdir():
        if not (stored / file.name).exists():
            shutil.copy(file, stored / file.name)
    module, _ = _loaded(stored)
    weights = dict(module.model.named_parameters())
    assert {w.dtype for w in weights.values()} == {torch.float32}
    reference = hf_model(stored)  # the family's own loading, upcast to fp32
    for name, hf_name in build_pretrained(stored).checkpoint_names.items():
        if hf_name is not None and name in weights:
            assert torch.equal(weights[name], reference.get_parameter(hf_name)), name


def test_a_pretrained_modules_hyper_parameters_rebuild_it(qwen2_vl: Path) -> None:
    """What a checkpoint records (Lightning rebuilds the module from it, e.g. load_from_checkpoint) names the
    checkpoint directory and the adapters, not a config that would contradict them."""
    from omni_lightning.data.processor import load_processor

    module = OmniModule(pretrained=str(qwen2_vl), lora=LORA)
    module._trainer = SimpleNamespace(datamodule=OmniDataModule("unused", processor=str(qwen2_vl)),
                                      strategy=SimpleNamespace())  # type: ignore[assignment]
    module.setup("fit")
    assert module.config.roles == load_processor(qwen2_vl).roles
    rebuilt = OmniModule(**module.hparams)
    assert (rebuilt.pretrained, rebuilt.lora, rebuilt.config) == (module.pretrained, module.lora, module.config)


def _dialogue(key: str, images: list[bytes], question: str, answer: str) -> dict[str, Any]:
    """A conversation sample with its images as members ``0.png``, ``1.png``..."""
    names = [f"{i}.png" for i in range(len(images))]
    record = {"messages": [{"role": "user", "content": "<image>" * len(images) + question},
                           {"role": "assistant", "content": answer}], "images": names}
    return {"__key__": key, "json": json.dumps(record).encode(), **dict(zip(names, images, strict=True))}


TWO_IMAGES = [_dialogue("two", [image_bytes(50, 90, 7), image_bytes(100, 30, 8)], " Compare the left and right.",
                        "The left one is red, the right one is blue."),
              _dialogue("one", [image_bytes(61, 47, 9)], " Describe the picture please.", "A cat sits on a mat.")]


def test_two_images_in_one_sample_equal_the_hf_forward(qwen2_vl: Path) -> None:
    """A dialogue with two images packed beside one with a single image: the logits are the HF model's on each
    (LLaVA-OneVision encodes each of two images as one padded square tile with one newline, a lone one in tiles)."""
    module, data = _loaded(qwen2_vl)
    hf = hf_model(qwen2_vl)
    batch = _batch(data, TWO_IMAGES)
    if data.packing.any_resolution is not None:
        assert [shape[0] for _, shape in batch["vision_media"]] == [1, 1, 5]
    with torch.no_grad():
        alone = torch.cat([hf(**{k: v for k, v in s.items() if k != "labels"}).logits[0]
                           for s in hf_inputs(batch, hf.config)])
        torch.testing.assert_close(module.model(batch), alone, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def llava_onevision(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llava_onevision(tmp_path_factory.mktemp("llava_onevision"))


def _llava_processor(checkpoint: Path) -> Any:
    """LlavaOnevisionProcessor with the checkpoint's image processor and settings, built without its video
    processor (which needs torchvision): its own placeholder counting, on its own image processor's outputs."""
    settings = json.loads((checkpoint / "processor_config.json").read_text())
    processor = object.__new__(transformers.LlavaOnevisionProcessor)
    processor.image_processor = transformers.AutoImageProcessor.from_pretrained(str(checkpoint), backend="pil")
    processor.num_image_tokens = settings["num_image_tokens"]
    processor.vision_feature_select_strategy = settings["vision_feature_select_strategy"]
    processor.vision_aspect_ratio = settings["vision_aspect_ratio"]
    processor.image_token, processor.video_token = "I", "V"
    return processor


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(height=st.integers(1, 3000), width=st.integers(1, 3000), bound=st.sampled_from([1, 4, 9]))
def test_any_resolution_counts_are_llava_onevisions_own(height: int, width: int, bound: int) -> None:
    """The placeholders counted from an image's size alone are LlavaOnevisionProcessor's, on the real model's
    layout (384-pixel tiles of 27x27 patches, its 36 canvases) for any image size and anyres bound."""
    from omni_lightning.batch import AnyResolution
    from omni_lightning.modalities import ANY_RESOLUTION_IMAGE, best_canvas, packing_spec

    pinpoints = [(h, w) for h in range(384, 2305, 384) for w in range(384, 2305, 384)]
    spec = packing_spec(vision_merge=1, any_resolution=AnyResolution(384, tuple(pinpoints), bound))
    processor = object.__new__(transformers.LlavaOnevisionProcessor)
    processor.image_processor = SimpleNamespace(image_grid_pinpoints=[list(p) for p in pinpoints])
    processor.num_image_tokens, processor.vision_aspect_ratio = 729, f"anyres_max_{bound}"
    canvas_h, canvas_w = best_canvas(height, width, pinpoints)
    tiles = 1 + canvas_h // 384 * (canvas_w // 384)
    ours = spec.media_placeholders(ANY_RESOLUTION_IMAGE, (tiles, 27, 27, height, width))
    assert ours == processor._get_number_of_features(height, width, 384, 384)
    assert spec.media_placeholders(ANY_RESOLUTION_IMAGE, (1, 27, 27, height, width)) == 729 + 1  # sharing a sample


def test_llava_onevision_placeholders_are_its_processors(llava_onevision: Path, pair_shards: str) -> None:
    """Each image's placeholders, read from its header before any pixel is decoded, are what LlavaOnevisionProcessor
    writes for it (alone: tiled; beside another: one tile), and a video's are its frames pooled plus one."""
    _, data = _loaded(llava_onevision)
    reader, processor = data.reader(), _llava_processor(llava_onevision)
    placeholder = data.packing.roles.placeholder("image")
    for raw in _raw(pair_shards)[:8] + TWO_IMAGES:
        sample = reader(raw)
        names = [m for m in raw if m.endswith(("png", ".png"))]
        images = [Image.open(io.BytesIO(raw[m])) for m in names]
        inputs = processor.image_processor(images=[images])
        expected = sum(len(processor.replace_image_token(inputs, i)) for i in range(len(images)))
        assert int((sample.tokens == placeholder).sum()) == expected, raw["__key__"]
    frames = np.zeros((5, 42, 42, 3), dtype=np.uint8)
    video = data.packing.modality("video")
    assert data.packing.media_placeholders(video, video.shape(frames, data.packing)) == len(
        processor.replace_video_token({"pixel_values_videos": [frames]}, 0))


def test_llava_onevision_micro_batches_cut_at_whole_media(llava_onevision: Path, pair_shards: str) -> None:
    """A packed batch cut into micro-batches (as a pipeline step does) gives each its samples' tiles and media list:
    the logits of the pieces are the whole batch's."""
    from omni_lightning.runtime.items import split_micro_batches

    module, data = _loaded(llava_onevision)
    batch = _batch(data, TWO_IMAGES + _raw(pair_shards)[:3])
    pieces = split_micro_batches(batch, 3, data.packing)
    assert sum(len(p["vision_media"]) for p in pieces) == len(batch["vision_media"])
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([module.model(p) for p in pieces]), module.model(batch), rtol=0,
                                   atol=1e-5)


def test_llava_onevision_refuses_what_it_cannot_lay_out(tmp_path: Path, llava_onevision: Path) -> None:
    """A select strategy that drops a patch, a processor tiling otherwise than the model, an image not in tiles, an
    image with another count of tiles than its size gives, a data module merging patches: each a ValueError naming
    it. The newline embedding trains (and freezes) with the projector."""
    import shutil

    from omni_lightning.batch import SizedMedia
    from omni_lightning.runtime.optim import part_of

    dropping = tmp_path / "default"
    shutil.copytree(llava_onevision, dropping)
    config = json.loads((dropping / "config.json").read_text())
    (dropping / "config.json").write_text(json.dumps({**config, "vision_feature_select_strategy": "default"}))
    with pytest.raises(ValueError, match="vision_feature_select_strategy='default' drops the first patch"):
        OmniModule(pretrained=str(dropping))

    module, data = _loaded(llava_onevision)
    other = tmp_path / "other"
    shutil.copytree(llava_onevision, other)
    settings = json.loads((other / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").write_text(json.dumps({**settings, "image_grid_pinpoints": [[44, 44]]}))
    misread = OmniDataModule("unused", processor=str(other))
    misread._adopt_model_packing(module)
    with pytest.raises(ValueError, match=r"canvases \[\[44, 44\]\]: read the data with the checkpoint's own"):
        misread.reader()
    with pytest.raises(ValueError, match="OmniDataModule\\(vision_merge=4\\) but the model expects vision_merge=1"):
        OmniDataModule("unused", vision_merge=4)._adopt_model_packing(module)

    image = data.packing.modality("image")
    with pytest.raises(ValueError, match=r"any-resolution image must be its tiles .* with its own \(height, width\)"):
        image.shape(np.zeros((42, 42, 3), dtype=np.uint8), data.packing)
    with pytest.raises(ValueError, match="a 50x90 image has 3 tiles, but the model's image_grid_pinpoints give it 1"):
        image.shape(SizedMedia(np.zeros((3, 42, 42, 3), dtype=np.uint8), (50, 90)), data.packing)
    assert part_of("assembly.vision.image_newline", module.model.encoder_names) == "projector"
