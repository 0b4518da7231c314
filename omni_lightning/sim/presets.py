"""Models and setups of the papers' evaluations: MegaScale-Omni's workloads A-D and DistTrain's 72B MLLM.

Encoder sizes follow the usual ViT scaling (12 * dim**2 parameters per block); GPT-175B's GELU MLP (two matmuls
of ``4 * dim``) is written as the SwiGLU of the same parameters and FLOPs (three matmuls of ``8 * dim / 3``).
Layouts are ones that fit 80 GiB GPUs at the papers' batch and sequence sizes; the global batch is
``dp * micro_batches`` sequences of ``seq_len`` tokens, so it grows with ``--gpus`` (weak scaling).
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_lightning.models.config import AudioEncoderConfig, LLMConfig, ReferenceMLLMConfig, VisionEncoderConfig
from omni_lightning.sim.cluster import Layout, ModelSpec

__all__ = ["ENCODERS", "LLMS", "Preset", "PRESETS", "model_spec", "preset_for"]

ENCODERS = {
    "vit-h": VisionEncoderConfig(dim=1280, n_layers=32, n_heads=16),  # 0.63B, DistTrain's ViT-Huge
    "vit-1b": VisionEncoderConfig(dim=1664, n_layers=32, n_heads=16),
    "vit-2.4b": VisionEncoderConfig(dim=2048, n_layers=48, n_heads=16),
    "vit-10b": VisionEncoderConfig(dim=4096, n_layers=50, n_heads=32),
}
LLMS = {
    "llama-12b": LLMConfig(vocab_size=128256, dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden=13824),
    "llama-70b": LLMConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672),
    "gpt-175b": LLMConfig(vocab_size=50257, dim=12288, n_layers=96, n_heads=96, n_kv_heads=96, ffn_hidden=32768),
}
# Whisper-large-sized audio encoder, for workloads with audio.
AUDIO = AudioEncoderConfig(n_mels=128, dim=1280, n_layers=32, n_heads=20)


def model_spec(encoder: str, llm: str) -> ModelSpec:
    """The MLLM of a named vision encoder (``ENCODERS``) and LLM (``LLMS``), with the audio encoder ``AUDIO``."""
    if encoder not in ENCODERS or llm not in LLMS:
        raise ValueError(f"unknown model {encoder!r} + {llm!r}; encoders {list(ENCODERS)}, LLMs {list(LLMS)}")
    config = ReferenceMLLMConfig(vision=ENCODERS[encoder], audio=AUDIO, llm=LLMS[llm])
    return ModelSpec(name=f"{encoder} + {llm}", config=config)


@dataclass(frozen=True)
class Preset:
    """A published setup: the model, the GPUs it ran on and a layout for them."""

    name: str
    description: str
    encoder: str
    llm: str
    gpus: int
    layout: Layout

    @property
    def model(self) -> ModelSpec:
        return model_spec(self.encoder, self.llm)


PRESETS = {
    p.name: p
    for p in (
        Preset("omni-a", "MegaScale-Omni A: batch 32 x 16K", "vit-1b", "llama-12b", 64,
               Layout(tp=8, pp=1, micro_batches=4, seq_len=16384)),
        Preset("omni-b", "MegaScale-Omni B: batch 64 x 16K", "vit-2.4b", "llama-70b", 128,
               Layout(tp=8, pp=4, micro_batches=16, seq_len=16384, recompute="full")),
        Preset("omni-c", "MegaScale-Omni C: batch 128 x 8K", "vit-10b", "llama-70b", 256,
               Layout(tp=8, pp=4, micro_batches=16, seq_len=8192, recompute="full")),
        Preset("omni-d", "MegaScale-Omni D: batch 256 x 8K", "vit-10b", "gpt-175b", 512,
               Layout(tp=8, pp=8, micro_batches=32, seq_len=8192, recompute="full")),
        Preset("disttrain-72b", "DistTrain: 72B MLLM (ViT-H + Llama3-70B), batch 288 x 8K", "vit-h", "llama-70b",
               1172, Layout(tp=8, pp=4, micro_batches=8, seq_len=8192, recompute="full")),
    )
}


def preset_for(gpus: int) -> Preset:
    """The largest MegaScale-Omni preset whose GPU count is at most ``gpus`` (the smallest if none is)."""
    fitting = [p for p in PRESETS.values() if p.name.startswith("omni-") and p.gpus <= gpus]
    return max(fitting, key=lambda p: p.gpus) if fitting else PRESETS["omni-a"]
