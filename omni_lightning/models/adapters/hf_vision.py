"""A Hugging Face SigLIP vision tower (``SiglipVisionModel``) as an :class:`EncoderAdapter` for native resolution."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import SiglipVisionModel

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.balance.reshard import SplitChunk
from omni_lightning.models.adapters.hf_attention import PackedItems, use_packed_attention
from omni_lightning.models.flops import TRAIN, TRAIN_FIRST_LAYER, attention_pair_flops, matmul_flops
from omni_lightning.models.layers import GeluMLP
from omni_lightning.parallel.attention import cu_seqlens_from_lengths
from omni_lightning.parallel.transfer import to_device

__all__ = ["SiglipVisionAdapter"]


class SiglipVisionAdapter(nn.Module):
    """SigLIP's patch embedding, encoder layers and final norm over packed native-resolution images, then a 2x2
    merging projector to the LLM width (``merge=4``, as the reference encoder and the data packing use).

    Variable image sizes: SigLIP learns position embeddings for a square ``image_size / patch_size`` grid; each
    item gets that table bicubically interpolated to its own grid (exactly HF's ``interpolate_pos_encoding=True``),
    so any whole number of patches per side works and a native-size image gets the table itself. Items are packed
    and attend only within themselves (packed attention, no dense mask), so a packed batch encodes every image as
    ``SiglipVisionModel(pixel_values=image, interpolate_pos_encoding=True)`` would.

    The data must be cut into the model's patch size (``pack_samples(patch_size=...)``; 14 for the reference
    pipeline and most SigLIP checkpoints). SigLIP's attention-pooling head is not used: the LLM reads every patch.
    Split items (``enc_sp > 1``) are not supported; whole-item encoder balancing is.
    """

    supports_sequence_parallel = False

    def __init__(self, model: SiglipVisionModel, llm_dim: int, *, merge: int = 4) -> None:
        super().__init__()
        if merge not in (1, 4):
            raise ValueError(f"merge={merge} must be 1 or 4 (a 2x2 spatial merge)")
        config = model.config
        use_packed_attention(config)  # whatever it was built with: items attend within themselves, no dense mask
        tower = getattr(model, "vision_model", model)  # older releases nest the tower one level down
        self.config = config
        self.merge = merge
        self.patch_embedding = tower.embeddings.patch_embedding
        self.position_embedding = tower.embeddings.position_embedding
        self.blocks = tower.encoder.layers
        self.post_layernorm = tower.post_layernorm
        self.projector = GeluMLP(config.hidden_size * merge, llm_dim, llm_dim)
        self.native_side = config.image_size // config.patch_size
        self.n_heads = config.num_attention_heads

    @property
    def tokens_per_output(self) -> int:
        return self.merge

    def forward(self, patches: torch.Tensor, positions: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        tokens, lengths = self.embed(patches, positions, grids)
        return self.encode(tokens, cu_seqlens_from_lengths(lengths))

    def item_tokens(self, patches: torch.Tensor, positions: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        return grids[:, 0] * grids[:, 1]

    def embed(self, patches: torch.Tensor, positions: torch.Tensor,
              grids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.patch_embedding.weight
        if patches.shape[-1] != weight[0].numel():
            raise ValueError(f"patches of {patches.shape[-1]} values do not fit the model's {tuple(weight.shape[1:])} "
                             "patch embedding: pack the data with the model's patch size")
        # A stride-p convolution over one p x p patch is a matmul with its kernel, read in the same (C, p, p) order.
        x = F.linear(patches.to(weight.dtype), weight.flatten(1), self.patch_embedding.bias)
        return x + self._position_embeddings(positions, grids).to(x.dtype), self.item_tokens(patches, positions, grids)

    def _position_embeddings(self, positions: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        side, dim = self.native_side, self.config.hidden_size
        table = self.position_embedding.weight.reshape(1, side, side, dim).permute(0, 3, 1, 2)
        lengths = (grids[:, 0] * grids[:, 1]).tolist()
        resized: dict[tuple[int, int], torch.Tensor] = {}
        parts = []
        for (rows, cols), item in zip(grids.tolist(), positions.split(lengths), strict=True):
            if (rows, cols) not in resized:
                grid = table if (rows, cols) == (side, side) else F.interpolate(
                    table, size=(rows, cols), mode="bicubic", align_corners=False)
                resized[rows, cols] = grid[0].permute(1, 2, 0)
            parts.append(resized[rows, cols][item[:, 0], item[:, 1]])
        return torch.cat(parts)

    def encode(self, x: torch.Tensor, cu_seqlens: torch.Tensor, chunks: Sequence[SplitChunk] = (),
               sp_groups: Mapping[int, dist.ProcessGroup] | None = None) -> torch.Tensor:
        if chunks:
            raise ValueError("SiglipVisionAdapter encodes whole items only: use enc_sp=1")
        items = PackedItems.of(cu_seqlens)
        h = x[None]
        for block in self.blocks:
            h = block(h, items)
        h = self.post_layernorm(h[0])
        return self.projector(h.reshape(-1, self.config.hidden_size * self.merge))

    def dummy_inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One 2x2-patch item (one merge window), for a rank that has no images."""
        positions = to_device([[0, 0], [0, 1], [1, 0], [1, 1]], device)
        weight = self.patch_embedding.weight
        patches = torch.zeros(4, weight[0].numel(), device=device, dtype=weight.dtype)
        return patches, positions, to_device([[2, 2]], device)

    def cost(self) -> ModuleCost:
        """Per patch: patch embedding, the layers (q, k, v, out, MLP) and the projector's share; per pair: attention."""
        config, dim = self.config, self.config.hidden_size
        layer = 4 * matmul_flops(dim, dim) + 2 * matmul_flops(dim, config.intermediate_size)
        llm_dim = self.projector.fc2.out_features
        projector = (matmul_flops(dim * self.merge, llm_dim) + matmul_flops(llm_dim, llm_dim)) / self.merge
        patch = matmul_flops(self.patch_embedding.weight[0].numel(), dim)
        return ModuleCost(linear=TRAIN_FIRST_LAYER * patch + TRAIN * (config.num_hidden_layers * layer + projector),
                          quadratic=attention_pair_flops(dim, config.num_hidden_layers))
