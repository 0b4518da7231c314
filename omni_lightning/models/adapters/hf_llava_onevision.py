"""LLaVA-OneVision whole: its SigLIP tower and projector per tile or frame, the layout of their outputs per image and
video, and its Qwen2 decoder, computing exactly what ``LlavaOnevisionForConditionalGeneration`` computes.

The model encodes every tile of an any-resolution image, and every video frame, at the tower's own size (its
native position table: a 384-pixel tile is 27x27 patches of 14, the convolution never reading the last 6 pixels),
then lays the outputs out per media item: an image alone in its sample is its whole view's features, then its
canvas' tiles as one map unpadded to the image's aspect, scaled down past ``anyres_max`` tiles, with a newline
embedding after each row; an image sharing its sample is one tile and one newline; a video is its frames pooled 2x2,
then one newline. Here each tile and frame is an encoder item of its own (:class:`LlavaOnevisionVisionAdapter`), so
the encoder stage balances tiles over ranks as any items, and the layout runs on the LLM's side
(:class:`LlavaOnevisionAssembly`, the model's own ``pack_image_features`` and ``apply_pooling``), from the media
list the packed batch carries (:mod:`omni_lightning.modalities`, :data:`~omni_lightning.batch.AnyResolution`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.balance.reshard import SplitChunk
from omni_lightning.batch import AnyResolution, MediaShape
from omni_lightning.models.adapters.hf_attention import PackedItems, SplitItems, use_packed_attention
from omni_lightning.models.adapters.hf_llm import HFCausalLMAdapter
from omni_lightning.models.flops import TRAIN, TRAIN_FIRST_LAYER, attention_pair_flops, matmul_flops
from omni_lightning.parallel.attention import cu_seqlens_from_lengths
from omni_lightning.parallel.transfer import to_device

__all__ = ["LlavaOnevisionAssembly", "LlavaOnevisionTextAdapter", "LlavaOnevisionVisionAdapter", "any_resolution"]

_ANYRES_MAX = "anyres_max_"


def any_resolution(config: Any) -> AnyResolution:
    """The any-resolution layout of a ``LlavaOnevisionConfig``; ``ValueError`` for what its model cannot lay out."""
    if config.vision_feature_select_strategy != "full":
        raise ValueError(f"vision_feature_select_strategy={config.vision_feature_select_strategy!r} drops the first "
                         "patch of every tile, which LLaVA-OneVision's own layout of tiles cannot arrange: its "
                         "checkpoints use 'full'")
    ratio = config.vision_aspect_ratio
    if not ratio.startswith(_ANYRES_MAX) or not ratio.removeprefix(_ANYRES_MAX).isdigit():
        raise ValueError(f"vision_aspect_ratio={ratio!r} is not of the form 'anyres_max_<tiles>'")
    return AnyResolution(tile=config.vision_config.image_size,
                         pinpoints=tuple((int(h), int(w)) for h, w in config.image_grid_pinpoints),
                         max_tiles=int(ratio.removeprefix(_ANYRES_MAX)))


class LlavaOnevisionVisionAdapter(nn.Module):
    """The SigLIP tower and LLaVA-OneVision's projector over packed tiles and frames, one encoder item each.

    Parameter names: ``patch_embedding.*``, ``position_embedding.*``, ``blocks.{i}.*``, ``post_layernorm.*`` and
    ``projector.*`` (the ``multi_modal_projector``, so that ``freeze=["projector"]`` finds it). The features are the
    hidden states of ``vision_feature_layer`` (several: concatenated on channels), before the final norm; layers
    past the deepest of them and the final norm take no part in the model's forward, so they are kept frozen (and
    exported as they came). Items attend within themselves; a tile split over an SP block (``enc_sp > 1``) attends
    with Ulysses sequence parallelism (every token carries its position-table entry from the stem on).
    """

    supports_sequence_parallel = True
    tokens_per_output = 1

    def __init__(self, tower: nn.Module, projector: nn.Module, feature_layer: int | Sequence[int]) -> None:
        super().__init__()
        config = tower.config
        use_packed_attention(config)  # whatever it was built with: items attend within themselves, no dense mask
        self.config = config
        self.patch_embedding = tower.embeddings.patch_embedding
        self.position_embedding = tower.embeddings.position_embedding
        self.blocks = tower.encoder.layers
        self.post_layernorm = tower.post_layernorm.requires_grad_(False)
        self.projector = projector
        self.side = config.image_size // config.patch_size
        self.n_heads = config.num_attention_heads
        depth = len(self.blocks)
        layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
        if not layers or any(not -depth - 1 <= layer <= depth for layer in layers):
            raise ValueError(f"vision_feature_layer={feature_layer} must index the tower's {depth + 1} hidden states")
        # Indices into (embeddings, layer 1, ..., layer depth), as the model reads its tower's hidden states.
        self.feature_layers = [layer % (depth + 1) for layer in layers]
        self.depth = max(self.feature_layers)
        for block in list(self.blocks)[self.depth :]:
            block.requires_grad_(False)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        tokens, lengths = self.embed(patches, positions, grids)
        return self.encode(tokens, cu_seqlens_from_lengths(lengths))

    def item_tokens(self, patches: torch.Tensor, positions: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        return grids[:, 0] * grids[:, 1]

    def embed(self, patches: torch.Tensor, positions: torch.Tensor,
              grids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.patch_embedding.weight
        if patches.shape[-1] != weight[0].numel():
            raise ValueError(f"patches of {patches.shape[-1]} values do not fit the tower's {tuple(weight.shape[1:])} "
                             "patch embedding: pack the data with the model's patch size")
        if bool((grids > self.side).any()):
            raise ValueError(f"items of {grids.max().item()} patches a side exceed the tower's {self.side}x{self.side} "
                             "position table: tile images at the tower's image_size")
        # A stride-p convolution over one p x p patch is a matmul with its kernel, read in the same (C, p, p) order;
        # each patch takes its own entry of the native table (the model never interpolates it).
        x = F.linear(patches.to(weight.dtype), weight.flatten(1), self.patch_embedding.bias)
        table = self.position_embedding(positions[:, 0] * self.side + positions[:, 1])
        return x + table.to(x.dtype), self.item_tokens(patches, positions, grids)

    def encode(self, x: torch.Tensor, cu_seqlens: torch.Tensor, chunks: Sequence[SplitChunk] = (),
               sp_groups: Mapping[int, dist.ProcessGroup] | None = None) -> torch.Tensor:
        items = PackedItems.of(cu_seqlens, split=SplitItems(chunks, sp_groups or {}) if chunks else None)
        hidden = [x[None]]
        for block in list(self.blocks)[: self.depth]:
            hidden.append(block(hidden[-1], items))
        features = torch.cat([hidden[layer] for layer in self.feature_layers], dim=-1)[0]
        return self.projector(features)

    def dummy_inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One patch, for a rank that has no images."""
        weight = self.patch_embedding.weight
        patches = torch.zeros(1, weight[0].numel(), device=device, dtype=weight.dtype)
        return patches, torch.zeros(1, 2, dtype=torch.long, device=device), to_device([[1, 1]], device)

    def idle_parameters(self) -> Iterator[nn.Parameter]:
        """The layers past the deepest feature layer and the final norm: kept for export, never run."""
        for module in [*list(self.blocks)[self.depth :], self.post_layernorm]:
            yield from module.parameters()

    def cost(self) -> ModuleCost:
        """Per patch: patch embedding, the layers run (q, k, v, out, MLP) and the projector; per pair: attention."""
        config, dim = self.config, self.config.hidden_size
        layer = 4 * matmul_flops(dim, dim) + 2 * matmul_flops(dim, config.intermediate_size)
        first, second = self.projector.linear_1, self.projector.linear_2
        projector = matmul_flops(first.in_features, first.out_features) + matmul_flops(second.in_features,
                                                                                       second.out_features)
        patch = matmul_flops(self.patch_embedding.weight[0].numel(), dim)
        return ModuleCost(linear=TRAIN_FIRST_LAYER * patch + TRAIN * (self.depth * layer + projector),
                          quadratic=attention_pair_flops(dim, self.depth))


