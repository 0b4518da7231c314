"""build_meshes creates exactly the groups ParallelDims computes, on real gloo worlds."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from omni_lightning.parallel.dims import ParallelDims
from omni_lightning.parallel.layout import build_meshes
from omni_lightning.parallel.tensor_parallel import ColwiseLinear, RowwiseLinear

pytestmark = pytest.mark.distributed

VIEWS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp", "cp_tp")


def _check_groups(rank: int, world_size: int, degrees: dict[str, int]) -> None:
    dims = ParallelDims(world_size=world_size, **degrees)
    meshes = build_meshes(dims, "cpu")
    assert meshes.world is not None
    assert meshes.world.mesh_dim_names == dims.materialized_dims
    for name in VIEWS:
        mesh = meshes.get(name)
        if dims.size(name) == 1:
            assert mesh is None, name
            continue
        ranks = dist.get_process_group_ranks(mesh.get_group())
        assert sorted(ranks) == dims.group_of(name, rank), name
        assert mesh.get_local_rank() == dims.local_rank_in(name, rank), name
    for name, group in (("encoder", meshes.encoder_group), ("enc_sp", meshes.encoder_sp_group)):
        assert sorted(dist.get_process_group_ranks(group)) == dims.group_of(name, rank), name
    fsdp = meshes.fsdp_mesh
    expected_fsdp_shape = tuple(d for d in (dims.dp_replicate, dims.dp_shard_cp) if d > 1)
    assert tuple(fsdp.shape) == expected_fsdp_shape
    # The groups are usable: a sum over the data-parallel view counts its members.
    count = torch.ones(())
    dist.all_reduce(count, group=meshes.get("dp").get_group())
    assert int(count) == dims.dp


@pytest.mark.parametrize(
    ("world_size", "degrees"),
    [
        (8, {"pp": 2, "dp_shard": 2, "tp": 2, "enc_sp": 2}),
        (8, {"dp_replicate": 2, "dp_shard": 2, "cp": 2, "ep": 2, "enc_sp": 2}),
        (4, {"dp_replicate": 2, "dp_shard": 1, "tp": 2, "enc_sp": 2}),
    ],
)
def test_meshes_match_parallel_dims(world_size: int, degrees: dict[str, int]) -> None:
    run_distributed(_check_groups, world_size, degrees)


def _check_world_size_mismatch(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="process group has 2 ranks"):
        build_meshes(ParallelDims(world_size=4, tp=2), "cpu")


def test_world_size_mismatch_is_reported() -> None:
    run_distributed(_check_world_size_mismatch, 2)


def _split_linear_layers(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)  # the same weights and input on both ranks
    colwise, rowwise, x = torch.nn.Linear(4, 6), torch.nn.Linear(6, 4), torch.randn(5, 4, requires_grad=True)
    expected = rowwise(colwise(x))
    expected.square().sum().backward()
    input_grad, x.grad = x.grad, None
    reference = {name: p.grad.clone() for name, p in [*colwise.named_parameters("col"), *rowwise.named_parameters(
        "row")]}
    colwise.zero_grad(), rowwise.zero_grad()
    parallelize_module(colwise, mesh, ColwiseLinear())
    parallelize_module(rowwise, mesh, RowwiseLinear())
    assert [p.placements for p in colwise.parameters()] == [(Shard(0),), (Shard(0),)]
    assert [p.placements for p in rowwise.parameters()] == [(Shard(1),), (Replicate(),)]
    out = rowwise(colwise(x))
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    torch.testing.assert_close(x.grad, input_grad)  # each rank's columns gave a part: summed over TP
    for name, p in [*colwise.named_parameters("col"), *rowwise.named_parameters("row")]:
        torch.testing.assert_close(p.grad.full_tensor(), reference[name], msg=name)
    twin = copy.deepcopy(rowwise)  # a copy multiplies its own weights, not the original's
    with torch.no_grad():
        twin.weight.zero_()
    torch.testing.assert_close(twin(torch.ones(5, 3)), twin.bias.to_local().expand(5, 4))
    with pytest.raises(ValueError, match="ColwiseLinear splits an nn.Linear, not a Embedding"):
        parallelize_module(torch.nn.Embedding(4, 2), mesh, ColwiseLinear())


def test_split_linear_layers_match_the_unsplit_ones() -> None:
    """Megatron-style column then row split on local tensors: the unsplit output and gradients, DTensor weights."""
    run_distributed(_split_linear_layers, 2)
