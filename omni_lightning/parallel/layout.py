"""The layout of a job: every process group, created here and nowhere else, and the one object that hands them on.

:func:`build_layout` materialises the groups :class:`ParallelDims` computes (the LLM's DeviceMesh and its views, the
encoder groups, the encoder pool's) in the same order on every rank, since group creation is collective. The groups
later steps need and only they know the shape of (the loader's reorder groups, the pipeline's point-to-point and
relay groups) are created on first request by :class:`OmniLayout`'s methods, which every rank calls in the same
order; a second request returns the same group.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from omni_lightning.balance.reorder import reorder_group_ranks
from omni_lightning.parallel.dims import FLATTENED_DIMS, ParallelDims
from omni_lightning.parallel.placement import PoolLayout
from omni_lightning.parallel.settings import PipelineSettings, PlacementSettings

if TYPE_CHECKING:
    from omni_lightning.balance.cost import CostModel
    from omni_lightning.balance.reshard import LinkCost
    from omni_lightning.batch import PackingSpec

__all__ = ["JOINT_STREAMS", "POOL_STREAMS", "EncoderPool", "ModelGroups", "OmniLayout", "OmniMeshes",
           "build_encoder_pool", "build_layout", "build_meshes", "new_reorder_groups", "new_streams"]


@dataclass(frozen=True)
class ModelGroups:
    """The process groups a model's own forward uses: its context-parallel peers (whose tokens it attends over), the
    ranks whose tokens make one global batch (``dp_cp``: global statistics such as MoE routing) and its
    tensor-parallel peers (equal activations: MoE layers split their tokens over them)."""

    cp: dist.ProcessGroup | None = None
    batch: dist.ProcessGroup | None = None
    tp: dist.ProcessGroup | None = None


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
    #: A 1-rank data-parallel mesh of the LLM mesh where no data-parallel degree exceeds 1: FSDP over it gives
    #: layouts without data parallelism (TP or PP alone, one process) mixed precision as the others get it.
    unit_fsdp_mesh: DeviceMesh | None = None

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
        """Mesh for ``fully_shard``: 2-D ``(dp_replicate, dp_shard_cp)`` for HSDP, else the 1-D sharding mesh
        (``None`` without data parallelism)."""
        return self.views.get("hsdp") or self.views.get("dp_shard_cp") or self.views.get("dp_replicate")

    def mixed_precision_mesh(self) -> DeviceMesh | None:
        """Mesh for ``fully_shard`` when parameters compute in another dtype: :attr:`fsdp_mesh`, or the 1-rank
        :attr:`unit_fsdp_mesh` where there is no data parallelism."""
        return self.fsdp_mesh or self.unit_fsdp_mesh


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
    # Without data parallelism the mesh keeps a dp_shard dimension of degree 1 (one group per rank), whose slice is
    # the 1-rank mesh mixed precision runs FSDP over; it shares the root with the TP mesh, as FSDP2 requires.
    unit_dp = not any(d in names for d in ("dp_replicate", "dp_shard", "cp"))
    mesh_names = tuple(d for d in parallel_dims.degrees if d in names or (unit_dp and d == "dp_shard"))
    views: dict[str, DeviceMesh] = {}
    rank = dist.get_rank()
    member = rank < parallel_dims.world_size
    shape = tuple(parallel_dims.degrees[n] for n in mesh_names)
    if pool is None:
        world = init_device_mesh(device_type, shape, mesh_dim_names=mesh_names)
    else:
        world = DeviceMesh(device_type, torch.arange(parallel_dims.world_size).reshape(shape),
                           mesh_dim_names=mesh_names)
    unit_fsdp_mesh = world["dp_shard"] if unit_dp and member else None
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
    return OmniMeshes(parallel_dims, world, views, encoder_group, blocks, ep_mesh, expert_replicas, unit_fsdp_mesh)


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

    ``mesh`` shards the encoders (FSDP) over the pool, ``group`` is the pool's encoder group for the resharder and
    ``sp_blocks`` its aligned SP blocks (as :class:`OmniMeshes`); all are ``None``/empty off the pool or with one
    encoder rank. ``transfers`` spans the world for the pools' collectives (the gradient norm); ``streams`` are the
    pools' point-to-point streams, one group each (:data:`POOL_STREAMS`, see :func:`new_streams`).
    """

    layout: PoolLayout
    mesh: DeviceMesh | None
    group: dist.ProcessGroup | None
    sp_blocks: dict[int, dist.ProcessGroup]
    transfers: dist.ProcessGroup
    streams: dict[str, dist.ProcessGroup]


