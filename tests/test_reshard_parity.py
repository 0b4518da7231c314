"""Encoder resharding with long-short SP: the row bookkeeping (pure) and gradient parity on 4 gloo ranks.

Parity tolerance: loss within 1e-5 relative, every gradient within 1e-4 of its norm (the foundation's parity
tolerance). Resharding changes only where an item is encoded and in which order fp32 sums happen (FSDP's
reduce-scatter, Ulysses's head split), which perturbs results by ~1e-7 relative; a lost, duplicated or misplaced
item or chunk changes the loss by far more than 1e-5 (it moves embeddings of the wrong image onto placeholders).
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.distributed as dist
from autograd_graph import backward_node_kinds
from built_step import built_step
from distributed import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.balance.reshard import GPU_NETWORK, GPU_NVLINK, plan_encoder_work, plan_item_exchange
from omni_lightning.batch import BYTE_ROLES
from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.module import initial_state_dict
from omni_lightning.parallel.dims import ParallelDims
from omni_lightning.parallel.fsdp import apply_fsdp
from omni_lightning.parallel.layout import build_layout, ranks_span_nodes
from omni_lightning.parallel.settings import PipelineSettings, PlacementSettings
from omni_lightning.runtime.loss import next_token_loss_sum
from omni_lightning.runtime.reshard import Resharder
from omni_lightning.runtime.step import StepOptions, _reshard_pricing

# The byte tokens' roles (ids 0-3) and their first text id.
FIRST_TEXT_ID = BYTE_ROLES.first_free_id


# ------------------------------------------------------------------------------------------ bookkeeping
def _simulate(lengths: np.ndarray, owners: np.ndarray, n_ranks: int, enc_sp: int, multiple: int) -> None:
    """Run every rank's exchange with numpy all-to-alls: each rank must encode exactly its planned rows, and the
    outputs must come back to their owners in item order."""
    costs = lengths.astype(float) ** 2 + 1.0
    plan = plan_encoder_work(costs, owners, n_ranks=n_ranks, enc_sp=enc_sp)
    exchanges = [plan_item_exchange(lengths, owners, plan, rank=r, n_ranks=n_ranks, multiple=multiple)
                 for r in range(n_ranks)]
    # A token is (item, position): what arrives must be exactly the items and chunks the plan gave each rank.
    tokens = [np.array([(i, p) for i in np.flatnonzero(owners == r) for p in range(lengths[i])], dtype=np.int64)
              .reshape(-1, 2) for r in range(n_ranks)]
    sent = [np.split(tokens[r][ex.send_index], np.cumsum(ex.send_counts)[:-1]) for r, ex in enumerate(exchanges)]
    for rank, ex in enumerate(exchanges):
        assert [len(sent[src][rank]) for src in range(n_ranks)] == ex.recv_counts
        local = np.concatenate([sent[src][rank] for src in range(n_ranks)])[ex.local_index]
        whole = sum(ex.whole_lengths)
        items = np.split(local[:whole], np.cumsum(ex.whole_lengths)[:-1]) if ex.whole_lengths else []
        assert sorted(int(x[0, 0]) for x in items) == [i for i in range(len(lengths)) if plan.rank_of[i] == rank]
        for item_tokens in items:
            assert item_tokens[:, 1].tolist() == list(range(len(item_tokens)))  # whole and in order
        offset = whole
        for chunk in ex.chunks:
            piece = local[offset : offset + chunk.lengths[rank - chunk.sp_start]]
            start = sum(chunk.lengths[: rank - chunk.sp_start])
            assert piece[:, 1].tolist() == list(range(start, start + len(piece)))
            offset += len(piece)
        assert offset == len(local)
        # "Encode": one output row per merge window, naming the window's first token.
        ex.outputs = local[::multiple]  # type: ignore[attr-defined]
    back = [np.split(ex.outputs[ex.back_index], np.cumsum([n // multiple for n in ex.recv_counts])[:-1])
            for ex in exchanges]
    for rank, ex in enumerate(exchanges):
        returned = np.concatenate([back[src][rank] for src in range(n_ranks)])[ex.assemble_index]
        np.testing.assert_array_equal(returned, tokens[rank][::multiple])


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 4)]),
    st.sampled_from([1, 4]),
    st.lists(st.tuples(st.integers(0, 7), st.integers(1, 40)), max_size=14),
)
def test_exchange_delivers_every_row_and_returns_it(layout: tuple[int, int], multiple: int,
                                                    items: list[tuple[int, int]]) -> None:
    n_ranks, enc_sp = layout
    items = sorted((owner % n_ranks, units * multiple) for owner, units in items)
    owners = np.array([o for o, _ in items], dtype=np.int64)
    lengths = np.array([n for _, n in items], dtype=np.int64)
    _simulate(lengths, owners, n_ranks, enc_sp, multiple)


def test_exchange_of_a_split_item_with_odd_windows() -> None:
    """One 60-token item (15 merge windows) over 4 ranks: chunks of 16, 16, 16, 12 tokens, nothing padded."""
    lengths, owners = np.array([60, 4, 8]), np.array([0, 1, 3])
    plan = plan_encoder_work(np.array([1000.0, 1.0, 2.0]), owners, n_ranks=4, enc_sp=4)
    assert plan.sp_degree[0] == 4
    exchange = plan_item_exchange(lengths, owners, plan, rank=3, n_ranks=4, multiple=4)
    assert exchange.chunks[0].lengths == (16, 16, 16, 12)
    _simulate(lengths, owners, 4, 4, 4)


def test_exchange_needs_items_ordered_by_owner() -> None:
    plan = plan_encoder_work(np.ones(2), np.array([1, 0]), n_ranks=2)
    with pytest.raises(ValueError, match="ordered by owner"):
        plan_item_exchange(np.array([4, 4]), np.array([1, 0]), plan, rank=0, n_ranks=2)


# ------------------------------------------------------------------------------------------------ parity
def _image(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    return rng.integers(0, 256, (rows * 14, cols * 14, 3), dtype=np.uint8)


def _sample(rng: np.random.Generator, key: str, text: int, images: list[tuple[int, int]] = (),
            mel_frames: int = 0) -> DecodedSample:
    mel = rng.standard_normal((mel_frames, 80)).astype(np.float32) if mel_frames else None
    return DecodedSample(key, rng.integers(FIRST_TEXT_ID, 256, text), [_image(rng, *g) for g in images], mel)


def _rank_samples(case: str, rank: int) -> list[DecodedSample]:
    rng = np.random.default_rng(1000 + rank)
    if case == "text_only":
        return [_sample(rng, f"t{rank}", 12 + rank)]
    if case == "even":  # one small image each: resharding cannot gain, so nothing travels
        return [_sample(rng, f"e{rank}", 6, [(4, 4)])]
    if case == "two_big":  # rank 0 loaded two large images: moving one whole halves the slowest rank's work
        return [_sample(rng, "big", 5, [(8, 8), (8, 8)])] if rank == 0 else [_sample(rng, f"s{rank}", 6, [(2, 2)])]
    return {  # huge, tiny and odd-length images (2x6, 6x10 patches), audio of odd token counts, a rank with none
        0: [_sample(rng, "huge", 9, [(16, 16)]), _sample(rng, "tiny+audio", 7, [(2, 2)], mel_frames=44)],
        1: [_sample(rng, "text", 20), _sample(rng, "text2", 5)],
        2: [_sample(rng, "odd", 6, [(2, 6), (6, 10)]), _sample(rng, "long_audio", 4, mel_frames=132)],
        3: [_sample(rng, "two", 8, [(4, 4), (2, 2)]), _sample(rng, "clip", 3, mel_frames=16)],
    }[rank]


def _reference(case: str, world: int, state: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    model.load_state_dict(state)
    batch = pack_samples([s for r in range(world) for s in _rank_samples(case, r)])
    loss_sum, tokens = next_token_loss_sum(model(batch), batch["labels"])
    loss = loss_sum / tokens
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(("ranks", "per_node", "spans"), [([0, 1, 2, 3], 4, False), ([4, 6], 4, False),
                                                      ([3, 4], 4, True), ([0, 8, 16], 8, True), ([5], 1, False)])
def test_a_group_spans_nodes_where_its_ranks_do(ranks: list[int], per_node: int, spans: bool) -> None:
    assert ranks_span_nodes(ranks, per_node) == spans


def test_ranks_per_node_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ranks_per_node"):
        ranks_span_nodes([0], 0)


def _check_link_of_the_encoder_group(rank: int, world: int) -> None:
    """On a GPU, ``link_cost="auto"`` prices the resharder's traffic over NVLink where its encoder group sits on one
    node and over the network where it spans nodes: the same choice on every rank."""
    dims = ParallelDims(world_size=world, dp_shard=world)
    for per_node, expected in ((world, GPU_NVLINK), (1, GPU_NETWORK), (None, GPU_NVLINK)):
        layout = build_layout(dims, "cpu", pipeline=PipelineSettings(), placement=PlacementSettings(), reshard=True,
                              ranks_per_node=per_node)
        group = layout.meshes.encoder_group
        assert layout.spans_nodes(group) == (expected is GPU_NETWORK)
        model = ReferenceMLLM(ReferenceMLLMConfig.tiny())
        pricing = _reshard_pricing(model, layout, torch.device("cuda"), StepOptions(param_dtype=torch.bfloat16), group)
        assert pricing["link"] == expected
        assert _reshard_pricing(model, layout, torch.device("cpu"), StepOptions(), group)["link"] != expected


def test_the_resharder_prices_the_links_its_encoder_group_spans() -> None:
    run_distributed(_check_link_of_the_encoder_group, 2)


def _check_parity(rank: int, world: int, layout: dict[str, int], case: str, link: str) -> None:
    config = ReferenceMLLMConfig.tiny()
    dims = ParallelDims(world_size=world, **layout)
    model, step = built_step(dims, reshard=True, link=link)
    meshes = step.meshes

    dp_rank = dims.local_rank_in("dp", rank)
    batch = pack_samples(_rank_samples(case, dp_rank))
    step.source.start([batch], train=True)
    logits = model(batch, step.source.outputs(0))
    loss_sum, tokens = next_token_loss_sum(logits, batch["labels"])
    dp_group = meshes.get("dp").get_group()
    totals = torch.stack([loss_sum.detach(), tokens.float()])
    dist.all_reduce(totals, group=dp_group)
    with loss_parallel() if isinstance(logits, DTensor) else nullcontext():
        (loss_sum * (dims.dp / totals[1])).backward()
    step.sync_gradients()  # tensor-parallel peers split the items: their encoder gradients sum, as before any step
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for name, p in model.named_parameters()}

    stats = step.encoder_stats
    ref_loss, ref_grads = _reference(case, dims.dp, initial_state_dict(config, seed=3))
    torch.testing.assert_close(float(totals[0] / totals[1]), ref_loss, rtol=1e-5, atol=0)
    for name, ref in ref_grads.items():
        error = (grads[name] - ref).norm().item()
        assert error <= 1e-4 * ref.norm().item() + 1e-8, f"gradient of {name} differs by {error:.3g}"
    if case in ("text_only", "even") or link == "auto":
        # Priced for Gloo on a CPU, the tiny model's items cost far less to encode than to move: all stay home.
        assert stats["items_moved"] == 0 and stats.get("bytes_moved", 0.0) == 0.0
    else:  # the huge image of "mixed" can only be evened out by splitting it; "two_big" by moving one whole
        # Tensor-parallel peers split the items first and each reshards its share: the plan that moved the huge
        # image is the one of the peer that took it.
        moved = torch.tensor([stats["items_moved"], stats.get("bytes_moved", 0.0), stats["items_split"],
                              float(stats["predicted_imbalance"] < stats["unbalanced_imbalance"])], dtype=torch.float64)
        dist.all_reduce(moved, op=dist.ReduceOp.MAX)
        assert moved[0] >= 1 and moved[1] > 0 and moved[3] == 1, stats
        assert (moved[2] >= 1) == (dims.enc_sp > 1), stats


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("layout", "case", "link"),
    [
        ({"dp_shard": 4, "enc_sp": 2}, "mixed", "compute_only"),
        ({"dp_shard": 4, "enc_sp": 4}, "mixed", "compute_only"),
        ({"dp_shard": 4}, "two_big", "compute_only"),
        ({"dp_shard": 2, "tp": 2, "enc_sp": 2}, "mixed", "compute_only"),
        ({"dp_shard": 4, "enc_sp": 4}, "text_only", "compute_only"),
        ({"dp_shard": 4, "enc_sp": 2}, "even", "compute_only"),
        ({"dp_shard": 4, "enc_sp": 2}, "mixed", "auto"),
    ],
    ids=["sp2", "sp4", "whole_items_only", "tp2_sp2", "text_only_step", "balanced_already", "priced_keeps_home"],
)
def test_resharded_step_matches_one_process(layout: dict[str, int], case: str, link: str) -> None:
    """Loss and every gradient of one step with resharding (and long-short SP) on 4 ranks equal one process
    running the union of the data-parallel ranks' micro-batches (TP peers read the same samples). The resharder
    plans on compute alone (``link_cost="compute_only"``), so that items move and split, except in the priced case,
    where the default CPU pricing keeps every item of the tiny model home."""
    run_distributed(_check_parity, 4, layout, case, link)


# ------------------------------------------------------------------------------ ranks left with nothing to encode
def _encoder_inputs(model: ReferenceMLLM, rank: int) -> dict[str, tuple[torch.Tensor, ...] | None]:
    """Rank 1's two images and rank 2's two audio clips; nothing else anywhere."""
    rng = np.random.default_rng(7 + rank)
    if rank == 1:
        samples = [_sample(rng, "images", 5, [(2, 4), (2, 4)])]
    else:
        samples = [_sample(rng, f"clip{i}", 5, mel_frames=32 if rank == 2 else 0) for i in range(2)]
    batch = pack_samples(samples)
    inputs = {name: model.encoder_inputs(batch, name) for name in model.encoder_names}
    return {name: x if model.encoders[name].item_tokens(*x).numel() else None for name, x in inputs.items()}


def _check_idle_ranks(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    reference = {name: {k: v.clone() for k, v in model.encoders[name].state_dict().items()}
                 for name in model.encoder_names}
    costs = {name: model.encoders[name].cost() for name in model.encoder_names}
    mesh = init_device_mesh("cpu", (world,))
    for encoder in model.encoders.values():  # as the joint pipeline shards its encoders: stem and rest are hooked
        apply_fsdp(encoder, mesh, blocks=[*encoder.blocks])
        register_fsdp_forward_method(encoder, "embed")
        register_fsdp_forward_method(encoder, "encode")
    # The LLM's work puts ranks 0-3 at 0, 1/2, 1/10 and 1 image's cost (a clip costs 0.78 of one): the images go to
    # ranks 0 and 2, the clips to ranks 1 and 0, each plan halving its encoder's busiest rank. For each encoder, one
    # rank sends every item it loaded and encodes nothing, and rank 3 has no item and encodes nothing.
    images = _encoder_inputs(model, 1)["vision"]
    tokens = model.encoders["vision"].item_tokens(*images).double()
    image_cost = float(costs["vision"](tokens, tokens**2).sum()) / 2
    resharder = Resharder(dist.group.WORLD, {}, costs, llm=ModuleCost(1.0, 0.0))
    mine = _encoder_inputs(model, rank)
    lengths = {name: (model.encoders[name].item_tokens(*x) if x is not None else torch.zeros(0, dtype=torch.int64))
               for name, x in mine.items()}
    steps = resharder.plan(lengths, {n: model.encoders[n].tokens_per_output for n in model.encoder_names},
                           (int(image_cost * (0.0, 0.5, 0.1, 1.0)[rank]), 0))
    encoders = {"vision": (0, 2), "audio": (0, 1)}
    for name in model.encoder_names:
        exchange = steps[name].exchange
        assert exchange is not None and (exchange.local_tokens > 0) == (rank in encoders[name]), (name, exchange)
    weights, outputs, previous = {}, {}, None
    for name, encoder in model.encoders.items():
        inputs = mine[name] if mine[name] is not None else encoder.dummy_inputs(torch.device("cpu"))
        previous = outputs[name] = resharder.encode(encoder, inputs, steps[name], dependency=previous)
        weights[name] = torch.randn(outputs[name].shape, generator=torch.Generator().manual_seed(rank))
    sum((outputs[n] * weights[n]).sum() for n in model.encoder_names).backward()

    # One process: every rank's items encoded where they were loaded, the same loss summed over the ranks; FSDP
    # averages the gradients over the 4 ranks.
    alone = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    for name in model.encoder_names:
        alone.encoders[name].load_state_dict(reference[name])
    total = torch.zeros(())
    for r in range(world):
        for name, x in _encoder_inputs(alone, r).items():
            if x is not None:
                out = alone.encoders[name](*x)
                total = total + (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(r))).sum()
                if r == rank:
                    torch.testing.assert_close(outputs[name].detach(), out.detach(), rtol=1e-5, atol=1e-6)
    total.backward()
    for name in model.encoder_names:
        references = dict(alone.encoders[name].named_parameters())
        for key, param in model.encoders[name].named_parameters():
            ref = references[key].grad / world
            error = (param.grad.full_tensor() - ref).norm().item()
            assert error <= 1e-5 * ref.norm().item() + 1e-8, f"gradient of {name}.{key} differs by {error:.3g}"


@pytest.mark.distributed
def test_a_rank_that_sends_every_item_and_receives_none_stays_in_step() -> None:
    """Where the plan leaves a rank nothing to encode (its items moved away, or it had none), it runs a dummy
    item. Under encoders sharded as the joint pipeline shards them, with ``embed`` and ``encode`` as FSDP forward
    methods, each call of ``embed`` gathers the stem again in backward, so that rank must embed its items and the
    dummy in one call before its exchange, as its peers do: a second call after the exchange hung the joint
    pipeline (its gather met a peer's exchange backward). Outputs and gradients equal one process's, within the
    parity tolerance above (a tenth of it: only the encoders run)."""
    run_distributed(_check_idle_ranks, 4)


# ------------------------------------------------------------------------------- a plan that keeps every item home
def _check_home_plan_runs_as_without_resharding(rank: int, world: int) -> None:
    graphs, outputs = [], []
    for reshard in (False, True):
        dims = ParallelDims(world_size=world, dp_shard=world, enc_sp=2 if reshard else 1)
        _, step = built_step(dims, reshard=reshard, link="compute_only")
        step.source.start([pack_samples(_rank_samples("even", rank))], train=True)
        encoded = step.source.outputs(0)
        graphs.append(backward_node_kinds(t for out in encoded.values() for t in out))
        outputs.append({name: out[0].detach() for name, out in encoded.items()})
    assert step.encoder_stats["items_moved"] == 0 and step.encoder_stats["predicted_imbalance"] > 0
    assert graphs[1] == graphs[0]
    for name, out in outputs[0].items():
        torch.testing.assert_close(outputs[1][name], out, rtol=0, atol=0)


@pytest.mark.distributed
def test_a_plan_that_keeps_every_item_home_encodes_as_a_step_without_resharding() -> None:
    """Where the group's plan moves nothing (each rank one small image: resharding cannot gain), the encoders run as
    they do without a resharder: the same outputs, bit for bit, and the same backward graph, without the data-
    dependency chain that orders the encoders' collectives only where items travel."""
    run_distributed(_check_home_plan_runs_as_without_resharding, 2)
