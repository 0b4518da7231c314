"""Pipeline parallelism: stage planning and micro-batch cutting (pure), training parity, checkpoints across layouts.

Tolerance: the foundation's (losses 1e-4 relative, gradients 1e-4 of their norm; see test_parity.py). A pipeline
computes every micro-batch's loss with the same operations as one process; only the order of fp32 gradient
accumulation over micro-batches differs.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lightning.fabric.strategies.fsdp import _METADATA_FILENAME
from lightning_runs import (
    LEARNING_RATE,
    RecordBatches,
    RecordRun,
    assert_resumes_under,
    fit,
    merged_grads,
    reference_run,
)
from test_parity import STEPS, _assert_grads_match

from omni_lightning import OmniDataModule, OmniModule, ReferenceMLLM
from omni_lightning.balance.cost import CostModel, ModuleCost
from omni_lightning.balance.pipeline_order import assign_encoder_items
from omni_lightning.batch import BYTE_ROLES
from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.data.relay import payload_keys
from omni_lightning.modalities import DEFAULT_PACKING
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.flops import reference_cost_model
from omni_lightning.runtime import joint as joint_pipeline
from omni_lightning.runtime.items import split_micro_batches
from omni_lightning.runtime.joint import JointEncoders, _item_order, share_items
from omni_lightning.runtime.loss import next_token_loss_sum
from omni_lightning.runtime.pipeline import assign_layers, layer_costs, stage_ids_of_rank

# The byte tokens' roles (ids 0-3) and their first text id.
FIRST_TEXT_ID = BYTE_ROLES.first_free_id


# -------------------------------------------------------------------------------------------------- planning
@given(st.lists(st.floats(0.1, 10.0), min_size=1, max_size=12), st.integers(1, 6), st.floats(0.0, 20.0))
def test_layer_assignment_is_contiguous_and_optimal(costs: list[float], stages: int, head: float) -> None:
    if len(costs) < stages:
        with pytest.raises(ValueError, match="cannot fill"):
            assign_layers(costs, stages, last_cost=head)
        return
    plan = assign_layers(costs, stages, last_cost=head)
    assert [i for stage in plan for i in stage] == list(range(len(costs)))
    assert all(plan)

    def peak(cuts: list[list[int]]) -> float:
        loads = [sum(costs[i] for i in stage) for stage in cuts]
        loads[-1] += head
        return max(loads)

    # Brute force over every way to cut the layers into `stages` non-empty runs.
    import itertools

    best = min(
        peak([list(range(a, b)) for a, b in zip((0, *cut), (*cut, len(costs)), strict=True)])
        for cut in itertools.combinations(range(1, len(costs)), stages - 1)
    )
    assert peak(plan) <= best + 1e-9


def test_head_weight_moves_layers_off_the_last_stage() -> None:
    costs, head = layer_costs(ReferenceMLLMConfig().llm)
    assert assign_layers([1.0] * 4, 2) == [[0, 1], [2, 3]]
    assert assign_layers([1.0] * 4, 2, last_cost=2.0) == [[0, 1, 2], [3]]
    assert head > 0 and len(costs) == ReferenceMLLMConfig().llm.n_layers


def test_loop_placement() -> None:
    assert stage_ids_of_rank(1, 4, 2) == [1, 5]
    assert stage_ids_of_rank(0, 2, 1) == [0]


def _samples() -> list[DecodedSample]:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (28, 56, 3), dtype=np.uint8)  # 2x4 patches: 2 merged tokens
    return [
        DecodedSample("text", rng.integers(FIRST_TEXT_ID, 256, 9)),
        DecodedSample("image", rng.integers(FIRST_TEXT_ID, 256, 4), [image, image]),
        DecodedSample("audio", rng.integers(FIRST_TEXT_ID, 256, 5), mel=rng.standard_normal((8, 80)).astype("f4")),
        DecodedSample("both", rng.integers(FIRST_TEXT_ID, 256, 6), [image], rng.standard_normal((4, 80)).astype("f4")),
    ]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_split_micro_batches_equals_packing_the_groups(n: int) -> None:
    samples = _samples()
    parts = split_micro_batches(pack_samples(samples), n, DEFAULT_PACKING)
    assert len(parts) == n
    keys = [k for part in parts for k in part["keys"]]
    assert keys == [s.key for s in samples]  # every sample once, in order
    for part in parts:
        if not part["keys"]:  # a filler: one token, no loss
            assert part["num_samples"] == 0 and (part["labels"] == -100).all()
            continue
        expected = pack_samples([s for s in samples if s.key in part["keys"]])
        for name, value in expected.items():
            if isinstance(value, torch.Tensor) and value.numel():
                torch.testing.assert_close(part[name], value, msg=f"{name} of {part['keys']}")


# ---------------------------------------------------------------------------------------------------- parity
DENSE, MOE = ReferenceMLLMConfig.tiny(), ReferenceMLLMConfig.tiny(moe=True)
LAYOUTS = {
    "pp2_1f1b": ({"pp": 2, "dp_shard": 1}, 2, DENSE),
    "pp2_gpipe_4mb": ({"pp": 2, "dp_shard": 1, "pp_schedule": "GPipe", "pp_microbatches": 4}, 2, DENSE),
    "pp2_interleaved": ({"pp": 2, "dp_shard": 1, "pp_schedule": "Interleaved1F1B", "pp_virtual_stages": 2}, 2,
                        DENSE),
    "pp2_zero_bubble": ({"pp": 2, "dp_shard": 1, "pp_schedule": "InterleavedZeroBubble", "pp_virtual_stages": 2}, 2,
                        DENSE),
    "pp2_dp2": ({"pp": 2, "dp_shard": 2}, 4, DENSE),
    "pp2_tp2": ({"pp": 2, "dp_shard": 1, "tp": 2}, 4, DENSE),
    "pp2_moe": ({"pp": 2, "dp_shard": 1}, 2, MOE),
    "pp2_dp2_ep2_moe": ({"pp": 2, "dp_shard": 2, "ep": 2}, 4, MOE),
    "pp2_tp2_moe": ({"pp": 2, "dp_shard": 1, "tp": 2}, 4, MOE),
    "pp2_dp2_tp2": ({"pp": 2, "dp_shard": 2, "tp": 2}, 8, DENSE),
    "pp2_dp2_cp2": ({"pp": 2, "dp_shard": 2, "cp": 2}, 8, DENSE),
    "pp2_dp2_enc_sp2": ({"pp": 2, "dp_shard": 2, "enc_sp": 2}, 4, DENSE),
    "pp2_tp2_cp2": ({"pp": 2, "dp_shard": 1, "tp": 2, "cp": 2}, 8, DENSE),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_matches_single_process(name: str, tmp_path: Path, tiny_shards: str, seed_checkpoint: Path,
                                         moe_seed: Path) -> None:
    """Every schedule, and pipelines composed with FSDP, TP, CP and EP (dense and MoE), on 2-8 ranks."""
    layout, devices, config = LAYOUTS[name]
    seed = moe_seed if config is MOE else seed_checkpoint
    module = OmniModule(config, learning_rate=LEARNING_RATE, init_checkpoint=str(seed))
    fit(tmp_path, tiny_shards, seed, layout=layout, devices=devices, max_steps=STEPS, module=module,
        gradient_clip_val=1.0, callbacks=[RecordRun(tmp_path, grads=True)])
    ref_losses, ref_grads = reference_run(tiny_shards, seed, dp_size=layout["dp_shard"], steps=STEPS, clip=1.0,
                                          config=config,
                                          pipeline_micro_batches=layout.get("pp_microbatches", layout["pp"]))
    losses = json.loads((tmp_path / "losses.json").read_text())
    torch.testing.assert_close(torch.tensor(list(losses.values())), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    _assert_grads_match(merged_grads(tmp_path), ref_grads, name)


@pytest.mark.distributed
def test_pipeline_checkpoint_resumes_without_pipeline(tmp_path: Path, tiny_shards: str,
                                                      seed_checkpoint: Path) -> None:
    """A checkpoint written by pp=2 x dp_shard=2 (each rank holding half the layers) resumes under dp_shard=2 x
    tp=2, with the same data position, and continues like the uninterrupted pipeline run."""
    assert_resumes_under(tmp_path, tiny_shards, seed_checkpoint, saved={"pp": 2, "dp_shard": 2},
                         resumed={"dp_shard": 2, "tp": 2})


@pytest.mark.distributed
def test_relayed_loader_position_resumes_exactly(tmp_path: Path, tiny_shards: str, seed_checkpoint: Path) -> None:
    """With encoders on stage 0, stage 1 checkpoints the loader position stage 0 relayed, so both stages' saved
    positions are the same, and a resumed run continues exactly where the uninterrupted one went on."""
    layout = {"pp": 2, "dp_shard": 2, "pp_encoders": "first_stage"}
    checkpoint = assert_resumes_under(tmp_path, tiny_shards, seed_checkpoint, saved=layout, resumed=layout,
                                      datamodule=lambda: OmniDataModule(tiny_shards, samples_per_step=4))
    ranks = torch.load(checkpoint / _METADATA_FILENAME, weights_only=False)["omni"]["ranks"]
    assert [r["dp_rank"] for r in ranks] == [0, 1, 0, 1]
    assert ranks[0]["loader"] == ranks[2]["loader"] and ranks[1]["loader"] == ranks[3]["loader"]
    assert ranks[0]["loader"] != ranks[1]["loader"]


# ---------------------------------------------------------------------------------------------- joint pipeline
def test_items_are_shared_by_predicted_cost() -> None:
    vision = reference_cost_model(ReferenceMLLMConfig.tiny()).vision
    loads = np.zeros(2)
    owner = share_items(np.array([64, 64, 4, 4, 4, 4]), vision, loads)
    assert owner[:2].tolist() == [1, 0]  # the two big items go to different ranks, the first one off stage 0
    assert loads.max() / loads.min() < 1.1
    # The running loads carry over: the next micro-batch's big item goes where there is least work so far.
    assert share_items(np.array([64]), vision, np.array([5.0, 1.0]))[0] == 1
    assert share_items(np.zeros(0), vision, np.zeros(4)).size == 0
    # The last micro-batches' items stay off stage 0, whose encoder backward of them would end the step late.
    tail = share_items(np.array([64, 64, 64, 4]), vision, np.zeros(3), off_first_stage=True)
    assert 0 not in tail and set(tail.tolist()) == {1, 2}


def test_outputs_return_to_item_order() -> None:
    rows, owner = np.array([2, 1, 3]), np.array([1, 0, 1])
    arrival = [1, 0, 0, 2, 2, 2]  # arrival order: item 1 (rank 0), item 0, item 2 (rank 1)
    order = _item_order(rows, owner, 2)
    assert [arrival[i] for i in order] == [0, 0, 1, 2, 2, 2]


def _joint_step_plan(joint: JointEncoders, micro_batches: list[dict[str, object]]) -> np.ndarray:
    """The owner of every item of the step, vision then audio per micro-batch, as ``start`` plans it."""
    joint.start(micro_batches, train=True)
    owners = np.concatenate([items.owner for m in range(len(micro_batches)) for items in joint._items[m]])
    joint._items.clear()
    return owners


def test_calibrated_joint_plan_uses_the_measured_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``JointEncoders.calibrate`` swaps the FLOP prices of the 1F1B item plan for measured ones: the plan is then
    exactly ``assign_encoder_items`` on the measured costs and forward shares, and differs from the FLOP plan."""
    pp = 4
    monkeypatch.setattr(joint_pipeline.dist, "get_world_size", lambda group=None: pp)
    monkeypatch.setattr(joint_pipeline.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(JointEncoders, "_post_receives", lambda self, m: None)  # no peers to receive from
    config = ReferenceMLLMConfig.tiny()
    with torch.device("meta"):
        model = ReferenceMLLM(config)
    flops = reference_cost_model(config)
    joint = JointEncoders(model, {"outputs": None, "gradients": None},  # type: ignore[dict-item]
                          {"vision": flops.vision, "audio": flops.audio},
                          n_microbatches=8, lag=pp, one_f_one_b=True)
    rng = np.random.default_rng(0)
    micro_batches = []
    for m in range(8):
        sides = [(2 + int(rng.integers(0, 10)) * 2, 2 + int(rng.integers(0, 10)) * 2) for _ in range(1 + m % 3)]
        images = [rng.integers(0, 256, (h * 14, w * 14, 3), dtype=np.uint8) for h, w in sides]
        mel = rng.standard_normal((4 * int(rng.integers(2, 16)), 80)).astype("f4")
        micro_batches.append(pack_samples([DecodedSample(str(m), rng.integers(FIRST_TEXT_ID, 256, 40), images, mel)]))
    flop_plan = _joint_step_plan(joint, micro_batches)

    with pytest.raises(ValueError, match="forward_share=1.0"):
        joint.calibrate(flops, forward_share=1.0, encoder_forward_share=0.5)
    # Measured on a device where the encoders run slowly next to the LLM and forwards take more than a third.
    measured = CostModel(vision=ModuleCost(flops.vision.linear * 40, flops.vision.quadratic * 40),
                         audio=ModuleCost(flops.audio.linear * 40, 0.0), llm=flops.llm)
    joint.calibrate(measured, forward_share=0.45, encoder_forward_share=0.4)
    calibrated_plan = _joint_step_plan(joint, micro_batches)

    item_costs, micro_batch, llm = [], [], []
    for m, batch in enumerate(micro_batches):
        grids = batch["vision_grids"]
        vision_tokens = (grids[:, 0] * grids[:, 1]).numpy().astype(np.float64)
        audio_tokens = (batch["audio_lengths"].numpy() // config.audio.downsample).astype(np.float64)
        for cost, tokens in ((measured.vision, vision_tokens), (measured.audio, audio_tokens)):
            item_costs.extend((cost.linear * tokens + cost.quadratic * tokens**2).tolist())
            micro_batch.extend([m] * tokens.size)
        lengths = np.diff(batch["cu_seqlens"].numpy().astype(np.float64))
        llm.append(measured.llm(lengths.sum(), (lengths * (lengths + 1) / 2).sum()))
    expected = assign_encoder_items(np.array(llm), np.array(micro_batch), np.array(item_costs), pp,
                                    forward_share=0.45, encoder_forward_share=0.4)
    assert calibrated_plan.tolist() == expected.tolist()
    assert calibrated_plan.tolist() != flop_plan.tolist()

    # Told that the first stage runs more of the LLM (it embeds), the plan is the one for those stage shares.
    heavy_first = (1.3, 1.0, 1.0, 1.0)
    joint.calibrate(measured, forward_share=0.45, encoder_forward_share=0.4, stage_shares=heavy_first)
    shared_plan = _joint_step_plan(joint, micro_batches)
    expected = assign_encoder_items(np.array(llm), np.array(micro_batch), np.array(item_costs), pp,
                                    forward_share=0.45, encoder_forward_share=0.4, stage_shares=np.array(heavy_first))
    assert shared_plan.tolist() == expected.tolist()
    assert shared_plan.tolist() != calibrated_plan.tolist()
    for bad in ((1.0, 1.0, 1.0), (1.0, 0.0, 1.0, 1.0), (1.0, float("inf"), 1.0, 1.0)):
        with pytest.raises(ValueError, match="positive, finite share for each of the 4 pipeline stages"):
            joint.calibrate(measured, forward_share=0.45, encoder_forward_share=0.4, stage_shares=bad)


class _JointProbe(pl.Callback):
    """Rank 0 records, each step, the order encoder work ran in and the most micro-batches alive at once."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.steps = out_dir, []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: object) -> None:
        joint = module.pipeline.source
        self.steps.append({"done": joint.done, "peak": joint.peak_in_flight})
        if trainer.global_rank == 0:
            (self.out_dir / "joint.json").write_text(json.dumps(self.steps))


@pytest.mark.distributed
def test_joint_pipeline_bounds_encoder_activations(tmp_path: Path, tiny_shards: str, seed_checkpoint: Path) -> None:
    """pp=2, 1F1B, 6 micro-batches a step: every micro-batch is encoded once, in order, and at most 2 pp - 1 of
    them hold encoder activations at a time (GPipe-style pre-encoding would hold all 6)."""
    layout = {"pp": 2, "dp_shard": 1, "pp_microbatches": 6}
    fit(tmp_path, tiny_shards, seed_checkpoint, layout=layout, devices=2, max_steps=2,
        callbacks=[_JointProbe(tmp_path)])
    steps = json.loads((tmp_path / "joint.json").read_text())
    assert [s["done"] for s in steps] == [list(range(6))] * 2
    assert all(s["peak"] <= 3 for s in steps), steps


class _CalibrationProbe(pl.Callback):
    """Every rank records, after each step, the figures its joint pipeline plans items with."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.steps = out_dir, []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: object) -> None:
        joint = module.pipeline.source
        self.steps.append({"vision": [joint.costs["vision"].linear, joint.costs["vision"].quadratic],
                           "llm": [joint.llm_cost.linear, joint.llm_cost.quadratic],
                           "forward_share": joint.forward_share, "stage_shares": joint.stage_shares is not None
                           and joint.stage_shares.tolist()})
        (self.out_dir / f"figures_rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))


@pytest.mark.distributed
@pytest.mark.parametrize(("layout", "devices"), [({"pp": 2, "dp_shard": 1}, 2), ({"pp": 2, "dp_shard": 2}, 4)],
                         ids=["pp2", "pp2_dp2"])
def test_joint_pipeline_calibrates_its_item_plan_from_its_first_steps(layout: dict[str, int], devices: int,
                                                                      tmp_path: Path, tiny_shards: str,
                                                                      seed_checkpoint: Path) -> None:
    """With ``pp_calibration_steps=2`` the joint pipeline plans in FLOPs through step 2 (step 0 is not timed), then
    from step 3 on with figures fitted to the timed steps 1 and 2: in seconds, the same on every rank (each computes
    the plan itself; data-parallel peers reshard items between them, so they fit their records together), each
    stage's share of the LLM time summing to one."""
    fit(tmp_path, tiny_shards, seed_checkpoint, layout={**layout, "pp_microbatches": 4, "pp_calibration_steps": 2},
        devices=devices, max_steps=4, callbacks=[_CalibrationProbe(tmp_path)])
    ranks = [json.loads((tmp_path / f"figures_rank{r}.json").read_text()) for r in range(devices)]
    assert all(rank == ranks[0] for rank in ranks)
    flops = reference_cost_model(ReferenceMLLMConfig.tiny())
    steps = ranks[0]
    assert [s["stage_shares"] for s in steps[:2]] == [False, False]
    assert all(s["llm"] == [flops.llm.linear, flops.llm.quadratic] for s in steps[:2])
    for calibrated in steps[2:]:
        assert sum(calibrated["stage_shares"]) == pytest.approx(1.0)
        assert 0 < calibrated["llm"][0] < 1e-3 * flops.llm.linear  # seconds per token, not FLOPs
        assert 0 < calibrated["forward_share"] < 1
    assert steps[2] == steps[3]  # calibrated once


class _EncodedItems(pl.Callback):
    """Every rank records, each step, how many items it encoded, how many the step held, and how many the encoder
    balancer moved between data-parallel peers."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.steps = out_dir, []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: object,
                           batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        held = int(batch["vision_grids"].shape[0] + batch["audio_lengths"].numel())
        joint = module.pipeline.source
        self.steps.append([joint.items_encoded, held, joint.items_moved])
        (self.out_dir / f"items_rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))


@pytest.mark.distributed
def test_tensor_parallel_peers_split_their_stages_encoder_work(tmp_path: Path, tiny_shards: str,
                                                              seed_checkpoint: Path) -> None:
    """pp=2 x tp=2: every image and clip of a step is encoded by exactly one of the four ranks (a stage's TP peers
    split its share instead of both encoding all of it), and both peers of some stage do encode."""
    fit(tmp_path, tiny_shards, seed_checkpoint, layout={"pp": 2, "dp_shard": 1, "tp": 2, "pp_microbatches": 4},
        devices=4, max_steps=4, callbacks=[_EncodedItems(tmp_path)])
    ranks = [json.loads((tmp_path / f"items_rank{r}.json").read_text()) for r in range(4)]
    for step in range(4):
        held = {rank[step][1] for rank in ranks}
        assert len(held) == 1 and sum(rank[step][0] for rank in ranks) == held.pop()
    # Ranks are laid out pp-major: 0 and 1 are stage 0's TP peers, 2 and 3 stage 1's.
    assert any(all(ranks[r][step][0] for r in peers) for peers in ((0, 1), (2, 3)) for step in range(4))


@pytest.mark.distributed
def test_joint_pipeline_reshards_items_over_data_parallel_peers(tmp_path: Path, tiny_shards: str,
                                                                seed_checkpoint: Path) -> None:
    """pp=2 x dp_shard=2 with enc_sp=2: at each insertion a stage's two data-parallel peers plan their items together
    (long-short SP, as without a pipeline), so items move between the replicas; every item is still one rank's, and
    the run matches one process (the LAYOUTS parity case ``pp2_dp2_enc_sp2``)."""
    fit(tmp_path, tiny_shards, seed_checkpoint, layout={"pp": 2, "dp_shard": 2, "pp_microbatches": 2, "enc_sp": 2},
        devices=4, max_steps=4, callbacks=[_EncodedItems(tmp_path)])
    ranks = [json.loads((tmp_path / f"items_rank{r}.json").read_text()) for r in range(4)]
    for replica in ((0, 2), (1, 3)):  # pp is outermost: ranks 0 and 2 are replica 0's stages
        for step in range(4):
            assert sum(ranks[r][step][0] for r in replica) == ranks[replica[0]][step][1]
    assert sum(rank[step][2] for rank in ranks for step in range(4)) > 0


@pytest.mark.distributed
@pytest.mark.parametrize("encoders", ["joint", "first_stage"])
def test_balanced_data_module_feeds_whole_steps_to_the_pipeline(encoders: str, tmp_path: Path, tiny_shards: str,
                                                                 seed_checkpoint: Path) -> None:
    """OmniDataModule under pp=2 x dp_shard=2 plans the schedule's 4 micro-batches per step and hands them over
    together; the step's gradient equals one process's over those micro-batches of both data-parallel ranks.
    With encoders on stage 0 only, stage 1 reads no shard: it gets stage 0's token layout without the payloads."""
    data = OmniDataModule(tiny_shards, samples_per_step=4, group_steps=2)
    layout = {"pp": 2, "dp_shard": 2, "pp_microbatches": 4, "pp_encoders": encoders}
    fit(tmp_path, tiny_shards, seed_checkpoint, layout=layout, max_steps=2, datamodule=data,
        callbacks=[RecordRun(tmp_path, grads=True), RecordBatches(tmp_path)])
    ranks = [torch.load(tmp_path / f"batches_rank{r}.pt", weights_only=False) for r in range(4)]
    steps = [ranks[r][0] for r in (0, 1)]  # stage 0, dp 0/1, the first step (the gradients recorded are its)
    assert all(len(step["micro_batches"]) == 4 for step in steps)
    payloads = set(payload_keys(DEFAULT_PACKING))
    for stage0, stage1 in ((ranks[0], ranks[2]), (ranks[1], ranks[3])):  # pipeline peers (pp is outermost)
        for first, later in zip(stage0, stage1, strict=True):
            for mb0, mb1 in zip(first["micro_batches"], later["micro_batches"], strict=True):
                assert mb0["keys"] == mb1["keys"]
                torch.testing.assert_close(mb0["labels"], mb1["labels"])
                assert payloads <= mb1.keys() if encoders == "joint" else not payloads & mb1.keys()
    micro = [mb for step in steps for mb in step["micro_batches"]]
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    model.load_state_dict(torch.load(seed_checkpoint, weights_only=True))
    sums, counts = zip(*(next_token_loss_sum(model(mb), mb["labels"]) for mb in micro), strict=True)
    (torch.stack(sums).sum() / torch.stack(counts).sum()).backward()
    reference = {name: p.grad for name, p in model.named_parameters()}
    _assert_grads_match(merged_grads(tmp_path), reference, "pipelined OmniDataModule")
