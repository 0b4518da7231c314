"""``omni-lightning export-hf``: a training checkpoint of a Hugging Face family, back in the family's own format.

A module trained from ``OmniModule(pretrained=DIR)`` keeps the directory's small files (``config.json``, the
tokenizer, the processors' configs, the chat template) in every checkpoint it writes (:func:`pretrained_files`),
so a checkpoint alone is enough: its weights, gathered from the shards of whatever layout wrote them, are renamed
back to the family's parameter names and written with ``save_pretrained``, the processor files beside them, in
the checkpoint's own dtype. ``from_pretrained(OUT)`` then loads what training left.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from omni_lightning.models.lora import is_lora_name
from omni_lightning.models.pretrained import build_pretrained, hf_class_of, trained_config
from omni_lightning.runtime.optim import part_of

__all__ = ["PRETRAINED_KEY", "export_hf", "merge_adapters", "pretrained_files"]

PRETRAINED_KEY = "omni_pretrained"
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_MOST_BYTES = 64 * 2**20  # tokenizers run to ~10 MB; anything far larger is not a setting


def pretrained_files(path: str | Path) -> dict[str, bytes]:
    """The non-weight files of a checkpoint directory, by name: what export needs to write the family's format."""
    files = {}
    for file in sorted(Path(path).iterdir()):
        if file.is_file() and not file.name.endswith(_WEIGHTS) and not file.name.endswith(".index.json") \
                and file.stat().st_size <= _MOST_BYTES:
            files[file.name] = file.read_bytes()
    return files


def _read(checkpoint: Path) -> tuple[dict[str, Any], bool]:
    """The checkpoint's non-tensor part and whether it is sharded (a directory Lightning's DCP save wrote)."""
    if checkpoint.is_dir():
        meta = checkpoint / "meta.pt"
        if not meta.is_file():
            raise ValueError(f"{checkpoint} is a directory without meta.pt: not a training checkpoint")
        return torch.load(meta, map_location="cpu", weights_only=False), True
    if not checkpoint.is_file():
        raise ValueError(f"checkpoint {checkpoint} does not exist")
    return torch.load(checkpoint, map_location="cpu", weights_only=False), False


def export_hf(checkpoint: str | Path, out: str | Path, *, merge_lora: bool = False,
              adapter_only: bool = False) -> Path:
    """Write the model of ``checkpoint`` to ``out`` in its Hugging Face family's format; returns ``out``.

    A module trained with LoRA adapters exports them merged into the decoder's weights (``merge_lora``) or as a
    ``peft`` adapter directory alone (``adapter_only``, which ``PeftModel.from_pretrained`` puts on the original
    checkpoint; refused where other parts trained too, since it would drop them).
    """
    import transformers

    checkpoint, out = Path(checkpoint), Path(out)
    saved, sharded = _read(checkpoint)
    if PRETRAINED_KEY not in saved:
        raise ValueError(f"{checkpoint} was not trained from a Hugging Face checkpoint (OmniModule(pretrained=DIR)): "
                         "it has no family format to export to")
    hparams = saved.get("hyper_parameters", {})
    lora = hparams.get("lora")
    if lora and merge_lora == adapter_only:
        raise ValueError(f"{checkpoint} trained LoRA adapters: export them with --merge-lora (merged into the weights) "
                         "or --adapter-only (a peft adapter directory)")
    if not lora and (merge_lora or adapter_only):
        raise ValueError(f"{checkpoint} has no LoRA adapters to merge or export alone")
    files: dict[str, bytes] = saved[PRETRAINED_KEY]["files"]
    with tempfile.TemporaryDirectory() as source:
        for name, data in files.items():
            (Path(source) / name).write_bytes(data)
        built = build_pretrained(source, lora=lora)
        config = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    model = built.model
    model.to_empty(device="cpu")
    state = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    if sharded:  # gathered whole from the shards of any layout, in this one process
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"state_dict": state}, checkpoint_id=checkpoint)
    else:
        state = {key: saved["state_dict"][key] for key in state}
    model.load_state_dict({key.removeprefix("model."): value for key, value in state.items()})
    out.mkdir(parents=True, exist_ok=True)
    if adapter_only:
        _write_adapter(model, built.checkpoint_names, lora, hparams.get("freeze", ()), out)
    else:
        if merge_lora:
            merge_adapters(model)
        _write_model(model, built, trained_config(built.family, config), out)
    for name, data in files.items():  # save_pretrained wrote the model's own configs
        if name not in ("config.json", "generation_config.json"):
            (out / name).write_bytes(data)
    return out


def _write_model(model: nn.Module, built: Any, config: Any, out: Path) -> None:
    import transformers

    hf = getattr(transformers, hf_class_of(built.family))._from_config(config)
    state = model.state_dict()
    hf_state = {hf_name: state[name] for name, hf_name in built.checkpoint_names.items() if hf_name}
    # A tied weight is stored under its first name (build_pretrained), but the family's state dict names it under
    # each of its names (an embedding tied to the LM head): every name takes it.
    aliases: dict[int, list[str]] = {}
    for hf_name, tensor in hf.state_dict(keep_vars=True).items():
        aliases.setdefault(id(tensor), []).append(hf_name)
    for names in aliases.values():
        if given := [hf_state[n] for n in names if n in hf_state]:
            hf_state.update(dict.fromkeys(names, given[0]))
    hf.load_state_dict(hf_state, strict=True)
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, torch.dtype) or isinstance(dtype, str) and dtype != "auto":
        hf.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    hf.save_pretrained(out)


def merge_adapters(model: nn.Module) -> None:
    """Fold every LoRA pair into its base weight (peft's own merge); the family's weights then carry them."""
    for module in model.modules():
        if hasattr(module, "base_layer") and hasattr(module, "merge"):
            module.merge()


def _write_adapter(model: nn.Module, names: dict[str, str | None], lora: dict[str, Any], frozen: Any,
                   out: Path) -> None:
    """The adapters alone, in peft's layout over the family's own module names."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    trained = sorted({part_of(n, model.encoder_names) for n, p in model.named_parameters()
                      if not is_lora_name(n) and p.requires_grad} - set(frozen))
    if trained:
        raise ValueError(f"--adapter-only writes the LoRA adapters alone, but {trained} trained too and would be "
                         "lost: export with --merge-lora, or train with those parts frozen")
    tensors, targets = {}, set()
    for name, param in model.named_parameters():
        if not is_lora_name(name):
            continue
        module, kind = name.split(".lora_")[0], name.split(".lora_")[1][0]  # A or B
        base = names[f"{module}.base_layer.weight"]
        assert base is not None
        path = base.removesuffix(".weight")
        targets.add(path)
        tensors[f"base_model.model.{path}.lora_{kind}.weight"] = param.detach().contiguous()
    settings = {**lora, "target_modules": sorted(targets)}  # exact paths: no other module of the model matches
    LoraConfig(**settings).save_pretrained(out)
    save_file(tensors, str(out / "adapter_model.safetensors"))
