"""Real data in: a Hugging Face processor directory, image-text pairs as collection tools write them, and
conversations (LLaVA, ShareGPT, typed parts) converted from a JSON file and a media folder, trained on 2 ranks.

What is shown: the images reach the vision encoder (placeholders and encoder items counted against the media
written), the targets are exactly the assistant tokens the tokenizer's own chat template marks, the model takes
its vocabulary and token roles from the processor, ``data/*`` counts what went in, bad members are counted skips,
and a resume is exact on these layouts.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import free_port, run_distributed
from hf_processors import chatml, save_processor, save_tokenizer, train_bpe
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning_runs import LEARNING_RATE, assert_resumes_under, fit
from PIL import Image
from torchdata.stateful_dataloader import StatefulDataLoader

from omni_lightning import OmniDataModule, OmniModule, ReferenceMLLMConfig, WebDataModule
from omni_lightning.batch import IGNORE_INDEX, PendingMedia, TokenRoles
from omni_lightning.cli import main, make_shards_main
from omni_lightning.data.conversation_shards import conversations_to_shards
from omni_lightning.data.conversations import parse_dialogue
from omni_lightning.data.jsonl import write_shard
from omni_lightning.data.layouts import LayoutNeedsProcessor, detect_layout
from omni_lightning.data.media import VideoPolicy
from omni_lightning.data.packing import pack_samples
from omni_lightning.data.processor import load_processor
from omni_lightning.data.reorder_stream import ReorderedStream, ReorderSettings
from omni_lightning.data.shards import expand_shards
from omni_lightning.data.streaming import SampleStream, open_shard
from omni_lightning.models.flops import reference_cost_model

REPO = Path(__file__).resolve().parents[1]
CAPTIONS = ["A cat sits on a mat.", "The left one is red, the right one is blue.", "What happens? A cat jumps.",
            "这只猫可爱吗？是的，非常可爱！", "Describe the picture please."]


def _image(height: int, width: int, seed: int, fmt: str = "JPEG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_processor(tmp_path_factory.mktemp("processor"))


@pytest.fixture(scope="module")
def pair_shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Two shards of ``KEY.jpg`` + ``KEY.txt`` + ``KEY.json``, as image-text collection tools write them."""
    out = tmp_path_factory.mktemp("pairs")
    rng = np.random.default_rng(0)
    for shard in range(2):
        samples = []
        for i in range(8):
            h, w = (int(x) for x in rng.integers(20, 90, 2))
            caption = CAPTIONS[(shard * 8 + i) % len(CAPTIONS)]
            samples.append({"__key__": f"pair{shard}{i:02d}", "jpg": _image(h, w, shard * 8 + i),
                            "txt": caption.encode(), "json": json.dumps({"width": w, "height": h}).encode()})
        write_shard(out / f"pairs-{shard:06d}.tar", samples)
    return str(out / "pairs-{000000..000001}.tar")


