"""Qwen2.5-Omni's thinker whole: its audio tower, its Qwen2.5-VL-style vision tower and its M-RoPE decoder, computing
exactly what ``Qwen2_5OmniThinkerForConditionalGeneration`` computes.

The audio tower cuts every clip into chunks of ``2 * n_window`` mel frames, runs its convolutional stem and
sinusoidal positions per chunk, attends within chunks, and averages pairs of positions per clip. Here the stem
(:meth:`Qwen25OmniAudioAdapter.embed`) runs chunk by chunk, so the encoder stage can move its tokens, and
:meth:`~Qwen25OmniAudioAdapter.encode` recovers the chunks from each clip's token count. Audio positions in the
decoder count on like text's; a video's temporal positions count ``position_id_per_seconds`` per second.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.balance.reshard import SplitChunk
from omni_lightning.batch import PackedBatch, PackingSpec, input_key
from omni_lightning.models.adapters.hf_attention import SplitItems, use_tower_attention
from omni_lightning.models.adapters.hf_qwen2_vl import (
    Qwen2VLTextAdapter,
    mrope_positions,
    position_columns,
    positions_from_columns,
)
from omni_lightning.models.flops import TRAIN, TRAIN_FIRST_LAYER, attention_pair_flops, matmul_flops
from omni_lightning.parallel.attention import cu_seqlens_from_lengths, host_bounds
from omni_lightning.parallel.transfer import to_device

__all__ = ["Qwen25OmniAudioAdapter", "Qwen25OmniTextAdapter"]

_FRAMES_PER_TOKEN = 2  # the stem's stride-2 convolution
_POOL = 2  # stem tokens averaged into one output
_INDEX_COLUMNS = 2  # a stem token's index in its clip, as (index // 256, index % 256)


class Qwen25OmniAudioAdapter(nn.Module):
    """The thinker's audio tower over packed clips (``mels [frames, n_mels]``, ``lengths`` multiples of 4 frames).

    Parameter names: ``conv1.*``, ``conv2.*``, ``blocks.{i}.*``, ``ln_post.*`` and ``projector.*`` (its output
    projection). A clip split over an SP block (``enc_sp > 1``) attends with Ulysses sequence parallelism, each of
    its stem tokens carrying its index in the clip (as exact small integers) so that it attends within its own
    chunk; pieces are cut at whole pairs, which the pooling averages.
    """

    supports_sequence_parallel = True
    tokens_per_output = _POOL

    def __init__(self, tower: nn.Module) -> None:
        super().__init__()
        config = tower.config
        self.config = config
        self.conv1, self.conv2 = tower.conv1, tower.conv2
        self.positional_embedding = tower.positional_embedding
        self.blocks = tower.layers
        self.ln_post = tower.ln_post
        self.projector = tower.proj
        # Not used by the thinker's forward, kept so that export writes every weight of the checkpoint back.
        self.audio_bos_eos_token = tower.audio_bos_eos_token.requires_grad_(False)
        self.n_window = config.n_window
        self.n_heads = config.encoder_attention_heads
        use_tower_attention(config)  # one call over every row: whole clips packed, split clips with Ulysses

    def forward(self, mels: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        tokens, token_lengths = self.embed(mels, lengths)
        return self.encode(tokens, cu_seqlens_from_lengths(token_lengths))

    def item_tokens(self, mels: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return lengths // _FRAMES_PER_TOKEN

    def _chunks(self, frames: int) -> list[int]:
        size = 2 * self.n_window
        return [size] * (frames // size) + ([frames % size] if frames % size else [])

    def embed(self, mels: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        clip_lengths = lengths.tolist()  # one read of the device, for the check and the split
        if not clip_lengths or any(n % (_FRAMES_PER_TOKEN * _POOL) for n in clip_lengths):
            raise ValueError(f"audio clip lengths {clip_lengths} must be non-empty multiples of 4 mel frames")
        if mels.shape[-1] != self.config.num_mel_bins:
            raise ValueError(f"{mels.shape[-1]} mel bins do not fit the audio tower's {self.config.num_mel_bins}: "
                             "decode audio with the checkpoint's feature extractor")
        weight = self.conv1.weight
        pieces, indices = [], []
        for clip in mels.split(clip_lengths):
            for chunk in clip.split(self._chunks(clip.shape[0])):
                x = F.gelu(self.conv1(chunk.t()[None].to(weight.dtype)))
                x = F.gelu(self.conv2(x))[0].t()
                pieces.append(x + self.positional_embedding.positional_embedding[: x.shape[0]].to(x.dtype))
            indices.append(torch.arange(clip.shape[0] // _FRAMES_PER_TOKEN, device=mels.device))
        x = torch.cat(pieces)
        index_columns = position_columns(torch.cat(indices)[:, None], x.dtype)
        return torch.cat([x, index_columns], dim=1), self.item_tokens(mels, lengths)

    def encode(self, x: torch.Tensor, cu_seqlens: torch.Tensor, chunks: Sequence[SplitChunk] = (),
               sp_groups: Mapping[int, dist.ProcessGroup] | None = None) -> torch.Tensor:
        x, index = x[:, :-_INDEX_COLUMNS], positions_from_columns(x[:, -_INDEX_COLUMNS:])[:, 0]
        bounds = host_bounds(cu_seqlens)
        whole, clip_tokens = bounds[-1], np.diff(bounds).tolist()
        # The tower attends within each chunk of a clip: its 2 * n_window frames are n_window stem tokens.
        windows = [w // _FRAMES_PER_TOKEN for n in clip_tokens for w in self._chunks(n * _FRAMES_PER_TOKEN)]
        cu = cu_seqlens_from_lengths(to_device(windows, x.device, torch.long))
        split = SplitItems(chunks, sp_groups or {}, index[whole:] // self.n_window) if chunks else None
        for block in self.blocks:
            x = block(x, cu_seqlens=cu, max_seqlen=max(windows, default=0), split_items=split)[0]
        # Clips are whole multiples of 4 frames and pieces of split ones whole pairs, so pairs of stem tokens never
        # straddle two clips.
        x = x.unflatten(0, (-1, _POOL)).mean(1)
        return self.projector(self.ln_post(x))

    def dummy_inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """One clip of 4 mel frames, for a rank that has no audio."""
        mels = torch.zeros(_FRAMES_PER_TOKEN * _POOL, self.config.num_mel_bins, device=device,
                           dtype=self.conv1.weight.dtype)
        return mels, to_device([_FRAMES_PER_TOKEN * _POOL], device)

    def idle_parameters(self) -> Iterator[nn.Parameter]:
        """The audio BOS/EOS embedding: kept for export, never run by the thinker."""
        yield from self.audio_bos_eos_token.parameters()

    def cost(self) -> ModuleCost:
        """Per cost-model audio token (4 mel frames, 2 stem positions): the stem, the layers, the projection; per
        pair of such tokens, the attention within a chunk (an upper bound across chunks)."""
        config, dim = self.config, self.config.d_model
        # conv1 runs on 4 frames, conv2 on its 2 outputs; the layers on 2 positions; the projection on one output.
        stem = TRAIN_FIRST_LAYER * 4 * matmul_flops(3 * config.num_mel_bins, dim) + TRAIN * 2 * matmul_flops(
            3 * dim, dim)
        layer = 4 * matmul_flops(dim, dim) + 2 * matmul_flops(dim, config.encoder_ffn_dim)
        layers = 2 * config.encoder_layers * layer + matmul_flops(dim, config.output_dim)
        return ModuleCost(linear=stem + TRAIN * layers, quadratic=4 * attention_pair_flops(dim, config.encoder_layers))


class Qwen25OmniTextAdapter(Qwen2VLTextAdapter):
    """The thinker's decoder and head, with its own M-RoPE: a video's temporal positions count
    ``position_id_per_seconds`` per second at ``video_fps`` (set from the data module), text after a vision item
    continues after its largest position, and vision tokens without the vision start token before them are placed
    as text, as the thinker's indexing does."""

    def __init__(self, model: nn.Module, video_fps: float = 2.0) -> None:
        nn.Module.__init__(self)
        config = model.config
        self._adopt(config.text_config, model.model.language_model, model.lm_head)
        self.image_token_id, self.video_token_id = config.image_token_id, config.video_token_id
        self.vision_start_token_id = config.vision_start_token_id
        vision = config.vision_config
        self.spatial_merge = vision.spatial_merge_size
        self.position_id_per_seconds, self.temporal_patch_size = config.position_id_per_seconds, \
            vision.temporal_patch_size
        self.video_fps = video_fps

    def rope_positions(self, batch: PackedBatch, spec: PackingSpec) -> torch.Tensor:
        grids = batch[input_key("vision", "grids")]
        interval = (self.temporal_patch_size / self.video_fps) * self.position_id_per_seconds
        return mrope_positions(batch["input_ids"], batch["cu_seqlens"], grids, image_id=self.image_token_id,
                               video_id=self.video_token_id, merge=self.spatial_merge, video_time_interval=interval,
                               continue_after="largest", vision_start_id=self.vision_start_token_id)
