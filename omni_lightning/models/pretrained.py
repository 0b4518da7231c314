"""Hugging Face multimodal checkpoints, whole: the family from ``config.json``, the model built on the meta device
from the family's own classes, and the checkpoint's weights under this package's parameter names.

Each family maps its HF model onto :class:`~omni_lightning.models.ReferenceMLLM` through adapters that reuse the HF
modules themselves (:mod:`omni_lightning.models.adapters`), so the numerics are the family's own. One rank reads the
weights (:func:`read_checkpoint`, through transformers' own loading, which knows every family's stored names) and
every rank receives its shards from it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omni_lightning.batch import BYTE_ROLES, TokenRoles
from omni_lightning.modalities import packing_spec
from omni_lightning.models.config import AudioEncoderConfig, LLMConfig, ReferenceMLLMConfig, VisionEncoderConfig
from omni_lightning.models.lora import apply_lora
from omni_lightning.models.mllm import ReferenceMLLM

__all__ = ["SUPPORTED_FAMILIES", "PretrainedModel", "build_pretrained", "checkpoint_family", "hf_class_of",
           "read_checkpoint", "reset_computed_buffers", "trained_config"]


@dataclass
class PretrainedModel:
    """A family's model on the meta device: the :class:`ReferenceMLLM`, its config, and for each of its parameter and
    persistent-buffer names the name the checkpoint stores it under (``None``: not in the checkpoint, initialised
    from the seed instead, e.g. the audio encoder of a vision-only family)."""

    model: ReferenceMLLM
    config: ReferenceMLLMConfig
    checkpoint_names: dict[str, str | None]
    family: str
    hf: nn.Module  # the family's own model, whose modules the adapters hold


def _family_model(hf_class: str, hf_config: Any) -> nn.Module:
    """The family's own model in fp32 whatever dtype its checkpoint is stored in (released ones are bf16): these
    are the master weights the optimizer updates; bf16 compute is the strategy's choice (``param_dtype``)."""
    import transformers

    return getattr(transformers, hf_class)._from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)


