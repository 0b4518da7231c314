"""Tests for :class:`ParallelDims`: degree validation, hand-checked rank groups and layout properties.

Pure rank math, no process groups. The hand-checked examples spell every group out literally (worked out from the
row-major layout ``pp, dp_replicate, dp_shard, cp, tp``, TP innermost); the Hypothesis properties check that every
dimension partitions the world and that the groups fit together for arbitrary valid layouts up to 4096 ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from omni_lightning.parallel.dims import FLATTENED_DIMS, MESH_DIM_NAMES, ParallelDims

Groups = tuple[tuple[int, ...], ...]

BASIC_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLAT_DIMS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "cp_tp": ("cp", "tp"),
}
ALL_DIMS: tuple[str, ...] = (*BASIC_DIMS, *FLAT_DIMS, "ep", "efsdp", "encoder", "enc_sp")

BIG = ParallelDims(4096, pp=8, dp_replicate=4, dp_shard=-1, cp=2, tp=4, ep=8, enc_sp=4)


# ------------------------------------------------------------------------------------------------- helpers
# Caches are keyed by the (frozen, hashable) layout so the property checks of one example share the group lists.
@functools.lru_cache(maxsize=64)
def _groups(dims: ParallelDims, name: str) -> Groups:
    """``dims.groups(name)`` as tuples, computed once per layout."""
    return tuple(tuple(group) for group in dims.groups(name))


@functools.lru_cache(maxsize=64)
def _index(dims: ParallelDims, name: str) -> tuple[int, ...]:
    """``index[rank]`` = position of the ``name`` group holding ``rank``."""
    index = [-1] * dims.world_size
    for i, group in enumerate(_groups(dims, name)):
        for rank in group:
            index[rank] = i
    return tuple(index)


def _coords(dims: ParallelDims, rank: int) -> dict[str, int]:
    """Row-major coordinate of ``rank`` (TP innermost), computed independently of ``ParallelDims.coordinate``."""
    sizes = {
        "pp": dims.pp,
        "dp_replicate": dims.dp_replicate,
        "dp_shard": dims.dp_shard_size,
        "cp": dims.cp,
        "tp": dims.tp,
    }
    coordinate: dict[str, int] = {}
    for name in reversed(BASIC_DIMS):
        rank, coordinate[name] = divmod(rank, sizes[name])
    assert rank == 0
    return {name: coordinate[name] for name in BASIC_DIMS}


@functools.lru_cache(maxsize=8)
def _coord_table(dims: ParallelDims) -> tuple[dict[str, int], ...]:
    return tuple(_coords(dims, rank) for rank in range(dims.world_size))


def _partition_by_fixed(dims: ParallelDims, varying: tuple[str, ...]) -> set[frozenset[int]]:
    """Ranks grouped by their coordinates along every basic dimension *not* in ``varying``."""
    fixed = [name for name in BASIC_DIMS if name not in varying]
    buckets: dict[tuple[int, ...], set[int]] = {}
    for rank, coordinate in enumerate(_coord_table(dims)):
        buckets.setdefault(tuple(coordinate[name] for name in fixed), set()).add(rank)
    return {frozenset(bucket) for bucket in buckets.values()}


def _as_sets(groups: Groups) -> set[frozenset[int]]:
    return {frozenset(group) for group in groups}


def _orthogonal(dims: ParallelDims, a: str, b: str) -> bool:
    """A group of ``a`` and a group of ``b`` never share more than one rank (no two ranks share both groups)."""
    return len(set(zip(_index(dims, a), _index(dims, b), strict=True))) == dims.world_size


# ------------------------------------------------------------------------------------------- valid layouts
def test_mesh_constants() -> None:
    assert MESH_DIM_NAMES == BASIC_DIMS
    assert FLATTENED_DIMS == FLAT_DIMS


@pytest.mark.parametrize(
    ("kwargs", "degrees", "flat", "materialized"),
    [
        # kwargs, (pp, dp_replicate, dp_shard, cp, tp), (dp, dp_shard_cp, dp_cp), materialized_dims
        ({"world_size": 1}, (1, 1, 1, 1, 1), (1, 1, 1), ()),
        ({"world_size": 16}, (1, 1, 16, 1, 1), (16, 16, 16), ("dp_shard",)),
        ({"world_size": 16, "tp": 4}, (1, 1, 4, 1, 4), (4, 4, 4), ("dp_shard", "tp")),
        (
            {"world_size": 16, "pp": 2, "dp_shard": 2, "cp": 2, "tp": 2, "ep": 2, "enc_sp": 2},
            (2, 1, 2, 2, 2),
            (2, 4, 4),
            ("pp", "dp_shard", "cp", "tp"),
        ),
        ({"world_size": 16, "dp_replicate": 2, "tp": 4}, (1, 2, 2, 1, 4), (4, 2, 4),
         ("dp_replicate", "dp_shard", "tp")),
        ({"world_size": 16, "dp_replicate": 16}, (1, 16, 1, 1, 1), (16, 1, 16), ("dp_replicate",)),
        ({"world_size": 12, "pp": 3, "cp": 2, "ep": 2}, (3, 1, 2, 2, 1), (2, 4, 4), ("pp", "dp_shard", "cp")),
        ({"world_size": 4096, "pp": 8, "dp_replicate": 4, "cp": 2, "tp": 4, "ep": 8}, (8, 4, 16, 2, 4), (64, 32, 128),
         BASIC_DIMS),
        (
            {"world_size": 4096, "pp": 8, "dp_replicate": 4, "dp_shard": 16, "cp": 2, "tp": 4, "ep": 8},
            (8, 4, 16, 2, 4),
            (64, 32, 128),
            BASIC_DIMS,
        ),
    ],
    ids=["w1", "w16-dp_shard", "w16-tp4", "w16-all", "w16-hsdp", "w16-replicate", "w12-odd", "w4096-resolved",
         "w4096-explicit"],
)
def test_valid_layouts(
    kwargs: dict[str, Any], degrees: tuple[int, ...], flat: tuple[int, int, int], materialized: tuple[str, ...]
) -> None:
    dims = ParallelDims(**kwargs)
    assert dims.degrees == dict(zip(BASIC_DIMS, degrees, strict=True))
    assert list(dims.degrees) == list(BASIC_DIMS)
    assert math.prod(degrees) == dims.world_size
    assert dims.dp_shard_size == dims.degrees["dp_shard"]
    assert dims.dp_shard == kwargs.get("dp_shard", -1)  # the field keeps what was passed; -1 is resolved aside
    assert (dims.dp, dims.dp_shard_cp, dims.dp_cp) == flat
    assert (dims.size("dp"), dims.size("dp_shard_cp"), dims.size("dp_cp")) == flat
    for name, degree in dims.degrees.items():
        assert dims.size(name) == degree
    assert dims.size("ep") == dims.ep
    assert dims.size("efsdp") == dims.dp_shard_cp // dims.ep
    assert dims.size("encoder") == dims.dp
    assert dims.size("enc_sp") == dims.enc_sp
    assert dims.materialized_dims == materialized
    assert dims.pp_enabled == (dims.pp > 1)
    assert dims.tp_enabled == (dims.tp > 1)
    assert dims.cp_enabled == (dims.cp > 1)
    assert dims.ep_enabled == (dims.ep > 1)
    assert dims.fsdp_enabled == (flat[1] > 1 or dims.dp_replicate > 1)


def test_big_layout_sizes() -> None:
    assert BIG.degrees == {"pp": 8, "dp_replicate": 4, "dp_shard": 16, "cp": 2, "tp": 4}
    assert {name: BIG.size(name) for name in ALL_DIMS} == {
        **BIG.degrees,
        "dp": 64,
        "dp_shard_cp": 32,
        "dp_cp": 128,
        "cp_tp": 8,
        "ep": 8,
        "efsdp": 4,
        "encoder": 64,
        "enc_sp": 4,
    }


def test_frozen_and_resolved_equality() -> None:
    dims = ParallelDims(16, tp=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.tp = 2  # type: ignore[misc]
    assert dims == ParallelDims(16, tp=4)
    assert hash(dims) == hash(ParallelDims(16, tp=4))


# ----------------------------------------------------------------------------------------- invalid layouts
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 6, "tp": 4}, "world size 6 is not divisible by pp*dp_replicate*cp*tp = 1*1*1*4 = 4"),
        ({"world_size": 16, "pp": 3}, "world size 16 is not divisible by pp*dp_replicate*cp*tp = 3*1*1*1 = 3"),
        (
            {"world_size": 16, "dp_shard": 2, "tp": 4},
            "pp*dp_replicate*dp_shard*cp*tp = 1*1*2*1*4 = 8 must equal the world size 16",
        ),
        ({"world_size": 8, "pp": 2, "dp_shard": 4, "tp": 2}, "= 2*1*4*1*2 = 16 must equal the world size 8"),
        ({"world_size": 8, "dp_shard": 4, "tp": 2, "ep": 3}, "ep=3 must divide dp_shard*cp = 4*1 = 4"),
        ({"world_size": 12, "dp_shard": 3, "cp": 2, "tp": 2, "ep": 4}, "ep=4 must divide dp_shard*cp = 3*2 = 6"),
        ({"world_size": 8, "dp_replicate": 2, "dp_shard": 2, "tp": 2, "enc_sp": 3},
         "enc_sp=3 must be a power of two"),
        ({"world_size": 24, "dp_replicate": 3, "tp": 2, "enc_sp": 8},
         "enc_sp=8 must divide the data-parallel size dp_replicate*dp_shard = 3*4 = 12"),
    ],
    ids=["w6-tp4", "w16-pp3", "product-too-small", "product-too-big", "ep3", "ep4-with-cp", "enc_sp3", "enc_sp8"],
)
def test_invalid_layout_messages(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelDims(**kwargs)


BAD_DEGREES: list[Any] = [0, -1, -4, True, False, 2.0, "2", None]


@pytest.mark.parametrize("name", ["world_size", "pp", "dp_replicate", "cp", "tp", "ep", "enc_sp"])
@pytest.mark.parametrize("value", BAD_DEGREES, ids=repr)
def test_bad_degree(name: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"world_size": 4, name: value}
    with pytest.raises(ValueError, match=re.escape(f"{name} must be a positive integer, got {value!r}")):
        ParallelDims(**kwargs)


@pytest.mark.parametrize("value", [0, -2, -16, True, False, 2.0, "4", None], ids=repr)
def test_bad_dp_shard(value: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(f"dp_shard must be a positive integer or -1 (use what is left), "
                                                   f"got {value!r}")):
        ParallelDims(4, dp_shard=value)


# --------------------------------------------------------------------------------------- hand-checked layouts
# ParallelDims(16, pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2, ep=2, enc_sp=2):
# rank = 8*pp + 4*dp_shard + 2*cp + tp (dp_replicate has degree 1).
HAND_A = ParallelDims(16, pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2, ep=2, enc_sp=2)
HAND_A_GROUPS: dict[str, list[list[int]]] = {
    "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "dp_replicate": [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11], [12], [13], [14], [15]],
    "dp_shard": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp_shard_cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    # the ranks of one data-parallel rank of one stage: both cp, both tp
    "cp_tp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    # consecutive pairs of each dp_shard_cp group: [0,2,4,6] -> [0,2],[4,6] (same dp_shard, both cp)
    "ep": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    # stride 2 inside each dp_shard_cp group: [0,2,4,6] -> [0,4],[2,6] (same cp, both dp_shard)
    "efsdp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "encoder": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    # encoder groups have 2 ranks, so each is a single enc_sp chunk
    "enc_sp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
}

# ParallelDims(16, dp_replicate=2, dp_shard=2, tp=4, ep=2, enc_sp=2): rank = 8*dp_replicate + 4*dp_shard + tp.
HAND_B = ParallelDims(16, pp=1, dp_replicate=2, dp_shard=2, cp=1, tp=4, ep=2, enc_sp=2)
HAND_B_GROUPS: dict[str, list[list[int]]] = {
    "pp": [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11], [12], [13], [14], [15]],
    "dp_replicate": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "dp_shard": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "cp": [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11], [12], [13], [14], [15]],
    "tp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "dp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    "dp_shard_cp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp_cp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    "cp_tp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "ep": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "efsdp": [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9], [10], [11], [12], [13], [14], [15]],
    "encoder": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    # consecutive pairs of each encoder group: [0,4,8,12] -> [0,4],[8,12] (one replica each)
    "enc_sp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
}

# ParallelDims(16, dp_shard=4, cp=2, tp=2, ep=4): rank = 4*dp_shard + 2*cp + tp; EP spans dp_shard and cp.
HAND_C = ParallelDims(16, dp_shard=4, cp=2, tp=2, ep=4)
HAND_C_GROUPS: dict[str, list[list[int]]] = {
    "dp_shard_cp": [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]],
    "ep": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    "efsdp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
}


@pytest.mark.parametrize(
    ("dims", "expected"),
    [(HAND_A, HAND_A_GROUPS), (HAND_B, HAND_B_GROUPS), (HAND_C, HAND_C_GROUPS)],
    ids=["pp2-dp_shard2-cp2-tp2", "hsdp2x2-tp4", "ep-across-cp"],
)
def test_hand_checked_groups(dims: ParallelDims, expected: dict[str, list[list[int]]]) -> None:
    for name, groups in expected.items():
        assert dims.groups(name) == groups, name
        for group in groups:
            for position, rank in enumerate(group):
                assert dims.group_of(name, rank) == group, (name, rank)
                assert dims.local_rank_in(name, rank) == position, (name, rank)


def test_hand_checked_coordinates() -> None:
    assert HAND_A.coordinate(13) == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1}
    assert HAND_A.rank_of({"pp": 1, "dp_shard": 1, "tp": 1}) == 13
    assert HAND_A.coordinate(6) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 1, "tp": 0}
    assert HAND_B.coordinate(13) == {"pp": 0, "dp_replicate": 1, "dp_shard": 1, "cp": 0, "tp": 1}
    assert HAND_B.rank_of({"dp_replicate": 1, "tp": 3}) == 11
    assert HAND_B.local_rank_in("dp", 13) == 3
    assert HAND_B.local_rank_in("dp_cp", 6) == 1
    assert HAND_B.local_rank_in("tp", 13) == 1


# ------------------------------------------------------------------------------------------- coordinates
@pytest.mark.parametrize("dims", [ParallelDims(1), HAND_A, HAND_B, BIG], ids=["w1", "hand_a", "hand_b", "w4096"])
def test_coordinate_round_trip(dims: ParallelDims) -> None:
    for rank in range(dims.world_size):
        coordinate = dims.coordinate(rank)
        assert coordinate == _coords(dims, rank)
        assert list(coordinate) == list(BASIC_DIMS)
        assert dims.rank_of(coordinate) == rank
    assert dims.rank_of({}) == 0
    last = {name: degree - 1 for name, degree in dims.degrees.items()}
    assert dims.rank_of(last) == dims.world_size - 1


@pytest.mark.parametrize("rank", [-1, 16, 17, 1000])
def test_rank_outside_world(rank: int) -> None:
    message = re.escape(f"rank {rank} is outside the world [0, 16)")
    with pytest.raises(ValueError, match=message):
        HAND_A.coordinate(rank)
    with pytest.raises(ValueError, match=message):
        HAND_A.group_of("tp", rank)
    with pytest.raises(ValueError, match=message):
        HAND_A.local_rank_in("dp", rank)


@pytest.mark.parametrize("coordinate", [{"tp": 2}, {"pp": -1}, {"cp": 5}, {"dp_replicate": 1}])
def test_rank_of_out_of_range_coordinate(coordinate: dict[str, int]) -> None:
    ((name, index),) = coordinate.items()
    with pytest.raises(ValueError, match=re.escape(f"coordinate {name}={index} is outside [0, ")):
        HAND_A.rank_of(coordinate)


@pytest.mark.parametrize("name", ["foo", "data", "DP", "expert", ""])
def test_unknown_dimension(name: str) -> None:
    message = re.escape(f"unknown dimension {name!r}")
    with pytest.raises(ValueError, match=message):
        HAND_A.size(name)
    with pytest.raises(ValueError, match=message):
        HAND_A.groups(name)
    with pytest.raises(ValueError, match=message):
        HAND_A.group_of(name, 0)


# ------------------------------------------------------------------------------------------ properties
def check_partitions(dims: ParallelDims) -> None:
    """Every dimension's groups partition the world into sorted groups of ``size(name)``, ordered by first rank."""
    for name in ALL_DIMS:
        groups = _groups(dims, name)
        size = dims.size(name)
        assert all(len(group) == size for group in groups), name
        assert all(list(group) == sorted(group) for group in groups), name
        assert [group[0] for group in groups] == sorted(group[0] for group in groups), name
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(dims.world_size)), name


