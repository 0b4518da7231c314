"""Parallel degrees and rank math, in pure Python (no process groups).

Ranks are laid out row-major over the LLM mesh ``pp, dp_replicate, dp_shard, cp, tp`` (outermost first), so the
chattiest dimension, TP, lands on adjacent ranks (inside a node) and PP, which only sends activations, is
outermost. Every group the runtime creates is computed here first, so the layout can be unit-tested for any
world size without spawning a process.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

__all__ = ["MESH_DIM_NAMES", "FLATTENED_DIMS", "ParallelDims"]

MESH_DIM_NAMES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# Flattened views of the LLM mesh and the basic dimensions they join, outermost first.
FLATTENED_DIMS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),  # data loading: ranks that read different samples
    "dp_shard_cp": ("dp_shard", "cp"),  # FSDP parameter sharding
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),  # loss and token-count reduction
    "cp_tp": ("cp", "tp"),  # ranks that hold the same samples: they split their encoder work
}


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of every parallel dimension for one job.

    Args:
        world_size: number of ranks in the job.
        pp: pipeline-parallel stages.
        dp_replicate: data-parallel replicas (HSDP's replicate dimension).
        dp_shard: FSDP sharding degree; ``-1`` takes whatever the other degrees leave of the world.
        cp: context-parallel degree (sequence split of the LLM).
        tp: tensor-parallel degree.
        ep: expert-parallel degree; EP re-factors ``dp_shard * cp`` and is not an extra factor of the world.
        enc_sp: encoder sequence-parallel degree; SP groups are ``enc_sp`` consecutive ranks of an encoder group
            (the data-parallel ranks of one pipeline stage that share a ``cp``/``tp`` coordinate).

    Raises:
        ValueError: naming the violated constraint and the numbers involved.
    """

    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    enc_sp: int = 1
    _resolved_dp_shard: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Degrees first: a bad degree is the root cause when a derived world size is also wrong.
        for name in ("pp", "dp_replicate", "cp", "tp", "ep", "enc_sp"):
            _check_positive_int(name, getattr(self, name))
        if self.dp_shard != -1:
            _check_positive_int("dp_shard", self.dp_shard, " or -1 (use what is left)")
        _check_positive_int("world_size", self.world_size)

        others = self.pp * self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by pp*dp_replicate*cp*tp = "
                    f"{self.pp}*{self.dp_replicate}*{self.cp}*{self.tp} = {others}, so dp_shard=-1 cannot be resolved"
                )
            dp_shard = self.world_size // others
        else:
            dp_shard = self.dp_shard
            product = others * dp_shard
            if product != self.world_size:
                raise ValueError(
                    f"pp*dp_replicate*dp_shard*cp*tp = {self.pp}*{self.dp_replicate}*{dp_shard}*{self.cp}*{self.tp}"
                    f" = {product} must equal the world size {self.world_size}"
                )
        object.__setattr__(self, "_resolved_dp_shard", dp_shard)

        if (dp_shard * self.cp) % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp_shard*cp = {dp_shard}*{self.cp} = {dp_shard * self.cp} "
                "(expert parallelism borrows the FSDP ranks; it is not an extra factor of the world)"
            )
        if self.enc_sp & (self.enc_sp - 1):
            raise ValueError(
                f"enc_sp={self.enc_sp} must be a power of two (an item is split over 2, 4, ... aligned ranks)"
            )
        if self.dp % self.enc_sp:
            raise ValueError(
                f"enc_sp={self.enc_sp} must divide the data-parallel size dp_replicate*dp_shard = "
                f"{self.dp_replicate}*{dp_shard} = {self.dp} (encoder SP groups live inside the data-parallel ranks)"
            )

    # ----------------------------------------------------------------------------------------------- degrees
    @property
    def degrees(self) -> dict[str, int]:
        """Degree of every LLM mesh dimension, outermost first, with ``dp_shard`` resolved."""
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self._resolved_dp_shard,
            "cp": self.cp,
            "tp": self.tp,
        }

    @property
    def dp_shard_size(self) -> int:
        """``dp_shard`` with ``-1`` resolved."""
        return self._resolved_dp_shard

    @property
    def dp(self) -> int:
        """Data-loading degree: ranks that read different samples."""
        return self.dp_replicate * self._resolved_dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """FSDP sharding degree."""
        return self._resolved_dp_shard * self.cp

    @property
    def dp_cp(self) -> int:
        """Loss-reduction degree."""
        return self.dp * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard_cp > 1 or self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def size(self, name: str) -> int:
        """Size of a basic, flattened, expert or encoder dimension by name."""
        degrees = self.degrees
        if name in degrees:
            return degrees[name]
        if name in FLATTENED_DIMS:
            return math.prod(degrees[d] for d in FLATTENED_DIMS[name])
        sizes = {"ep": self.ep, "efsdp": self.dp_shard_cp // self.ep, "encoder": self.dp, "enc_sp": self.enc_sp}
        if name in sizes:
            return sizes[name]
        raise ValueError(f"unknown dimension {name!r}; known: {sorted([*degrees, *FLATTENED_DIMS, *sizes])}")

    @property
    def materialized_dims(self) -> tuple[str, ...]:
        """Mesh dimensions that get a process group: those of degree > 1, outermost first."""
        return tuple(name for name, degree in self.degrees.items() if degree > 1)

    # ------------------------------------------------------------------------------------------- rank math
    def coordinate(self, rank: int) -> dict[str, int]:
        """Position of ``rank`` along every mesh dimension."""
        self._check_rank(rank)
        coordinate: dict[str, int] = {}
        for name in reversed(MESH_DIM_NAMES):
            degree = self.degrees[name]
            coordinate[name] = rank % degree
            rank //= degree
        return {name: coordinate[name] for name in MESH_DIM_NAMES}

    def rank_of(self, coordinate: dict[str, int]) -> int:
        """Inverse of :meth:`coordinate`; missing dimensions count as 0."""
        rank = 0
        for name in MESH_DIM_NAMES:
            degree = self.degrees[name]
            index = coordinate.get(name, 0)
            if not 0 <= index < degree:
                raise ValueError(f"coordinate {name}={index} is outside [0, {degree})")
            rank = rank * degree + index
        return rank

    def groups(self, name: str) -> list[list[int]]:
        """Every group of dimension ``name`` as sorted rank lists, ordered by the smallest rank they hold.

        ``name`` is a mesh dimension, a flattened view (``dp``, ``dp_shard_cp``, ``dp_cp``, ``cp_tp``), ``ep``/``efsdp``
        (expert parallel and its FSDP complement), ``encoder`` (the data-parallel ranks that plan encoder work
        together) or ``enc_sp`` (encoder sequence-parallel groups).
        """
        if name in self.degrees:
            return self._groups_over((name,))
        if name in FLATTENED_DIMS or name == "encoder":
            return self._groups_over(FLATTENED_DIMS.get(name, FLATTENED_DIMS["dp"]))
        if name in ("ep", "efsdp", "enc_sp"):
            parent_dims = FLATTENED_DIMS["dp" if name == "enc_sp" else "dp_shard_cp"]
            chunk = self.enc_sp if name == "enc_sp" else self.ep
            if name == "efsdp":
                children = [g[i::chunk] for g in self._groups_over(parent_dims) for i in range(chunk)]
            else:
                children = [g[i : i + chunk] for g in self._groups_over(parent_dims) for i in range(0, len(g), chunk)]
            return sorted(children, key=lambda group: group[0])
        self.size(name)  # raises the "unknown dimension" error
        raise AssertionError("unreachable")

    def group_of(self, name: str, rank: int) -> list[int]:
        """The group of dimension ``name`` that holds ``rank``, as a sorted rank list."""
        self._check_rank(rank)
        if name in self.degrees:
            return self._group_through(rank, (name,))
        if name in FLATTENED_DIMS:
            return self._group_through(rank, FLATTENED_DIMS[name])
        if name in ("ep", "efsdp"):
            parent = self._group_through(rank, FLATTENED_DIMS["dp_shard_cp"])
            index = parent.index(rank)
            if name == "ep":  # consecutive chunks: EP peers sit as close together as the FSDP group allows
                return parent[index - index % self.ep : index - index % self.ep + self.ep]
            return parent[index % self.ep :: self.ep]
        if name in ("encoder", "enc_sp"):
            parent = self._group_through(rank, FLATTENED_DIMS["dp"])
            if name == "encoder":
                return parent
            start = parent.index(rank) - parent.index(rank) % self.enc_sp
            return parent[start : start + self.enc_sp]
        self.size(name)  # raises the "unknown dimension" error
        raise AssertionError("unreachable")

    def expert_replica_groups(self) -> list[list[int]]:
        """Ranks that hold the same experts under expert parallelism: within one ``dp_cp`` group, those at the same
        position of their EP group (the ``efsdp`` ranks, times ``dp_replicate``). Their expert gradients are summed."""
        groups = []
        for dp_cp in self.groups("dp_cp"):
            by_position: dict[int, list[int]] = {}
            for rank in dp_cp:
                by_position.setdefault(self.local_rank_in("ep", rank), []).append(rank)
            groups.extend(by_position.values())
        return sorted(groups)

    def local_rank_in(self, name: str, rank: int) -> int:
        """Index of ``rank`` inside its ``name`` group (e.g. the data-parallel rank for ``name='dp'``)."""
        return self.group_of(name, rank).index(rank)

    def _group_through(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        """Ranks that share every coordinate of ``rank`` except those along ``dims`` (row-major, so sorted)."""
        base = self.coordinate(rank)
        for name in dims:
            base[name] = 0
        start = self.rank_of(base)
        return [start + offset for offset in self._offsets(dims)]

    def _groups_over(self, dims: tuple[str, ...]) -> list[list[int]]:
        degrees = self.degrees
        fixed = [d for d in MESH_DIM_NAMES if d not in dims]
        offsets = self._offsets(dims)
        starts = sorted(
            self.rank_of(dict(zip(fixed, index, strict=True)))
            for index in itertools.product(*(range(degrees[d]) for d in fixed))
        )
        return [[start + offset for offset in offsets] for start in starts]

    def _offsets(self, dims: tuple[str, ...]) -> list[int]:
        """Rank offsets of the members of a group along ``dims`` from its first member, in row-major order."""
        strides = self._strides()
        degrees = self.degrees
        return [
            sum(strides[d] * i for d, i in zip(dims, index, strict=True))
            for index in itertools.product(*(range(degrees[d]) for d in dims))
        ]

    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for name in reversed(MESH_DIM_NAMES):
            strides[name] = stride
            stride *= self.degrees[name]
        return strides

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world [0, {self.world_size})")


def _check_positive_int(name: str, value: object, alternative: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer{alternative}, got {value!r}")
