"""Materialise the groups computed by :class:`ParallelDims` as a DeviceMesh and encoder process groups."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from omni_lightning.parallel.dims import FLATTENED_DIMS, ParallelDims
from omni_lightning.parallel.placement import PoolLayout

__all__ = ["OmniMeshes", "EncoderPool", "build_meshes", "build_encoder_pool"]


@dataclass
class OmniMeshes:
    """The LLM mesh, its flattened views and the encoder groups of this rank.

    ``encoder_sp_blocks[d]`` is this rank's aligned block of ``d`` consecutive encoder-group ranks, for every
    power of two ``2 <= d <= enc_sp``: an item split ``d`` ways runs Ulysses attention over such a block.

    ``get(name)`` returns the 1-D mesh of a dimension or flattened view, or ``None`` when its degree is 1 (no
    group exists for it), so callers write ``if (tp := meshes.get("tp")) is not None``.
    """

    parallel_dims: ParallelDims
    world: DeviceMesh | None
    views: dict[str, DeviceMesh]
    encoder_group: dist.ProcessGroup | None
    encoder_sp_blocks: dict[int, dist.ProcessGroup]
    ep_mesh: DeviceMesh | None = None
    expert_replica_group: dist.ProcessGroup | None = None

    @property
    def encoder_sp_group(self) -> dist.ProcessGroup | None:
        """This rank's full encoder SP group (``enc_sp`` ranks), or ``None`` when ``enc_sp`` is 1."""
        return self.encoder_sp_blocks.get(self.parallel_dims.enc_sp)

    def get(self, name: str) -> DeviceMesh | None:
        self.parallel_dims.size(name)  # raises on an unknown name
        return self.views.get(name)

    def size(self, name: str) -> int:
        return self.parallel_dims.size(name)

    def local_rank(self, name: str) -> int:
        """This rank's index inside its ``name`` group (0 when the dimension has degree 1)."""
        mesh = self.views.get(name)
        return 0 if mesh is None else mesh.get_local_rank()

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """Mesh for ``fully_shard``: 2-D ``(dp_replicate, dp_shard_cp)`` for HSDP, else the 1-D sharding mesh."""
        return self.views.get("hsdp") or self.views.get("dp_shard_cp") or self.views.get("dp_replicate")


def build_meshes(parallel_dims: ParallelDims, device_type: str, *, pool: PoolLayout | None = None) -> OmniMeshes:
    """Create the LLM DeviceMesh (dimensions of degree > 1 only), its flattened views and the encoder groups.

    Group creation is collective: every rank must call this with the same ``parallel_dims``; the order of creation
    is fixed here, so it is the same on every rank. With a disaggregated ``pool`` the LLM mesh covers the LLM pool's
    ranks (the first ``parallel_dims.world_size``) and the encoder ranks take part in creating it without being in it.
    """
    world_size = pool.world_size if pool is not None else parallel_dims.world_size
    if dist.get_world_size() != world_size:
        raise ValueError(
            f"the process group has {dist.get_world_size()} ranks but the layout was built for {world_size}"
        )
    names = parallel_dims.materialized_dims
    views: dict[str, DeviceMesh] = {}
    world: DeviceMesh | None = None
    rank = dist.get_rank()
    member = rank < parallel_dims.world_size
    if names:
        shape = tuple(parallel_dims.degrees[n] for n in names)
        if pool is None:
            world = init_device_mesh(device_type, shape, mesh_dim_names=names)
        else:
            world = DeviceMesh(device_type, torch.arange(parallel_dims.world_size).reshape(shape),
                               mesh_dim_names=names)
        if member:
            views.update(_views(world, names))
        else:  # the flattened views' groups: the same group creations, which only a member of the mesh can slice
            for flat_name, components in FLATTENED_DIMS.items():
                if len([d for d in components if d in names]) > 1:
                    _mirror_new_groups(parallel_dims.groups(flat_name))

    encoder_group = _new_subgroups(parallel_dims.groups("encoder"), rank)
    blocks: dict[int, dist.ProcessGroup] = {}
    degree = 2
    while degree <= parallel_dims.enc_sp:
        aligned = [g[i : i + degree] for g in parallel_dims.groups("encoder") for i in range(0, len(g), degree)]
        blocks[degree] = _new_subgroups(sorted(aligned), rank)
        degree *= 2
    ep_mesh, expert_replicas = None, None
    if parallel_dims.ep > 1:
        shard_view = views.get("dp_shard_cp")
        efsdp = parallel_dims.size("efsdp")
        # EP groups are consecutive chunks of the FSDP ranks (ep innermost), as ParallelDims lays them out.
        if not member:
            if efsdp > 1:
                _mirror_new_groups(parallel_dims.groups("efsdp") + parallel_dims.groups("ep"))
        elif efsdp > 1:
            ep_mesh = shard_view._unflatten(0, (efsdp, parallel_dims.ep), ("efsdp", "ep"))["ep"]
        else:
            ep_mesh = shard_view
        expert_replicas = _new_subgroups(parallel_dims.expert_replica_groups(), rank)
    return OmniMeshes(parallel_dims, world, views, encoder_group, blocks, ep_mesh, expert_replicas)


