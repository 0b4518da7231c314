"""Qwen2-VL and Qwen2.5-VL whole: the vision tower and merger as the vision encoder, the decoder with multimodal
rotary positions (M-RoPE) as the LLM, computing exactly what ``Qwen2VLForConditionalGeneration`` and
``Qwen2_5_VLForConditionalGeneration`` compute (Qwen2.5-VL's tower attends in windows except in its full-attention
blocks, and its video positions count seconds).

The packed vision inputs of :mod:`omni_lightning.modalities` are Qwen2-VL's own: patch rows in ``(C, T, p, p)``
order with each 2x2 merge window adjacent, (row, col) positions in the same order, one attention item per image or
per temporal patch of a video. The tower's rotary angles need the positions after the stem, where encoder
resharding may move the tokens to another rank, so :meth:`Qwen2VLVisionAdapter.embed` appends them to each token
as four small integers (exact in bf16 and fp16) and :meth:`~Qwen2VLVisionAdapter.encode` takes them off again.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.balance.reshard import SplitChunk
from omni_lightning.batch import PackedBatch, PackingSpec, input_key
from omni_lightning.models.adapters.hf_attention import SplitItems, use_tower_attention
from omni_lightning.models.adapters.hf_llm import HFCausalLMAdapter
from omni_lightning.models.flops import TRAIN, TRAIN_FIRST_LAYER, attention_pair_flops, matmul_flops
from omni_lightning.parallel.attention import cu_seqlens_from_lengths, host_bounds
from omni_lightning.parallel.transfer import to_device

__all__ = ["Qwen25VLTextAdapter", "Qwen25VLVisionAdapter", "Qwen2VLTextAdapter", "Qwen2VLVisionAdapter",
           "mrope_positions", "position_columns", "positions_from_columns"]

_BASE = 256  # positions travel as (p // 256, p % 256): integers below 256 are exact in bf16
_POSITION_COLUMNS = 4


def position_columns(positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Integer ``positions [n, k]`` as ``2 k`` columns of ``dtype`` that stay exact in bf16 and fp16 (each below
    256), to travel with stem tokens; :func:`positions_from_columns` reads them back."""
    positions = positions.long()
    return torch.cat([positions // _BASE, positions % _BASE], dim=1).to(dtype)


def positions_from_columns(columns: torch.Tensor) -> torch.Tensor:
    high, low = columns.float().round().long().chunk(2, dim=1)
    return high * _BASE + low


def _longest(cu_seqlens: torch.Tensor) -> int:
    """The longest item, from the one host read of ``cu_seqlens`` every block shares (:func:`host_bounds`)."""
    return max((end - start for start, end in itertools.pairwise(host_bounds(cu_seqlens))), default=0)


class Qwen2VLVisionAdapter(nn.Module):
    """Qwen2-VL's vision tower (Conv3d patch stem, 2-D rotary blocks) and its patch merger, over packed items.

    Parameter names: ``patch_embed.*``, ``blocks.{i}.*`` and ``projector.*`` (the merger, so that
    ``freeze=["projector"]`` finds it). Whole items attend within themselves (packed, through the tower's own
    ``cu_seqlens``); an item split over an SP block (``enc_sp > 1``) attends with Ulysses sequence parallelism, its
    rotary angles travelling with its tokens; chunks are cut at whole merge windows, so the merger sees its groups.
    """

    supports_sequence_parallel = True

    def __init__(self, visual: nn.Module) -> None:
        super().__init__()
        config = visual.config
        self.config = config
        self.patch_embed = visual.patch_embed
        self.rotary_pos_emb = visual.rotary_pos_emb
        self.blocks = visual.blocks
        self.projector = visual.merger
        self.merge = config.spatial_merge_size
        self.tokens_per_output = self.merge * self.merge
        self.n_heads = config.num_heads
        use_tower_attention(config)  # one call over every row: whole items packed, split items with Ulysses

    @property
    def patch_width(self) -> int:
        config = self.config
        return config.in_channels * config.temporal_patch_size * config.patch_size * config.patch_size

    def forward(self, patches: torch.Tensor, positions: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        tokens, lengths = self.embed(patches, positions, grids)
        return self.encode(tokens, cu_seqlens_from_lengths(lengths))

    def item_tokens(self, patches: torch.Tensor, positions: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        return grids[:, 0] * grids[:, 1]

    def embed(self, patches: torch.Tensor, positions: torch.Tensor,
              grids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if patches.shape[-1] != self.patch_width:
            raise ValueError(f"patches of {patches.shape[-1]} values do not fit Qwen2-VL's patch stem of "
                             f"{self.patch_width} (channels x temporal_patch_size={self.config.temporal_patch_size} "
                             f"x {self.config.patch_size}^2): pack the data with the model's patch sizes")
        x = self.patch_embed(patches)
        return torch.cat([x, position_columns(positions, x.dtype)], dim=1), self.item_tokens(patches, positions,
                                                                                                grids)

    def encode(self, x: torch.Tensor, cu_seqlens: torch.Tensor, chunks: Sequence[SplitChunk] = (),
               sp_groups: Mapping[int, dist.ProcessGroup] | None = None) -> torch.Tensor:
        hidden, positions = x[:, :-_POSITION_COLUMNS], positions_from_columns(x[:, -_POSITION_COLUMNS:])
        rotary = self.rotary_pos_emb(hidden, positions)
        cu = cu_seqlens.to(torch.int32)
        split = SplitItems(chunks, sp_groups or {}) if chunks else None
        for block in self.blocks:
            hidden = block(hidden, cu_seqlens=cu, max_seqlen=_longest(cu), position_embeddings=rotary,
                           split_items=split)
        return self.projector(hidden)

    def dummy_inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One merge window, for a rank that has no images."""
        positions = to_device([[0, 0], [0, 1], [1, 0], [1, 1]], device)
        patches = torch.zeros(4, self.patch_width, device=device, dtype=self.patch_embed.proj.weight.dtype)
        return patches, positions, to_device([[2, 2]], device)

    def cost(self) -> ModuleCost:
        """Per patch: the stem, every block (qkv, projection, MLP) and a quarter of the merger; per pair of
        patches of one item, the attention."""
        config, dim = self.config, self.config.embed_dim
        hidden = int(dim * config.mlp_ratio)
        block = matmul_flops(dim, 3 * dim) + matmul_flops(dim, dim) + 2 * matmul_flops(dim, hidden)
        merged = dim * self.tokens_per_output
        merger = (matmul_flops(merged, merged) + matmul_flops(merged, config.hidden_size)) / self.tokens_per_output
        stem = TRAIN_FIRST_LAYER * matmul_flops(self.patch_width, dim)  # no gradient for the pixels
        return ModuleCost(linear=stem + TRAIN * (config.depth * block + merger),
                          quadratic=attention_pair_flops(dim, config.depth))


class Qwen2VLTextAdapter(HFCausalLMAdapter):
    """Qwen2-VL's decoder and LM head, with its multimodal rotary positions computed from the packed batch
    (:func:`mrope_positions`): parameter names ``tok_embeddings.*``, ``layers.{i}.*``, ``norm.*``, ``output.*``."""

    def __init__(self, model: nn.Module) -> None:
        nn.Module.__init__(self)
        config = model.config
        self._adopt(config.text_config, model.model.language_model, model.lm_head)
        self.image_token_id, self.video_token_id = config.image_token_id, config.video_token_id
        self.spatial_merge = config.vision_config.spatial_merge_size

    def rope_positions(self, batch: PackedBatch, spec: PackingSpec) -> torch.Tensor:
        """``[3, tokens]`` M-RoPE positions of the packed batch, restarting per sample."""
        grids = batch[input_key("vision", "grids")]
        return mrope_positions(batch["input_ids"], batch["cu_seqlens"], grids, image_id=self.image_token_id,
                               video_id=self.video_token_id, merge=self.spatial_merge)

    def position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """``[3, 1, tokens]`` M-RoPE position ids of ``[3, tokens]`` positions (1-D text positions on all axes)."""
        return (positions if positions.ndim == 2 else positions[None].expand(3, -1))[:, None, :].long()


def mrope_positions(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, grids: torch.Tensor, *, image_id: int,
                    video_id: int, merge: int, video_time_interval: float = 1.0,
                    continue_after: Literal["longest_side", "largest"] = "longest_side",
                    vision_start_id: int | None = None) -> torch.Tensor:
    """Qwen2-VL's ``get_rope_index`` over a packed batch: ``[3, tokens]`` (temporal, height, width), per sample.

    Text runs count on from the position before them on all three axes. A run of image placeholders takes the
    next vision item, laid out on its merged grid from the current position; a run of video placeholders takes as
    many items (temporal patches, equal grids) as it covers, the temporal axis counting them (times
    ``video_time_interval``, rounded down: Qwen2.5-VL's tokens per second times seconds per patch). After either, the
    position moves on by the larger merged side, as Qwen2-VL's and Qwen2.5-VL's own indexing does
    (``continue_after="longest_side"``), or to one past the item's largest position on any axis, as Qwen2.5-Omni's
    does (``"largest"``). With ``vision_start_id`` (Qwen2.5-Omni), a run not right after that token is laid out as
    text, as the thinker's indexing finds vision items by their start token only. ``grids`` are the vision items'
    ``[rows, cols]`` in patches, in packing order.
    """
    ids = input_ids.tolist()
    sides = (grids.long() // merge).tolist()
    out = np.zeros((3, len(ids)), dtype=np.int64)
    bounds, item = host_bounds(cu_seqlens), 0  # the LLM's attention reads the same bounds
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        position, i = 0, start
        while i < end:
            token, j = ids[i], i + 1
            if token not in (image_id, video_id):
                while j < end and ids[j] not in (image_id, video_id):
                    j += 1
                out[:, i:j] = np.arange(position, position + j - i)
                position += j - i
                i = j
                continue
            while j < end and ids[j] == token:
                j += 1
            as_text = vision_start_id is not None and (i == start or ids[i - 1] != vision_start_id)
            while i < j:  # images one item each; a video as many temporal patches as its run covers
                if item >= len(sides):
                    raise ValueError(f"placeholder tokens at {i} have no vision item left (grids: {len(sides)})")
                h, w = sides[item]
                frames = 1 if token == image_id else max((j - i) // (h * w), 1)
                interval = 1.0 if token == image_id else video_time_interval
                steps = (torch.arange(frames, dtype=torch.float32) * interval).long().numpy()  # as the model rounds
                t, r, c = np.meshgrid(steps, np.arange(h), np.arange(w), indexing="ij")
                size = frames * h * w
                if i + size > j:
                    raise ValueError(f"a run of {j - i} placeholder tokens does not cover its vision item of {size}")
                block = np.stack([t.ravel(), r.ravel(), c.ravel()]) + position
                if as_text:
                    block = np.broadcast_to(np.arange(position, position + size), (3, size))
                out[:, i : i + size] = block
                position = position + max(h, w) if continue_after == "longest_side" else int(block.max()) + 1
                i += size
                item += frames
    return torch.from_numpy(out).to(input_ids.device)


def _item_grids(positions: torch.Tensor, item_bounds: tuple[int, ...]) -> torch.Tensor:
    """Each whole item's ``(1, rows, columns)`` on the host, from its patches' positions (one temporal patch, rows and
    columns counted from zero): the items' largest positions in one read of the device, not two per item."""
    lengths = np.diff(item_bounds).astype(np.int64)
    lengths = lengths[lengths > 0]
    if not lengths.size:
        return torch.zeros(0, 3, dtype=torch.long)
    rows = positions[: item_bounds[-1], :2]
    owner = to_device(np.repeat(np.arange(lengths.size), lengths), rows.device)[:, None].expand(-1, 2)
    largest = rows.new_zeros(lengths.size, 2).scatter_reduce(0, owner, rows, "amax").cpu()
    return torch.cat([torch.ones(lengths.size, 1, dtype=torch.long), largest.long() + 1], dim=1)


class Qwen25VLVisionAdapter(Qwen2VLVisionAdapter):
    """Qwen2.5-VL's tower: as Qwen2-VL's, but attending within windows of ``window_size`` pixels (tokens reordered
    window by window, as the model does) except in its full-attention blocks."""

    def encode(self, x: torch.Tensor, cu_seqlens: torch.Tensor, chunks: Sequence[SplitChunk] = (),
               sp_groups: Mapping[int, dist.ProcessGroup] | None = None) -> torch.Tensor:
        """Whole items reordered window by window, as the model does, attend in windows (or whole in the
        full-attention blocks); the rows of split items keep their order and attend within their windows by key
        (after Ulysses' exchange each member holds the whole item)."""
        from transformers.vision_utils import get_vision_window_index

        config, unit = self.config, self.tokens_per_output
        hidden, positions = x[:, :-_POSITION_COLUMNS], positions_from_columns(x[:, -_POSITION_COLUMNS:])
        cu = cu_seqlens.to(torch.int32)
        item_bounds = host_bounds(cu)
        whole = item_bounds[-1]
        grid_thw = _item_grids(positions, item_bounds)
        if whole:
            window_index, cu_windows = get_vision_window_index(grid_thw, spatial_merge_size=self.merge,
                                                               window_size=config.window_size,
                                                               patch_size=config.patch_size)
        else:  # split items only
            window_index, cu_windows = torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.int32)
        window_index, cu_windows = to_device(window_index, hidden.device), to_device(cu_windows, hidden.device)

        def by_window(t: torch.Tensor) -> torch.Tensor:
            head = t[:whole].reshape(whole // unit, unit, t.shape[1])[window_index].reshape(whole, t.shape[1])
            return torch.cat([head, t[whole:]])

        rotary = tuple(by_window(r) for r in self.rotary_pos_emb(hidden, positions))
        hidden = by_window(hidden)
        full_split = SplitItems(chunks, sp_groups or {}) if chunks else None
        side = config.window_size // config.patch_size  # a window's side in patches
        keys = (positions[whole:, 0] // side) * (1 << 20) + positions[whole:, 1] // side
        windowed_split = SplitItems(chunks, sp_groups or {}, keys) if chunks else None
        for index, block in enumerate(self.blocks):
            full = index in config.fullatt_block_indexes
            bounds = cu if full else cu_windows
            hidden = block(hidden, cu_seqlens=bounds, max_seqlen=_longest(bounds), position_embeddings=rotary,
                           split_items=full_split if full else windowed_split)
        out = self.projector(hidden)
        outputs = whole // unit
        return torch.cat([out[:outputs][torch.argsort(window_index)], out[outputs:]])

    def cost(self) -> ModuleCost:
        """Per patch: the stem, every block (qkv, projection, gated MLP) and a quarter of the merger; per pair of
        patches, the attention (windowed blocks attend to fewer pairs: an upper bound)."""
        config, dim = self.config, self.config.hidden_size
        block = matmul_flops(dim, 3 * dim) + matmul_flops(dim, dim) + 3 * matmul_flops(dim, config.intermediate_size)
        merged = dim * self.tokens_per_output
        merger = (matmul_flops(merged, merged) + matmul_flops(merged, config.out_hidden_size)) / self.tokens_per_output
        stem = TRAIN_FIRST_LAYER * matmul_flops(self.patch_width, dim)
        return ModuleCost(linear=stem + TRAIN * (config.depth * block + merger),
                          quadratic=attention_pair_flops(dim, config.depth))


class Qwen25VLTextAdapter(Qwen2VLTextAdapter):
    """Qwen2.5-VL's decoder: as Qwen2-VL's, with a video's temporal positions counting ``tokens_per_second`` per
    second of video (``video_fps``: the rate frames were sampled at, set from the data module)."""

    def __init__(self, model: nn.Module, video_fps: float = 2.0) -> None:
        super().__init__(model)
        vision = model.config.vision_config
        self.tokens_per_second, self.temporal_patch_size = vision.tokens_per_second, vision.temporal_patch_size
        self.video_fps = video_fps

    def rope_positions(self, batch: PackedBatch, spec: PackingSpec) -> torch.Tensor:
        grids = batch[input_key("vision", "grids")]
        interval = self.tokens_per_second * (self.temporal_patch_size / self.video_fps)  # the processor's order
        return mrope_positions(batch["input_ids"], batch["cu_seqlens"], grids, image_id=self.image_token_id,
                               video_id=self.video_token_id, merge=self.spatial_merge, video_time_interval=interval)