def _qwen_vl(hf_config: Any, roles: TokenRoles | None, *, hf_class: str, vision_adapter: Any, text_adapter: Any,
             tower_width: str, llm_settings: Mapping[str, Any] | None = None
             ) -> tuple[nn.Module, ReferenceMLLM, ReferenceMLLMConfig]:
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL-MoE: the tower and merger, the M-RoPE decoder and its head
    (``llm_settings``: further :class:`LLMConfig` fields, e.g. the experts')."""

    text, vision = hf_config.text_config, hf_config.vision_config
    if vision.spatial_merge_size != 2:
        raise ValueError(f"spatial_merge_size={vision.spatial_merge_size}: only the 2x2 merge is supported")
    hf = _family_model(hf_class, hf_config)
    config = ReferenceMLLMConfig(
        vision=VisionEncoderConfig(patch_size=vision.patch_size, in_channels=vision.in_channels,
                                   dim=getattr(vision, tower_width), n_layers=vision.depth, n_heads=vision.num_heads,
                                   merge=4, temporal_patch_size=vision.temporal_patch_size),
        # These families hear nothing: a minimal reference audio encoder fills the slot (their vocabularies have no
        # audio placeholder, so no sample ever reaches it).
        audio=AudioEncoderConfig(dim=16, n_layers=1, n_heads=2),
        llm=LLMConfig(vocab_size=text.vocab_size, dim=text.hidden_size, n_layers=text.num_hidden_layers,
                      n_heads=text.num_attention_heads, n_kv_heads=text.num_key_value_heads,
                      ffn_hidden=text.intermediate_size, **(llm_settings or {})),
        roles=roles,
    )
    # Images and video only: an audio sample is refused as a modality the model has no encoder for, never fed to
    # the stand-in encoder.
    packing = replace(config.packing(), modalities=tuple(m for m in config.packing().modalities if m.name != "audio"))
    model = ReferenceMLLM(config, vision=vision_adapter(hf.model.visual), llm=text_adapter(hf), packing=packing)
    model.audio.requires_grad_(False)  # the stand-in never hears anything: nothing to train, nothing to export
    return hf, model, config


def _qwen2_vl(hf_config: Any, roles: TokenRoles | None) -> tuple[nn.Module, ReferenceMLLM, ReferenceMLLMConfig]:
    from omni_lightning.models.adapters.hf_qwen2_vl import Qwen2VLTextAdapter, Qwen2VLVisionAdapter

    return _qwen_vl(hf_config, roles, hf_class=_HF_CLASSES["qwen2_vl"], vision_adapter=Qwen2VLVisionAdapter,
                    text_adapter=Qwen2VLTextAdapter, tower_width="embed_dim")


def _qwen2_5_vl(hf_config: Any, roles: TokenRoles | None) -> tuple[nn.Module, ReferenceMLLM, ReferenceMLLMConfig]:
    from omni_lightning.models.adapters.hf_qwen2_vl import Qwen25VLTextAdapter, Qwen25VLVisionAdapter

    return _qwen_vl(hf_config, roles, hf_class=_HF_CLASSES["qwen2_5_vl"], vision_adapter=Qwen25VLVisionAdapter,
                    text_adapter=Qwen25VLTextAdapter, tower_width="hidden_size")


def _qwen3_vl_moe(hf_config: Any, roles: TokenRoles | None) -> tuple[nn.Module, ReferenceMLLM, ReferenceMLLMConfig]:
    """Qwen3-VL-MoE: the tower with its DeepStack mergers, the mixture-of-experts M-RoPE decoder. Its
    load-balancing loss trains when its config asks the model for router logits (``output_router_logits``), at
    ``router_aux_loss_coef``, as the family's own forward adds it."""
    from omni_lightning.models.adapters.hf_qwen3_vl import Qwen3VLMoeTextAdapter, Qwen3VLVisionAdapter

    text = hf_config.text_config
    experts = {"moe_every": text.decoder_sparse_step, "n_experts": text.num_experts,
               "moe_top_k": text.num_experts_per_tok,
               "moe_aux_loss_coef": text.router_aux_loss_coef if text.output_router_logits else 0.0}
    return _qwen_vl(hf_config, roles, hf_class=_HF_CLASSES["qwen3_vl_moe"], vision_adapter=Qwen3VLVisionAdapter,
                    text_adapter=Qwen3VLMoeTextAdapter, tower_width="hidden_size", llm_settings=experts)


def _qwen2_5_omni_thinker(hf_config: Any, roles: TokenRoles | None
                          ) -> tuple[nn.Module, ReferenceMLLM, ReferenceMLLMConfig]:
    """Qwen2.5-Omni's thinker: the audio tower, the vision tower and merger, the M-RoPE decoder and its head."""

    from omni_lightning.models.adapters.hf_qwen2_5_omni import Qwen25OmniAudioAdapter, Qwen25OmniTextAdapter
    from omni_lightning.models.adapters.hf_qwen2_vl import Qwen25VLVisionAdapter

    text, vision, audio = hf_config.text_config, hf_config.vision_config, hf_config.audio_config
    if vision.spatial_merge_size != 2:
        raise ValueError(f"spatial_merge_size={vision.spatial_merge_size}: only the 2x2 merge is supported")
    hf = _family_model(_HF_CLASSES["qwen2_5_omni_thinker"], hf_config)
    config = ReferenceMLLMConfig(
        vision=VisionEncoderConfig(patch_size=vision.patch_size, in_channels=vision.in_channels,
                                   dim=vision.hidden_size, n_layers=vision.depth, n_heads=vision.num_heads, merge=4,
                                   temporal_patch_size=vision.temporal_patch_size),
        audio=AudioEncoderConfig(n_mels=audio.num_mel_bins, dim=audio.d_model, n_layers=audio.encoder_layers,
                                 n_heads=audio.encoder_attention_heads),
        llm=LLMConfig(vocab_size=text.vocab_size, dim=text.hidden_size, n_layers=text.num_hidden_layers,
                      n_heads=text.num_attention_heads, n_kv_heads=text.num_key_value_heads,
                      ffn_hidden=text.intermediate_size),
        roles=roles,
    )
    model = ReferenceMLLM(config, vision=Qwen25VLVisionAdapter(hf.model.visual),
                          audio=Qwen25OmniAudioAdapter(hf.model.audio_tower), llm=Qwen25OmniTextAdapter(hf))
    return hf, model, config


def _llava_onevision(hf_config: Any, roles: TokenRoles | None) -> tuple[nn.Module, ReferenceMLLM, ReferenceMLLMConfig]:
    """LLaVA-OneVision: the SigLIP tower and projector per tile or frame, the layout of their outputs per image and
    video (with the image newline), the Qwen2 decoder and its head."""

    from omni_lightning.models.adapters.hf_llava_onevision import (
        LlavaOnevisionAssembly,
        LlavaOnevisionTextAdapter,
        LlavaOnevisionVisionAdapter,
        any_resolution,
    )

    text, vision = hf_config.text_config, hf_config.vision_config
    if vision.model_type != "siglip_vision_model":
        raise ValueError(f"a LLaVA-OneVision vision tower of type {vision.model_type!r}: only SigLIP's is supported")
    layout = any_resolution(hf_config)
    hf = _family_model(_HF_CLASSES["llava_onevision"], hf_config)
    config = ReferenceMLLMConfig(
        vision=VisionEncoderConfig(patch_size=vision.patch_size, in_channels=vision.num_channels,
                                   dim=vision.hidden_size, n_layers=vision.num_hidden_layers,
                                   n_heads=vision.num_attention_heads, merge=1),
        audio=AudioEncoderConfig(dim=16, n_layers=1, n_heads=2),  # a stand-in, as for the Qwen VL families
        llm=LLMConfig(vocab_size=text.vocab_size, dim=text.hidden_size, n_layers=text.num_hidden_layers,
                      n_heads=text.num_attention_heads, n_kv_heads=text.num_key_value_heads,
                      ffn_hidden=text.intermediate_size),
        roles=roles,
    )
    full = packing_spec(patch_size=vision.patch_size, vision_merge=1, roles=roles or BYTE_ROLES, any_resolution=layout)
    packing = replace(full, modalities=tuple(m for m in full.modalities if m.name != "audio"))
    model = ReferenceMLLM(
        config, vision=LlavaOnevisionVisionAdapter(hf.model.vision_tower, hf.model.multi_modal_projector,
                                                   hf_config.vision_feature_layer),
        llm=LlavaOnevisionTextAdapter(hf), packing=packing, assembly={"vision": LlavaOnevisionAssembly(hf.model)})
    model.audio.requires_grad_(False)
    return hf, model, config


# Each family's transformers class, by name (transformers is imported on first use).
_HF_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
               "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
               "qwen2_5_omni_thinker": "Qwen2_5OmniThinkerForConditionalGeneration",
               "qwen2_5_omni": "Qwen2_5OmniForConditionalGeneration",
               "llava_onevision": "LlavaOnevisionForConditionalGeneration"}


