"""The built-in modalities: video as its own modality on the vision tower, temporal patches, and 0.1's samples.

With a temporal patch of 1 (the default) a video packs exactly as its frames would as images: same placeholder id,
same patches, so numerics and synthetic data are those of release 0.1. With a temporal patch of ``T`` every ``T``
frames are one item and an image fills its temporal patch with copies of itself (Qwen2-VL's convention).
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest
import torch

from omni_lightning.balance.cost import feature_matrix, meta_items
from omni_lightning.balance.cost import sample_features as cost_sample_features
from omni_lightning.balance.workload import SampleMeta
from omni_lightning.batch import BYTE_ROLES, input_key
from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.data.packing import sample_features as payload_sample_features
from omni_lightning.modalities import DEFAULT_PACKING, packing_spec
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.mllm import ReferenceMLLM

TEXT = np.arange(BYTE_ROLES.first_free_id, BYTE_ROLES.first_free_id + 5)


def _frames(count: int, rows: int = 2, cols: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, rows * 14, cols * 14, 3), dtype=np.uint8)


def test_video_with_unit_temporal_patch_packs_as_its_frames_do_as_images() -> None:
    frames = _frames(3)
    video = pack_samples([DecodedSample("v", TEXT, media={"video": [frames]})])
    images = pack_samples([DecodedSample("i", TEXT, images=list(frames))])
    for name in ("input_ids", "labels", "position_ids", *(input_key("vision", n) for n in ("patches", "positions",
                                                                                              "grids"))):
        torch.testing.assert_close(video[name], images[name], rtol=0, atol=0)


def test_temporal_patches_cut_video_into_items_and_fill_images() -> None:
    spec = packing_spec(temporal_patch_size=2)
    frames = _frames(3)
    batch = pack_samples([DecodedSample("v", TEXT, media={"video": [frames]})], spec)
    # frames 0-1 and 2 (+ itself repeated): two items of 2x4 patches, each merged 2x2 into 2 placeholders
    assert batch[input_key("vision", "grids")].tolist() == [[2, 4], [2, 4]]
    assert batch[input_key("vision", "patches")].shape == (16, 3 * 2 * 14 * 14)
    assert (batch["input_ids"] == BYTE_ROLES.placeholder("video")).sum() == 4
    last = pack_samples([DecodedSample("l", TEXT, media={"video": [np.stack([frames[2], frames[2]])]})], spec)
    torch.testing.assert_close(batch[input_key("vision", "patches")][8:], last[input_key("vision", "patches")])

    image = pack_samples([DecodedSample("i", TEXT, images=[frames[0]])], spec)
    still = pack_samples([DecodedSample("s", TEXT, media={"video": [np.stack([frames[0]] * 2)]})], spec)
    torch.testing.assert_close(image[input_key("vision", "patches")], still[input_key("vision", "patches")])

    meta = SampleMeta(modality="video", text_tokens=5, video_frames=3, video_grid=(2, 4))
    assert meta_items(meta, spec) == {"vision": [8, 8]}
    assert meta_items(meta, DEFAULT_PACKING) == {"vision": [8, 8, 8]}


@pytest.mark.parametrize("temporal", [1, 2, 3])
def test_metadata_and_payload_price_a_video_alike(temporal: int) -> None:
    """The planners price a sample from its metadata (simulator, pool sizing) or from its payload (the loader): one
    feature function, the same features, whatever the temporal patch."""
    spec = packing_spec(temporal_patch_size=temporal)
    meta = SampleMeta(modality="video", text_tokens=5, video_frames=5, video_grid=(2, 4),
                      merge=(("video", 4),))
    sample = DecodedSample("v", TEXT, media={"video": [_frames(5)]})
    encoders = spec.encoder_names
    np.testing.assert_array_equal(cost_sample_features(meta, encoders, spec),
                                  payload_sample_features(sample, encoders, spec))
    np.testing.assert_array_equal(feature_matrix([meta], encoders, spec)[0], cost_sample_features(meta, encoders, spec))


def test_a_model_with_temporal_patches_trains_on_video() -> None:
    config = ReferenceMLLMConfig.tiny()
    config = replace(config, vision=replace(config.vision, temporal_patch_size=2))
    model = ReferenceMLLM(config)
    assert model.packing.temporal_patch_size == 2
    batch = pack_samples([DecodedSample("v", TEXT, media={"video": [_frames(5)]}),
                          DecodedSample("i", TEXT, images=[_frames(1)[0]])], model.packing)
    logits = model(batch)
    assert logits.shape == (batch["input_ids"].numel(), config.llm.vocab_size) and torch.isfinite(logits).all()
    logits.sum().backward()
    assert model.vision.patch_embed.weight.grad.abs().sum() > 0


def test_a_video_must_have_frames_and_whole_patches() -> None:
    with pytest.raises(ValueError, match=r"sample v: video 0: a video must be \[frames >= 1"):
        pack_samples([DecodedSample("v", TEXT, media={"video": [np.zeros((0, 28, 28, 3), np.uint8)]})])
    with pytest.raises(ValueError, match="not a whole number of 14-pixel patches"):
        pack_samples([DecodedSample("v", TEXT, media={"video": [np.zeros((2, 28, 30, 3), np.uint8)]})])


def test_a_sample_pickled_by_release_0_1_loads_with_its_video_apart() -> None:
    """0.1 pickled ``images`` (a video's frames appended) and ``mel``; loader states in its checkpoints hold such
    samples (``tests/fixtures/legacy_checkpoint`` resumes one for real)."""
    frames, still = _frames(2), _frames(1, seed=1)[0]
    mel = np.ones((8, 80), np.float32)
    old = DecodedSample.__new__(DecodedSample)
    old.__dict__.update(key="k", tokens=TEXT, images=[still, *frames], mel=mel,
                        meta={"images": [[2, 4]], "video_frames": 2})
    loaded = DecodedSample.__new__(DecodedSample)
    loaded.__setstate__(dict(old.__dict__))
    assert sorted(loaded.media) == ["audio", "image", "video"]
    np.testing.assert_array_equal(loaded.media["image"][0], still)
    np.testing.assert_array_equal(loaded.media["video"][0], frames)
    assert loaded.mel is mel and loaded.images[0] is still
    assert pickle.loads(pickle.dumps(loaded)).media.keys() == loaded.media.keys()

    images_only = DecodedSample.__new__(DecodedSample)
    images_only.__setstate__({"key": "i", "tokens": TEXT, "images": list(frames), "mel": None, "meta": {}})
    assert list(images_only.media) == ["image"] and len(images_only.images) == 2
