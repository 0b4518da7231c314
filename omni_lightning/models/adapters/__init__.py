"""Model adapters: the protocols the strategy needs from encoders and LLMs, and Hugging Face implementations.

``EncoderAdapter`` and ``LLMAdapter`` (see :mod:`.protocol`) describe what parallelisation and encoder balancing
use. The reference modules implement them; so do the adapters for ``transformers`` models, which are imported on
first use (``pip install 'omni-lightning[hf]'``), so that importing this package never imports ``transformers``::

    from transformers import LlamaForCausalLM, SiglipVisionModel, WhisperModel
    from omni_lightning import OmniDataModule, OmniModule, ReferenceMLLM, ReferenceMLLMConfig
    from omni_lightning.models.adapters import HFCausalLMAdapter, SiglipVisionAdapter, WhisperEncoderAdapter

    llm = HFCausalLMAdapter(LlamaForCausalLM.from_pretrained(...))
    width = llm.config.hidden_size  # every encoder projects to the decoder's width
    vision = SiglipVisionAdapter(SiglipVisionModel.from_pretrained(...), width)
    audio = WhisperEncoderAdapter(WhisperModel.from_pretrained(...).encoder, width)
    model = ReferenceMLLM(ReferenceMLLMConfig(), vision=vision, audio=audio, llm=llm)
    module = OmniModule(model)
    data = OmniDataModule(..., cost_model=model.cost_model())  # balance samples by these models' costs

Supported layouts for adapted models: tp, dp_replicate, dp_shard and whole-item encoder balancing (pp, cp, ep
and enc_sp > 1 need the reference modules and are refused with a ``ValueError``).
"""

from typing import Any

from omni_lightning.models.adapters.protocol import EncoderAdapter, LLMAdapter, OutputAssembly

__all__ = [
    "EncoderAdapter",
    "HFCausalLMAdapter",
    "LLMAdapter",
    "OutputAssembly",
    "SiglipVisionAdapter",
    "WhisperEncoderAdapter",
]


def __getattr__(name: str) -> Any:
    # Imported on first use, so that importing this package never imports transformers.
    if name == "HFCausalLMAdapter":
        from omni_lightning.models.adapters.hf_llm import HFCausalLMAdapter

        return HFCausalLMAdapter
    if name == "SiglipVisionAdapter":
        from omni_lightning.models.adapters.hf_vision import SiglipVisionAdapter

        return SiglipVisionAdapter
    if name == "WhisperEncoderAdapter":
        from omni_lightning.models.adapters.hf_audio import WhisperEncoderAdapter

        return WhisperEncoderAdapter
    raise AttributeError(f"module 'omni_lightning.models.adapters' has no attribute {name!r}")
