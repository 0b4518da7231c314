"""LoRA on the LLM's projections, through ``peft``: adapters injected into the decoder (whose own weights freeze),
their initial values as peft draws them, and the tensor-parallel plan of a LoRA-wrapped layer.

peft replaces a target ``nn.Linear`` by a layer holding the original as ``base_layer`` and the low-rank pair as
``lora_A.<adapter>`` / ``lora_B.<adapter>``. Under tensor parallelism the pair follows its base: beside a
column-parallel projection ``lora_B`` is column-parallel too (``lora_A`` sees the whole input); beside a row-parallel
one ``lora_A`` is row-parallel (it reads the sharded input and its small output is reduced), ``lora_B`` whole.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from omni_lightning.parallel.tensor_parallel import ColwiseLinear, RowwiseLinear

__all__ = ["ADAPTER", "apply_lora", "is_lora_name", "lora_initial_state", "lora_layer_plan"]

ADAPTER = "default"  # peft's adapter name


def apply_lora(llm: nn.Module, settings: Mapping[str, Any]) -> None:
    """Inject LoRA adapters (``peft.LoraConfig(**settings)``, e.g. ``{"r": 8, "lora_alpha": 16, "target_modules":
    ["q_proj", "v_proj"]}``) into ``llm``; peft freezes everything of ``llm`` but the adapters."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(**dict(settings))
    if config.init_lora_weights is not True:
        raise ValueError(f"lora init_lora_weights={config.init_lora_weights!r} is not supported: the adapters start "
                         "as peft's default (lora_A Kaiming-uniform, lora_B zero), identical on every rank")
    inject_adapter_in_model(config, llm, adapter_name=ADAPTER)


def is_lora_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_initial_state(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every adapter parameter's initial value, drawn as peft's default does (``lora_A`` Kaiming-uniform with
    ``a=sqrt(5)``, ``lora_B`` zero, so training starts from the model itself), from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, param in model.named_parameters():
        if ".lora_A." in name:
            value = torch.empty(param.shape)
            nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
            state[name] = value
        elif ".lora_B." in name:
            state[name] = torch.zeros(param.shape)
    return state


def lora_layer_plan(layer: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` (submodule name -> style) for ``layer`` with its LoRA-wrapped projections addressed through their
    ``base_layer`` and the matching half of their adapter pair."""
    out: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        module = layer.get_submodule(name)
        if not hasattr(module, "base_layer"):
            out[name] = style
            continue
        out[f"{name}.base_layer"] = style
        if isinstance(style, ColwiseLinear):
            out[f"{name}.lora_B.{ADAPTER}"] = ColwiseLinear()
        elif isinstance(style, RowwiseLinear):
            out[f"{name}.lora_A.{ADAPTER}"] = RowwiseLinear()
        else:
            raise ValueError(f"LoRA on {name} under tensor parallelism with style {type(style).__name__}: only "
                             "column- and row-parallel projections are supported")
    return out
