"""Sizing the encoder pool of the disaggregated placement for a model and a workload, with the pool solver."""

from __future__ import annotations

import math

import torch

from omni_lightning.balance.allocation import ModuleShape, encoder_pool_size, pool_problem
from omni_lightning.balance.cost import CostModel
from omni_lightning.balance.workload import load_workload
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.flops import reference_cost_model
from omni_lightning.models.mllm import ReferenceMLLM

__all__ = ["size_encoder_pool"]

_POOL_SEQ_LEN = 4096  # LLM tokens a rank packs per step when the solver sizes the pools


def size_encoder_pool(config: ReferenceMLLMConfig, workload: str, *, world_size: int, llm_unit: int, tp: int,
                      seq_len: int = _POOL_SEQ_LEN, length_scale: float = 1.0,
                      cost_model: CostModel | None = None) -> int:
    """Encoder ranks for ``world_size`` ranks training ``config`` on ``workload`` (a spec file or preset name), by
    the pool solver.

    The solver compares the pools' predicted step times (the model's training FLOPs from its cost model, both pools
    on the same devices, so only ratios matter); the step holds one packed sequence of ``seq_len`` tokens per rank,
    of samples drawn as the synthetic shards draw them (``length_scale``). Memory is not the limit at these sizes.
    ``cost_model`` replaces the FLOP model with a measured one (e.g. :func:`~omni_lightning.balance.cost.fit_cost_model`
    on profiled steps, as DistTrain profiles before it sizes).
    """
    spec = load_workload(workload)
    with torch.device("meta"):
        model = ReferenceMLLM(config)
    encoders = list(model.encoders.values())
    encoder_shape = ModuleShape(params=float(sum(p.numel() for e in encoders for p in e.parameters())),
                                layers=sum(len(e.blocks) for e in encoders), dim=max(e.config.dim for e in encoders))
    llm_shape = ModuleShape(params=float(sum(p.numel() for p in model.llm.parameters())),
                            layers=config.llm.n_layers, dim=config.llm.dim)
    problem = pool_problem(cost_model or reference_cost_model(config), spec, world_size=world_size,
                           memory_bytes=math.inf, device_flops=1.0, intra_node_bandwidth=math.inf, sequences=world_size,
                           seq_len=seq_len, encoder=encoder_shape, llm=llm_shape, samples=512,
                           length_scale=length_scale)
    return encoder_pool_size(problem, llm_unit=llm_unit, tp=tp)
