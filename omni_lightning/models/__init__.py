"""The models: the reference multimodal LLM (encoders, projectors, decoder, MoE) with its parallelize plan, and the
adapters that put Hugging Face components in its place."""

from omni_lightning.models.config import AudioEncoderConfig, LLMConfig, ReferenceMLLMConfig, VisionEncoderConfig
from omni_lightning.models.mllm import ReferenceMLLM

__all__ = ["AudioEncoderConfig", "LLMConfig", "ReferenceMLLM", "ReferenceMLLMConfig", "VisionEncoderConfig"]
