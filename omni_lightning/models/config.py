"""Configuration of the reference multimodal LLM."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omni_lightning.batch import BYTE_ROLES, PackingSpec, TokenRoles
from omni_lightning.modalities import packing_spec

__all__ = [
    "AUDIO_ID",
    "BOS_ID",
    "FIRST_TEXT_ID",
    "IMAGE_ID",
    "PAD_ID",
    "AudioEncoderConfig",
    "LLMConfig",
    "ReferenceMLLMConfig",
    "VisionEncoderConfig",
]

# Release 0.1's names of the byte roles' ids (the roles live in omni_lightning.batch.BYTE_ROLES now).
PAD_ID, BOS_ID = BYTE_ROLES.pad, BYTE_ROLES.bos
IMAGE_ID, AUDIO_ID = BYTE_ROLES.placeholder("image"), BYTE_ROLES.placeholder("audio")
FIRST_TEXT_ID = BYTE_ROLES.first_free_id


@dataclass
class VisionEncoderConfig:
    """ViT on native-resolution images and video: patches of ``patch_size`` pixels over ``temporal_patch_size``
    frames (an image fills a temporal patch with copies of itself), a 2x2 spatial merge (``merge=4``)."""

    patch_size: int = 14
    in_channels: int = 3
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: float = 4.0
    merge: int = 4
    temporal_patch_size: int = 1

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size


@dataclass
class AudioEncoderConfig:
    """Whisper-style encoder: two stride-2 convolutions over mel frames (``downsample=4``), then a transformer."""

    n_mels: int = 80
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: float = 4.0
    downsample: int = 4


@dataclass
class LLMConfig:
    """Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU (or top-k MoE every ``moe_every`` layers)."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    moe_every: int = 0
    n_experts: int = 4
    moe_top_k: int = 2
    moe_aux_loss_coef: float = 0.01

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def is_moe_layer(self, index: int) -> bool:
        return self.moe_every > 0 and (index + 1) % self.moe_every == 0


@dataclass
class ReferenceMLLMConfig:
    """A vision encoder and an audio encoder, each with a projector, feeding a decoder LLM."""

    vision: VisionEncoderConfig = field(default_factory=VisionEncoderConfig)
    audio: AudioEncoderConfig = field(default_factory=AudioEncoderConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    attention_backend: str = "auto"
    # The token roles of the data it trains on: ``None`` for the byte roles (ids 0-3), else a tokenizer's, which
    # OmniModule fills in from the data module's processor (and saves with the hyper-parameters).
    roles: TokenRoles | None = None

    def __post_init__(self) -> None:
        llm = self.llm
        # Sizes first: a zero would otherwise surface as a division error below.
        sizes = {"llm": ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "n_experts"),
                 "vision": ("dim", "n_layers", "n_heads", "patch_size", "temporal_patch_size"),
                 "audio": ("dim", "n_layers", "n_heads")}
        for part, names in sizes.items():
            for name in names:
                value = getattr(getattr(self, part), name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"{part}.{name} must be a positive integer, got {value!r}")
        if llm.moe_every < 0:
            raise ValueError(f"llm.moe_every={llm.moe_every} must be 0 (dense) or the spacing of MoE layers")
        if llm.dim % llm.n_heads:
            raise ValueError(f"llm.dim={llm.dim} must be divisible by llm.n_heads={llm.n_heads}")
        if llm.head_dim % 2:
            raise ValueError(f"llm.dim / llm.n_heads = {llm.head_dim} must be even: RoPE rotates pairs of dimensions;"
                             " change dim or n_heads")
        if llm.n_heads % llm.n_kv_heads:
            raise ValueError(f"llm.n_heads={llm.n_heads} must be a multiple of llm.n_kv_heads={llm.n_kv_heads}")
        if self.roles is None and llm.vocab_size <= BYTE_ROLES.first_free_id:
            raise ValueError(f"llm.vocab_size={llm.vocab_size} must exceed the {BYTE_ROLES.first_free_id} reserved "
                             "ids")
        if self.roles is not None and llm.vocab_size <= int(self.roles.special_ids.max()):
            raise ValueError(f"llm.vocab_size={llm.vocab_size} must exceed every token role's id "
                             f"{self.roles.special_ids.tolist()}")
        if llm.moe_every and not 1 <= llm.moe_top_k <= llm.n_experts:
            raise ValueError(f"llm.moe_top_k={llm.moe_top_k} must be in [1, n_experts={llm.n_experts}]")
        for name, enc in (("vision", self.vision), ("audio", self.audio)):
            if enc.dim % enc.n_heads:
                raise ValueError(f"{name}.dim={enc.dim} must be divisible by {name}.n_heads={enc.n_heads}")
        if self.vision.merge not in (1, 4):
            raise ValueError(f"vision.merge={self.vision.merge} must be 1 or 4 (a 2x2 spatial merge)")
        if self.audio.downsample != 4:
            raise ValueError(f"audio.downsample={self.audio.downsample} must be 4 (two stride-2 convolutions)")
        if self.attention_backend not in ("auto", "sdpa", "flash"):
            raise ValueError(f"attention_backend={self.attention_backend!r} must be 'auto', 'sdpa' or 'flash'")

    def packing(self) -> PackingSpec:
        """How samples pack for this model: its encoders' patch size, merge, temporal patch and downsampling, with
        its data's token roles (the byte roles unless :attr:`roles` says otherwise)."""
        return packing_spec(patch_size=self.vision.patch_size, vision_merge=self.vision.merge,
                            temporal_patch_size=self.vision.temporal_patch_size,
                            audio_downsample=self.audio.downsample, roles=self.roles or BYTE_ROLES)

    @classmethod
    def tiny(cls, *, moe: bool = False) -> ReferenceMLLMConfig:
        """Small enough for multi-process CPU tests, real in shape (GQA, RoPE, SwiGLU, optional MoE)."""
        return cls(
            vision=VisionEncoderConfig(dim=32, n_layers=2, n_heads=4),
            audio=AudioEncoderConfig(n_mels=80, dim=32, n_layers=1, n_heads=4),
            llm=LLMConfig(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=128, moe_every=2 if moe else 0),
        )


# Checkpoints store the module's hyperparameters, these configs among them; Lightning loads them with
# ``weights_only=True``, which accepts only allow-listed classes.
torch.serialization.add_safe_globals([VisionEncoderConfig, AudioEncoderConfig, LLMConfig, ReferenceMLLMConfig,
                                      TokenRoles])
