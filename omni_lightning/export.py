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

from omni_lightning.models.pretrained import build_pretrained, hf_class_of, trained_config

__all__ = ["PRETRAINED_KEY", "export_hf", "pretrained_files"]

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


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the model of ``checkpoint`` to ``out`` in its Hugging Face family's format; returns ``out``."""
    import transformers

    checkpoint, out = Path(checkpoint), Path(out)
    saved, sharded = _read(checkpoint)
    if PRETRAINED_KEY not in saved:
        raise ValueError(f"{checkpoint} was not trained from a Hugging Face checkpoint (OmniModule(pretrained=DIR)): "
                         "it has no family format to export to")
    files: dict[str, bytes] = saved[PRETRAINED_KEY]["files"]
    with tempfile.TemporaryDirectory() as source:
        for name, data in files.items():
            (Path(source) / name).write_bytes(data)
        built = build_pretrained(source)
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
    config = trained_config(built.family, config)  # a whole Qwen2.5-Omni exports its thinker
    hf = getattr(transformers, hf_class_of(built.family))._from_config(config)
    stored = {hf_name: state[f"model.{name}"] for name, hf_name in built.checkpoint_names.items() if hf_name}
    hf.load_state_dict(stored, strict=True)
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, torch.dtype) or isinstance(dtype, str) and dtype != "auto":
        hf.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    for name, data in files.items():  # save_pretrained wrote the model's own configs
        if name not in ("config.json", "generation_config.json"):
            (out / name).write_bytes(data)
    return out
