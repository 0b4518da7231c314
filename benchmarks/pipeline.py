"""Pipeline bubbles with encoders on stage 0 only (torchtitan's way) against the joint encoder-LLM pipeline.

Starts ``--stages`` fork-started gloo processes, one pipeline stage each, and trains the reference MLLM (12 decoder
layers, cut into cost-balanced stages) with 1F1B for ``--steps`` steps per configuration, on micro-batches drawn
from each workload's synthetic samples. Every rank records its actions in the order they ran (forward and
backward of each micro-batch, and in the joint pipeline each encoder insertion) with their thread CPU times. This
machine runs more ranks than it has cores, so wall-clock idle time mixes bubbles with waiting for a core; the step
is therefore replayed as dedicated devices would run it (:func:`omni_lightning.sim.replay_pipeline`: the recorded
order, the measured durations, the pipeline's dependencies), and the bubble is the idle share of all stages' time
(encoder work counts as busy: it is work that has to be done somewhere).

Micro-batches are formed and ordered by the loader's planner, as OmniDataModule feeds a pipeline: LPT of the
predicted cost over a step's micro-batches towards the 1F1B cost profile (light ones where the pipeline fills and
drains), then a local search on the 1F1B step time of their predicted costs (``ReorderConfig(pipeline_order=
"search")``: the order, and samples moved between micro-batches so that they ramp up to the indivisible heavy ones
and down after them). The joint pipeline's micro-batches balance their LLM cost
(it spreads their encoder work over every stage), the stage-0 placement's their whole cost. The planner prices
samples with the FLOP cost model until a workload's first warm-up step has been measured, then with one fitted to
that step by the function ``OmniStrategy(pp_calibration_steps=...)`` uses (``fit_joint_calibration``: the LLM's
coefficients to each micro-batch's forward and backward time, the encoders' to its encoder time, and the forward's
share of the LLM time), as a job calibrates on its first steps; ``--no-calibrate`` keeps the FLOP model. Each step
runs ``--repeats`` times and every action keeps its least time
over the repeats (the same actions run in the same order each time), which keeps each micro-batch's own cost but
not the other processes' interference. The theoretical bubble of 1F1B with uniform micro-batches is
``(p - 1) / (m + p - 1)``.

    python benchmarks/pipeline.py [--workload FILE ...] [--micro-batches 8 16 32] [--stages 4]

The joint pipeline plans which rank encodes each item as the real runtime does (``JointEncoders``: small items by
LPT, large ones placed on a model of the 1F1B step with its encoder insertions; see
:func:`omni_lightning.balance.pipeline_order.assign_encoder_items`), with FLOP costs until the warm-up is measured
and then with the loader planner's fitted model, the measured forward shares and each stage's measured share of the LLM
time (``JointEncoders.calibrate``: the first stage also embeds, so it gets less encoder work). The last but one
column replays the joint pipeline's step with each micro-batch's encoder work shared evenly by the stages (what
splitting items over the pipeline ranks would give), separating the cost of indivisible large items from the
schedule's; the last column replays it with each stage's LLM forwards and backwards at their means over the
micro-batches and the encoder work as it ran (the joint pipeline on uniform micro-batches: what is left once the
uneven micro-batches, which the loader forms, are taken out). Its last line is ``joint bubble/theoretical: X``,
the worst over the workloads and micro-batch counts it ran, on the micro-batches as they are.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import default_workloads, free_port
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from omni_lightning.balance.calibration import fit_joint_calibration
from omni_lightning.balance.cost import CostModel, feature_matrix
from omni_lightning.balance.reorder import ReorderConfig, plan_reorder_group
from omni_lightning.balance.workload import SampleMeta, load_workload, sample_metadata
from omni_lightning.batch import BYTE_ROLES
from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.models.config import (
    AudioEncoderConfig,
    LLMConfig,
    ReferenceMLLMConfig,
    VisionEncoderConfig,
)
from omni_lightning.models.flops import reference_cost_model
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.module import initial_state_dict
from omni_lightning.parallel.dims import ParallelDims
from omni_lightning.parallel.layout import build_layout
from omni_lightning.parallel.settings import PipelineSettings, PlacementSettings
from omni_lightning.parallel.timing import ActionLog
from omni_lightning.runtime import pipeline
from omni_lightning.runtime.joint import JointEncoders
from omni_lightning.runtime.loss import StepLoss
from omni_lightning.runtime.step import PipelineStep, build_step
from omni_lightning.sim import Action, one_f_one_b_bubble, replay_pipeline

FIRST_TEXT_ID = BYTE_ROLES.first_free_id

RESULTS = Path(__file__).parent / "results" / "pipeline.json"
# Wide enough that matmuls, not per-call overheads, dominate each action on a CPU.
CONFIG = ReferenceMLLMConfig(
    vision=VisionEncoderConfig(dim=128, n_layers=2, n_heads=4),
    audio=AudioEncoderConfig(n_mels=80, dim=128, n_layers=2, n_heads=4),
    llm=LLMConfig(dim=192, n_layers=12, n_heads=4, n_kv_heads=4, ffn_hidden=512),
)


@dataclass(frozen=True)
class _Planner:
    """What the planner prices micro-batches with: a cost model and the forward's share of an LLM micro-batch."""

    model: CostModel
    forward_share: float = 1 / 3  # FLOPs: the backward computes input and weight gradients
    encoder_forward_share: float = 1 / 3
    stage_shares: tuple[float, ...] | None = None  # each stage's share of the LLM time; None: equal

    def calibrate(self, runner: pipeline.PipelineRunner) -> None:
        """Let the joint pipeline's item plan use these figures too, as the job's calibration would."""
        if isinstance(runner.source, JointEncoders):
            runner.source.calibrate(self.model, forward_share=self.forward_share,
                                    encoder_forward_share=self.encoder_forward_share, stage_shares=self.stage_shares)