def _qwen2_5_omni(hf_config: Any, roles: TokenRoles | None) -> tuple[nn.Module, ReferenceMLLM, ReferenceMLLMConfig]:
    """A whole Qwen2.5-Omni checkpoint: its thinker is what trains (and exports); the talker is left alone."""
    return _qwen2_5_omni_thinker(hf_config.thinker_config, roles)


_FAMILIES: dict[str, Callable[[Any, TokenRoles | None], tuple[nn.Module, ReferenceMLLM, ReferenceMLLMConfig]]] = {
    "qwen2_vl": _qwen2_vl,
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl_moe": _qwen3_vl_moe,
    "qwen2_5_omni_thinker": _qwen2_5_omni_thinker,
    "qwen2_5_omni": _qwen2_5_omni,
    "llava_onevision": _llava_onevision,
}
# Families whose trained part is one submodule of the checkpoint's model: (its attribute, its config's attribute).
_PART = {"qwen2_5_omni": ("thinker", "thinker_config")}
SUPPORTED_FAMILIES = tuple(_FAMILIES)


def hf_class_of(family: str) -> str:
    """The name of the transformers class that what a family trains is exported as (the thinker, for a whole
    Qwen2.5-Omni)."""
    return _HF_CLASSES["qwen2_5_omni_thinker" if family in _PART else family]


