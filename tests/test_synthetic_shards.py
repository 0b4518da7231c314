"""Synthetic webdataset shards: layout, member formats, determinism and argument checks."""

from __future__ import annotations

import io
import json
import tarfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from omni_lightning.balance.workload import SampleMeta
from omni_lightning.data.synthetic import FIRST_TEXT_ID, NUM_CLASSES, make_synthetic_shards

PRESETS = ["omni_mix", "text_heavy", "video_heavy", "vlm_dynres"]
SMALL = {"num_shards": 2, "samples_per_shard": 4, "length_scale": 0.05, "max_llm_tokens": 256}
PATCH, N_MELS, VOCAB = 14, 80, 256

# Every sample is audio or video, so those members are exercised whatever the seed.
MEDIA_SPEC = """
name: media_only
merge: {video: 4, audio: 4}
modalities:
  video:
    weight: 1
    text_tokens: {dist: const, value: 30}
    frames: {dist: uniform_int, low: 2, high: 5}
    patches_per_frame: {dist: const, value: 64}
  audio:
    weight: 1
    text_tokens: {dist: const, value: 30}
    seconds: {dist: uniform, low: 0.1, high: 0.5}
"""


def read_tar(path: str) -> dict[str, dict[str, bytes]]:
    """Members of a shard grouped by sample key, in file order."""
    samples: dict[str, dict[str, bytes]] = defaultdict(dict)
    with tarfile.open(path) as tar:
        for member in tar:
            key, suffix = member.name.split(".", 1)
            data = tar.extractfile(member)
            assert data is not None
            samples[key][suffix] = data.read()
    return dict(samples)


def expected_members(meta: SampleMeta) -> set[str]:
    members = {"json", "tokens.npy"} | {f"img{i}.png" for i in range(len(meta.images))}
    if meta.video_frames:
        members.add("video.npy")
    if meta.audio_frames:
        members.add("mel.npy")
    return members


def check_sample(members: dict[str, bytes], max_llm_tokens: int) -> SampleMeta:
    raw = json.loads(members["json"])
    class_id = raw["class_id"]
    assert 0 <= class_id < NUM_CLASSES
    meta = SampleMeta.from_json(raw)
    assert set(members) == expected_members(meta)
    assert meta.llm_tokens <= max_llm_tokens

    tokens = np.load(io.BytesIO(members["tokens.npy"]))
    assert tokens.dtype == np.int32 and tokens.shape == (meta.text_tokens,)
    assert tokens.min() >= FIRST_TEXT_ID and tokens.max() < VOCAB
    for i, (h, w) in enumerate(meta.images):
        image = Image.open(io.BytesIO(members[f"img{i}.png"]))
        assert image.mode == "RGB" and image.size == (w * PATCH, h * PATCH)
    if meta.video_frames:
        video = np.load(io.BytesIO(members["video.npy"]))
        h, w = meta.video_grid
        assert video.dtype == np.uint8 and video.shape == (meta.video_frames, h * PATCH, w * PATCH, 3)
    if meta.audio_frames:
        mel = np.load(io.BytesIO(members["mel.npy"]))
        assert mel.dtype == np.float16 and mel.shape == (meta.audio_frames, N_MELS)
        assert np.isfinite(mel).all()
    return meta


@pytest.fixture(scope="module")
def preset_shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    root = tmp_path_factory.mktemp("shards")
    return {name: make_synthetic_shards(root / name, workload=name, seed=1, **SMALL) for name in PRESETS}


@pytest.mark.parametrize("name", PRESETS)
def test_shards_read_back_with_tarfile(name: str, preset_shards: dict[str, list[str]]) -> None:
    paths = preset_shards[name]
    assert [Path(p).name for p in paths] == ["train-000000.tar", "train-000001.tar"]
    for shard, path in enumerate(paths):
        samples = read_tar(path)
        assert list(samples) == [f"train-{shard:06d}-{i:06d}" for i in range(SMALL["samples_per_shard"])]
        for members in samples.values():
            check_sample(members, SMALL["max_llm_tokens"])


@pytest.mark.parametrize("name", PRESETS)
def test_shards_read_back_with_webdataset(name: str, preset_shards: dict[str, list[str]]) -> None:
    paths = preset_shards[name]
    samples = list(wds.WebDataset(paths, shardshuffle=False))
    assert len(samples) == SMALL["num_shards"] * SMALL["samples_per_shard"]
    for sample in samples:
        members = {k: v for k, v in sample.items() if not k.startswith("__")}
        meta = check_sample(members, SMALL["max_llm_tokens"])
        assert sample["__key__"].startswith("train-")
        assert json.loads(members["json"])["modality"] == meta.modality


