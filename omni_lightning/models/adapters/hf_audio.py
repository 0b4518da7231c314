"""A Hugging Face Whisper encoder (``WhisperEncoder``) as an :class:`EncoderAdapter` over variable-length clips."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.balance.reshard import SplitChunk
from omni_lightning.models.adapters.hf_attention import PackedItems, use_packed_attention
from omni_lightning.models.flops import TRAIN, TRAIN_FIRST_LAYER, attention_pair_flops, matmul_flops
from omni_lightning.models.layers import GeluMLP
from omni_lightning.parallel.attention import cu_seqlens_from_lengths
from omni_lightning.parallel.transfer import to_device

__all__ = ["WhisperEncoderAdapter"]

# Whisper's convolutions halve the frame rate; averaging pairs of encoder outputs (as Qwen2-Audio does) makes the
# 4 mel frames per audio placeholder token that the data packing and the cost model use.
_MELS_PER_TOKEN = 4
_STEM_STRIDE = 2
_POOL = _MELS_PER_TOKEN // _STEM_STRIDE


class WhisperEncoderAdapter(nn.Module):
    """Whisper's convolutional stem, sinusoidal positions, encoder layers and final norm over packed clips, then
    2-frame average pooling and a projector to the LLM width: one embedding per 4 mel frames.

    Whisper pads every clip to 30 s and attends over the padding. Here each clip attends only to its own frames
    (packed attention, no dense mask), so clips of any length up to ``2 * max_source_positions`` frames cost what they
    contain; a clip of exactly that length encodes as ``WhisperEncoder`` encodes it. Clips are convolved one by
    one, so no kernel reads across a clip boundary. The position table stays frozen, as in Whisper. Split items
    (``enc_sp > 1``) are not supported; whole-item encoder balancing is.
    """

    supports_sequence_parallel = False
    tokens_per_output = _POOL

    def __init__(self, encoder: WhisperEncoder, llm_dim: int) -> None:
        super().__init__()
        config = encoder.config
        use_packed_attention(config)  # whatever it was built with: items attend within themselves, no dense mask
        self.config = config
        self.conv1, self.conv2 = encoder.conv1, encoder.conv2
        # Whisper freezes its sinusoidal table: a (persistent) buffer says so to the optimizer and to FSDP.
        self.register_buffer("embed_positions", encoder.embed_positions.weight.detach().clone())
        self.blocks = encoder.layers
        self.layer_norm = encoder.layer_norm
        self.projector = GeluMLP(config.d_model, llm_dim, llm_dim)
        self.n_heads = config.encoder_attention_heads
        self.max_frames = _STEM_STRIDE * config.max_source_positions

    def forward(self, mels: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        tokens, token_lengths = self.embed(mels, lengths)
        return self.encode(tokens, cu_seqlens_from_lengths(token_lengths))

    def item_tokens(self, mels: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return lengths // _STEM_STRIDE

    def embed(self, mels: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        clip_lengths = lengths.tolist()  # one read of the device, for the checks and the split
        if not clip_lengths or any(n % _MELS_PER_TOKEN or n > self.max_frames for n in clip_lengths):
            raise ValueError(f"audio clip lengths {clip_lengths} must be non-empty multiples of "
                             f"{_MELS_PER_TOKEN} of at most {self.max_frames} frames (Whisper's position table)")
        clips = [F.gelu(self.conv2(F.gelu(self.conv1(clip.t()[None].to(self.conv1.weight.dtype)))))[0].t()
                 for clip in mels.split(clip_lengths)]
        x = torch.cat([clip + self.embed_positions[: clip.shape[0]].to(clip.dtype) for clip in clips])
        return x, self.item_tokens(mels, lengths)

    def encode(self, x: torch.Tensor, cu_seqlens: torch.Tensor, chunks: Sequence[SplitChunk] = (),
               sp_groups: Mapping[int, dist.ProcessGroup] | None = None) -> torch.Tensor:
        if chunks:
            raise ValueError("WhisperEncoderAdapter encodes whole clips only: use enc_sp=1")
        items = PackedItems.of(cu_seqlens)
        h = x[None]
        for block in self.blocks:
            h = block(h, items)
        # Clip lengths are multiples of 4 frames, so pairs of stem tokens never straddle two clips.
        h = self.layer_norm(h[0]).unflatten(0, (-1, _POOL)).mean(1)
        return self.projector(h)

    def dummy_inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """One clip of 4 mel frames, for a rank that has no audio."""
        return (torch.zeros(_MELS_PER_TOKEN, self.config.num_mel_bins, device=device, dtype=self.conv1.weight.dtype),
                to_device([_MELS_PER_TOKEN], device))

    def cost(self) -> ModuleCost:
        """Per cost-model audio token (4 mel frames, 2 encoder positions) and per pair of such tokens (4 pairs of
        encoder positions each)."""
        config, dim = self.config, self.config.d_model
        conv1 = _MELS_PER_TOKEN * 3 * matmul_flops(config.num_mel_bins, dim)  # kernel 3, stride 1
        conv2 = _STEM_STRIDE * 3 * matmul_flops(dim, dim)
        layer = 4 * matmul_flops(dim, dim) + 2 * matmul_flops(dim, config.encoder_ffn_dim)
        llm_dim = self.projector.fc2.out_features
        projector = matmul_flops(dim, llm_dim) + matmul_flops(llm_dim, llm_dim)
        return ModuleCost(
            linear=TRAIN_FIRST_LAYER * conv1
            + TRAIN * (conv2 + _STEM_STRIDE * config.encoder_layers * layer + projector),
            quadratic=_STEM_STRIDE**2 * attention_pair_flops(dim, config.encoder_layers),
        )