def _micro_batches(workload: str, count: int, step: int, planner: _Planner, encoders: str,
                   args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[list[SampleMeta]]]:
    """The same micro-batches on every rank (seeded by workload and step), formed and ordered as OmniDataModule
    does under pipeline parallelism: its planner for one rank and step (LPT of the predicted cost towards the 1F1B
    cost profile, then the micro-batches and order its local search finds shortest for those costs). The joint
    pipeline's micro-batches balance their LLM cost, since it spreads their encoder work over every stage; with
    encoders on stage 0 they balance the whole cost. Also returns their samples."""
    spec = load_workload(workload)
    rng = np.random.default_rng([args.seed, step])
    metas = [sample_metadata(spec, rng, length_scale=args.length_scale, max_llm_tokens=args.max_llm_tokens)
             for _ in range(count * args.samples_per_micro_batch)]
    costs = planner.model.costs(metas)
    zeros = np.zeros(len(metas), dtype=np.int64)
    config = ReorderConfig(steps=1, micro_batches=count, pp=args.stages, pipeline_order="search",
                           forward_share=planner.forward_share)
    plan = plan_reorder_group(costs.sum(axis=1), np.array([m.llm_tokens for m in metas]), zeros, zeros, n_ranks=1,
                              config=config, seed=args.seed, epoch=step, group_index=0,
                              micro_batch_costs=costs[:, 2] if encoders == "joint" else None)
    groups = [[metas[i] for i in ids] for ids in plan.micro_batches[0][0]]
    return [pack_samples([_sample(meta, rng) for meta in group]) for group in groups], groups


def _calibrated(groups: list[list[SampleMeta]], everyone: list[list[tuple[str, int, float]]]) -> _Planner:
    """The planner fitted to one measured step of the joint pipeline (its micro-batches' samples and every rank's
    actions) by the function a job's own calibration uses (``JointCalibrator``;
    :func:`~omni_lightning.balance.calibration.fit_joint_calibration`): the LLM's coefficients to each micro-batch's
    forward and backward CPU time over all stages, the encoders' to its encoder forward and backward time over all
    ranks, the forward's share of the LLM's and of the encoders' time, and each stage's share of the LLM time."""
    features = np.stack([feature_matrix(group).sum(axis=0) for group in groups])
    figures = fit_joint_calibration(features, everyone, flops=reference_cost_model(CONFIG))
    return _Planner(figures.cost_model, figures.forward_share, figures.encoder_forward_share, figures.stage_shares)