def check_basic_dims(dims: ParallelDims) -> None:
    """A basic group varies one coordinate; groups of two different basic dimensions are orthogonal."""
    for name in BASIC_DIMS:
        assert _as_sets(_groups(dims, name)) == _partition_by_fixed(dims, (name,)), name
    for a, b in itertools.combinations(BASIC_DIMS, 2):
        assert _orthogonal(dims, a, b), (a, b)


def check_flattened_dims(dims: ParallelDims) -> None:
    """A flattened group is the product of its components' groups (e.g. dp_cp = equal pp and tp coordinates)."""
    for name, components in FLAT_DIMS.items():
        groups = _groups(dims, name)
        assert _as_sets(groups) == _partition_by_fixed(dims, components), name
        assert dims.size(name) == math.prod(dims.size(component) for component in components), name
        for group in groups:
            spanned = {group[0]}
            for component in components:
                index, component_groups = _index(dims, component), _groups(dims, component)
                spanned = {member for rank in spanned for member in component_groups[index[rank]]}
            assert spanned == set(group), (name, group)


def check_expert_dims(dims: ParallelDims) -> None:
    """ep x efsdp is an orthogonal factorisation of every dp_shard_cp group."""
    ep_index, efsdp_index = _index(dims, "ep"), _index(dims, "efsdp")
    ep_groups, efsdp_groups = set(_groups(dims, "ep")), set(_groups(dims, "efsdp"))
    assert dims.size("ep") * dims.size("efsdp") == dims.dp_shard_cp
    assert _orthogonal(dims, "ep", "efsdp")
    for group in _groups(dims, "dp_shard_cp"):
        # EP takes consecutive ep-sized chunks, its FSDP complement the stride-ep slices
        assert {group[i : i + dims.ep] for i in range(0, len(group), dims.ep)} <= ep_groups
        assert {group[i :: dims.ep] for i in range(dims.ep)} <= efsdp_groups
        eps = {ep_index[rank] for rank in group}
        efsdps = {efsdp_index[rank] for rank in group}
        assert len(eps) == dims.size("efsdp") and len(efsdps) == dims.ep
        assert {(ep_index[rank], efsdp_index[rank]) for rank in group} == set(itertools.product(eps, efsdps))


