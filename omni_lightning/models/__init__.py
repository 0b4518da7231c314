"""The reference multimodal LLM (encoders, projectors, decoder, MoE) and its attention backends."""

from omni_lightning.models.attention import varlen_attention
from omni_lightning.models.config import AudioEncoderConfig, LLMConfig, ReferenceMLLMConfig, VisionEncoderConfig
from omni_lightning.models.mllm import ReferenceMLLM

__all__ = [
    "AudioEncoderConfig",
    "LLMConfig",
    "ReferenceMLLM",
    "ReferenceMLLMConfig",
    "VisionEncoderConfig",
    "varlen_attention",
]