def _sample(meta: SampleMeta, rng: np.random.Generator) -> DecodedSample:
    """Random content of the shape ``meta`` says (what the shards would decode to)."""
    grids = list(meta.images) + [meta.video_grid] * meta.video_frames
    images = [rng.integers(0, 256, (h * 14, w * 14, 3), dtype=np.uint8) for h, w in grids]
    mel = rng.standard_normal((meta.audio_frames, 80)).astype(np.float32) if meta.audio_frames else None
    return DecodedSample("synthetic", rng.integers(FIRST_TEXT_ID, 256, meta.text_tokens), images, mel)


def _fastest(runs: list[list[tuple[str, int, float]]]) -> list[tuple[str, int, float]]:
    """Each action's least CPU time over repeated runs of the same step. The schedule runs the same actions in
    the same order every time, so only the time varies; the least is the estimate least disturbed by the other
    processes sharing the cores, and it keeps every micro-batch's own cost."""
    orders = {tuple((kind, mb) for kind, mb, _ in run) for run in runs}
    assert len(orders) == 1, "repeats of one step ran different actions"
    return [(kind, mb, min(run[i][2] for run in runs)) for i, (kind, mb, _) in enumerate(runs[0])]


def _spread(step: list[list[tuple[str, int, float]]]) -> list[list[Action]]:
    """The step with every micro-batch's encoder work (``E``, ``EB``) shared evenly by the stages, at the same
    insertions: what splitting each item over the pipeline ranks would give, whole items being what they are."""
    total: dict[tuple[str, int], float] = {}
    for rank in step:
        for kind, m, seconds in rank:
            if kind in ("E", "EB"):
                total[(kind, m)] = total.get((kind, m), 0.0) + seconds
    return [[Action(kind, m, total[(kind, m)] / len(step) if kind in ("E", "EB") else seconds)
             for kind, m, seconds in rank] for rank in step]


def _even_llm(step: list[list[tuple[str, int, float]]]) -> list[list[Action]]:
    """The step with every stage's LLM forward and backward at their means over the micro-batches, the encoder
    work as it ran: the joint pipeline's bubble on uniform micro-batches, apart from what uneven ones add."""
    actions = []
    for rank in step:
        mean = {kind: float(np.mean([a[2] for a in rank if a[0] == kind])) for kind in ("F", "B")}
        actions.append([Action(kind, m, mean.get(kind, seconds)) for kind, m, seconds in rank])
    return actions


