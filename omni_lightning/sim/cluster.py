"""The hardware, model and layout a simulated step runs on, and the memory and communication it costs (pure).

Compute is priced by :class:`omni_lightning.balance.cost.CostModel` (training FLOPs per sample, built with
:func:`~omni_lightning.models.flops.reference_cost_model` from the model's shapes) and turned into seconds at
``Cluster.effective_flops``.
Communication is priced with ring collectives: ``2 (n - 1) / n`` of the payload crosses each link, over NVLink
inside a node and over the per-GPU network share across nodes (hierarchically when a group has several GPUs in
each node).

Memory per GPU, in bytes, is what decides out-of-memory:

* LLM states: bf16 parameters and fp32 gradients (6 bytes per parameter) on every data-parallel replica of a
  TP x PP shard, fp32 master weights and Adam moments (12 bytes) sharded over data and context parallelism
  (Megatron's distributed optimizer);
* encoder states: fully sharded (FSDP, 16 bytes per parameter) over the encoder's data-parallel group, plus one
  layer gathered at a time;
* activations: with selective recomputation and flash attention, ``34 * dim / tp`` bytes per token and layer
  (Korthikanti et al. 2022, sequence parallel); with full recomputation only each layer's input, ``2 * dim / tp``,
  plus one layer's full activations. Pipeline stage ``s`` of ``p`` keeps ``p - s`` micro-batches in flight (1F1B).
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_lightning.models.config import ReferenceMLLMConfig

__all__ = [
    "GiB",
    "Cluster",
    "Layout",
    "ModelSpec",
    "collective_seconds",
    "encoder_params",
    "fsdp_state_bytes",
    "llm_params",
    "llm_state_bytes",
]

GiB = float(1 << 30)
_SELECTIVE_BYTES = 34  # per token, layer and hidden unit (bf16, flash attention, sequence parallel)
_CHECKPOINT_BYTES = 2  # a layer's bf16 input, all that full recomputation keeps
_REPLICATED_BYTES = 6  # bf16 parameter + fp32 gradient per parameter
_OPTIMIZER_BYTES = 12  # fp32 master weight + Adam's two moments
_FSDP_BYTES = 16  # everything of a parameter, sharded


@dataclass(frozen=True)
class Cluster:
    """GPUs and their links.

    Args:
        gpus: devices in the job.
        flops: peak dense bf16 FLOP/s of one GPU.
        mfu: share of the peak that large matmuls reach (turns FLOPs into seconds).
        memory_gib: memory of one GPU; ``reserve_gib`` of it is kept for the allocator, workspaces and buffers.
        intra_node_gbps, inter_node_gbps: bytes/s per GPU (GB/s) over NVLink and over the network.
    """

    gpus: int
    flops: float = 989e12
    mfu: float = 0.5
    gpus_per_node: int = 8
    memory_gib: float = 80.0
    reserve_gib: float = 8.0
    intra_node_gbps: float = 400.0
    inter_node_gbps: float = 50.0

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"gpus={self.gpus} and gpus_per_node={self.gpus_per_node} must be positive")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu={self.mfu} must be in (0, 1]")
        if self.memory_gib <= self.reserve_gib:
            raise ValueError(f"memory_gib={self.memory_gib} must exceed reserve_gib={self.reserve_gib}")

    @property
    def effective_flops(self) -> float:
        """FLOP/s one GPU sustains on the model's matmuls."""
        return self.flops * self.mfu

    @property
    def usable_bytes(self) -> float:
        """Memory of one GPU that states and activations may take."""
        return (self.memory_gib - self.reserve_gib) * GiB


@dataclass(frozen=True)
class ModelSpec:
    """A named MLLM: its shapes (a :class:`ReferenceMLLMConfig`, which only describes sizes here)."""

    name: str
    config: ReferenceMLLMConfig


