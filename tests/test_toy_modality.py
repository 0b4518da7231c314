"""Modalities are an open set: two toy modalities added from user code, without touching the library.

* ``depth``: a single-channel depth map, its own placeholder id, encoded by the vision tower (a modality sharing an
  encoder with image and video);
* ``imu``: an inertial-sensor recording ``[frames, 6]``, encoded by an encoder of its own (``motion``, a reference
  audio-style encoder over 6 channels), whose format the test writes.

They go through the packer, the cost features, the loader's reordering (samples moved between ranks on the wire),
the model's forward, encoder resharding with long-short SP and a checkpoint's state dict. Parity tolerances are
those of ``test_reshard_parity.py`` (loss 1e-5 relative, gradients 1e-4 of their norm): resharding only moves
where items are encoded and reorders fp32 sums.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from omni_lightning.balance.cost import CostModel, ModuleCost, work_features
from omni_lightning.batch import EncoderFormat, EncoderInput, Modality, PackingSpec, TokenRoles, input_key
from omni_lightning.data.packing import DecodedSample, pack_samples, sample_features
from omni_lightning.data.reorder_stream import ReorderedStream, ReorderSettings
from omni_lightning.modalities import IMAGE, packing_spec
from omni_lightning.models.config import AudioEncoderConfig, ReferenceMLLMConfig
from omni_lightning.models.encoders import AudioEncoder
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.parallel.dims import ParallelDims
from omni_lightning.parallel.layout import build_layout
from omni_lightning.parallel.settings import PipelineSettings, PlacementSettings
from omni_lightning.runtime.loss import next_token_loss_sum
from omni_lightning.runtime.step import build_step

IMU_CHANNELS = 6
IMU_FRAMES_PER_TOKEN = 4  # the motion encoder's two stride-2 convolutions


# ------------------------------------------------------------------------------------------- the toy modalities
def _depth_as_image(depth: Any) -> np.ndarray:
    array = np.asarray(depth)
    if array.ndim != 2:
        raise ValueError(f"a depth map must be [height, width], got shape {list(array.shape)}")
    return np.repeat(array[:, :, None], 3, axis=2)


def _imu_shape(signal: Any, spec: PackingSpec) -> tuple[int, ...]:
    array = np.asarray(signal)
    if array.ndim != 2 or array.shape[1] != IMU_CHANNELS or array.shape[0] % IMU_FRAMES_PER_TOKEN:
        raise ValueError(f"an IMU recording must be [4k frames, {IMU_CHANNELS}], got shape {list(array.shape)}")
    return (array.shape[0],)


DEPTH = Modality(name="depth", encoder="vision",
                 shape=lambda depth, spec: IMAGE.shape(_depth_as_image(depth), spec),
                 item_tokens=IMAGE.item_tokens,
                 build=lambda depth, spec: IMAGE.build(_depth_as_image(depth), spec))
IMU = Modality(name="imu", encoder="motion", shape=_imu_shape,
               item_tokens=lambda shape, spec: [shape[0] // IMU_FRAMES_PER_TOKEN],
               build=lambda signal, spec: (np.asarray(signal, np.float32), np.array([len(signal)], np.int64)))
MOTION = EncoderFormat(
    name="motion",
    inputs=(EncoderInput("signal", per_item=False, dtype="float32", trailing=lambda spec: (IMU_CHANNELS,)),
            EncoderInput("lengths", per_item=True, dtype="int64", trailing=lambda spec: ())),
    item_tokens=lambda per_item, spec: np.asarray(per_item["lengths"]).reshape(-1) // IMU_FRAMES_PER_TOKEN,
    rows_per_token=lambda spec: IMU_FRAMES_PER_TOKEN,
    tokens_per_output=lambda spec: 1,
)
ROLES = TokenRoles(placeholders=(("image", 2), ("video", 2), ("audio", 3), ("depth", 4), ("imu", 5)))
SPEC = packing_spec(roles=ROLES, extra_modalities=(DEPTH, IMU), extra_encoders=(MOTION,))
CONFIG = ReferenceMLLMConfig.tiny()


def _motion_encoder() -> AudioEncoder:
    return AudioEncoder(AudioEncoderConfig(n_mels=IMU_CHANNELS, dim=32, n_layers=1, n_heads=4), CONFIG.llm.dim)


def _model() -> ReferenceMLLM:
    return ReferenceMLLM(CONFIG, encoders={"motion": _motion_encoder()}, packing=SPEC)


def _sample(rng: np.random.Generator, key: str, text: int, *, depth: list[tuple[int, int]] = (),
            imu: list[int] = (), images: list[tuple[int, int]] = ()) -> DecodedSample:
    media = {
        "image": [rng.integers(0, 256, (r * 14, c * 14, 3), dtype=np.uint8) for r, c in images],
        "depth": [rng.integers(0, 256, (r * 14, c * 14), dtype=np.uint8) for r, c in depth],
        "imu": [rng.standard_normal((frames, IMU_CHANNELS)).astype(np.float32) for frames in imu],
    }
    return DecodedSample(key, rng.integers(ROLES.first_free_id, 256, text), media=media)


# ------------------------------------------------------------------------------------- packing and cost features
def test_packer_lays_out_each_modality_in_spec_order() -> None:
    rng = np.random.default_rng(0)
    sample = _sample(rng, "all", 5, images=[(2, 2)], depth=[(4, 2)], imu=[8, 12])
    batch = pack_samples([sample], SPEC)
    ids = batch["input_ids"].tolist()
    # BOS, 1 image output (4 patches merged 2x2), 2 depth outputs, 2 + 3 IMU outputs, then the text.
    assert ids[:9] == [ROLES.bos, 2, 4, 4, 5, 5, 5, 5, 5]
    assert ids[9:] == sample.tokens.tolist()
    assert batch[input_key("motion", "lengths")].tolist() == [8, 12]
    signal = torch.from_numpy(np.concatenate(sample.media["imu"]))
    torch.testing.assert_close(batch[input_key("motion", "signal")], signal)
    assert batch[input_key("vision", "grids")].tolist() == [[2, 2], [4, 2]]  # the image, then the depth map
    assert (batch["labels"][:8] == -100).all() and batch["labels"][8] == sample.tokens[0]  # the next token is text

    features = sample_features(sample, SPEC.encoder_names, SPEC)
    assert features.tolist() == work_features(SPEC.encoder_names, {"vision": [4, 8], "motion": [2, 3]},
                                              [len(ids)]).tolist()


def test_an_unknown_modality_or_bad_item_is_named() -> None:
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match="modality 'imu' has no encoder"):
        pack_samples([_sample(rng, "x", 3, imu=[8])])  # the built-in packing knows no IMU
    bad = DecodedSample("odd", np.array([7, 8]), media={"imu": [np.zeros((6, IMU_CHANNELS), np.float32)]})
    with pytest.raises(ValueError, match=r"sample odd: imu 0: an IMU recording must be"):
        pack_samples([bad], SPEC)


def test_cost_model_prices_the_new_encoder_and_insists_on_it() -> None:
    model = _model()
    cost = model.cost_model()
    assert cost.encoder_names == ("vision", "audio", "motion")
    assert cost.motion == model.motion.cost()
    sample = _sample(np.random.default_rng(2), "s", 4, imu=[16])
    features = sample_features(sample, cost.encoder_names, SPEC)
    priced = cost.replace(motion=ModuleCost(linear=1.0, quadratic=0.0)).module_costs(features).sum()
    unpriced = cost.replace(motion=ModuleCost(linear=0.0, quadratic=0.0)).module_costs(features).sum()
    assert priced - unpriced == pytest.approx(16 / IMU_FRAMES_PER_TOKEN)
    with pytest.raises(ValueError, match="does not price"):
        work_features(("vision", "audio"), {"motion": [4]}, [10])
    with pytest.raises(ValueError, match="give OmniDataModule the model's cost model"):
        ReorderedStream(_ListLoader([]), group=None, group_index=0, cost_model=CostModel(**{
            k: v for k, v in cost.encoders.items() if k != "motion"}, llm=cost.llm),
            settings=ReorderSettings(samples_per_step=1), packing=SPEC)


# --------------------------------------------------------------------------------------------------- the model
def test_forward_takes_each_modality_from_its_encoder() -> None:
    torch.manual_seed(0)
    model = _model()
    rng = np.random.default_rng(3)
    sample = _sample(rng, "mix", 6, images=[(2, 4)], depth=[(2, 2)], imu=[8])
    batch = pack_samples([sample], SPEC)
    with torch.no_grad():
        embeddings = model.embed(batch, model.encode(batch))
        ids = batch["input_ids"]

        def encoded(modality: Modality, item: Any) -> torch.Tensor:
            inputs = [torch.from_numpy(np.asarray(a)) for a in modality.build(item, SPEC)]
            return getattr(model, modality.encoder)(*inputs)

        torch.testing.assert_close(embeddings[ids == 2], encoded(IMAGE, sample.media["image"][0]))
        torch.testing.assert_close(embeddings[ids == 4], encoded(DEPTH, sample.media["depth"][0]))
        torch.testing.assert_close(embeddings[ids == 5], encoded(IMU, sample.media["imu"][0]))
        text = ids >= ROLES.first_free_id
        torch.testing.assert_close(embeddings[text], model.llm.embed_tokens(ids[text]))
    assert {k.split(".")[0] for k in model.state_dict()} == {"vision", "audio", "motion", "llm"}


def test_an_encoder_stage_may_hand_more_outputs_per_item() -> None:
    """Outputs beyond the first (features a model injects deeper, as Qwen3-VL's DeepStack does) travel with the
    first; the reference model puts the first into the placeholders and leaves the rest to models that use them."""
    torch.manual_seed(0)
    model = _model()
    batch = pack_samples([_sample(np.random.default_rng(4), "deep", 5, depth=[(2, 2)], imu=[8])], SPEC)
    with torch.no_grad():
        encoded = model.encode(batch)
        deeper = {name: (outputs[0], torch.full_like(outputs[0], 7.0)) for name, outputs in encoded.items()}
        torch.testing.assert_close(model(batch, deeper), model(batch, encoded), rtol=0, atol=0)


# ------------------------------------------------------------------------------------ the loader's reordering
class _ListLoader:
    """What ReorderedStream reads from: records one at a time, with a resumable position."""

    def __init__(self, records: list[DecodedSample]) -> None:
        self.records, self.position = records, 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.position = state["position"]

    def __iter__(self) -> Iterator[DecodedSample]:
        while True:
            record = self.records[self.position % len(self.records)]
            self.position += 1
            yield record


def _rank_records(rank: int) -> list[DecodedSample]:
    rng = np.random.default_rng(100 + rank)
    if rank == 0:  # every heavy sample lands on rank 0: reordering must move some of them, IMU arrays included
        return [_sample(rng, f"heavy{i}", 6, depth=[(8, 8)], imu=[64]) for i in range(4)]
    return [_sample(rng, f"light{i}", 4) for i in range(4)]


def _check_reordering(rank: int, world: int) -> None:
    cost = _model().cost_model()
    stream = ReorderedStream(_ListLoader(_rank_records(rank)), group=dist.group.WORLD, group_index=0, cost_model=cost,
                            settings=ReorderSettings(samples_per_step=2, group_steps=2), packing=SPEC)
    batches = [b for _, b in zip(range(2), stream, strict=False)]
    keys = [k for b in batches for k in b["keys"]]
    everyone: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(everyone, keys)
    assert sorted(k for ks in everyone for k in ks) == sorted(
        s.key for r in range(world) for s in _rank_records(r)), everyone
    assert batches[-1]["reorder"]["samples_moved"] > 0
    originals = {s.key: s for r in range(world) for s in _rank_records(r)}
    for batch in batches:  # what was packed is what was read, wherever it was read
        expected = pack_samples([originals[k] for k in batch["keys"]], SPEC)
        for name in (input_key("motion", "signal"), input_key("vision", "patches"), "input_ids"):
            torch.testing.assert_close(batch[name], expected[name], rtol=0, atol=0)


@pytest.mark.distributed
def test_reordering_moves_samples_of_the_new_modalities() -> None:
    run_distributed(_check_reordering, 2)


# ------------------------------------------------------------------------------- resharding and long-short SP
def _parity_samples(rank: int) -> list[DecodedSample]:
    rng = np.random.default_rng(200 + rank)
    return {  # a huge depth map and a long recording on rank 0, short ones elsewhere, a rank with text only
        0: [_sample(rng, "huge", 7, depth=[(16, 16)], imu=[96])],
        1: [_sample(rng, "text", 12)],
        2: [_sample(rng, "small", 5, images=[(2, 2)], depth=[(2, 4)], imu=[8])],
        3: [_sample(rng, "imu", 4, imu=[20, 12])],
    }[rank]


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    return _model().state_dict()


def _check_resharded_parity(rank: int, world: int) -> None:
    dims = ParallelDims(world_size=world, dp_shard=world, enc_sp=2)
    layout = build_layout(dims, "cpu", pipeline=PipelineSettings(), placement=PlacementSettings(), reshard=True,
                          link_cost="compute_only")  # moves and splits are what is tested
    with torch.device("meta"):
        model = _model()
    step = build_step(model, layout, device=torch.device("cpu"))
    model.to_empty(device="cpu")
    set_model_state_dict(model, _state(), options=StateDictOptions(full_state_dict=True, strict=True))

    batch = pack_samples(_parity_samples(rank), SPEC)
    step.source.start([batch], train=True)
    loss_sum, tokens = next_token_loss_sum(model(batch, step.source.outputs(0)), batch["labels"])
    totals = torch.stack([loss_sum.detach(), tokens.float()])
    dist.all_reduce(totals)
    (loss_sum * (world / totals[1])).backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    stats = step.encoder_stats

    reference = _model()
    reference.load_state_dict(_state())
    union = pack_samples([s for r in range(world) for s in _parity_samples(r)], SPEC)
    ref_sum, ref_tokens = next_token_loss_sum(reference(union), union["labels"])
    (ref_sum / ref_tokens).backward()
    torch.testing.assert_close(float(totals[0] / totals[1]), (ref_sum / ref_tokens).item(), rtol=1e-5, atol=0)
    for name, p in reference.named_parameters():
        error = (grads[name] - p.grad).norm().item()
        assert error <= 1e-4 * p.grad.norm().item() + 1e-8, f"gradient of {name} differs by {error:.3g}"
    assert all(grads[n].abs().sum() > 0 for n in grads if n.startswith("motion.")), "the motion encoder trained"
    assert stats["items_moved"] >= 1 and stats["items_split"] >= 1, stats


@pytest.mark.distributed
def test_resharded_step_with_the_new_modalities_matches_one_process() -> None:
    """Depth maps share the vision tower's plan, IMU recordings get the motion encoder's own, long items of both are
    split over SP pairs; loss and every gradient equal one process running the union of the ranks' samples."""
    run_distributed(_check_resharded_parity, 4)