def _worker(rank: int, size: int, port: int, args: argparse.Namespace, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=900))
    layout = build_layout(ParallelDims(world_size=size, pp=size, dp_shard=1), "cpu", pipeline=PipelineSettings(),
                          placement=PlacementSettings(), reshard=False)
    state = initial_state_dict(CONFIG, seed=0)
    for workload in args.workload:
        planner, calibrated = _Planner(reference_cost_model(CONFIG)), False  # FLOPs until a warm-up is measured
        for count in args.micro_batches:
            # The joint pipeline first: its warm-up step times the LLM and the encoders apart, for the calibration.
            for encoders in ("joint", "first_stage"):
                with torch.device("meta"):
                    model = ReferenceMLLM(CONFIG)
                max_tokens = args.max_llm_tokens * args.samples_per_micro_batch * 2
                settings = PipelineSettings("1F1B", count, 1, max_tokens=max_tokens, encoders=encoders)
                step_kind = build_step(model, replace(layout, pipeline=settings), device=torch.device("cpu"))
                assert isinstance(step_kind, PipelineStep)
                runner = step_kind.runner
                if calibrated:
                    planner.calibrate(runner)
                model.to_empty(device="cpu")
                kept = model.state_dict().keys()
                set_model_state_dict(model, {k: v for k, v in state.items() if k in kept},
                                     options=StateDictOptions(full_state_dict=True, strict=True))
                steps = []
                for step in range(args.steps + 1):  # the first step warms up
                    micro, groups = _micro_batches(workload, count, step, planner, encoders, args)
                    runs = []
                    for _ in range(args.repeats):
                        runner.action_log = ActionLog(time.thread_time)  # every action's thread CPU seconds
                        dist.barrier()
                        runner.step(micro, StepLoss(loss_tokens=1e3, data_parallel=1))
                        runs.append(runner.action_log.actions)
                    runner.action_log = None
                    everyone: list[Any] = [None] * size
                    dist.all_gather_object(everyone, _fastest(runs))
                    if step > 0:
                        steps.append(everyone)
                    elif args.calibrate and not calibrated:  # every rank fits the same model from the same data
                        planner, calibrated = _calibrated(groups, everyone), True
                        planner.calibrate(runner)
                if rank == 0:
                    results[(Path(workload).stem, count, encoders)] = steps
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", nargs="+", default=default_workloads())
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[8, 16])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each step; every action keeps its least time")
    parser.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                        help="plan micro-batches with the FLOP cost model instead of one fitted to the first warm-up")
    parser.add_argument("--length-scale", type=float, default=0.05)
    parser.add_argument("--max-llm-tokens", type=int, default=384)
    parser.add_argument("--samples-per-micro-batch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    port = free_port()
    results = mp.Manager().dict()
    mp.start_processes(_worker, args=(args.stages, port, args, results), nprocs=args.stages, start_method="fork")

    rows, worst = [], 0.0
    print(f"{'workload':<14}{'m':>4}{'theory':>8}{'stage-0 enc':>13}{'joint':>8}{'joint/theory':>14}"
          f"{'step ms (s0, joint)':>22}{'joint, items split':>20}{'joint, even LLM':>17}")
    for workload, count in sorted({(w, c) for w, c, _ in dict(results)}):
        theory = one_f_one_b_bubble(args.stages, count)
        outcome = {}
        for mode in ("first_stage", "joint"):
            replays = [replay_pipeline([[Action(*a) for a in rank] for rank in step])
                       for step in results[(workload, count, mode)]]
            outcome[mode] = (float(np.mean([r.bubble for r in replays])), float(np.mean([r.makespan for r in replays])),
                             [float(np.mean(b)) for b in zip(*[r.bubbles for r in replays], strict=True)])
        ratio = outcome["joint"][0] / theory
        split, even = (float(np.mean([replay_pipeline(counterfactual(step)).bubble
                                      for step in results[(workload, count, "joint")]]))
                       for counterfactual in (_spread, _even_llm))
        for mode in ("first_stage", "joint"):
            steps = results[(workload, count, mode)]
            seconds = {kind: [float(np.mean([a[2] for step in steps for a in step[s] if a[0] == kind] or [0.0]))
                              for s in range(args.stages)] for kind in ("F", "B", "E", "EB")}
            outcome[mode] = (*outcome[mode], seconds)
        worst = max(worst, ratio)
        rows.append({"workload": workload, "micro_batches": count, "theoretical_bubble": theory,
                     "first_stage_bubble": outcome["first_stage"][0], "joint_bubble": outcome["joint"][0],
                     "first_stage_stage_bubbles": outcome["first_stage"][2], "joint_stage_bubbles": outcome["joint"][2],
                     "first_stage_step_s": outcome["first_stage"][1], "joint_step_s": outcome["joint"][1],
                     "first_stage_action_s": outcome["first_stage"][3], "joint_action_s": outcome["joint"][3],
                     "joint_items_split_bubble": split, "joint_even_llm_bubble": even})
        print(f"{workload:<14}{count:>4}{theory:>8.3f}{outcome['first_stage'][0]:>13.3f}{outcome['joint'][0]:>8.3f}"
              f"{ratio:>14.3f}{outcome['first_stage'][1] * 1e3:>11.0f},{outcome['joint'][1] * 1e3:>8.0f}"
              f"{split:>20.3f}{even:>17.3f}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"joint bubble/theoretical: {worst:.3f}")


if __name__ == "__main__":
    main()