@dataclass(frozen=True)
class Layout:
    """The LLM's parallel layout and the encoder's sequence parallelism.

    ``micro_batches`` packed sequences of ``seq_len`` tokens per data-parallel rank and step; ``dp`` follows from
    the number of GPUs (``Layout.dp_of``). ``recompute`` is ``"selective"`` or ``"full"`` (full adds one forward to
    the backward, for encoders and LLM alike). ``reorder_group`` data-parallel ranks plan their samples together,
    ``group_steps`` steps at a time (``OmniDataModule``'s ``reorder_group_size`` and ``group_steps``).
    """

    tp: int = 8
    pp: int = 1
    cp: int = 1
    micro_batches: int = 8
    seq_len: int = 8192
    enc_sp: int = 8
    recompute: str = "selective"
    reorder_group: int = 8
    group_steps: int = 8

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "micro_batches", "seq_len", "enc_sp", "reorder_group", "group_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.recompute not in ("selective", "full"):
            raise ValueError(f"recompute={self.recompute!r} must be 'selective' or 'full'")

    @property
    def model_parallel(self) -> int:
        """GPUs of one data-parallel replica."""
        return self.tp * self.pp * self.cp

    def dp_of(self, gpus: int) -> int:
        """Data-parallel degree on ``gpus`` GPUs (GPUs beyond a whole number of replicas stay idle)."""
        dp = gpus // self.model_parallel
        if dp < 1:
            raise ValueError(f"{gpus} GPUs cannot hold one replica of tp*pp*cp={self.model_parallel}")
        return dp

    @property
    def recompute_factor(self) -> float:
        """Training FLOPs over the no-recompute count (forward 1, backward 2; full recomputation adds a forward)."""
        return 4 / 3 if self.recompute == "full" else 1.0

    def activation_bytes(self, dim: int) -> float:
        """Bytes kept per token and layer, before dividing by TP."""
        return float((_CHECKPOINT_BYTES if self.recompute == "full" else _SELECTIVE_BYTES) * dim)


def encoder_params(config: ReferenceMLLMConfig, modality: str) -> float:
    """Parameters of the vision or audio encoder with its projector (matmul weights; norms are negligible)."""
    llm_dim = config.llm.dim
    if modality == "vision":
        enc = config.vision
        stem, projector = enc.patch_dim * enc.dim, enc.dim * enc.merge * llm_dim + llm_dim * llm_dim
    else:
        enc = config.audio
        stem, projector = 3 * enc.n_mels * enc.dim + 3 * enc.dim * enc.dim, enc.dim * llm_dim + llm_dim * llm_dim
    block = 4 * enc.dim * enc.dim + 2 * enc.dim * int(enc.dim * enc.mlp_ratio)
    return float(stem + enc.n_layers * block + projector)


def llm_params(config: ReferenceMLLMConfig) -> float:
    """Parameters of the decoder: attention, SwiGLU (or all experts in MoE layers), embeddings and LM head."""
    llm = config.llm
    q, kv = llm.n_heads * llm.head_dim, llm.n_kv_heads * llm.head_dim
    attention = llm.dim * (q + 2 * kv) + q * llm.dim
    swiglu = 3 * llm.dim * llm.ffn_hidden
    layers = sum(attention + (llm.n_experts * swiglu if llm.is_moe_layer(i) else swiglu) for i in range(llm.n_layers))
    return float(layers + 2 * llm.vocab_size * llm.dim)


def llm_state_bytes(params: float, layout: Layout, dp: int) -> float:
    """LLM parameter, gradient and optimizer bytes on one GPU (distributed optimizer over dp x cp)."""
    shard = params / (layout.tp * layout.pp)
    return shard * (_REPLICATED_BYTES + _OPTIMIZER_BYTES / (dp * layout.cp))


def fsdp_state_bytes(params: float, layers: int, group: int) -> float:
    """Fully sharded states over ``group`` GPUs plus the one layer gathered (bf16) while it computes."""
    return params * _FSDP_BYTES / group + 2 * params / max(layers, 1)


def collective_seconds(payload_bytes: float, group: int, cluster: Cluster, *, per_node: int = 1) -> float:
    """A hierarchical ring all-reduce (reduce-scatter + all-gather) of ``payload_bytes`` over ``group`` GPUs, of
    which ``per_node`` share each node: over NVLink among those, then of their ``1 / per_node`` shards across nodes."""
    if group <= 1 or payload_bytes <= 0:
        return 0.0
    local = max(1, min(per_node, group, cluster.gpus_per_node))
    nodes = group / local
    seconds = 2 * (local - 1) / local * payload_bytes / (cluster.intra_node_gbps * 1e9)
    if nodes > 1:
        seconds += 2 * (nodes - 1) / nodes * payload_bytes / local / (cluster.inter_node_gbps * 1e9)
    return seconds