def _conversations(media: Path) -> list[dict[str, Any]]:
    """Dialogues in the three forms, one and two images, multi-turn; the media files they name."""
    records = []
    for i in range(16):
        first, second = f"img{i}a.jpg", f"img{i}b.png"
        (media / first).write_bytes(_image(28 + 7 * (i % 5), 56 - 7 * (i % 3), i))
        (media / second).write_bytes(_image(40, 30 + 9 * (i % 4), 100 + i, "PNG"))
        answer = CAPTIONS[i % len(CAPTIONS)]
        if i % 3 == 0:  # LLaVA
            records.append({"id": f"llava{i}", "image": first, "conversations": [
                {"from": "human", "value": "<image>\nDescribe the picture please."}, {"from": "gpt", "value": answer},
                {"from": "human", "value": "And again?"}, {"from": "gpt", "value": "Yes."}]})
        elif i % 3 == 1:  # LLaMA-Factory ShareGPT, two images
            records.append({"id": f"sharegpt{i}", "images": [first, second], "messages": [
                {"role": "user", "content": "Compare <image> and <image>, left and right."},
                {"role": "assistant", "content": answer}]})
        else:  # typed content parts
            records.append({"id": f"typed{i}", "messages": [
                {"role": "system", "content": "You describe media."},
                {"role": "user", "content": [{"type": "image", "image": first}, {"type": "text", "text": "What?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]}]})
    return records


@pytest.fixture(scope="module")
def conversation_shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Converted with the project's own command from a JSON file and its media folder."""
    root = tmp_path_factory.mktemp("conversations")
    media = root / "media"
    media.mkdir()
    (root / "dialogues.json").write_text(json.dumps(_conversations(media)))
    make_shards_main(["--from-conversations", str(root / "dialogues.json"), "--media-root", str(media),
                      "--out", str(root / "shards"), "--samples-per-shard", "8", "--prefix", "chat"])
    return str(root / "shards" / "chat-{000000..000001}.tar")


def _raw_samples(pattern: str) -> list[dict[str, Any]]:
    return [raw for path in expand_shards(pattern) for raw in open_shard(path)]


# ---------------------------------------------------------------------------------------------------- the pieces
def test_processor_gives_roles_vocabulary_and_media_policy(processor_dir: Path, pair_shards: str) -> None:
    processor = load_processor(processor_dir)
    tokenizer = processor.tokenizer
    assert processor.vocab_size == len(tokenizer)
    assert processor.roles.placeholder("image") == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert processor.roles.placeholder("audio") == tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    assert (processor.roles.eos, processor.roles.pad) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    data = OmniDataModule(pair_shards, processor=str(processor_dir))
    assert (data.packing.patch_size, data.packing.vision_merge) == (14, 4)  # the processor's 14 and 2x2
    with pytest.raises(ValueError, match=r"patch_size=16 but the processor at .* has patch_size=14"):
        OmniDataModule(pair_shards, processor=str(processor_dir), patch_size=16)
    with pytest.raises(ValueError, match="is not a directory"):
        OmniDataModule(pair_shards, processor=str(processor_dir / "missing"))


def test_audio_and_video_sampling_come_from_the_processor(tmp_path: Path, pair_shards: str) -> None:
    from transformers import WhisperFeatureExtractor

    save_tokenizer(tmp_path, train_bpe(), chatml(True), named=True)
    WhisperFeatureExtractor(feature_size=80, hop_length=320).save_pretrained(tmp_path)  # 50 mel frames a second
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"fps": 1.0, "max_frames": 8,
                                                                         "min_frames": 2}))
    data = OmniDataModule(pair_shards, processor=str(tmp_path))
    assert data.audio_policy.hop_length == data.reader().processor.audio.hop_length == 320
    assert data.video_policy == data.reader().processor.video == VideoPolicy(fps=1.0, max_frames=8, min_frames=2)
    chosen = OmniDataModule(pair_shards, processor=str(tmp_path), audio_frames_per_second=50, video_fps=4.0,
                            video_max_frames=16)
    assert chosen.video_policy == VideoPolicy(fps=4.0, max_frames=16, min_frames=2)
    with pytest.raises(ValueError, match=r"audio_frames_per_second=100 but the processor at .* has "
                                         r"audio_frames_per_second=50"):
        OmniDataModule(pair_shards, processor=str(tmp_path), audio_frames_per_second=100)
    assert OmniDataModule(pair_shards, audio_frames_per_second=50).audio_policy.hop_length == 320  # bytes
    assert OmniDataModule(pair_shards).audio_policy.hop_length == 160
    with pytest.raises(ValueError, match="audio_frames_per_second=7 must divide the audio sampling rate 16000"):
        OmniDataModule(pair_shards, audio_frames_per_second=7)


def test_any_resolution_tiles_from_a_llava_onevision_processor(tmp_path: Path, pair_shards: str,
                                                               conversation_shards: str) -> None:
    """Each tile is an encoder item with its own placeholders: a lone image gets its whole view and its canvas'
    tiles, each image of a two-image dialogue one padded square tile."""
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    save_tokenizer(tmp_path, train_bpe(), chatml(True), named=True)
    LlavaOnevisionImageProcessorPil(size={"height": 70, "width": 70}, image_grid_pinpoints=[
        [70, 70], [70, 140], [140, 70], [140, 140]]).save_pretrained(tmp_path)
    data = OmniDataModule(pair_shards, processor=str(tmp_path))
    reader, spec = data.reader(), data.packing
    assert reader.processor.image.tile == 70 and reader.processor.image.tile_crop == 56  # whole 28-pixel groups
    placeholder = spec.roles.placeholder("image")
    image_counts = []
    for raw in _raw_samples(pair_shards)[:4] + _raw_samples(conversation_shards)[:3]:
        sample = reader(raw)
        planned = [item.shape for item in sample.media["image"]]
        image_counts.append(len(planned))
        assert all(shape[0] == 1 for shape in planned) if len(planned) > 1 else planned[0][0] > 1
        batch = pack_samples([reader.decode(sample)], spec)
        tiles = sum(shape[0] for shape in planned)
        assert batch["vision_grids"].tolist() == [[4, 4]] * tiles
        assert int((batch["input_ids"] == placeholder).sum()) == tiles * 4  # 4x4 patches merged 2x2
    assert 1 in image_counts and 2 in image_counts


def test_the_plain_stream_counts_what_went_in_and_what_it_skipped(tmp_path: Path, processor_dir: Path) -> None:
    samples = [{"__key__": "broken", "jpg": _image(40, 40, 0)[:60], "txt": b"A cat."}]
    samples += [{"__key__": f"good{i}", "jpg": _image(40, 40 + 8 * i, i), "txt": CAPTIONS[i].encode()}
                for i in range(4)]
    write_shard(tmp_path / "plain-000000.tar", samples)
    data = WebDataModule(str(tmp_path / "plain-000000.tar"), batch_size=2, processor=str(processor_dir))
    first, second = itertools.islice(iter(data.stream(data.shards)), 2)
    assert (first["data"]["skipped"], first["data"]["samples"], first["data"]["images"]) == (1, 2, 2)
    assert first["data"]["loss_tokens"] == int((first["labels"] != IGNORE_INDEX).sum()) > 0
    assert (second["data"]["skipped"], second["data"]["samples"]) == (0, 2)
    with pytest.raises(ValueError, match="shard .*plain-000000.tar, sample broken"):
        strict = WebDataModule(str(tmp_path / "plain-000000.tar"), batch_size=2, processor=str(processor_dir),
                               on_bad_sample="error")
        next(iter(strict.stream(strict.shards)))


def test_layouts_are_decided_per_sample(pair_shards: str, conversation_shards: str) -> None:
    assert {detect_layout(raw) for raw in _raw_samples(pair_shards)} == {"pairs"}
    assert {detect_layout(raw) for raw in _raw_samples(conversation_shards)} == {"conversations"}
    with pytest.raises(ValueError, match=r"no layout recognises its members \['bin'\]"):
        detect_layout({"__key__": "x", "bin": b"?"})


def test_conversation_targets_are_the_templates_assistant_tokens(processor_dir: Path, conversation_shards: str
                                                                 ) -> None:
    """Collapsed to one placeholder per item, the ids are the tokenizer's own rendering and the targets its own
    assistant-token mask (the template has a generation region); packed, the labels are the next target token."""
    data = OmniDataModule(conversation_shards, processor=str(processor_dir))
    reader, tokenizer = data.reader(), data.data_processor.tokenizer
    ids = data.packing.roles.placeholder("image")
    for raw in _raw_samples(conversation_shards):
        sample = reader(raw)
        keep = np.ones(len(sample.tokens), dtype=bool)
        runs = np.flatnonzero(np.diff(np.concatenate([[0], (sample.tokens == ids).astype(np.int8)])) == 1)
        for start in runs:
            end = start
            while end < len(sample.tokens) and sample.tokens[end] == ids:
                end += 1
            keep[start + 1:end] = False
        record = json.loads(raw["json"])
        dialogue = parse_dialogue(record)
        messages = [{"role": m.role, "content": [dict(p) for p in m.parts]} for m in dialogue.messages]
        own = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        assert sample.tokens[keep].tolist() == list(own["input_ids"])
        assert sample.targets[keep].astype(int).tolist() == list(own["assistant_masks"])
        assert len(sample.media["image"]) == len(runs) == len(dialogue.media)
    batch = pack_samples([reader.decode(sample)], data.packing)
    expected = np.where(sample.targets[1:], sample.tokens[1:], IGNORE_INDEX).tolist() + [IGNORE_INDEX]
    assert batch["labels"].tolist() == expected


def test_bad_members_are_named(processor_dir: Path) -> None:
    reader = OmniDataModule(None, processor=str(processor_dir)).reader()
    good = {"role": "user", "content": "<image> What?"}, {"role": "assistant", "content": "A cat."}
    cases = {
        "truncated image": ({"jpg": _image(40, 40, 0)[:50], "txt": b"A cat."}, "jpg cannot be (read|decoded)"),
        "empty caption": ({"jpg": _image(40, 40, 0), "txt": b"  "}, "txt is empty"),
        "non-UTF-8 caption": ({"jpg": _image(40, 40, 0), "txt": b"\xff\xfe"}, "txt is not UTF-8"),
        "missing member": ({"json": json.dumps({"messages": list(good), "images": ["0.jpg"]}).encode()},
                           r"names members \['0.jpg'\] that the sample does not have"),
        "unreferenced member": ({"json": json.dumps({"messages": list(good), "images": ["0.jpg"]}).encode(),
                                 "0.jpg": _image(40, 40, 0), "1.jpg": _image(40, 40, 1)},
                                r"media members \['1.jpg'\] are not referenced"),
        "no assistant turn": ({"json": json.dumps({"messages": [good[0]], "images": ["0.jpg"]}).encode(),
                               "0.jpg": _image(40, 40, 0)}, "assistant"),
        "audio without an encoder of its kind": (
            {"json": json.dumps({"messages": [{"role": "user", "content": "<audio> Hear?"}, good[1]],
                                 "audios": ["0.wav"]}).encode(), "0.wav": b"RIFF"}, "0.wav cannot be read"),
    }
    for name, (members, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            reader({"__key__": name.replace(" ", "_"), **members})


def test_conversations_without_a_chat_template_stop_the_job(conversation_shards: str) -> None:
    reader = OmniDataModule(conversation_shards).reader()  # bytes: no tokenizer, no template
    with pytest.raises(LayoutNeedsProcessor, match=r"pass OmniDataModule\(processor=PATH\)"):
        reader(_raw_samples(conversation_shards)[0])


def test_pairs_under_bytes_keep_their_images(pair_shards: str) -> None:
    """The headline bug of 0.1: KEY.jpg + KEY.txt + KEY.json shards trained on captions alone."""
    data = OmniDataModule(pair_shards)
    sample = data.reader()(_raw_samples(pair_shards)[0])
    (image,) = sample.media["image"]
    assert image.shape[0] % 28 == 0 and image.shape[1] % 28 == 0 and sample.targets is None


# ---------------------------------------------------------------------------------------------------- training
class CountWhatGoesIn(pl.Callback):
    """Every rank writes, per step: images, placeholder tokens and vision encoder items in its batches, the number
    of tokens trained on, and the logged data/* metrics."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.rows = out_dir, []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        spec = module.packing()
        placeholder = spec.roles.placeholder("image")
        grids = batch["vision_grids"]
        self.rows.append({
            "placeholders": int((batch["input_ids"] == placeholder).sum()),
            "encoder_outputs": int((grids[:, 0] * grids[:, 1]).sum()) // spec.vision_merge,
            "vision_items": int(grids.shape[0]), "counted_images": batch["data"]["images"],
            "loss_tokens": int((batch["labels"] != IGNORE_INDEX).sum()),
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("data/")},
            "vocab": module.config.llm.vocab_size,
        })
        (self.out_dir / f"counts_rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def _module() -> OmniModule:
    return OmniModule(learning_rate=LEARNING_RATE)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["pairs", "conversations", "mixed"])
def test_training_feeds_every_image_to_the_encoder(layout: str, tmp_path: Path, processor_dir: Path,
                                                   pair_shards: str, conversation_shards: str,
                                                   seed_checkpoint: Path) -> None:
    shards = {"pairs": pair_shards, "conversations": conversation_shards,
              "mixed": [pair_shards.replace("{000000..000001}", f"{i:06d}") for i in range(2)]
              + [conversation_shards.replace("{000000..000001}", f"{i:06d}") for i in range(2)]}[layout]
    data = OmniDataModule(shards, processor=str(processor_dir), samples_per_step=2, group_steps=2)
    fit(tmp_path, "", seed_checkpoint, layout={"dp_shard": 2}, devices=2, max_steps=3, module=_module(),
        datamodule=data, callbacks=[CountWhatGoesIn(tmp_path)], log_every_n_steps=1)
    rows = [json.loads((tmp_path / f"counts_rank{r}.json").read_text()) for r in range(2)]
    tokenizer_size = load_processor(processor_dir).vocab_size
    images = 0
    for rank_rows in rows:
        for row in rank_rows:
            assert row["placeholders"] == row["encoder_outputs"] > 0  # every image's outputs have their tokens
            assert row["vision_items"] == row["counted_images"]
            assert row["vocab"] == tokenizer_size  # the model took the vocabulary from the processor
            images += row["counted_images"]
    for step in range(3):  # data/images is the sum over both ranks of what each trained on
        assert rows[0][step]["metrics"]["data/images"] == rows[0][step]["counted_images"] + rows[1][step][
            "counted_images"]
        assert rows[0][step]["metrics"]["data/loss_tokens"] > 0 and rows[0][step]["metrics"]["data/skipped"] == 0
    assert images >= 6


@pytest.mark.distributed
def test_bad_samples_are_counted_in_data_skipped(tmp_path: Path, processor_dir: Path, seed_checkpoint: Path) -> None:
    """Each rank's shard starts with a truncated image and a dialogue naming a member it lacks: both skipped,
    logged and counted in the first step's data/skipped (summed over the ranks), the rest trained."""
    for shard in range(2):
        dialogue = {"messages": [{"role": "user", "content": "<image> ?"}, {"role": "assistant", "content": "A."}],
                    "images": ["0.jpg"]}
        samples = [{"__key__": f"broken{shard}", "jpg": _image(40, 40, 0)[:60], "txt": b"A cat."},
                   {"__key__": f"orphan{shard}", "json": json.dumps(dialogue).encode()}]
        samples += [{"__key__": f"good{shard}{i}", "jpg": _image(40, 40 + 8 * i, i), "txt": CAPTIONS[i].encode()}
                    for i in range(5)]
        write_shard(tmp_path / f"bad-{shard:06d}.tar", samples)
    data = OmniDataModule(str(tmp_path / "bad-{000000..000001}.tar"), processor=str(processor_dir),
                          samples_per_step=2, group_steps=2)
    fit(tmp_path, "", seed_checkpoint, layout={"dp_shard": 2}, devices=2, max_steps=2, module=_module(),
        datamodule=data, callbacks=[CountWhatGoesIn(tmp_path)], log_every_n_steps=1)
    rows = json.loads((tmp_path / "counts_rank0.json").read_text())
    assert [row["metrics"]["data/skipped"] for row in rows] == [4, 0]
    # The group of each rank read 4 samples, 2 of them broken: 2 good ones a step over both ranks, each one image.
    assert all(row["metrics"]["data/images"] == row["metrics"]["data/samples"] == 2 for row in rows)


@pytest.mark.distributed
def test_resume_is_exact_on_the_new_layouts(tmp_path: Path, processor_dir: Path, pair_shards: str,
                                            conversation_shards: str, seed_checkpoint: Path) -> None:
    shards = [pair_shards.replace("{000000..000001}", f"{i:06d}") for i in range(2)] + [
        conversation_shards.replace("{000000..000001}", f"{i:06d}") for i in range(2)]
    checkpoint = assert_resumes_under(
        tmp_path, "", seed_checkpoint, saved={"dp_shard": 4}, resumed={"dp_shard": 4}, module=_module,
        datamodule=lambda: OmniDataModule(shards, processor=str(processor_dir), samples_per_step=2, group_steps=2))
    saved = torch.load(checkpoint / "meta.pt", weights_only=False)["hyper_parameters"]["model"]
    processor = load_processor(processor_dir)
    assert (saved.llm.vocab_size, saved.roles) == (processor.vocab_size, processor.roles)


def test_the_loggers_record_the_model_resolved_from_the_processor(tmp_path: Path, processor_dir: Path,
                                                                 pair_shards: str) -> None:
    """hparams.yaml names the model that trains (the vocabulary and token roles taken from the processor), not the
    ``model: null`` it was given."""
    from lightning.pytorch.loggers import CSVLogger

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=CSVLogger(tmp_path, name="csv"),
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    trainer.fit(_module(), datamodule=OmniDataModule(pair_shards, processor=str(processor_dir), samples_per_step=1,
                                                     group_steps=1))
    written = (tmp_path / "csv" / "version_0" / "hparams.yaml").read_text()
    processor = load_processor(processor_dir)
    assert "model: null" not in written and f"vocab_size: {processor.vocab_size}" in written, written


def test_an_explicit_model_too_small_for_the_vocabulary_is_refused(processor_dir: Path, pair_shards: str) -> None:
    module = OmniModule(ReferenceMLLMConfig.tiny())  # vocab 256 < len(tokenizer)
    module._trainer = type("T", (), {"datamodule": OmniDataModule(pair_shards, processor=str(processor_dir)),
                                     "strategy": None})()
    with pytest.raises(ValueError, match=r"llm.vocab_size=256 is smaller than the vocabulary of the tokenizer"):
        module.setup("fit")


@pytest.mark.distributed
def test_readme_conversation_demo_converts_and_trains(tmp_path: Path) -> None:
    """The README's commands for conversations: write the demo dataset and processor, convert, train 2 steps on
    2 processes, with every media kind (images, a video, an audio clip) among the samples."""
    data = tmp_path / "data" / "demo_chat"
    subprocess.run([sys.executable, str(REPO / "examples" / "make_demo_conversations.py"), str(data),
                    "--dialogues", "24"], check=True, capture_output=True)
    main(["make-shards", "--from-conversations", str(data / "dialogues.json"), "--media-root", str(data / "media"),
          "--out", str(data / "shards"), "--samples-per-shard", "12"])
    kinds = {m.rsplit(".", 1)[-1] for raw in _raw_samples(str(data / "shards")) for m in raw if not m.startswith("_")}
    assert {"json", "jpg", "png", "mp4", "wav"} <= kinds
    os.environ["MASTER_PORT"] = str(free_port())
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the config's paths are relative to the repository root, as in the README
    try:
        main(["fit", "--config", str(REPO / "examples" / "conversations.yaml"), "--trainer.max_steps", "2",
              "--trainer.strategy.launcher", "fork", "--trainer.enable_progress_bar", "false",
              "--trainer.logger", "false", "--data.init_args.group_steps", "2"])
    finally:
        os.chdir(cwd)


_PIECES = {
    "jpg": [_image(40, 40, 0), _image(40, 40, 0)[:60], b"", b"\xff\xd8\xff"],
    "png": [_image(30, 50, 1, "PNG"), _image(30, 50, 1, "PNG")[:40]],
    "0.jpg": [_image(40, 40, 2), b"not an image"],
    "0.wav": [b"RIFF\x00\x00", b""],
    "0.mp4": [b"\x00\x00\x00\x18ftypmp42", b""],
    "txt": [b"A cat.", b"", b"\xff\xfe\xfd", "猫".encode()],
    "json": [b"{}", b"[]", b"not json", json.dumps({"caption": 3}).encode(),
             json.dumps({"messages": [{"role": "user", "content": "<image> ?"},
                                      {"role": "assistant", "content": "A cat."}], "images": ["0.jpg"]}).encode(),
             json.dumps({"messages": [{"role": "user", "content": "<video><audio> ?"},
                                      {"role": "assistant", "content": ""}], "videos": ["0.mp4"],
                         "audios": ["0.wav"]}).encode(),
             json.dumps({"conversations": [{"from": "gpt", "value": "<image>"}], "image": "9.jpg"}).encode(),
             json.dumps({"messages": []}).encode()],
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(sorted(_PIECES)), st.integers(0, 7), max_size=5))
def test_any_mix_of_members_is_a_sample_or_a_named_bad_sample(processor_dir: Path, choice: dict[str, int]) -> None:
    """Whatever members a sample has (truncated media, wrong names, markers without media, non-UTF-8 text, empty
    dialogues), reading it gives a packable sample or a ValueError that names it; never another exception."""
    data = _fuzz_data(processor_dir)
    raw = {"__key__": "fuzzed", **{m: _PIECES[m][i % len(_PIECES[m])] for m, i in choice.items()}}
    try:
        sample = data.reader().decode(data.reader()(raw))
    except ValueError as error:
        assert "fuzzed" in str(error)
        return
    pack_samples([sample], data.packing)


_FUZZ: dict[Path, OmniDataModule] = {}


def _fuzz_data(processor_dir: Path) -> OmniDataModule:
    if processor_dir not in _FUZZ:
        _FUZZ[processor_dir] = OmniDataModule(None, processor=str(processor_dir))
    return _FUZZ[processor_dir]


def test_a_tokenizer_without_named_multimodal_tokens(tmp_path: Path) -> None:
    """It takes its <image> special token as the image placeholder and names the tokens it looked for when a
    modality has none."""
    tokenizer = save_tokenizer(tmp_path, train_bpe(), chatml(True))  # <image> is a special token; no <video>
    processor = load_processor(tmp_path)
    assert processor.placeholder("image") == tokenizer.convert_tokens_to_ids("<image>")
    with pytest.raises(ValueError, match=r"has no video placeholder token \(looked for <video>\)"):
        processor.placeholder("video")
    data = OmniDataModule(None, processor=str(tmp_path))  # trains images; a video sample is a named bad sample
    assert data.packing.modality_names == ("image",)
    dialogue = {"messages": [{"role": "user", "content": "<video> ?"}, {"role": "assistant", "content": "A."}],
                "videos": ["0.mp4"]}
    with pytest.raises(ValueError, match="sample v: .*has no video placeholder token"):
        data.reader()({"__key__": "v", "json": json.dumps(dialogue).encode(), "0.mp4": b"\x00"})


def test_gpt2_style_roles_and_templates_that_refuse_a_dialogue(tmp_path: Path) -> None:
    """One <|endoftext|> as pad, bos and eos is accepted; a template's raise_exception is a named bad sample."""
    assert TokenRoles(pad=7, bos=7, eos=7, placeholders=(("image", 9),)).filler == 7
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}"
    save_tokenizer(tmp_path, train_bpe(), strict + chatml(False), named=True)
    reader = OmniDataModule(None, processor=str(tmp_path)).reader()
    dialogue = {"messages": [{"role": "assistant", "content": "A."}, {"role": "user", "content": "?"}]}
    with pytest.raises(ValueError, match="sample r: the chat template refuses it .*roles must alternate"):
        reader({"__key__": "r", "json": json.dumps(dialogue).encode()})


def test_sizes_come_from_headers_and_lying_headers_are_fitted_or_skipped(processor_dir: Path, tmp_path: Path) -> None:
    """The reader plans media from their headers (nothing decoded); decoding after the plan pads a clip a little
    short of its promise to the planned frames, and refuses one far short."""
    import soundfile

    data = OmniDataModule(None, processor=str(processor_dir))
    reader = data.reader()
    wav = io.BytesIO()
    soundfile.write(wav, np.sin(np.arange(16000) / 7).astype(np.float32), 16000, format="WAV")
    dialogue = {"messages": [{"role": "user", "content": "<image><audio> ?"}, {"role": "assistant", "content": "A."}],
                "images": ["0.jpg"], "audios": ["0.wav"]}
    sample = reader({"__key__": "planned", "json": json.dumps(dialogue).encode(), "0.jpg": _image(50, 90, 0),
                     "0.wav": wav.getvalue()})
    (image,), (clip,) = sample.media["image"], sample.media["audio"]
    assert isinstance(image, PendingMedia) and isinstance(clip, PendingMedia)
    assert image.shape == (56, 84, 3) and clip.shape == (100, 80)  # 50x90 resized to 2x3 merge windows; 1 s
    decoded = reader.decode(sample)
    assert decoded.media["image"][0].shape == image.shape and decoded.media["audio"][0].shape == clip.shape
    pack_samples([decoded], data.packing)
    for promised, fits in ((104, True), (140, False)):  # 4 frames short: one audio token; 40 frames: 29%
        lying = replace(sample, media={**sample.media, "audio": [replace(clip, shape=(promised, 80))]})
        if fits:
            assert reader.decode(lying).media["audio"][0].shape == (promised, 80)
        else:
            with pytest.raises(ValueError, match="decodes to 100 frames, 40 fewer than the 140 its header promised"):
                reader.decode(lying)


def test_each_trained_sample_is_decoded_once_after_the_plan(processor_dir: Path, pair_shards: str) -> None:
    """Reordering moves undecoded samples; the rank that trains one decodes it, once, in a worker thread."""
    data = OmniDataModule(pair_shards, processor=str(processor_dir))
    reader, calls = data.reader(), []

    def decode(sample: Any) -> Any:
        calls.append((sample.key, threading.current_thread().name))
        return reader.decode(sample)

    samples = SampleStream(expand_shards(pair_shards), dp_rank=0, dp_size=1, batch_size=1, packing=data.packing,
                           reader=reader)
    loader = StatefulDataLoader(samples, batch_size=None, collate_fn=lambda item: item)
    stream = ReorderedStream(loader, group=None, group_index=0,
                             cost_model=reference_cost_model(ReferenceMLLMConfig.tiny()),
                             settings=ReorderSettings(samples_per_step=2, group_steps=2), packing=data.packing,
                             decode=decode)
    batches = [batch for _, batch in zip(range(4), stream, strict=False)]
    trained = [key for batch in batches for key in batch["keys"]]
    assert sorted(key for key, _ in calls) == sorted(trained) and len(set(trained)) == len(trained) == 8
    assert all(name.startswith("omni-decode") for _, name in calls)


def _reordered(paths: list[str], processor: Path, *, dp_rank: int = 0, dp_size: int = 1,
               group: dist.ProcessGroup | None = None) -> ReorderedStream:
    """What OmniDataModule.train_dataloader assembles for the processor, built by hand."""
    data = OmniDataModule(None, processor=str(processor))
    samples = SampleStream(paths, dp_rank=dp_rank, dp_size=dp_size, batch_size=1, packing=data.packing,
                           reader=data.reader(), on_bad_sample="skip")
    loader = StatefulDataLoader(samples, batch_size=None, collate_fn=lambda item: item)
    return ReorderedStream(loader, group=group, group_index=0,
                           cost_model=reference_cost_model(ReferenceMLLMConfig.tiny()),
                           settings=ReorderSettings(samples_per_step=2, group_steps=2), packing=data.packing,
                           decode=data.reader().decode)


def _undecodable_after_the_plan(shard: int) -> list[dict[str, Any]]:
    """A pair and a dialogue whose JPEG is cut in half (its header still gives the size, so the plan takes it; its
    pixels do not decode), among good pairs: four samples, two of them to skip after the plan."""
    dialogue = {"messages": [{"role": "user", "content": "<image> ?"}, {"role": "assistant", "content": "A."}],
                "images": ["0.jpg"]}
    cut = _image(60, 60, shard)[: len(_image(60, 60, shard)) // 2]
    return [{"__key__": f"cutpair{shard}", "jpg": cut, "txt": b"A cat."},
            {"__key__": f"good{shard}a", "jpg": _image(40, 48, shard), "txt": CAPTIONS[0].encode()},
            {"__key__": f"cutchat{shard}", "json": json.dumps(dialogue).encode(), "0.jpg": cut},
            {"__key__": f"good{shard}b", "jpg": _image(48, 40, shard), "txt": CAPTIONS[1].encode()}]


def test_a_skip_after_the_plan_counts_in_reorder_and_data_skipped(tmp_path: Path, processor_dir: Path) -> None:
    write_shard(tmp_path / "cut-000000.tar", _undecodable_after_the_plan(0))
    first, second = itertools.islice(iter(_reordered([str(tmp_path / "cut-000000.tar")], processor_dir)), 2)
    keys = first["keys"] + second["keys"]
    assert sorted(keys) == ["good0a", "good0b"]
    skipped = [first["data"]["skipped"], second["data"]["skipped"]]
    assert sum(skipped) == 2  # each in the step that planned it
    assert second["reorder"]["skipped"] == 2 and first["reorder"]["skipped"] == skipped[0]


def _world_skips_after_the_plan(rank: int, world_size: int, paths: list[str], processor: Path, out: Path) -> None:
    group, _ = dist.new_subgroups_by_enumeration([list(range(world_size))])
    batches = list(itertools.islice(iter(_reordered(paths, processor, dp_rank=rank, dp_size=world_size,
                                                    group=group)), 4))
    steps = [{"keys": b["keys"], "data_skipped": b["data"]["skipped"], "reorder_skipped": b["reorder"]["skipped"]}
             for b in batches]
    (out / f"rank{rank}.json").write_text(json.dumps(steps))


@pytest.mark.distributed
def test_a_skip_after_the_plan_keeps_every_rank_aligned(tmp_path: Path, processor_dir: Path) -> None:
    """Both ranks' shards hold a pair and a dialogue whose JPEG fails to decode after the plan, wherever the plan
    sends them: both ranks run the same steps, train every good sample once, and count each skip once."""
    paths = [str(tmp_path / f"cut-{r:06d}.tar") for r in range(2)]
    for rank, path in enumerate(paths):
        write_shard(Path(path), _undecodable_after_the_plan(rank))
    run_distributed(_world_skips_after_the_plan, 2, paths, processor_dir, tmp_path)
    world = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [len(steps) for steps in world] == [4, 4]  # two epochs of two steps, in lockstep
    for epoch in range(2):
        trained = [k for steps in world for step in steps[2 * epoch: 2 * epoch + 2] for k in step["keys"]]
        assert sorted(trained) == ["good0a", "good0b", "good1a", "good1b"]
        assert sum(step["data_skipped"] for steps in world for step in steps[2 * epoch: 2 * epoch + 2]) == 4
    assert sum(steps[-1]["reorder_skipped"] for steps in world) == 8  # both epochs, counted where decoded


def test_caption_key_picks_the_caption_of_a_pair(processor_dir: Path) -> None:
    """With caption_key the pair's caption is that json key (not txt, not the json's caption); a pair without it
    is a bad sample naming the key."""
    raw = {"__key__": "p", "jpg": _image(40, 40, 0), "txt": b"from txt",
           "json": json.dumps({"caption": "from caption", "alt": "from alt"}).encode()}
    tokenizer = load_processor(processor_dir).tokenizer

    def text(sample: Any) -> str:
        return tokenizer.decode(sample.tokens[sample.targets].tolist())

    chosen = OmniDataModule(None, processor=str(processor_dir), caption_key="alt").reader()
    assert "from alt" in text(chosen(raw))
    assert "from txt" in text(OmniDataModule(None, processor=str(processor_dir)).reader()(raw))
    without_txt = {k: v for k, v in raw.items() if k != "txt"}
    assert "from caption" in text(OmniDataModule(None, processor=str(processor_dir)).reader()(without_txt))
    with pytest.raises(ValueError, match="sample p: its json has no caption key 'title'"):
        OmniDataModule(None, processor=str(processor_dir), caption_key="title").reader()(raw)


@pytest.mark.parametrize(("records", "problem"), [
    ([{"id": "a", "messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "A."}],
       "images": ["gone.jpg"]}], r"dialogues.json\[0\]: image 'gone.jpg' is not a file"),
    ([{"id": "a.b", "messages": [{"role": "user", "content": "?"}, {"role": "assistant", "content": "A."}]}],
     r"dialogues.json\[0\]: id 'a.b' is repeated or not made of letters"),
    (["not a dialogue"], r"dialogues.json\[0\]: "),
])
def test_a_bad_conversation_stops_the_conversion_naming_it(tmp_path: Path, records: list[Any], problem: str) -> None:
    (tmp_path / "dialogues.json").write_text(json.dumps(records))
    with pytest.raises(ValueError, match=problem):
        conversations_to_shards(tmp_path / "dialogues.json", tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.tar"))