def _views(world: DeviceMesh, names: tuple[str, ...]) -> dict[str, DeviceMesh]:
    """The 1-D mesh of every dimension and flattened view of degree > 1, and HSDP's 2-D one, sliced from ``world``."""
    views = {name: world[name] for name in names}
    mesh_dim_of: dict[str, str] = {}  # view name -> the dim name the root mesh knows it by
    for flat_name, components in FLATTENED_DIMS.items():
        present = tuple(d for d in components if d in names)
        if len(present) == 1:
            views[flat_name], mesh_dim_of[flat_name] = world[present[0]], present[0]
        elif len(present) > 1:
            # Keep the returned mesh: slicing a flattened dim back off the root is being deprecated.
            views[flat_name], mesh_dim_of[flat_name] = world[present]._flatten(flat_name), flat_name
    shard_dim = mesh_dim_of.get("dp_shard_cp")
    if "dp_replicate" in names and shard_dim is not None:
        views["hsdp"] = world["dp_replicate", shard_dim]
    return views


def _mirror_new_groups(groups: list[list[int]]) -> None:
    """What a rank outside the LLM mesh does while its members flatten or unflatten it: ``new_group`` must be entered
    by every rank, once per group and in the same order (groups are named by a counter), even by non-members."""
    for ranks in groups:
        dist.new_group(ranks=ranks)


@dataclass
class EncoderPool:
    """The encoder pool's groups (disaggregated placement), on every rank; members hold the pool's groups.

    ``mesh`` shards the encoders (FSDP) over the pool, ``group`` is the pool's encoder group for the balancer and
    ``sp_blocks`` its aligned SP blocks (as :class:`OmniMeshes`); all are ``None``/empty off the pool or with one
    encoder rank. ``transfers`` spans the world and carries only the pools' point-to-point transfers.
    """

    layout: PoolLayout
    mesh: DeviceMesh | None
    group: dist.ProcessGroup | None
    sp_blocks: dict[int, dist.ProcessGroup]
    transfers: dist.ProcessGroup


def build_encoder_pool(layout: PoolLayout, enc_sp: int, device_type: str) -> EncoderPool:
    """Create the encoder pool's mesh, SP blocks and the transfer group (collective: every rank calls it)."""
    rank, ranks = dist.get_rank(), layout.encoder_ranks
    mesh, group = None, None
    if len(ranks) > 1:
        mesh = DeviceMesh(device_type, torch.tensor(ranks), mesh_dim_names=("encoder_pool",))
        group = mesh.get_group() if rank in ranks else None
    blocks: dict[int, dist.ProcessGroup] = {}
    degree = 2
    while degree <= enc_sp:
        mine = _new_subgroups([ranks[i : i + degree] for i in range(0, len(ranks), degree)], rank)
        if mine is not None:
            blocks[degree] = mine
        degree *= 2
    transfers = dist.new_group(ranks=list(range(layout.world_size)))
    return EncoderPool(layout, mesh, group, blocks, transfers)


def _new_subgroups(groups: list[list[int]], rank: int) -> dist.ProcessGroup | None:
    """This rank's group of ``groups`` (created collectively), or ``None`` for singletons and for a rank in none
    of them (an encoder-pool rank creating the LLM pool's groups)."""
    if len(groups[0]) == 1:
        return None
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    if not any(rank in group for group in groups):
        return None
    if rank not in dist.get_process_group_ranks(mine):
        raise AssertionError(f"rank {rank} landed in the wrong subgroup {dist.get_process_group_ranks(mine)}")
    return mine
