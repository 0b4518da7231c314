"""Pool sizing for the disaggregated placement (DistTrain): how many GPUs the encoders get, and both pools' layouts.

The encoders run on a pool of ``n_enc = tp_enc * dp_enc`` GPUs, the LLM on a pool of
``n_llm = tp * pp * dp`` GPUs; micro-batches stream from one to the other, so a step takes about the slower pool's
time plus the first micro-batch's encoder work (the LLM pool waits for it). Within one choice of degrees every term
is linear in the reciprocal pool sizes:

* encoder pool: ``F_enc / (n_enc * flops)`` of compute plus TP communication ``(tokens_enc / dp_enc) * c(tp_enc)``;
* LLM pool: the fullest pipeline's ``m = ceil(sequences / dp)`` sequences of work over its ``tp * pp`` GPUs, plus
  TP communication, both stretched by the 1F1B bubble ``(pp - 1) / (m + pp - 1)``.

Given the LLM pool, the encoder pool's time only falls as it grows, so the best encoder pool takes every GPU the
LLM pool leaves (rounded down to a multiple of its TP degree). :func:`solve_pools` therefore enumerates TP in
``{1, 2, 4, 8}`` for both pools, the pipeline degrees, and every data-parallel degree of the LLM pool up to the
step's sequences (a degree that does not divide them leaves some pipelines one sequence short), vectorised, and
keeps the fastest layout whose states and activations fit in memory. That is exact for the model, and sizes 1296
GPUs well under a second (``benchmarks/allocation.py``).

Pure numpy: no process groups. ``pool_problem`` builds the problem from a cost model and a workload spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni_lightning.balance.cost import CostModel, meta_items
from omni_lightning.balance.workload import WorkloadSpec, sample_metadata

__all__ = [
    "TP_DEGREES",
    "PP_DEGREES",
    "ModuleShape",
    "PoolProblem",
    "PoolChoice",
    "pool_problem",
    "pool_step_time",
    "pool_memory",
    "solve_pools",
    "encoder_pool_size",
    "tp_seconds_per_token",
]

TP_DEGREES = (1, 2, 4, 8)
PP_DEGREES = (1, 2, 4, 8, 16)
_SELECTIVE_BYTES = 34  # activation bytes per token, layer and hidden unit (flash attention, sequence parallel)
_CHECKPOINT_BYTES = 2  # with full recomputation: each layer's bf16 input
_TP_COLLECTIVES = 8  # per layer and micro-batch: 2 in the forward, 2 in the backward, 2 bytes (bf16) each


@dataclass(frozen=True)
class ModuleShape:
    """What memory and TP communication need to know of a module: parameters, layers and hidden size."""

    params: float
    layers: int
    dim: int


@dataclass(frozen=True)
class PoolProblem:
    """One training step, as the pool solver sees it.

    Args:
        world_size: GPUs to split between the pools.
        memory_bytes: usable memory per GPU.
        device_flops: FLOP/s one GPU sustains.
        intra_node_bandwidth: bytes/s of a GPU's NVLink (TP groups stay inside a node, so TP <= 8).
        encoder_flops, llm_flops: predicted training FLOPs of one step in each module.
        encoder_tokens: encoder tokens of one step (patches, audio frames), for TP traffic and activations.
        sequences: packed LLM sequences of ``seq_len`` tokens per step, spread over the LLM pool's data parallelism.
        encoder, llm: module shapes.
        recompute: ``"selective"`` or ``"full"`` activation recomputation.
    """

    world_size: int
    memory_bytes: float
    device_flops: float
    intra_node_bandwidth: float
    encoder_flops: float
    llm_flops: float
    encoder_tokens: float
    sequences: int
    seq_len: int
    encoder: ModuleShape
    llm: ModuleShape
    recompute: str = "selective"

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"world_size={self.world_size}: two pools need at least 2 GPUs")
        if self.sequences < 1 or self.seq_len < 1:
            raise ValueError(f"sequences={self.sequences} and seq_len={self.seq_len} must be positive")
        if self.recompute not in ("selective", "full"):
            raise ValueError(f"recompute={self.recompute!r} must be 'selective' or 'full'")

    @property
    def activation_bytes(self) -> float:
        return float(_CHECKPOINT_BYTES if self.recompute == "full" else _SELECTIVE_BYTES)


@dataclass(frozen=True)
class PoolChoice:
    """Both pools' layouts: ``tp_enc * dp_enc`` encoder GPUs, ``tp * pp * dp`` LLM GPUs."""

    tp_enc: int
    dp_enc: int
    tp: int
    pp: int
    dp: int

    @property
    def encoder_gpus(self) -> int:
        return self.tp_enc * self.dp_enc

    @property
    def llm_gpus(self) -> int:
        return self.tp * self.pp * self.dp