def check_tp_consecutive(dims: ParallelDims) -> None:
    """TP is innermost: every TP group is a block of consecutive ranks."""
    for group in _groups(dims, "tp"):
        assert group[0] % dims.tp == 0
        assert list(group) == list(range(group[0], group[0] + dims.tp))


def check_encoder_dims(dims: ParallelDims) -> None:
    """Encoder groups are the dp groups; an enc_sp group is a consecutive chunk of one encoder group (one stage)."""
    encoder_groups, encoder_index = _groups(dims, "encoder"), _index(dims, "encoder")
    assert encoder_groups == _groups(dims, "dp")
    table = _coord_table(dims)
    for group in _groups(dims, "enc_sp"):
        assert len({encoder_index[rank] for rank in group}) == 1
        encoder_group = encoder_groups[encoder_index[group[0]]]
        start = encoder_group.index(group[0])
        assert start % dims.enc_sp == 0
        assert encoder_group[start : start + dims.enc_sp] == group
        assert len({(table[rank]["pp"], table[rank]["cp"], table[rank]["tp"]) for rank in group}) == 1


def check_coordinates(dims: ParallelDims) -> None:
    """``coordinate`` matches the row-major decomposition and ``rank_of`` inverts it."""
    for rank, expected in enumerate(_coord_table(dims)):
        coordinate = dims.coordinate(rank)
        assert coordinate == expected
        assert dims.rank_of(coordinate) == rank