def trained_config(family: str, hf_config: Any) -> Any:
    """The config of what a family trains (``hf_config`` itself, or the thinker's)."""
    return getattr(hf_config, _PART[family][1]) if family in _PART else hf_config


def checkpoint_family(path: str | Path) -> str:
    """The ``model_type`` of a checkpoint directory, checked to be a supported family."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"pretrained={str(path)!r} has no config.json: give a Hugging Face checkpoint directory "
                         "(save_pretrained's output)")
    family = json.loads(config_file.read_text()).get("model_type")
    if family not in _FAMILIES:
        raise ValueError(f"pretrained={str(path)!r} is a {family!r} checkpoint; the supported families are "
                         f"{list(SUPPORTED_FAMILIES)}")
    return family


def build_pretrained(path: str | Path, roles: TokenRoles | None = None,
                     lora: Mapping[str, Any] | None = None) -> PretrainedModel:
    """The checkpoint's model on the meta device (no weights read) and where each of its tensors is stored;
    ``roles`` are the token roles of the data it will train on (its tokenizer's); ``lora`` injects LoRA adapters
    into its decoder (:func:`~omni_lightning.models.lora.apply_lora`), which the checkpoint does not store."""
    import transformers

    family = checkpoint_family(path)
    hf_config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    with torch.device("meta"):
        hf, model, config = _FAMILIES[family](hf_config, roles)
    stored: dict[int, str] = {}
    for name, tensor in _tensors(hf):  # a tied weight is stored under its first name
        stored.setdefault(id(tensor), name)
    if lora:  # after the names are read: a wrapped projection keeps its weight, as base_layer.weight
        with torch.device("meta"):
            apply_lora(model.llm, lora)
    names = {name: stored.get(id(t)) for name, t in _tensors(model)}
    return PretrainedModel(model, config, names, family, hf)


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    persistent = set(module.state_dict(keep_vars=True))
    yield from ((name, b) for name, b in module.named_buffers(remove_duplicate=False) if name in persistent)


def read_checkpoint(path: str | Path, names: dict[str, str | None]) -> dict[str, torch.Tensor]:
    """The tensors of ``names`` (model name -> the HF model's own name) from the checkpoint directory, by model
    name. transformers reads the files (every family's renamed and converted keys included); ``ValueError`` naming
    what the checkpoint lacks."""
    import transformers

    family = checkpoint_family(path)
    if family in _PART:  # only the trained part (a whole Qwen2.5-Omni's thinker), its keys without their prefix
        part, part_config = _PART[family]
        config = getattr(transformers.AutoConfig.from_pretrained(str(path), local_files_only=True), part_config)
        loaded = getattr(transformers, hf_class_of(family)).from_pretrained(
            str(path), config=config, local_files_only=True, dtype="auto", key_mapping={rf"^{part}\.": ""})
    else:
        loaded = getattr(transformers, _HF_CLASSES[family]).from_pretrained(str(path), local_files_only=True,
                                                                            dtype="auto")
    tensors = dict(_tensors(loaded))
    wanted = {name: stored for name, stored in names.items() if stored is not None}
    if missing := sorted(stored for stored in wanted.values() if stored not in tensors):
        raise ValueError(f"the checkpoint at {path} lacks {len(missing)} tensors of its family's model, e.g. "
                         f"{missing[:5]}")
    return {name: tensors[stored].detach() for name, stored in wanted.items()}


def reset_computed_buffers(pretrained: PretrainedModel) -> None:
    """Recompute the tables the family derives from its config (rotary frequencies, sinusoidal positions): buffers
    outside the checkpoint, which construction on the meta device leaves empty. The family's own initialisation
    computes them, module by module, on modules that hold such buffers and no parameters."""
    hf = pretrained.hf
    for module in pretrained.model.modules():
        persistent = set(module.state_dict(keep_vars=True))
        computed = [name for name, _ in module.named_buffers(recurse=False) if name not in persistent]
        if computed and not any(True for _ in module.parameters(recurse=False)):
            module._is_hf_initialized = False  # transformers skips modules it believes initialised
            hf._init_weights(module)
