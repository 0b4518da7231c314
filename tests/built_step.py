"""The tiny reference model parallelised by the runtime and its step, as a job builds them, for gloo-world tests."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.module import initial_state_dict
from omni_lightning.parallel.dims import ParallelDims
from omni_lightning.parallel.layout import build_layout
from omni_lightning.parallel.settings import PipelineSettings, PlacementSettings
from omni_lightning.runtime.step import Step, build_step


def built_step(dims: ParallelDims, *, reshard: bool, link: str) -> tuple[ReferenceMLLM, Step]:
    """The tiny model at seed 3, parallelized for ``dims``, and its step, as a job builds them (collective)."""
    config = ReferenceMLLMConfig.tiny()
    layout = build_layout(dims, "cpu", pipeline=PipelineSettings(), placement=PlacementSettings(), reshard=reshard,
                          link_cost=link)
    with torch.device("meta"):
        model = ReferenceMLLM(config)
    step = build_step(model, layout, device=torch.device("cpu"))
    model.to_empty(device="cpu")
    set_model_state_dict(model, initial_state_dict(config, seed=3),
                         options=StateDictOptions(full_state_dict=True, strict=True))
    return model, step
