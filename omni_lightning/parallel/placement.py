"""Rank math of the disaggregated placement (DistTrain's): an LLM pool and an encoder pool, in pure Python.

The world is cut into two contiguous rank ranges: the LLM pool first (ranks ``0 .. llm.world_size - 1``, laid out by
its own :class:`ParallelDims`, so rank 0 logs and owns checkpoint names as in every other layout), then the encoder
pool. Each data-parallel rank of the LLM reads its own samples; the encoder ranks that *serve* it encode their
items and send the outputs to every LLM rank that embeds them (the first pipeline stage's ranks of that
data-parallel rank: its TP and CP peers need the same embeddings).

The pools may have different data-parallel sizes ``D`` (LLM) and ``E`` (encoders):

* fan-out, ``E >= D``: LLM data-parallel rank ``d`` is served by the encoder ranks ``e`` with ``e % D == d``
  (``E // D`` or one more of them), and its items of each micro-batch are shared among them by cost;
* fan-in, ``E < D``: encoder rank ``e`` serves the LLM data-parallel ranks ``d`` with ``d % E == e``.

So every LLM data-parallel rank is served and every encoder rank has work. The mapping is static, as a
statically sized pool's is: within the encoder pool, :class:`~omni_lightning.runtime.reshard.Resharder`
still evens out each micro-batch's work (with long-short SP when ``enc_sp > 1``).
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_lightning.parallel.dims import ParallelDims

__all__ = ["PoolLayout"]


@dataclass(frozen=True)
class PoolLayout:
    """Ranks of both pools and who serves whom (see the module docstring).

    Args:
        llm: the LLM pool's degrees; its ranks are ``0 .. llm.world_size - 1``.
        encoder_world_size: ranks of the encoder pool, which follow the LLM pool's.
    """

    llm: ParallelDims
    encoder_world_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.encoder_world_size, int) or self.encoder_world_size < 1:
            raise ValueError(f"encoder_world_size={self.encoder_world_size!r} must be a positive integer: the "
                             "disaggregated placement needs at least one encoder rank")

    @property
    def world_size(self) -> int:
        return self.llm.world_size + self.encoder_world_size

    @property
    def encoder_ranks(self) -> list[int]:
        """Global ranks of the encoder pool, in pool order."""
        return list(range(self.llm.world_size, self.world_size))

    def is_encoder_rank(self, rank: int) -> bool:
        self._check_rank(rank)
        return rank >= self.llm.world_size

    def encoder_index(self, rank: int) -> int:
        """Position of an encoder rank in its pool."""
        if not self.is_encoder_rank(rank):
            raise ValueError(f"rank {rank} belongs to the LLM pool (ranks 0..{self.llm.world_size - 1})")
        return rank - self.llm.world_size

    def serving(self, dp_rank: int) -> list[int]:
        """Global ranks of the encoder ranks that serve LLM data-parallel rank ``dp_rank``."""
        dp, pool = self.llm.dp, self.encoder_world_size
        if not 0 <= dp_rank < dp:
            raise ValueError(f"data-parallel rank {dp_rank} is outside [0, {dp})")
        indices = [e for e in range(pool) if e % dp == dp_rank] if pool >= dp else [dp_rank % pool]
        return [self.llm.world_size + e for e in indices]

    def served_by(self, encoder_rank: int) -> list[int]:
        """LLM data-parallel ranks whose items ``encoder_rank`` (global) encodes, in order."""
        self.encoder_index(encoder_rank)
        return [d for d in range(self.llm.dp) if encoder_rank in self.serving(d)]

    def consumers(self, dp_rank: int) -> list[int]:
        """LLM ranks that embed the encoder outputs of data-parallel rank ``dp_rank``: the first pipeline stage's
        ranks holding that rank's samples (its CP and TP peers), sorted; the first is the *leader*, which sends the
        items' inputs and the outputs' gradients."""
        if not 0 <= dp_rank < self.llm.dp:
            raise ValueError(f"data-parallel rank {dp_rank} is outside [0, {self.llm.dp})")
        return [r for r in range(self.llm.world_size)
                if self.llm.coordinate(r)["pp"] == 0 and self.llm.local_rank_in("dp", r) == dp_rank]

    def dp_rank_of(self, llm_rank: int) -> int:
        """Data-parallel rank of an LLM rank."""
        if self.is_encoder_rank(llm_rank):
            raise ValueError(f"rank {llm_rank} belongs to the encoder pool")
        return self.llm.local_rank_in("dp", llm_rank)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world [0, {self.world_size})")
