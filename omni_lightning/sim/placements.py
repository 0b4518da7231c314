"""Predicted step time of the three placements of encoders and LLM, from the runtime's own planners.

Every placement trains the same samples (one :class:`~omni_lightning.sim.draws.StepDraw` per step) with the same
LLM layout; compute is the cost model's FLOPs at the cluster's effective FLOP/s, the pipeline is replayed with
:func:`~omni_lightning.sim.replay_pipeline`, and the step ends with the gradient synchronisation (exposed, the same
rule for all). Where the runtime plans, the simulator calls the same function, through its module, so a change
there moves the figures here:

* **coupled** (Megatron-LM, torchtitan): every data-parallel rank trains what it read, packed in arrival order; the
  encoders run on the first pipeline stage, TP-sharded like it, inside its forward and backward (1F1B).
* **disaggregated** (DistTrain): encoders on their own pool, sized once by
  :func:`omni_lightning.balance.allocation.solve_pools` for the workload's mean mix; the LLM pool's samples are
  reordered (:func:`~omni_lightning.balance.reorder.plan_reorder_group`, LPT and the 1F1B micro-batch order); encoder
  items go whole to the least-loaded encoder rank (:func:`~omni_lightning.balance.reshard.plan_encoder_work` without
  SP); the pools stream micro-batches to each other, so the step is the slower pool plus one micro-batch of encoder
  latency.
* **omni** (OmniStrategy): grouped reordering in reorder groups of data-parallel ranks, ``group_steps`` steps planned
  together as the loader does (``plan_reorder_group`` on each sample's whole cost, LLM and encoders, as the loader
  prices it; the steps' mean is what compares), samples whole, each rank-step's micro-batches shaped for 1F1B as
  ``OmniDataModule`` shapes them under pipeline parallelism (on their LLM cost under the joint pipeline, towards the
  1F1B cost profile, ``pipeline_order="ramp"``; with ``Scenario.pipeline_search``, refined by the loader's local
  search); encoder items (images, frames, clips) placed on stages and peers as the joint pipeline places them and
  planned per insertion over the data-parallel ranks with long-short SP by the runtime resharder's own decision
  (``plan_resharding``: each encoder's items in turn, moves and splits priced as the runtime prices them on a GPU;
  without a pipeline, on top of each rank's LLM work on the micro-batch). ``Scenario.assume`` names
  capabilities the runtime lacks that a run may simulate instead (see ``ASSUMPTIONS``).
  Its ablations switch off multiplexing (encoders on stage 0's GPUs, still planned with LSSP), reordering (arrival
  order) or LSSP (``enc_sp=1``).

Scale: a step ends when the slowest data-parallel replica does (the gradient synchronisation waits for it), so by
default every reorder group is simulated, i.e. every data-parallel rank (``dp // reorder_group`` whole groups):
the expected maximum of long-tailed per-replica work grows with the number of replicas, and a fixed sample of them
(``max_groups``) would give the same stragglers at 4096 and 8192 GPUs. A step's time is the slowest simulated
rank's; the figure is the mean over ``steps`` steps, enough of them to average over the per-step modality mix (with
``concentration``, one step in a few is encoder-heavy or encoder-light, and a placement's step time is not linear
in the mix: the coupled one is held up by encoder-heavy steps, and light ones leave its encoder stage idle).
Leftover samples that a plan could not place are scaled out: each step's time is divided by the share of the drawn
work it ran.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from omni_lightning.balance import allocation, reorder, reshard
from omni_lightning.balance.pipeline_order import assign_encoder_items, split_items
from omni_lightning.balance.pipeline_replay import Action, replay_pipeline
from omni_lightning.balance.workload import WorkloadSpec
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.flops import reference_cost_model
from omni_lightning.sim.cluster import (
    Cluster,
    GiB,
    Layout,
    ModelSpec,
    collective_seconds,
    encoder_params,
    fsdp_state_bytes,
    llm_params,
    llm_state_bytes,
)
from omni_lightning.sim.draws import SamplePool, StepDraw, draw_step
from omni_lightning.sim.schedules import joint_pipeline, one_f_one_b

_RESHARD_MIN_GAIN = 0.05  # the runtime resharder's default (runtime.reshard.Resharder's min_gain)
# What the runtime's resharder prices a plan's traffic by on the GPUs simulated here: the default link of a CUDA
# device (``link_cost="auto"``), whatever links the encoder group actually spans.
_ELEMENT_BYTES = 2  # bf16 parameters and activations

__all__ = ["ASSUMPTIONS", "OmniOptions", "PlacementResult", "Scenario", "Simulation"]

# Capabilities the runtime lacks, which omni may be credited with only when a scenario names them:
# * ``cp_sample_split``: a sequence costlier than a micro-batch's fair share split into context-parallel pieces
#   over the data-parallel ranks of its reorder group (the runtime's CP is a fixed mesh degree, and the loader never
#   splits a sample);
# * ``replica_encoder_plan``: a step's encoder items planned once over every GPU of the reorder group (the runtime
#   plans each insertion's items over the data-parallel ranks, a rank's context- and tensor-parallel peers
#   splitting its items); implies ``even_encoder_slices``, since such a plan says nothing about insertions;
# * ``even_encoder_slices``: each GPU's encoder work of the step spread evenly over its insertions (the runtime
#   inserts whole items at the micro-batch they belong to).
ASSUMPTIONS: tuple[str, ...] = ("cp_sample_split", "replica_encoder_plan", "even_encoder_slices")

_SELECTIVE_BYTES = 34  # bytes per token, layer and hidden unit of a layer's full activations
# One step of a reorder group's loader plan: each rank's micro-batches of pieces, the pieces (read, LLM share), and
# the reads (pool indices).
_LoaderPlan = tuple[list[list[list[int]]], list[tuple[int, float]], np.ndarray]


@dataclass(frozen=True)
class Scenario:
    """What to simulate: model, cluster, layout, workload, and how much of it to sample.

    ``concentration``: Dirichlet concentration of the per-step modality mix (``None``: the spec's fixed mix).
    ``steps``: steps drawn (the figures are means over them). ``max_groups``: reorder groups simulated per step
    (``None``: all of them, every data-parallel rank; a smaller number is only a quicker, optimistic look, since
    the ranks left out could only add stragglers). ``pipeline_search``: omni's loader also refines each rank-step's
    ramp of micro-batches by the local search on the 1F1B step time of their predicted costs, as
    ``OmniDataModule`` does by default (``pipeline_order="search"``); without it the simulator plans the ramp alone
    (``"ramp"``), since the search costs up to a second per rank-step at pp 8 with 32 micro-batches and every
    rank-step of every reorder group is planned, while at these scales a micro-batch holds enough samples for
    the ramp to get within half a percent of it (``benchmarks/README.md``). ``assume``: capabilities the runtime
    does not have, simulated only when named here (:data:`ASSUMPTIONS`).
    """

    model: ModelSpec
    cluster: Cluster
    layout: Layout
    workload: WorkloadSpec
    steps: int = 8
    max_groups: int | None = None
    concentration: float | None = 10.0
    seed: int = 0
    pipeline_search: bool = False
    assume: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        unknown = set(self.assume) - set(ASSUMPTIONS)
        if unknown:
            raise ValueError(f"unknown assumption(s) {sorted(unknown)}; known: {list(ASSUMPTIONS)}")


@dataclass(frozen=True)
class OmniOptions:
    """The three mechanisms the ablation switches off one at a time."""

    multiplex: bool = True
    reorder: bool = True
    lssp: bool = True


@dataclass
class PlacementResult:
    """Predicted step time (``inf`` when out of memory), peak memory per GPU, and compute imbalance.

    ``imbalance`` is max / mean per-GPU compute (training FLOPs over FLOP/s; no communication, no waiting) per step
    (1.0 is perfect balance), averaged over steps.
    """

    name: str
    step_s: float
    memory_gib: float
    imbalance: float
    detail: str = ""
    per_step_s: list[float] = field(default_factory=list)

    @property
    def oom(self) -> bool:
        return math.isinf(self.step_s)


def _split(cost: np.ndarray, tokens: np.ndarray, share: float, cp_max: int) -> np.ndarray:
    """Context-parallel degree of each sample: the fewest power-of-two ranks (up to ``cp_max``) that bring its cost
    under ``share``; 1 for all samples that already fit."""
    degree = np.ones(cost.size, dtype=np.int64)
    while True:
        over = (cost / degree > share) & (degree < cp_max) & (tokens >= 2 * degree)
        if not over.any():
            return degree
        degree[over] *= 2


def _traffic_of(config: ReferenceMLLMConfig, encoder: str) -> reshard.EncoderTraffic:
    """What the runtime's resharder counts an item of ``encoder`` to move per stem token
    (``runtime.step._encoder_traffic`` of the reference model's encoder)."""
    shape = getattr(config, encoder)
    return reshard.EncoderTraffic.of_encoder(width=shape.dim, layers=shape.n_layers, output_width=config.llm.dim,
                                             tokens_per_output=getattr(shape, "merge", 1), element_bytes=_ELEMENT_BYTES)


def _compute_of(plan: reshard.EncoderPlan, costs: np.ndarray) -> np.ndarray:
    """Each rank's encoder compute under ``plan`` (``costs`` per item; a split item's share on each of its block's
    ranks), without the traffic a priced plan adds to its ``rank_cost``."""
    whole = plan.sp_degree == 1
    compute = np.zeros(plan.rank_cost.size)
    np.add.at(compute, plan.rank_of[whole], costs[whole])
    degree = plan.sp_degree[~whole]
    members = np.repeat(plan.sp_start[~whole], degree) + np.arange(degree.sum()) - np.repeat(degree.cumsum() - degree,
                                                                                              degree)
    np.add.at(compute, members, np.repeat(costs[~whole] / degree, degree))
    return compute


class Simulation:
    """One scenario: its priced sample pool and the steps every placement trains (the same for all)."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        config = scenario.model.config
        self.cost_model = reference_cost_model(config)
        layout, cluster = scenario.layout, scenario.cluster
        self.dp = layout.dp_of(cluster.gpus)
        group = min(layout.reorder_group, self.dp)
        self.group = group
        groups = self.dp // group
        self.ranks = (groups if scenario.max_groups is None else min(groups, scenario.max_groups)) * group
        self.pool = SamplePool.build(scenario.workload, self.cost_model, seq_len=layout.seq_len, seed=scenario.seed,
                                     packing=config.packing())
        # One random stream per step, which draws the step's modality mix first and then each rank's reads in rank
        # order: step k has the same mix, and rank r the same samples, at every GPU count, so the figures of one
        # workload at different scales differ by the ranks added and not by a different sample of mixes.
        self.draws: list[StepDraw] = [
            draw_step(self.pool, ranks=self.ranks, micro_batches=layout.micro_batches, seq_len=layout.seq_len,
                      rng=np.random.default_rng([scenario.seed, 1, step]), concentration=scenario.concentration)
            for step in range(scenario.steps)
        ]
        self.flops = cluster.effective_flops
        self.encoder_params = encoder_params(config, "vision") + encoder_params(config, "audio")
        self.llm_params = llm_params(config)
        # The loader plan of a (step, reorder group) is the same for omni and the ablations that keep reordering and
        # shape micro-batches alike (on the LLM's cost under the joint pipeline, on the whole cost else).
        self._loader_plans: dict[tuple[int, int, bool], _LoaderPlan] = {}
        # Each replica-step's stage and peer of every item (the joint pipeline's plan), by (step, replica, multiplex,
        # reorder).
        self._item_plans: dict[tuple[int, int, bool, bool], tuple[np.ndarray, np.ndarray]] = {}
        # Each encoder's traffic per stem token, as the runtime's resharder prices it.
        self.encoder_traffic = [_traffic_of(config, name) for name in self.pool.encoder_names]
        # Each encoder's attention width and depth, which its items' Ulysses traffic scales with.
        self._encoder_width_layers = np.array([(getattr(config, name).dim, getattr(config, name).n_layers)
                                               for name in self.pool.encoder_names], dtype=np.float64)

    # ------------------------------------------------------------------------------------------------ helpers
    @property
    def whole_sample_bound(self) -> float:
        """How close to the mean any placement of whole samples over the data-parallel ranks can get: the largest
        of ``reorder.lower_bound`` (largest sample, or the mean) over the mean rank's cost, worst step."""
        worst = 1.0
        for draw in self.draws:
            ids = np.concatenate(draw.samples)
            costs = self.pool.llm[ids] + self.pool.encoder[ids]
            worst = max(worst, reorder.lower_bound(costs, self.ranks) / (costs.sum() / self.ranks))
        return worst

    @property
    def sampling_note(self) -> str:
        """How much of the job the figures come from."""
        return (f"simulated {self.ranks} of {self.dp} data-parallel ranks ({self.ranks // self.group} reorder "
                f"group(s) of {self.group}) x {len(self.draws)} steps, omni's loader planning "
                f"{self.scenario.layout.group_steps} at a time{self._shaping_note}; step time = slowest simulated "
                "rank, mean over the steps")

    @property
    def _shaping_note(self) -> str:
        if self.scenario.layout.pp <= 1:
            return ""
        return (", its micro-batches shaped towards the 1F1B cost profile"
                f"{' with the 1F1B search' if self.scenario.pipeline_search else ''}")

    def _llm_durations(self, cost: float, tokens: float, layout: Layout, fraction: float) -> tuple[float, float]:
        """Forward and backward seconds of one micro-batch on a pipeline stage holding ``fraction`` of the LLM's
        layers (TP traffic included)."""
        cluster, llm = self.scenario.cluster, self.scenario.model.config.llm
        compute = cost * fraction / (layout.tp * layout.cp * self.flops)
        comm = (tokens / layout.cp * llm.n_layers * fraction
                * allocation.tp_seconds_per_token(llm.dim, layout.tp, cluster.intra_node_gbps * 1e9))
        backward = 2 / 3 + (layout.recompute_factor - 1)
        return compute / 3 + comm / 2, compute * backward + comm / 2

    def stage_fractions(self, layout: Layout, *, encoders_on_first: bool) -> np.ndarray:
        """Share of the LLM's layers on each pipeline stage. With the encoders on the first stage, that stage gets
        fewer layers (whole ones), so that at the workload's mean mix it carries as much as the others: the static
        tuning Megatron-LM's uneven first stage allows."""
        pp, layers = layout.pp, self.scenario.model.config.llm.n_layers
        if pp == 1 or not encoders_on_first:
            return np.full(pp, 1 / pp)
        ratio = self.mean_encoder_share
        first = min(max(round(layers * (1 - ratio * (pp - 1)) / pp), 0), layers // pp)
        return np.array([first / layers] + [(layers - first) / layers / (pp - 1)] * (pp - 1))

    @property
    def mean_encoder_share(self) -> float:
        """Encoder over LLM work at the spec's mean mix."""
        pool = self.pool
        enc = sum(w * pool.encoder[ix].mean() for w, ix in zip(pool.weights, pool.by_modality, strict=True))
        llm = sum(w * pool.llm[ix].mean() for w, ix in zip(pool.weights, pool.by_modality, strict=True))
        return float(enc / llm)

    def _split_work(self, flops: float, layout: Layout) -> tuple[float, float]:
        """Forward and backward seconds of ``flops`` training FLOPs on one GPU."""
        seconds = flops / self.flops
        return seconds / 3, seconds * (2 / 3 + layout.recompute_factor - 1)

    def _llm_memory(self, layout: Layout, dp: int, fractions: np.ndarray) -> np.ndarray:
        """LLM bytes per GPU of every stage: states of its layers and the activations of the micro-batches in flight
        (stage ``s`` of ``p`` keeps ``p - s`` under 1F1B)."""
        llm = self.scenario.model.config.llm
        tokens = layout.seq_len / layout.cp
        per_micro = tokens * llm.n_layers * fractions * layout.activation_bytes(llm.dim) / layout.tp
        full_layer = tokens * _SELECTIVE_BYTES * llm.dim / layout.tp if layout.recompute == "full" else 0.0
        in_flight = np.minimum(layout.pp - np.arange(layout.pp), layout.micro_batches)
        states = llm_state_bytes(self.llm_params, layout, dp) * fractions * layout.pp
        return states + in_flight * per_micro + full_layer

    def _encoder_activations(self, tokens: float, largest: float, layout: Layout, shards: int) -> float:
        """Bytes of encoder activations for ``tokens`` in flight whose largest item has ``largest`` tokens, each
        split over ``shards`` GPUs (TP or SP)."""
        vision = self.scenario.model.config.vision
        kept = tokens * vision.n_layers * layout.activation_bytes(vision.dim)
        full_layer = largest * _SELECTIVE_BYTES * vision.dim if layout.recompute == "full" else 0.0
        return (kept + full_layer) / shards

    def _sync(self, params: float, group: int, tp: int) -> float:
        """Exposed gradient synchronisation of ``params`` (per GPU) over a data-parallel ``group`` whose members sit
        ``tp`` apart: reduce-scatter of bf16 gradients, all-gather of updated weights."""
        cluster = self.scenario.cluster
        return collective_seconds(2 * params, group, cluster, per_node=max(1, cluster.gpus_per_node // tp))

    def _result(self, name: str, steps: list[float], memory: float, imbalance: list[float], detail: str
                ) -> PlacementResult:
        over = memory > self.scenario.cluster.usable_bytes
        return PlacementResult(name, math.inf if over else float(np.mean(steps)), memory / GiB,
                               float(np.mean(imbalance)), detail, steps)

    # ------------------------------------------------------------------------------------------------ coupled
    def coupled(self) -> PlacementResult:
        """Encoders on the first stage, one sample assignment (what each rank read, in arrival order)."""
        layout, pool, cluster = self.scenario.layout, self.pool, self.scenario.cluster
        vision = self.scenario.model.config.vision
        stage_gpus = layout.tp * layout.cp
        fractions = self.stage_fractions(layout, encoders_on_first=True)
        llm_memory = self._llm_memory(layout, self.dp, fractions)
        steps, imbalance, memory = [], [], 0.0
        for draw in self.draws:
            makespans, busy = [], []
            for r, samples in enumerate(draw.samples):
                enc_f, enc_b, enc_tokens = [], [], []
                llm_cost, llm_tokens = [], []
                for batch in draw.micro_batches[r]:
                    ids = samples[batch]
                    tokens = float(pool.item_tokens[pool.items_of(ids)[0]].sum())
                    comm = tokens * vision.n_layers * allocation.tp_seconds_per_token(
                        vision.dim, layout.tp, cluster.intra_node_gbps * 1e9)
                    f, b = self._split_work(float(pool.encoder[ids].sum()) / stage_gpus, layout)
                    enc_f.append(f + comm / 2)
                    enc_b.append(b + comm / 2)
                    enc_tokens.append(tokens)
                    llm_cost.append(float(pool.llm[ids].sum()))
                    llm_tokens.append(float(pool.tokens[ids].sum()))
                replay = replay_pipeline(self._actions(llm_cost, llm_tokens, layout, fractions, enc_f, enc_b,
                                                       joint=False))
                makespans.append(replay.makespan)
                compute = sum(llm_cost) * fractions
                compute[0] += float(pool.encoder[samples].sum())
                busy.extend(np.repeat(compute * layout.recompute_factor / (stage_gpus * self.flops), stage_gpus))
                largest = float(pool.item_tokens[pool.items_of(samples)[0]].max(initial=0.0))
                window = max(sum(enc_tokens[m : m + layout.pp]) for m in range(len(enc_tokens)))
                memory = max(memory, llm_memory[0] + self._encoder_state_bytes(layout.tp, self.dp * layout.cp)
                             + self._encoder_activations(window, largest, layout, stage_gpus), llm_memory.max())
            sync = self._sync(self.llm_params / (layout.tp * layout.pp), self.dp * layout.cp, layout.tp) + self._sync(
                self.encoder_params / layout.tp, self.dp * layout.cp, layout.tp)
            steps.append(max(makespans) + sync)
            imbalance.append(max(busy) / float(np.mean(busy)))
        return self._result("coupled", steps, memory, imbalance,
                            f"encoders on stage 0 ({fractions[0] * 100:.0f}% of the LLM layers there), arrival order")

    def _actions(self, llm_cost: list[float], llm_tokens: list[float], layout: Layout, fractions: np.ndarray,
                 enc_forward: list[float] | np.ndarray, enc_backward: list[float] | np.ndarray, *, joint: bool
                 ) -> list[list[Action]]:
        """One data-parallel replica's pipeline step. ``joint``: ``enc_*[s][m]`` are stage ``s``'s encoder insertions
        (the joint pipeline); otherwise ``enc_*[m]`` is folded into the first stage's forward and backward."""
        durations = [[self._llm_durations(c, t, layout, f) for c, t in zip(llm_cost, llm_tokens, strict=True)]
                     for f in fractions]
        forward = [[d[0] for d in stage] for stage in durations]
        backward = [[d[1] for d in stage] for stage in durations]
        if joint:
            return joint_pipeline(forward, backward, np.asarray(enc_forward).tolist(),
                                  np.asarray(enc_backward).tolist())
        forward[0] = [f + e for f, e in zip(forward[0], enc_forward, strict=True)]
        backward[0] = [b + e for b, e in zip(backward[0], enc_backward, strict=True)]
        return one_f_one_b(forward, backward)

    def _encoder_state_bytes(self, tp: int, group: int) -> float:
        vision = self.scenario.model.config.vision
        return fsdp_state_bytes(self.encoder_params / tp, vision.n_layers, group)

    # ------------------------------------------------------------------------------------------------ omni
    def omni(self, options: OmniOptions = OmniOptions()) -> PlacementResult:
        """OmniStrategy, or one of its ablations (``options``): what the runtime executes for this layout, unless
        the scenario assumes more (``Scenario.assume``; ``replica_encoder_plan`` selects
        :meth:`_omni_replica_plan`)."""
        if "replica_encoder_plan" in self.scenario.assume:
            return self._omni_replica_plan(options)
        return self._omni_runtime(options)

    def _omni_runtime(self, options: OmniOptions) -> PlacementResult:
        """OmniStrategy as the runtime runs it.

        The loader's plan (:meth:`_omni_micro_batches`) gives each data-parallel replica its micro-batches of
        whole samples. In each replica, the joint pipeline places every item of the step on a pipeline stage
        (:func:`~omni_lightning.balance.pipeline_order.assign_encoder_items`, as ``JointEncoders`` does, on the
        item's cost over the stage's context- and tensor-parallel peers), and the stage's peers split its items of
        each micro-batch and encoder by LPT, their labels turned by the replica (:meth:`_stage_and_peer`). With
        multiplexing off, every item is the first stage's. Then, per insertion (stage, peer, micro-batch), the
        resharder plans the items of that position of every data-parallel replica over the data-parallel ranks
        (:func:`~omni_lightning.balance.reshard.plan_resharding`, long items split over ``enc_sp`` consecutive
        data-parallel ranks, which sit ``cp * tp`` GPUs apart; without a pipeline, on top of each GPU's share of its
        micro-batch's LLM work), each encoder's items in turn, priced as the runtime prices them on a GPU (its
        default link for the encoder group: NVLink inside a node, the network for a group spanning nodes, whatever
        links the items then cross; the time counted here charges the outputs' travel and the Ulysses traffic over
        those, by bandwidth),
        keeping each rank's own items unless that lowers the slowest rank's work by more than 5% (the runtime
        resharder's ``min_gain``). Each insertion runs the items planned there, whole or as their SP shares, at
        the micro-batch they belong to (with ``even_encoder_slices``: each GPU's step of encoder work spread evenly
        over its insertions), and a stage moves at the pace of its busiest peer. Not modelled: the resharder's
        collectives make the replicas wait for each other at every insertion; each replica's pipeline is replayed
        on its own.
        """
        layout, pool = self.scenario.layout, self.pool
        pp, micro, peers = layout.pp, layout.micro_batches, layout.cp * layout.tp
        even = "even_encoder_slices" in self.scenario.assume
        replicas = self.ranks
        enc_sp = math.gcd(layout.enc_sp, replicas) if options.lssp else 1  # SP blocks tile the data-parallel ranks
        fractions = self.stage_fractions(layout, encoders_on_first=not options.multiplex)
        llm_memory = self._llm_memory(layout, self.dp, fractions)
        window = min(2 * pp if options.multiplex else pp, micro) / micro  # share of a step in flight
        slots = np.ones((pp, micro))  # each stage's share of its step's encoder work, by insertion (even slices)
        if options.multiplex and pp > 1 and micro > pp:
            slots[0, micro - pp :] = 0.0
        slots /= slots.sum(axis=1, keepdims=True)
        # Data-parallel rank r's GPU at one (stage, peer) position; only which node it is on matters.
        dp_gpu = np.arange(replicas) * peers
        # The link the runtime prices the resharder's plans by on a GPU: its default for the encoder group's nodes.
        link = reshard.resolve_link("auto", "cuda",
                                    spans_nodes=np.unique(dp_gpu // self.scenario.cluster.gpus_per_node).size > 1)
        makespans_of_steps, syncs, imbalance, memory, placed, drawn = [], [], [], 0.0, 0.0, 0.0
        for step, draw in enumerate(self.draws):
            llm_cost, llm_tokens = np.zeros((replicas, micro)), np.zeros((replicas, micro))
            all_items, all_replica, all_position = [], [], []
            for g in range(replicas // self.group):
                read = np.concatenate([draw.samples[r] for r in range(g * self.group, (g + 1) * self.group)])
                drawn += float(pool.llm[read].sum() + pool.encoder[read].sum())
                micro_batches, pieces, ids = self._omni_micro_batches(options, step, g)
                for i in range(self.group):
                    r = g * self.group + i
                    occurrences, batch_of, shares = [], [], []
                    for m, batch in enumerate(micro_batches[i]):
                        for piece in batch:
                            occurrence, share = pieces[piece]
                            occurrences.append(occurrence)
                            batch_of.append(m)
                            shares.append(share)
                    samples = ids[np.array(occurrences, dtype=np.int64)]
                    # bincount adds each micro-batch's pieces in order: the sums a loop of += would make.
                    share_of = np.array(shares, dtype=np.float64)
                    llm_cost[r] = np.bincount(batch_of, weights=pool.llm[samples] * share_of, minlength=micro)
                    llm_tokens[r] = np.bincount(batch_of, weights=pool.tokens[samples] * share_of, minlength=micro)
                    placed += float(llm_cost[r].sum() + pool.encoder[samples].sum())
                    items, position = pool.items_of(samples)
                    mb = np.array(batch_of, dtype=np.int64)[position]
                    # LSSP does not change where items go before the resharder: its ablation reuses omni's.
                    key = (step, r, options.multiplex, options.reorder)
                    if key not in self._item_plans:
                        self._item_plans[key] = self._stage_and_peer(llm_cost[r], mb, pool.item_cost[items],
                                                                     pool.item_encoder[items], options, r)
                    stage, peer = self._item_plans[key]
                    all_items.append(items)
                    all_replica.append(np.full(items.size, r))
                    all_position.append((stage * peers + peer) * micro + mb)
            items, replica, position = (np.concatenate(a) for a in (all_items, all_replica, all_position))
            # Encoder seconds (forward, backward) and tokens of every GPU: [replica, stage, peer, micro-batch].
            enc_f, enc_b = np.zeros((replicas, pp * peers * micro)), np.zeros((replicas, pp * peers * micro))
            enc_tokens, enc_flops = np.zeros((replicas, pp * peers * micro)), np.zeros((replicas, pp * peers * micro))
            largest = 0.0
            by_position = np.argsort(position, kind="stable")
            bounds = np.flatnonzero(np.diff(position[by_position])) + 1
            for chunk in np.split(by_position, bounds) if by_position.size else []:
                key = int(position[chunk[0]])
                costs = pool.item_cost[items[chunk]]
                # Without a pipeline every GPU runs its encoders and then its share of the LLM on the micro-batch,
                # and the resharder balances the two together.
                base = llm_cost[:, key % micro] / peers if pp == 1 else np.zeros(replicas)
                plan = self._resharder_plan(items[chunk], replica[chunk], replicas, enc_sp, base, link)
                # The plan's prices are the planner's; the time is the compute plus what _encoder_traffic charges
                # over the links the items cross.
                compute = _compute_of(plan, costs)
                comm, tokens, big = self._encoder_traffic(plan, items[chunk], dp_gpu[replica[chunk]], dp_gpu)
                f, b = self._split_work(compute, layout)
                enc_f[:, key] += f + comm / 2
                enc_b[:, key] += b + comm / 2
                enc_tokens[:, key] += tokens
                enc_flops[:, key] += compute
                largest = max(largest, big)
            shape = (replicas, pp, peers, micro)
            # A stage's peers meet at every TP/CP collective of the LLM: the stage runs at its busiest peer's pace.
            stage_f, stage_b = enc_f.reshape(shape).max(axis=2), enc_b.reshape(shape).max(axis=2)
            if even:
                stage_f = stage_f.sum(axis=2, keepdims=True) * slots[None]
                stage_b = stage_b.sum(axis=2, keepdims=True) * slots[None]
            flops_of_gpu = enc_flops.reshape(shape).sum(axis=3)  # [replica, stage, peer]
            tokens_of_gpu = enc_tokens.reshape(shape).sum(axis=3)
            makespans, gpu_busy = [], []
            for r in range(replicas):
                if options.multiplex:
                    actions = self._actions(llm_cost[r].tolist(), llm_tokens[r].tolist(), layout, fractions,
                                            stage_f[r], stage_b[r], joint=True)
                else:
                    actions = self._actions(llm_cost[r].tolist(), llm_tokens[r].tolist(), layout, fractions,
                                            stage_f[r, 0], stage_b[r, 0], joint=False)
                makespans.append(replay_pipeline(actions).makespan)
                busy = np.repeat(llm_cost[r].sum() * fractions / (peers * self.flops), peers)
                busy += flops_of_gpu[r].ravel() / self.flops
                gpu_busy.extend((busy * layout.recompute_factor).tolist())
                in_flight = tokens_of_gpu[r].max() * window
                memory = max(memory, llm_memory.max() + self._encoder_state_bytes(1, self.dp * peers * pp)
                             + self._encoder_activations(in_flight, largest, layout, 1))
            makespans_of_steps.append(max(makespans))
            syncs.append(self._sync(self.llm_params / (layout.tp * layout.pp), self.dp * layout.cp, layout.tp)
                         + self._sync(self.encoder_params, self.dp * peers * pp, 1))
            imbalance.append(max(gpu_busy) / float(np.mean(gpu_busy)))
        steps = [m * drawn / placed + sync for m, sync in zip(makespans_of_steps, syncs, strict=True)]
        return self._result(self._omni_name(options), steps, memory, imbalance,
                            f"items planned per insertion over {replicas} data-parallel ranks, {peers} peers "
                            f"splitting a rank's, enc_sp {enc_sp}{', even slices' if even else ''}")

    def _resharder_plan(self, items: np.ndarray, owners: np.ndarray, n_ranks: int, enc_sp: int, base: np.ndarray,
                        link: reshard.LinkCost) -> reshard.EncoderPlan:
        """Where the runtime's resharder encodes ``items`` (pool indices) loaded on ``owners``: each encoder's items
        planned in turn (:func:`~omni_lightning.balance.reshard.plan_resharding`, their moves and splits priced as
        the runtime prices them on a GPU), each on top of ``base`` and the encoders planned before it. The returned
        plan covers every item; its ``rank_cost`` is each rank's priced encoder cost."""
        pool = self.pool
        costs = pool.item_cost[items]
        rank_of, sp_start = owners.copy(), np.full(items.size, -1, dtype=np.int64)
        sp_degree = np.ones(items.size, dtype=np.int64)
        rank_cost, moved = np.zeros(n_ranks), 0
        encoder_of = pool.item_encoder[items]
        for encoder in np.unique(encoder_of).tolist():
            mine = np.flatnonzero(encoder_of == encoder)
            prices = reshard.item_prices(pool.item_tokens[items[mine]], self.encoder_traffic[encoder], link,
                                         enc_sp=enc_sp)
            plan = reshard.plan_resharding(costs[mine], owners[mine], n_ranks=n_ranks, enc_sp=enc_sp, prices=prices,
                                           base=base, min_gain=_RESHARD_MIN_GAIN)
            rank_of[mine], sp_start[mine], sp_degree[mine] = plan.rank_of, plan.sp_start, plan.sp_degree
            base = base + plan.rank_cost
            rank_cost += plan.rank_cost
            moved += plan.moved
        return reshard.EncoderPlan(rank_of, sp_start, sp_degree, rank_cost, moved)

    def _stage_and_peer(self, llm_cost: np.ndarray, micro_batch: np.ndarray, costs: np.ndarray,
                        encoder: np.ndarray, options: OmniOptions, replica: int) -> tuple[np.ndarray, np.ndarray]:
        """The pipeline stage and the context/tensor-parallel peer that encode each item of data-parallel replica
        ``replica``'s step, as the runtime plans them (``JointEncoders._assign_peers``, ``LocalEncoders``): a
        stage's peers split its items of each micro-batch and encoder by LPT (``split_items``), the labels turned by
        the replica (``turned_peers``)."""
        layout = self.scenario.layout
        pp, peers = layout.pp, layout.cp * layout.tp
        if options.multiplex and pp > 1:
            stage = assign_encoder_items(llm_cost, micro_batch, costs / peers, pp)
        else:
            stage = np.zeros(costs.size, dtype=np.int64)
        peer = np.zeros(costs.size, dtype=np.int64)
        # The items of each (micro-batch, encoder, stage) in index order, in the runtime's order of those: one sort,
        # not a scan of every item for each of them.
        position = (micro_batch * (int(encoder.max(initial=0)) + 1) + encoder) * pp + stage
        by_position = np.argsort(position, kind="stable")
        for mine in np.split(by_position, np.flatnonzero(np.diff(position[by_position])) + 1):
            if mine.size:
                peer[mine] = split_items(costs[mine], peers, replica)
        return stage, peer

    @staticmethod
    def _omni_name(options: OmniOptions) -> str:
        off = [label for label, on in (("multiplexing", options.multiplex), ("reordering", options.reorder),
                                       ("LSSP", options.lssp)) if not on]
        return "omni" + "".join(f", no {label}" for label in off)

    def _omni_replica_plan(self, options: OmniOptions) -> PlacementResult:
        """OmniStrategy with ``--assume replica_encoder_plan`` (and so even slices): a step's encoder items planned
        over every GPU of the reorder group.

        Encoder work is inserted uniformly: each GPU's planned encoder work of the step is spread evenly over its
        insertions (an encoder pass can pause between layers), and a stage's GPUs, which meet at every TP collective
        of the LLM, move at the pace of the busiest of them. As in the runtime, the first stage has no share of the
        last ``pp`` micro-batches (its encoder backward of them would follow its last LLM backward), so its GPUs'
        work goes into the insertions before.
        """
        layout, pool = self.scenario.layout, self.pool
        mp, stage_gpus, micro = layout.model_parallel, layout.tp * layout.cp, layout.micro_batches
        enc_gpus = mp if options.multiplex else stage_gpus  # encoder ranks per data-parallel replica
        stages = layout.pp if options.multiplex else 1
        enc_sp = min(layout.enc_sp, enc_gpus) if options.lssp else 1
        fractions = self.stage_fractions(layout, encoders_on_first=not options.multiplex)
        llm_memory = self._llm_memory(layout, self.dp, fractions)
        window = min(2 * layout.pp if options.multiplex else layout.pp, micro) / micro  # share of a step in flight
        slots = np.ones((layout.pp, micro))  # each stage's share of its step's encoder work, by insertion
        if options.multiplex and layout.pp > 1 and micro > layout.pp:
            slots[0, micro - layout.pp :] = 0.0
        slots /= slots.sum(axis=1, keepdims=True)
        makespans_of_steps, syncs, imbalance, memory, placed, drawn = [], [], [], 0.0, 0.0, 0.0
        for step, draw in enumerate(self.draws):
            makespans, gpu_busy = [], []
            for g in range(self.ranks // self.group):
                read = np.concatenate([draw.samples[r] for r in range(g * self.group, (g + 1) * self.group)])
                drawn += float(pool.llm[read].sum() + pool.encoder[read].sum())
                micro_batches, pieces, ids = self._omni_micro_batches(options, step, g)
                llm_cost, llm_tokens = np.zeros((self.group, micro)), np.zeros((self.group, micro))
                # Each read of a sample (the pools repeat samples) sends its encoder outputs to the rank of its first
                # piece.
                home: dict[int, int] = {}
                for i in range(self.group):
                    for m, batch in enumerate(micro_batches[i]):
                        for piece in batch:
                            occurrence, share = pieces[piece]
                            sample = ids[occurrence]
                            llm_cost[i, m] += pool.llm[sample] * share
                            llm_tokens[i, m] += pool.tokens[sample] * share
                            home.setdefault(occurrence, i)
                samples = ids[np.array(list(home), dtype=np.int64)]
                items, position = pool.items_of(samples)
                owner_rank = np.array(list(home.values()), dtype=np.int64)[position]
                plan = reshard.plan_encoder_work(pool.item_cost[items], owner_rank * enc_gpus,
                                                 n_ranks=self.group * enc_gpus, enc_sp=enc_sp)
                enc_comm, enc_tokens, largest = self._encoder_traffic(plan, items, owner_rank * enc_gpus,
                                                                      np.arange(self.group * enc_gpus))
                placed += float(llm_cost.sum() + pool.encoder[samples].sum())
                enc_flops = plan.rank_cost.reshape(self.group, stages, -1)
                comm = enc_comm.reshape(self.group, stages, -1)
                for i in range(self.group):
                    f, b = self._split_work(enc_flops[i], layout)
                    # Uniform insertion: a GPU's step of encoder work in equal slices, the stage at its busiest GPU.
                    enc_f = np.zeros((layout.pp, micro))
                    enc_b = np.zeros((layout.pp, micro))
                    enc_f[:stages] = (f + comm[i] / 2).max(axis=1)[:, None] * slots[:stages]
                    enc_b[:stages] = (b + comm[i] / 2).max(axis=1)[:, None] * slots[:stages]
                    if options.multiplex:
                        actions = self._actions(llm_cost[i].tolist(), llm_tokens[i].tolist(), layout, fractions,
                                                enc_f, enc_b, joint=True)
                    else:
                        actions = self._actions(llm_cost[i].tolist(), llm_tokens[i].tolist(), layout, fractions,
                                                enc_f[0], enc_b[0], joint=False)
                    makespans.append(replay_pipeline(actions).makespan)
                    busy = np.repeat(llm_cost[i].sum() * fractions / (stage_gpus * self.flops), stage_gpus)
                    busy[:enc_gpus] += enc_flops[i].ravel() / self.flops  # the first stage's GPUs come first
                    gpu_busy.extend((busy * layout.recompute_factor).tolist())
                    in_flight = enc_tokens[i * enc_gpus : (i + 1) * enc_gpus].max() * window
                    memory = max(memory, llm_memory.max() + self._encoder_state_bytes(1, self.dp * enc_gpus)
                                 + self._encoder_activations(in_flight, largest, layout, 1))
            makespans_of_steps.append(max(makespans))
            syncs.append(self._sync(self.llm_params / (layout.tp * layout.pp), self.dp * layout.cp, layout.tp)
                         + self._sync(self.encoder_params, self.dp * enc_gpus, 1))
            imbalance.append(max(gpu_busy) / float(np.mean(gpu_busy)))
        # A plan moves samples between the steps it plans together, so leftovers are scaled out over all steps.
        steps = [m * drawn / placed + sync for m, sync in zip(makespans_of_steps, syncs, strict=True)]
        return self._result(self._omni_name(options), steps, memory, imbalance,
                            f"{self.group * enc_gpus} encoder ranks per reorder group, enc_sp {enc_sp}")

    def _omni_micro_batches(self, options: OmniOptions, step: int, group: int) -> _LoaderPlan:
        """Micro-batches of every rank of a reorder group in one step, as lists of *pieces* ``(read, share of its
        LLM work)``, where a read is a position in the returned array of pool indices.

        Balanced: as the runtime's loader, each reorder group plans ``layout.group_steps`` steps together (every
        rank buffers that many steps of reads; ``OmniDataModule(group_steps=8)``), so a sample may train in another
        step of its group than the one it was read in. ``plan_reorder_group`` runs over the group on each sample's
        whole cost, LLM and encoders, as the runtime's loader prices it (under the joint pipeline a rank-step's
        micro-batches are balanced on their LLM cost alone and shaped for 1F1B as ``Scenario.pipeline_search``
        says, and the group's plan competes with one balanced step by step on the joint pipeline's model, with the
        stage's context- and tensor-parallel peers as ``OmniDataModule`` gives them), samples whole; with
        ``--assume cp_sample_split``, after splitting any sequence whose LLM cost exceeds a micro-batch's fair share
        into context-parallel pieces (at most the balance group's size).
        Unbalanced: what each rank read in this step, in arrival order, whole.
        """
        layout, pool = self.scenario.layout, self.pool
        ranks = range(group * self.group, (group + 1) * self.group)
        if not options.reorder:
            draw = self.draws[step]
            ids = np.concatenate([draw.samples[r] for r in ranks])
            micro, offset = [], 0
            for r in ranks:
                micro.append([[offset + j for j in batch] for batch in draw.micro_batches[r]])
                offset += draw.samples[r].size
            return micro, [(j, 1.0) for j in range(ids.size)], ids
        joint = layout.pp > 1 and options.multiplex
        if (step, group, joint) in self._loader_plans:
            return self._loader_plans[step, group, joint]
        first = step - step % layout.group_steps
        planned = range(first, min(first + layout.group_steps, len(self.draws)))
        ids = np.concatenate([self.draws[k].samples[r] for k in planned for r in ranks])
        owners = np.concatenate([np.full(self.draws[k].samples[r].size, i) for k in planned
                                 for i, r in enumerate(ranks)])
        cost, tokens = pool.llm[ids], pool.tokens[ids]
        share = float(cost.sum()) / (self.group * layout.micro_batches * len(planned))
        whole = cost + pool.encoder[ids]
        if "cp_sample_split" in self.scenario.assume:
            degree = _split(cost, tokens, share, self.group)
        else:  # the runtime trains every sample whole on its rank (its context parallelism is the mesh's cp)
            degree = np.ones(cost.size, dtype=np.int64)
        piece_read = np.repeat(np.arange(ids.size), degree)
        piece_share = np.repeat(1.0 / degree, degree)
        piece_tokens = np.ceil(np.repeat(tokens / degree, degree)).astype(np.int64)
        plan = reorder.plan_reorder_group(
            whole[piece_read] * piece_share, piece_tokens, np.repeat(owners, degree),
            np.zeros(piece_read.size), n_ranks=self.group,
            micro_batch_costs=cost[piece_read] * piece_share if joint else None,
            config=reorder.ReorderConfig(steps=len(planned), micro_batches=layout.micro_batches,
                                         token_budget=layout.seq_len, pp=layout.pp,
                                         pipeline_order="search" if self.scenario.pipeline_search else "ramp",
                                         encoder_peers=layout.cp * layout.tp),
            seed=self.scenario.seed, epoch=first // layout.group_steps, group_index=group)
        pieces = list(zip(piece_read.tolist(), piece_share.tolist(), strict=True))
        for k in planned:
            self._loader_plans[k, group, joint] = ([plan.micro_batches[i][k - first] for i in range(self.group)],
                                                   pieces, ids)
        return self._loader_plans[step, group, joint]

    def _encoder_traffic(self, plan: reshard.EncoderPlan, items: np.ndarray, home: np.ndarray, gpu_of: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray, float]:
        """Per encoder rank of ``plan``: communication seconds (Ulysses all-to-alls of split items, inside a node
        where the SP block is, else over the network; encoder outputs and their gradients between the encoding GPU
        and ``home``, the GPU of the item's LLM rank) and encoder tokens; and the largest item share any rank holds
        (its full activations are alive while its layer runs). ``gpu_of[rank]`` is the GPU of each encoder rank."""
        cluster, config, pool = self.scenario.cluster, self.scenario.model.config, self.pool
        passes = 3 if self.scenario.layout.recompute == "full" else 2  # forward, backward (+ recomputed forward)
        intra, inter = cluster.intra_node_gbps * 1e9, cluster.inter_node_gbps * 1e9
        node = cluster.gpus_per_node
        degree = plan.sp_degree
        n = pool.item_tokens[items]
        out_bytes = 2 * pool.item_llm_tokens[items] * config.llm.dim * _ELEMENT_BYTES / degree
        width, layers = self._encoder_width_layers[pool.item_encoder[items]].T
        ulysses = passes * 4 * (n / degree) * width * _ELEMENT_BYTES * (degree - 1) / degree * layers
        # Every rank an item runs on: itself when whole, its SP block when split.
        first = np.where(degree == 1, plan.rank_of, plan.sp_start)
        block_intra = gpu_of[first] // node == gpu_of[first + degree - 1] // node
        item = np.repeat(np.arange(items.size), degree)
        rank = np.repeat(first, degree) + (np.arange(item.size) - np.repeat(np.cumsum(degree) - degree, degree))
        gpu = gpu_of[rank]
        bandwidth = np.where(gpu // node == home[item] // node, intra, inter)
        seconds = (ulysses[item] / np.where(block_intra[item], intra, inter)
                   + np.where(gpu == home[item], 0.0, out_bytes[item] / bandwidth))
        size = plan.rank_cost.size
        comm = np.bincount(rank, weights=seconds, minlength=size)
        tokens = np.bincount(rank, weights=(n / degree)[item], minlength=size)
        return comm, tokens, float((n / degree).max(initial=0.0))

    # ------------------------------------------------------------------------------------------------ disaggregated
    def pool_problem(self, workload: WorkloadSpec | None = None) -> allocation.PoolProblem:
        """The pool-sizing problem of this scenario's job (its mean mix unless ``workload`` is given)."""
        sc, layout, config = self.scenario, self.scenario.layout, self.scenario.model.config
        return allocation.pool_problem(
            self.cost_model, workload or sc.workload, world_size=sc.cluster.gpus, memory_bytes=sc.cluster.usable_bytes,
            device_flops=self.flops, intra_node_bandwidth=sc.cluster.intra_node_gbps * 1e9,
            sequences=self.dp * layout.micro_batches, seq_len=layout.seq_len,
            encoder=allocation.ModuleShape(self.encoder_params, config.vision.n_layers, config.vision.dim),
            llm=allocation.ModuleShape(self.llm_params, config.llm.n_layers, config.llm.dim),
            recompute=layout.recompute, seed=sc.seed)

    def disaggregated(self, problem: allocation.PoolProblem | None = None) -> PlacementResult:
        """DistTrain: pools sized once by the solver for ``problem`` (default: this workload's mean mix)."""
        problem = problem or self.pool_problem()
        choice = allocation.solve_pools(problem)
        if choice is None:
            return PlacementResult("disaggregated", math.inf, math.nan, math.nan, "no pool layout fits in memory")
        layout, pool, cluster = self.scenario.layout, self.pool, self.scenario.cluster
        llm_layout = replace(layout, tp=choice.tp, pp=choice.pp, cp=1)
        fraction = self.ranks / self.dp  # the simulated share of the global batch
        llm_ranks = max(1, round(choice.dp * fraction))
        enc_ranks = max(1, round(choice.dp_enc * fraction))
        sequences = self.dp * layout.micro_batches
        micro = -(-sequences // choice.dp)
        vision = self.scenario.model.config.vision
        steps, imbalance, memory = [], [], 0.0
        for step, draw in enumerate(self.draws):
            ids = np.concatenate(draw.samples)
            plan = reorder.plan_reorder_group(
                pool.llm[ids], pool.tokens[ids], np.arange(ids.size) % llm_ranks, np.zeros(ids.size),
                n_ranks=llm_ranks,
                config=reorder.ReorderConfig(steps=1, micro_batches=micro, token_budget=layout.seq_len, pp=choice.pp),
                seed=self.scenario.seed, epoch=step, group_index=0)
            makespans, busy, placed = [], [], []
            for r in range(llm_ranks):
                batches = plan.micro_batches[r][0]
                zeros = [0.0] * len(batches)
                costs = [float(pool.llm[ids[b]].sum()) for b in batches]
                tokens = [float(pool.tokens[ids[b]].sum()) for b in batches]
                replay = replay_pipeline(self._actions(costs, tokens, llm_layout, np.full(choice.pp, 1 / choice.pp),
                                                       zeros, zeros, joint=False))
                makespans.append(replay.makespan)
                busy.extend([sum(costs) * layout.recompute_factor / (choice.tp * choice.pp * self.flops)]
                            * (choice.tp * choice.pp))
                placed.extend(int(s) for b in batches for s in ids[b])
            kept = np.array(placed, dtype=np.int64)
            items, position = pool.items_of(kept)
            enc_plan = reshard.plan_encoder_work(pool.item_cost[items], position % enc_ranks, n_ranks=enc_ranks,
                                                 enc_sp=1)
            group_tokens = np.bincount(enc_plan.rank_of, weights=pool.item_tokens[items], minlength=enc_ranks)
            out_bytes = np.bincount(enc_plan.rank_of, weights=pool.item_llm_tokens[items], minlength=enc_ranks) \
                * 2 * self.scenario.model.config.llm.dim * 2
            bw = cluster.intra_node_gbps * 1e9
            t_enc_groups = (enc_plan.rank_cost * layout.recompute_factor / (choice.tp_enc * self.flops)
                            + group_tokens * vision.n_layers * allocation.tp_seconds_per_token(vision.dim,
                                                                                                choice.tp_enc, bw)
                            + out_bytes / choice.tp_enc / (cluster.inter_node_gbps * 1e9))
            t_enc = float(t_enc_groups.max())
            busy.extend(np.repeat(enc_plan.rank_cost * layout.recompute_factor / (choice.tp_enc * self.flops),
                                  choice.tp_enc).tolist())
            sync = max(self._sync(self.llm_params / (choice.tp * choice.pp), choice.dp, choice.tp),
                       self._sync(self.encoder_params / choice.tp_enc, choice.dp_enc, choice.tp_enc))
            drawn = float(pool.llm[ids].sum() + pool.encoder[ids].sum())
            done = float(pool.llm[kept].sum() + pool.encoder[kept].sum())
            steps.append((max(max(makespans), t_enc) + t_enc / micro) * drawn / done + sync)
            imbalance.append(max(busy) / float(np.mean(busy)))
            # Memory under the step's actual encoder load: a shifted mix can overflow a pool sized for the mean.
            step_problem = replace(problem, encoder_tokens=float(group_tokens.sum()) * choice.dp_enc / enc_ranks)
            enc_bytes, llm_bytes = allocation.pool_memory(step_problem, choice)
            largest = float(pool.item_tokens[items].max(initial=0.0))
            memory = max(memory, enc_bytes + (largest * _SELECTIVE_BYTES * vision.dim / choice.tp_enc
                                              if layout.recompute == "full" else 0.0), llm_bytes)
        detail = (f"encoder pool {choice.encoder_gpus} GPUs (tp {choice.tp_enc} x dp {choice.dp_enc}), LLM pool "
                  f"{choice.llm_gpus} (tp {choice.tp} x pp {choice.pp} x dp {choice.dp})")
        return self._result("disaggregated", steps, memory, imbalance, detail)