#: The disaggregated placement's streams: items to the encoder pool, their outputs back, the outputs' gradients.
POOL_STREAMS = ("items", "outputs", "gradients")
#: The joint pipeline's streams: each stage's encoder outputs to stage 0, their gradients back.
JOINT_STREAMS = ("outputs", "gradients")


def new_streams(names: tuple[str, ...], groups: list[list[int]], rank: int) -> dict[str, dist.ProcessGroup] | None:
    """One group of ``groups`` per point-to-point stream (collective; this rank's, ``None`` outside them all).

    NCCL matches the point-to-point operations of a pair of ranks within a group in the order they are issued and
    ignores tags, so both sides must issue them in the same order. A stream carries one kind of message in one
    direction, micro-batch after micro-batch, which both sides issue in the same order by construction; two
    directions in one group would have to interleave alike on both sides, which a schedule cannot promise.
    """
    streams = {name: dist.new_subgroups_by_enumeration(groups)[0] for name in names}
    return streams if any(rank in group for group in groups) else None


def build_encoder_pool(layout: PoolLayout, enc_sp: int, device_type: str) -> EncoderPool:
    """Create the encoder pool's mesh, SP blocks and the transfer group (collective: every rank calls it)."""
    rank, ranks = dist.get_rank(), layout.encoder_ranks
    # A 1-rank pool has a mesh too (mixed precision runs FSDP over it) but no group to reshard over.
    mesh = DeviceMesh(device_type, torch.tensor(ranks), mesh_dim_names=("encoder_pool",))
    group = mesh.get_group() if rank in ranks and len(ranks) > 1 else None
    blocks: dict[int, dist.ProcessGroup] = {}
    degree = 2
    while degree <= enc_sp:
        mine = _new_subgroups([ranks[i : i + degree] for i in range(0, len(ranks), degree)], rank)
        if mine is not None:
            blocks[degree] = mine
        degree *= 2
    everyone = list(range(layout.world_size))
    transfers = dist.new_group(ranks=everyone)
    streams = new_streams(POOL_STREAMS, [everyone], rank)
    assert streams is not None
    return EncoderPool(layout, mesh, group, blocks, transfers, streams)


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