class LlavaOnevisionAssembly(nn.Module):
    """LLaVA-OneVision's layout of a micro-batch's tile and frame outputs into its images' and videos' features
    (an :class:`~omni_lightning.models.adapters.OutputAssembly`), through the model's own ``pack_image_features``
    and ``apply_pooling``, with its trainable ``image_newline`` (parameter name ``image_newline``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.config = model.config  # all that the model's layout methods read of it
        self.image_newline = model.image_newline
        vision = self.config.vision_config
        self.per_item = (vision.image_size // vision.patch_size) ** 2

    def forward(self, outputs: torch.Tensor, media: Sequence[tuple[str, MediaShape]]) -> torch.Tensor:
        from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

        pieces, start = [], 0
        for modality, shape in media:
            items = shape[0]  # tiles of an image, frames of a video
            features = outputs[start : start + items * self.per_item].unflatten(0, (items, self.per_item))
            start += items * self.per_item
            if modality == "image":
                (image,), _ = LlavaOnevisionModel.pack_image_features(
                    self, [features], [tuple(shape[3:5])], image_newline=self.image_newline,
                    vision_aspect_ratio=self.config.vision_aspect_ratio)
                pieces.append(image)
            elif modality == "video":
                frames = LlavaOnevisionModel.apply_pooling(self, features).flatten(0, 1)
                pieces += [frames, self.image_newline[None].to(frames.dtype)]
            else:
                raise ValueError(f"LLaVA-OneVision lays out images and videos, not {modality!r} items")
        if start != outputs.shape[0]:
            raise ValueError(f"the vision encoder produced {outputs.shape[0]} outputs, but the micro-batch's media "
                             f"{[m for m, _ in media]} take {start}")
        # The newline joins the graph even without media, so every rank reduces a gradient for it.
        pieces.append(self.image_newline[None, :].to(outputs.dtype)[:0])
        return torch.cat(pieces)


class LlavaOnevisionTextAdapter(HFCausalLMAdapter):
    """LLaVA-OneVision's Qwen2 decoder and LM head (tied to the embedding where the checkpoint ties them): positions
    count on per sample (1-D RoPE), as the model's own."""

    def __init__(self, model: nn.Module) -> None:
        nn.Module.__init__(self)
        config = model.config
        self._adopt(config.text_config, model.model.language_model, model.lm_head)
        self.image_token_id, self.video_token_id = config.image_token_id, config.video_token_id