def tp_seconds_per_token(dim: int, tp: np.ndarray | float, bandwidth: float) -> np.ndarray | float:
    """Seconds of TP traffic one token adds per layer (ring all-reduce of its activations, forward and backward)."""
    return _TP_COLLECTIVES * dim * 2 * (tp - 1) / tp / bandwidth


def _times(problem: PoolProblem, tp_enc: np.ndarray, dp_enc: np.ndarray, tp: np.ndarray, pp: np.ndarray,
           dp: np.ndarray) -> np.ndarray:
    """Vectorised :func:`pool_step_time`."""
    n_enc = tp_enc * dp_enc
    enc, llm, bw = problem.encoder, problem.llm, problem.intra_node_bandwidth
    t_enc = (problem.encoder_flops / (n_enc * problem.device_flops)
             + problem.encoder_tokens / dp_enc * enc.layers * tp_seconds_per_token(enc.dim, tp_enc, bw))
    micro = np.ceil(problem.sequences / dp)  # the fullest pipeline's micro-batches
    bubble = (pp - 1) / (micro + pp - 1)
    per_sequence = problem.llm_flops / problem.sequences
    t_llm = (per_sequence * micro / (tp * pp * problem.device_flops)
             + micro * problem.seq_len / pp * llm.layers * tp_seconds_per_token(llm.dim, tp, bw)) / (1 - bubble)
    return np.maximum(t_enc, t_llm) + t_enc / micro


