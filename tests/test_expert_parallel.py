"""Expert parallelism: dispatch bookkeeping (pure), an EP layer against one process, and MoE training parity.

Tolerances: the EP layer runs each token through the same expert weights as one process, only on another rank, so
outputs and gradients agree to 1e-5. Training parity uses the foundation's 1e-4 (see test_parity.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from lightning_runs import LEARNING_RATE, RecordRun, assert_resumes_under, fit, reference_run
from test_parity import STEPS, _assert_grads_match

from omni_lightning import OmniModule, ReferenceMLLMConfig
from omni_lightning.models.moe import MoEFeedForward
from omni_lightning.parallel.dims import ParallelDims
from omni_lightning.parallel.expert_parallel import (
    apply_ep,
    expert_major_order,
    row_share,
    sync_expert_gradients,
    sync_token_split_gradients,
)
from omni_lightning.parallel.layout import build_meshes


def test_expert_major_order() -> None:
    # 2 sources x 2 local experts: rows [s0e0 s0e0 | s0e1 | s1e0 | s1e1 s1e1] -> [s0e0 s0e0 s1e0 | s0e1 s1e1 s1e1]
    assert expert_major_order(np.array([[2, 1], [1, 2]])).tolist() == [0, 1, 3, 2, 4, 5]
    assert expert_major_order(np.zeros((2, 2), dtype=np.int64)).tolist() == []


def test_expert_replicas_share_an_ep_position() -> None:
    dims = ParallelDims(world_size=8, dp_replicate=2, dp_shard=2, tp=2, ep=2)
    # dp_cp groups: [0, 2, 4, 6] and [1, 3, 5, 7]; EP groups are consecutive pairs of the FSDP ranks [0, 2], [4, 6].
    assert dims.expert_replica_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ParallelDims(world_size=4, dp_shard=4, ep=4).expert_replica_groups() == [[0], [1], [2], [3]]


def _check_layer(rank: int, world: int) -> None:
    torch.manual_seed(0)  # the same layer and the same global tokens on every rank, for the reference
    layer = MoEFeedForward(dim=8, hidden=16, n_experts=4, top_k=2)
    tokens = torch.randn(4 * world, 8)
    # Rank 0's tokens all prefer expert 0 and 1: ranks holding experts 2 and 3 receive nothing from it.
    tokens[:4] = (layer.router.weight[0] * 4 + layer.router.weight[1] * 3).detach()
    assert set(layer.router(tokens[:4]).topk(2).indices.flatten().tolist()) <= {0, 1}
    reference = layer(tokens)
    weight = torch.randn_like(reference)
    (reference * weight).sum().backward()
    ref_grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()

    meshes = build_meshes(ParallelDims(world_size=world, dp_shard=world, ep=world), "cpu")
    apply_ep([layer.experts], meshes.ep_mesh, meshes.expert_replica_group, gradient_divide=1)
    mine = slice(4 * rank, 4 * rank + 4)
    out = layer(tokens[mine])
    torch.testing.assert_close(out, reference[mine], atol=1e-5, rtol=1e-5)
    (out * weight[mine]).sum().backward()
    sync_expert_gradients(layer)
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # the router is replicated: its gradient is the sum over ranks
    torch.testing.assert_close(router_grad, ref_grads["router.weight"], atol=1e-5, rtol=1e-5)
    for name in ("w1", "w3", "w2"):
        grad = getattr(layer.experts, name).grad.full_tensor()
        torch.testing.assert_close(grad, ref_grads[f"experts.{name}"], atol=1e-5, rtol=1e-5)


@pytest.mark.distributed
def test_ep_layer_matches_one_process_with_an_idle_expert_route() -> None:
    run_distributed(_check_layer, 4)


def test_row_shares_cover_the_rows_once_in_order() -> None:
    for rows in range(9):
        for peers in range(1, 5):
            shares = [row_share(rows, peers, peer) for peer in range(peers)]
            assert [start for start, _ in shares] == [0] + [stop for _, stop in shares[:-1]]
            assert shares[-1][1] == rows
            assert max(b - a for a, b in shares) - min(b - a for a, b in shares) <= 1


def _check_token_split(rank: int, world: int) -> None:
    torch.manual_seed(0)  # the same layer and the same tokens on every peer, as tensor-parallel peers hold them
    layer = MoEFeedForward(dim=8, hidden=16, n_experts=4, top_k=2)
    for rows in (7, 1):  # uneven shares, and a peer with no token at all
        tokens = torch.randn(rows, 8, requires_grad=True)
        weight = torch.randn(rows, 8)
        layer.zero_grad()
        (layer(tokens) * weight).sum().backward()
        ref_out = layer(tokens).detach()
        ref_grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
        ref_input_grad = tokens.grad.clone()
        tokens.grad, routed = None, []
        layer.zero_grad()
        layer.token_split_group = dist.group.WORLD
        hook = layer.experts.register_forward_hook(lambda _, args, __, routed=routed: routed.append(int(args[1].sum())))
        out = layer(tokens)
        hook.remove()
        start, stop = row_share(rows, world, rank)
        assert routed == [(stop - start) * 2], "each peer runs its own tokens' top-2 experts only"
        torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
        (out * weight).sum().backward()
        sync_token_split_gradients(layer)
        torch.testing.assert_close(tokens.grad, ref_input_grad, atol=1e-6, rtol=1e-6)
        for name, param in layer.named_parameters():
            torch.testing.assert_close(param.grad, ref_grads[name], atol=1e-6, rtol=1e-6)
        layer.token_split_group = None


@pytest.mark.distributed
def test_tensor_parallel_peers_split_a_moe_layers_tokens() -> None:
    """Two peers holding the same tokens each route their share: outputs, input and weight gradients equal one
    process running them all (1e-6: the same arithmetic per token, gradients summed over two peers)."""
    run_distributed(_check_token_split, 2)


MOE = ReferenceMLLMConfig.tiny(moe=True)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("layout", "devices"),
    [({"dp_shard": 4, "ep": 4}, 4), ({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, 4),
     ({"dp_shard": 2, "ep": 2, "tp": 2}, 4), ({"dp_shard": 4, "ep": 4, "tp": 2}, 8)],
    ids=["ep4", "hsdp_ep2", "ep2_tp2", "ep4_tp2_8ranks"],
)
def test_moe_training_matches_one_process(layout: dict[str, int], devices: int, tmp_path: Path, tiny_shards: str,
                                          moe_seed: Path) -> None:
    """Ten steps of the MoE variant (load-balance loss included) match one process, loss by loss."""
    module = OmniModule(MOE, learning_rate=LEARNING_RATE, init_checkpoint=str(moe_seed))
    fit(tmp_path, tiny_shards, moe_seed, layout=layout, devices=devices, max_steps=STEPS, module=module,
        callbacks=[RecordRun(tmp_path, grads=True)])
    dp = layout.get("dp_replicate", 1) * layout["dp_shard"]
    ref_losses, ref_grads = reference_run(tiny_shards, moe_seed, dp_size=dp, steps=STEPS, config=MOE)
    losses = json.loads((tmp_path / "losses.json").read_text())
    torch.testing.assert_close(torch.tensor(list(losses.values())), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    _assert_grads_match(torch.load(tmp_path / "grads.pt", weights_only=True), ref_grads, "MoE")


@pytest.mark.distributed
def test_expert_parallel_checkpoint_resumes_without_ep(tmp_path: Path, tiny_shards: str, moe_seed: Path) -> None:
    """Experts sharded 4 ways are saved as whole tensors' shards: a dp_shard=2 x tp=2 run (no EP) resumes them."""
    def module() -> OmniModule:
        return OmniModule(MOE, learning_rate=LEARNING_RATE, init_checkpoint=str(moe_seed))

    assert_resumes_under(tmp_path, tiny_shards, moe_seed, saved={"dp_shard": 4, "ep": 4}, resumed={"dp_shard": 4},
                         module=module)
