"""Modality encoders of the reference MLLM: a native-resolution ViT and a Whisper-style audio encoder.

Both take packed items (all images of a micro-batch back to back, all audio clips back to back) and return one
LLM-width embedding per placeholder token, in item order. Each is a per-token stem (``embed``) followed by the
transformer and projector (``encode``); encoder resharding moves items between the two, and ``encode`` runs whole
items with packed attention and split items with Ulysses sequence parallelism.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.balance.reshard import SplitChunk
from omni_lightning.models.config import AudioEncoderConfig, VisionEncoderConfig
from omni_lightning.models.flops import audio_encoder_cost, vision_encoder_cost
from omni_lightning.models.layers import EncoderBlock, GeluMLP, sincos_features
from omni_lightning.parallel.attention import AttentionBackend, cu_seqlens_from_lengths
from omni_lightning.parallel.transfer import to_device

__all__ = ["VisionEncoder", "AudioEncoder"]


class VisionEncoder(nn.Module):
    """ViT over native-resolution images.

    Inputs (as :data:`~omni_lightning.modalities.VISION_ENCODER` packs them): ``patches [n_patches, patch_dim]`` with
    the patches of each 2x2 merge window adjacent, ``positions [n_patches, 2]`` (row, column) and ``grids
    [n_items, 2]`` (rows, columns per item; each temporal slice of a video is an item). Output:
    ``[n_patches // merge, llm_dim]``.
    """

    def __init__(self, config: VisionEncoderConfig, llm_dim: int, backend: AttentionBackend = "auto") -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Linear(config.patch_dim, config.dim)
        self.blocks = nn.ModuleList(
            EncoderBlock(config.dim, config.n_heads, config.mlp_ratio, backend) for _ in range(config.n_layers)
        )
        self.norm = nn.LayerNorm(config.dim)
        self.projector = GeluMLP(config.dim * config.merge, llm_dim, llm_dim)

    supports_sequence_parallel = True

    @property
    def tokens_per_output(self) -> int:
        """Stem tokens (patches) per output embedding: a split never cuts through a merge window."""
        return self.config.merge

    @property
    def n_heads(self) -> int:
        return self.config.n_heads

    def item_tokens(self, patches: torch.Tensor, positions: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """Patches per item."""
        return grids[:, 0] * grids[:, 1]

    def cost(self) -> ModuleCost:
        """Training FLOPs per patch and per attention pair
        (:func:`~omni_lightning.models.flops.vision_encoder_cost`)."""
        return vision_encoder_cost(self.config, self.projector.fc2.out_features)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        tokens, lengths = self.embed(patches, positions, grids)
        return self.encode(tokens, cu_seqlens_from_lengths(lengths))

    def embed(
        self, patches: torch.Tensor, positions: torch.Tensor, grids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token stem: ``(tokens [n_patches, dim], tokens per item)``. Items can be resharded after it."""
        half = self.config.dim // 2
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype))  # pixels arrive fp32; weights may be bf16
        # 2-D position: half the channels encode the row, half the column, so any resolution works.
        pos = torch.cat([sincos_features(positions[:, 0], half), sincos_features(positions[:, 1], half)], dim=-1)
        return x + pos.to(x.dtype), self.item_tokens(patches, positions, grids)

    def encode(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, chunks: Sequence[SplitChunk] = (),
        sp_groups: Mapping[int, dist.ProcessGroup] | None = None,
    ) -> torch.Tensor:
        """Transformer, norm and merging projector over stem tokens: whole items, then split-item chunks."""
        for block in self.blocks:
            x = block(x, cu_seqlens, chunks, sp_groups)
        x = self.norm(x)
        return self.projector(x.reshape(-1, self.config.dim * self.config.merge))

    def dummy_inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A single 2x2-patch item, run by a rank that has no images so that its collectives match the others'; in
        the stem's compute dtype."""
        positions = to_device([[0, 0], [0, 1], [1, 0], [1, 1]], device)
        patches = torch.zeros(4, self.config.patch_dim, device=device, dtype=self.patch_embed.weight.dtype)
        return patches, positions, to_device([[2, 2]], device)


class AudioEncoder(nn.Module):
    """Two stride-2 convolutions over mel frames (4x downsampling per clip), a transformer, and a projector.

    Inputs: ``mels [n_frames, n_mels]`` of all clips back to back and ``lengths [n_clips]`` (each a multiple of 4).
    Output: ``[n_frames // 4, llm_dim]``.
    """

    def __init__(self, config: AudioEncoderConfig, llm_dim: int, backend: AttentionBackend = "auto") -> None:
        super().__init__()
        self.config = config
        self.conv1 = nn.Conv1d(config.n_mels, config.dim, kernel_size=3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(config.dim, config.dim, kernel_size=3, stride=2, padding=1)
        self.blocks = nn.ModuleList(
            EncoderBlock(config.dim, config.n_heads, config.mlp_ratio, backend) for _ in range(config.n_layers)
        )
        self.norm = nn.LayerNorm(config.dim)
        self.projector = GeluMLP(config.dim, llm_dim, llm_dim)

    tokens_per_output = 1
    supports_sequence_parallel = True

    @property
    def n_heads(self) -> int:
        return self.config.n_heads

    def item_tokens(self, mels: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Downsampled frames per clip."""
        return lengths // self.config.downsample

    def cost(self) -> ModuleCost:
        """Training FLOPs per downsampled frame and per attention pair
        (:func:`~omni_lightning.models.flops.audio_encoder_cost`)."""
        return audio_encoder_cost(self.config, self.projector.fc2.out_features)

    def forward(self, mels: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        tokens, token_lengths = self.embed(mels, lengths)
        return self.encode(tokens, cu_seqlens_from_lengths(token_lengths))

    def embed(self, mels: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolutional stem: ``(tokens [n_frames // 4, dim], tokens per clip)``. Clips are resharded after it,
        so a split clip needs no convolution halo from its neighbours' chunks."""
        clip_lengths = lengths.tolist()  # one read of the device, for the check and the split
        if not clip_lengths or any(length % self.config.downsample for length in clip_lengths):
            raise ValueError(
                f"audio clip lengths {clip_lengths} must be non-empty multiples of {self.config.downsample}"
            )
        # Convolve clip by clip: a kernel sliding across a clip boundary would mix two recordings.
        mels = mels.to(self.conv1.weight.dtype)  # mel frames arrive fp32; weights may be bf16
        clips = [
            F.gelu(self.conv2(F.gelu(self.conv1(clip.t().unsqueeze(0))))).squeeze(0).t()
            for clip in mels.split(clip_lengths)
        ]
        positions = torch.cat([torch.arange(clip.shape[0], device=mels.device) for clip in clips])
        x = torch.cat(clips)
        return x + sincos_features(positions, self.config.dim).to(x.dtype), self.item_tokens(mels, lengths)

    def encode(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, chunks: Sequence[SplitChunk] = (),
        sp_groups: Mapping[int, dist.ProcessGroup] | None = None,
    ) -> torch.Tensor:
        """Transformer, norm and projector over stem tokens: whole clips, then split-clip chunks."""
        for block in self.blocks:
            x = block(x, cu_seqlens, chunks, sp_groups)
        return self.projector(self.norm(x))

    def dummy_inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """One clip of ``downsample`` frames for a rank without audio (see :meth:`VisionEncoder.dummy_inputs`)."""
        return (
            torch.zeros(self.config.downsample, self.config.n_mels, device=device, dtype=self.conv1.weight.dtype),
            to_device([self.config.downsample], device),
        )