def _memory(problem: PoolProblem, tp_enc: np.ndarray, dp_enc: np.ndarray, tp: np.ndarray, pp: np.ndarray,
            dp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised :func:`pool_memory`."""
    enc, llm, act = problem.encoder, problem.llm, problem.activation_bytes
    micro = np.ceil(problem.sequences / dp)
    # Encoder pool: fully sharded states plus one gathered layer; two micro-batches' items in flight.
    enc_tokens = problem.encoder_tokens / dp_enc * np.minimum(2.0, micro) / micro
    encoder = (enc.params * 16 / (tp_enc * dp_enc) + 2 * enc.params / (enc.layers * tp_enc)
               + enc_tokens * enc.layers * act * enc.dim / tp_enc)
    if problem.recompute == "full":
        encoder = encoder + enc_tokens * _SELECTIVE_BYTES * enc.dim / tp_enc
    # LLM pool: distributed optimizer; stage 0 keeps pp micro-batches of its layers (1F1B).
    states = llm.params / (tp * pp) * (6 + 12 / dp)
    per_micro = problem.seq_len * llm.layers / pp * act * llm.dim / tp
    full_layer = problem.seq_len * _SELECTIVE_BYTES * llm.dim / tp if problem.recompute == "full" else 0.0
    return encoder, states + np.minimum(pp, micro) * per_micro + full_layer


def pool_step_time(problem: PoolProblem, choice: PoolChoice) -> float:
    """Predicted step time (seconds) of ``choice``: the slower pool plus one micro-batch of encoder latency."""
    arrays = [np.array([v], dtype=np.float64) for v in (choice.tp_enc, choice.dp_enc, choice.tp, choice.pp, choice.dp)]
    return float(_times(problem, *arrays)[0])


def pool_memory(problem: PoolProblem, choice: PoolChoice) -> tuple[float, float]:
    """Bytes per GPU of the encoder pool and of the LLM pool's first stage (its fullest) under ``choice``."""
    arrays = [np.array([v], dtype=np.float64) for v in (choice.tp_enc, choice.dp_enc, choice.tp, choice.pp, choice.dp)]
    encoder, llm = _memory(problem, *arrays)
    return float(encoder[0]), float(llm[0])


def solve_pools(problem: PoolProblem) -> PoolChoice | None:
    """The fastest :class:`PoolChoice` that fits in memory, or ``None`` if none does (see the module docstring).

    Ties go to the smaller LLM pool, then to the smaller TP degrees, so the answer is deterministic.
    """
    world = problem.world_size
    rows = []
    for tp in TP_DEGREES:
        for pp in PP_DEGREES:
            if pp > problem.llm.layers:
                continue
            dps = np.arange(1, world // (tp * pp) + 1)
            dps = dps[(dps <= problem.sequences) & (dps * tp * pp < world)]
            for tp_enc in TP_DEGREES:
                dp_enc = (world - dps * tp * pp) // tp_enc
                keep = dp_enc >= 1
                rows.append(np.stack([np.full(keep.sum(), tp_enc), dp_enc[keep], np.full(keep.sum(), tp),
                                      np.full(keep.sum(), pp), dps[keep]], axis=1))
    if not rows:
        return None
    table = np.concatenate(rows).astype(np.float64)
    columns = [table[:, i] for i in range(5)]
    encoder, llm = _memory(problem, *columns)
    fits = (encoder <= problem.memory_bytes) & (llm <= problem.memory_bytes)
    if not fits.any():
        return None
    times = np.where(fits, _times(problem, *columns), np.inf)
    llm_gpus = table[:, 2] * table[:, 3] * table[:, 4]
    best = int(np.lexsort((table[:, 2], table[:, 0], llm_gpus, times))[0])
    tp_enc, dp_enc, tp, pp, dp = (int(v) for v in table[best])
    return PoolChoice(tp_enc=tp_enc, dp_enc=dp_enc, tp=tp, pp=pp, dp=dp)


def encoder_pool_size(problem: PoolProblem, *, llm_unit: int, tp: int = 1, pp: int = 1) -> int:
    """Encoder ranks of the fastest split of ``problem.world_size`` ranks whose LLM pool keeps a given layout.

    The run-time question (``OmniStrategy(placement="disaggregated", encoder_world_size=None)``): the LLM pool's
    TP and PP degrees are the user's, its size a multiple of ``llm_unit`` (``tp * pp * cp * dp_replicate``), and the
    encoder pool, which has no TP at run time, takes the rest. Every split is tried (:func:`pool_step_time`, CP ranks
    counted as data parallelism); splits that do not fit in memory are skipped, ties go to the smaller LLM pool.
    Raises ``ValueError`` when no split leaves both pools a rank or none fits.
    """
    world = problem.world_size
    if llm_unit < 1 or llm_unit % (tp * pp):
        raise ValueError(f"llm_unit={llm_unit} must be a positive multiple of tp*pp = {tp * pp}")
    best: tuple[float, int] | None = None
    for llm_gpus in range(llm_unit, world, llm_unit):
        choice = PoolChoice(tp_enc=1, dp_enc=world - llm_gpus, tp=tp, pp=pp, dp=llm_gpus // (tp * pp))
        if max(pool_memory(problem, choice)) > problem.memory_bytes:
            continue
        time = pool_step_time(problem, choice)
        if best is None or time < best[0]:
            best = (time, choice.dp_enc)
    if best is None:
        raise ValueError(f"no split of {world} ranks into an LLM pool of a multiple of {llm_unit} ranks and an "
                         "encoder pool of at least one fits in memory")
    return best[1]


def pool_problem(
    cost_model: CostModel,
    spec: WorkloadSpec,
    *,
    world_size: int,
    memory_bytes: float,
    device_flops: float,
    intra_node_bandwidth: float,
    sequences: int,
    seq_len: int,
    encoder: ModuleShape,
    llm: ModuleShape,
    recompute: str = "selective",
    samples: int = 2048,
    seed: int = 0,
    length_scale: float = 1.0,
) -> PoolProblem:
    """The :class:`PoolProblem` of a workload: its mean encoder and LLM work per LLM token, drawn from ``spec``
    (``samples`` samples cut to ``seq_len``, sizes times ``length_scale`` as the synthetic shards draw them), times
    the step's ``sequences * seq_len`` tokens. Sizing on the mean is what a static allocation can do: the mix of the
    steps that follow may differ."""
    rng = np.random.default_rng(seed)
    metas = [sample_metadata(spec, rng, length_scale=length_scale, max_llm_tokens=seq_len) for _ in range(samples)]
    costs = cost_model.costs(metas)
    llm_tokens = float(sum(m.llm_tokens for m in metas))
    enc_tokens = float(sum(sum(map(sum, meta_items(m).values())) for m in metas))
    step_tokens = sequences * seq_len
    scale = step_tokens / llm_tokens
    return PoolProblem(
        world_size=world_size,
        memory_bytes=memory_bytes,
        device_flops=device_flops,
        intra_node_bandwidth=intra_node_bandwidth,
        encoder_flops=float(costs[:, :-1].sum()) * scale,
        llm_flops=float(costs[:, -1].sum()) * scale,
        encoder_tokens=enc_tokens * scale,
        sequences=sequences,
        seq_len=seq_len,
        encoder=encoder,
        llm=llm,
        recompute=recompute,
    )