@pytest.mark.parametrize("name", PRESETS)
def test_index_json(name: str, preset_shards: dict[str, list[str]]) -> None:
    index = json.loads((Path(preset_shards[name][0]).parent / "train-index.json").read_text())
    assert index == {
        "workload": name,
        "num_shards": 2,
        "samples_per_shard": 4,
        "seed": 1,
        "length_scale": 0.05,
        "max_llm_tokens": 256,
        "patch_size": PATCH,
        "n_mels": N_MELS,
        "vocab_size": VOCAB,
        "shards": ["train-000000.tar", "train-000001.tar"],
        "samples": 8,
    }


def test_video_and_audio_members(tmp_path: Path) -> None:
    spec = tmp_path / "media_only.yaml"
    spec.write_text(MEDIA_SPEC)
    paths = make_synthetic_shards(tmp_path / "out", workload=spec, num_shards=1, samples_per_shard=12, seed=3)
    metas = [check_sample(m, 10**9) for m in read_tar(paths[0]).values()]
    assert {m.modality for m in metas} == {"video", "audio"}
    assert all(m.video_frames or m.audio_frames for m in metas)


def test_text_is_learnable(tmp_path: Path) -> None:
    # Most steps follow t_{i+1} = 4 + (t_i - 4 + c + 1) mod (V - 4), the rest is the 5% noise.
    paths = make_synthetic_shards(tmp_path, workload="text_heavy", num_shards=1, samples_per_shard=8, seed=0)
    follows = total = 0
    for members in read_tar(paths[0]).values():
        c = json.loads(members["json"])["class_id"]
        tokens = np.load(io.BytesIO(members["tokens.npy"])).astype(np.int64)
        predicted = FIRST_TEXT_ID + (tokens[:-1] - FIRST_TEXT_ID + c + 1) % (VOCAB - FIRST_TEXT_ID)
        follows += int((predicted == tokens[1:]).sum())
        total += len(tokens) - 1
    assert 0.8 < follows / total < 0.97


def test_same_seed_is_byte_identical_and_seeds_differ(tmp_path: Path) -> None:
    kwargs = {"workload": "omni_mix", "seed": 7, **SMALL}
    first = make_synthetic_shards(tmp_path / "a", **kwargs)
    second = make_synthetic_shards(tmp_path / "b", **kwargs)
    for a, b in zip(first, second, strict=True):
        assert Path(a).read_bytes() == Path(b).read_bytes()
        for (key_a, sample_a), (key_b, sample_b) in zip(read_tar(a).items(), read_tar(b).items(), strict=True):
            assert key_a == key_b
            assert sample_a["json"] == sample_b["json"]
            assert sample_a["tokens.npy"] == sample_b["tokens.npy"]
    other = make_synthetic_shards(tmp_path / "c", **{**kwargs, "seed": 8})
    assert [read_tar(p) for p in other] != [read_tar(p) for p in first]


def test_shards_are_independent(tmp_path: Path) -> None:
    # Shard i depends only on (seed, i): writing more shards leaves the first ones unchanged.
    two = make_synthetic_shards(tmp_path / "two", workload="vlm_dynres", **{**SMALL, "num_shards": 2})
    three = make_synthetic_shards(tmp_path / "three", workload="vlm_dynres", **{**SMALL, "num_shards": 3})
    assert [Path(p).read_bytes() for p in two] == [Path(p).read_bytes() for p in three[:2]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_shards": 0}, "num_shards=0"),
        ({"samples_per_shard": 0}, "samples_per_shard=0"),
        ({"vocab_size": 12}, "vocab_size=12 must be an integer >= 13"),
        ({"patch_size": 0}, "patch_size=0"),
        ({"n_mels": 0}, "n_mels=0"),
        ({"seed": -1}, "seed=-1"),
        ({"prefix": "a.b"}, "prefix='a.b'"),
        ({"prefix": ""}, "prefix=''"),
        ({"length_scale": 0.0}, "length_scale=0.0"),
        ({"max_llm_tokens": 2}, "max_llm_tokens=2 is too small"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_synthetic_shards(tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()