PROPERTY_CHECKS = (
    check_partitions,
    check_basic_dims,
    check_flattened_dims,
    check_expert_dims,
    check_tp_consecutive,
    check_encoder_dims,
    check_coordinates,
)

FACTORS: tuple[int, ...] = (1, 2, 3, 4, 5, 8, 16)


@st.composite
def layouts(draw: st.DrawFn, max_world: int) -> ParallelDims:
    """Valid layouts: degrees drawn from small powers of two and small odd factors, world size <= ``max_world``."""
    degrees: dict[str, int] = {}
    budget = max_world
    for name in draw(st.permutations(BASIC_DIMS)):  # random order, so no dimension is favoured by the budget
        degrees[name] = draw(st.sampled_from([factor for factor in FACTORS if factor <= budget]))
        budget //= degrees[name]
    dp_shard_cp = degrees["dp_shard"] * degrees["cp"]
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    return ParallelDims(
        math.prod(degrees.values()),
        pp=degrees["pp"],
        dp_replicate=degrees["dp_replicate"],
        dp_shard=draw(st.sampled_from([-1, degrees["dp_shard"]])),
        cp=degrees["cp"],
        tp=degrees["tp"],
        ep=draw(st.sampled_from([d for d in range(1, dp_shard_cp + 1) if dp_shard_cp % d == 0])),
        enc_sp=draw(st.sampled_from([d for d in range(1, dp + 1) if dp % d == 0 and d & (d - 1) == 0])),
    )