@dataclass
class OmniLayout:
    """This rank's place in the job, handed by the strategy to the module and the data module.

    ``dims`` are the LLM's degrees (the whole world, or the LLM pool of the disaggregated placement); ``meshes``
    this rank's LLM mesh and encoder groups; ``pool`` the encoder pool's groups (disaggregated only). ``reshard``:
    each step's encoder items are resharded over the encoder group. ``cost_model`` and ``packing`` are the model's,
    for the loader's plans. ``link_cost`` prices the resharder's and the loader's traffic: ``"auto"`` (the device's
    default for the group's links, :func:`~omni_lightning.balance.reshard.resolve_link`),
    a :class:`~omni_lightning.balance.reshard.LinkCost`, or ``"compute_only"`` (moves are free to the plan).
    ``reshard_calibration_steps``: training batches (after the first) timed to price the resharder's plan in
    measured seconds (0: it keeps ``cost_model``, or FLOPs). ``ranks_per_node``: how many consecutive global ranks
    share a node (``None``: unknown, the job is taken as one node), for :meth:`spans_nodes`.
    """

    dims: ParallelDims
    meshes: OmniMeshes
    pipeline: PipelineSettings
    placement: PlacementSettings
    rank: int
    reshard: bool
    pool: EncoderPool | None = None
    cost_model: CostModel | None = None
    packing: PackingSpec | None = None
    link_cost: LinkCost | Literal["auto", "compute_only"] = "auto"
    reshard_calibration_steps: int = 0
    ranks_per_node: int | None = None
    _created: dict[tuple[object, ...], Any] = field(default_factory=dict, repr=False)  # groups made on first use

    def spans_nodes(self, group: dist.ProcessGroup | None) -> bool:
        """Whether ``group``'s ranks sit on more than one node (so ``"auto"`` prices its traffic over the network)."""
        if group is None or self.ranks_per_node is None:
            return False
        return ranks_span_nodes(dist.get_process_group_ranks(group), self.ranks_per_node)

    @property
    def is_encoder_rank(self) -> bool:
        """Whether this rank belongs to the encoder pool of the disaggregated placement."""
        return self.pool is not None and self.pool.layout.is_encoder_rank(self.rank)

    @property
    def dp_rank(self) -> int:
        """The data-parallel rank whose samples this rank reads. An encoder-pool rank reads the stream of the first
        LLM data-parallel rank it serves, so that both pools run the same number of batches an epoch."""
        if self.pool is not None and self.is_encoder_rank:
            return self.pool.layout.served_by(self.rank)[0]
        return self.meshes.local_rank("dp")

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def pipelined(self) -> bool:
        """Whether a step is a stream of micro-batches: a pipeline, or the pools' stream (a two-stage pipeline)."""
        return self.dims.pp > 1 or self.placement.disaggregated

    @property
    def model_groups(self) -> ModelGroups:
        cp, batch, tp = (self.meshes.get(name) for name in ("cp", "dp_cp", "tp"))
        return ModelGroups(cp=cp.get_group() if cp is not None else None,
                           batch=batch.get_group() if batch is not None else None,
                           tp=tp.get_group() if tp is not None else None)

    def reorder_groups(self, size: int) -> tuple[dist.ProcessGroup | None, int]:
        """This rank's reorder group (see :func:`new_reorder_groups`) and its index in its data-parallel group."""
        key = ("reorder", size)
        if key not in self._created:
            self._created[key] = new_reorder_groups(self.dims.groups("dp"), self.dp_rank, size)
        return self._created[key]

    def relay_group(self) -> dist.ProcessGroup | None:
        """A gloo group of this rank's pipeline peers (stage 0 first): stage 0 relays each step's shapes over it."""
        return self._subgroups(("relay",), self.dims.groups("pp"), backend="gloo")

    def pipeline_transfer_streams(self) -> dict[str, dist.ProcessGroup] | None:
        """Groups of this rank's pipeline peers for the joint pipeline's transfers alone (:data:`JOINT_STREAMS`, see
        :func:`new_streams`), so they never meet the schedule's."""
        key = ("pipeline_transfers",)
        if key not in self._created:
            self._created[key] = new_streams(JOINT_STREAMS, self.dims.groups("pp"), self.rank)
        return self._created[key]

    def _subgroups(self, key: tuple[object, ...], groups: list[list[int]], *,
                   backend: str | None) -> dist.ProcessGroup | None:
        if key not in self._created:
            # An encoder-pool rank takes part in creating the LLM pool's groups (collective) without being in one.
            mine, _ = dist.new_subgroups_by_enumeration(groups, backend=backend)
            self._created[key] = mine if any(self.rank in group for group in groups) else None
        return self._created[key]


def new_reorder_groups(dp_groups: list[list[int]], dp_rank: int, size: int) -> tuple[dist.ProcessGroup | None, int]:
    """Reorder groups of ``size`` consecutive data-parallel ranks in every data-parallel group, created in the same
    order on every rank (collective), on gloo (the loader exchanges host tensors): this rank's (``None`` alone) and
    its index among those of its data-parallel group (:func:`~omni_lightning.balance.reorder.reorder_group_ranks`)."""
    chunks = reorder_group_ranks(len(dp_groups[0]), size)
    index = next(i for i, chunk in enumerate(chunks) if dp_rank in chunk)
    if size == 1:
        return None, index
    mine, _ = dist.new_subgroups_by_enumeration([[group[i] for i in chunk] for group in dp_groups for chunk in chunks],
                                                backend="gloo")
    return mine, index


def build_layout(dims: ParallelDims, device_type: str, *, pipeline: PipelineSettings, placement: PlacementSettings,
                 reshard: bool, pool: PoolLayout | None = None, pool_enc_sp: int = 1,
                 link_cost: LinkCost | Literal["auto", "compute_only"] = "auto",
                 reshard_calibration_steps: int = 0, ranks_per_node: int | None = None) -> OmniLayout:
    """Create the job's groups (collective: every rank calls it with the same arguments) and this rank's layout."""
    meshes = build_meshes(dims, device_type, pool=pool)
    encoder_pool = build_encoder_pool(pool, pool_enc_sp, device_type) if pool is not None else None
    return OmniLayout(dims, meshes, pipeline, placement, dist.get_rank(), reshard, encoder_pool,
                      link_cost=link_cost, reshard_calibration_steps=reshard_calibration_steps,
                      ranks_per_node=ranks_per_node)


def ranks_span_nodes(ranks: Iterable[int], ranks_per_node: int) -> bool:
    """Whether global ``ranks`` sit on more than one node, where nodes hold ``ranks_per_node`` consecutive ranks
    each (as Lightning and torchrun number them: node rank x ranks per node + local rank)."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be at least 1")
    return len({rank // ranks_per_node for rank in ranks}) > 1