def _run_checks(dims: ParallelDims) -> None:
    for check in PROPERTY_CHECKS:
        check(dims)


# Every property runs on the same drawn layout so the group lists are computed once per example. Small worlds get
# many examples; worlds up to 4096 ranks cost a few tenths of a second each, so they get a handful plus fixed ones.
@settings(max_examples=200, deadline=None)
@given(layouts(max_world=128))
@example(HAND_A)
@example(HAND_B)
@example(HAND_C)
def test_layout_properties_small_worlds(dims: ParallelDims) -> None:
    _run_checks(dims)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(max_world=4096))
@example(BIG)
@example(ParallelDims(4096, pp=1, dp_replicate=1, dp_shard=-1, cp=1, tp=1, ep=4096, enc_sp=4096))
@example(ParallelDims(4095, pp=5, dp_replicate=3, dp_shard=-1, cp=3, tp=7, ep=13, enc_sp=1))
def test_layout_properties_large_worlds(dims: ParallelDims) -> None:
    _run_checks(dims)


@pytest.mark.parametrize("check", PROPERTY_CHECKS, ids=lambda check: check.__name__)
@pytest.mark.parametrize("dims", [ParallelDims(1), HAND_A, HAND_B, HAND_C], ids=["w1", "hand_a", "hand_b", "hand_c"])
def test_property_checks_on_fixed_layouts(dims: ParallelDims, check: Callable[[ParallelDims], None]) -> None:
    """Each property on its own, so a failure names it even without Hypothesis' report."""
    check(dims)


MEDIUM = ParallelDims(256, pp=2, dp_replicate=2, dp_shard=8, cp=2, tp=4, ep=4, enc_sp=2)


@pytest.mark.parametrize("rank", [0, 1, 77, 255])
def test_group_of_matches_groups(rank: int) -> None:
    for name in ALL_DIMS:
        group = MEDIUM.group_of(name, rank)
        assert tuple(group) == _groups(MEDIUM, name)[_index(MEDIUM, name)[rank]]
        assert group[MEDIUM.local_rank_in(name, rank)] == rank
    assert MEDIUM.group_of("tp", rank) == list(range(rank - rank % 4, rank - rank % 4 + 4))
