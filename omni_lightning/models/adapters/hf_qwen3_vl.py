"""Qwen3-VL-MoE whole: its vision tower (learned positions resampled to each item's grid, 2-D rotary blocks, the
merger and the DeepStack mergers) and its mixture-of-experts M-RoPE decoder, computing exactly what
``Qwen3VLMoeForConditionalGeneration`` computes, its load-balancing loss included.

DeepStack: the tower's features after some of its blocks, each through a merger of its own, are added to the hidden
states of the vision placeholders after the decoder's first layers. The vision encoder returns them beside its
main output as further ``dim`` columns of each output row (:attr:`Qwen3VLVisionAdapter.deepstack_layers` of them),
so they travel with the main output wherever the encoder stage moves outputs; the model adds them in
(:meth:`~omni_lightning.models.mllm.ReferenceMLLM.deepstack`).

The decoder's experts run through this package's expert machinery (:func:`~omni_lightning.models.moe.
combine_experts`, so expert parallelism shards them); the router and the load-balancing loss are the family's: the
loss is ``n_experts * sum_e f_e * p_e`` over the assignments and router probabilities of *every* MoE layer of the
micro-batch's global batch together (transformers' ``load_balancing_loss_func``), which couples the layers. Each
layer records its routing statistics (:class:`RouterStats`); a pipeline stage sums its layers' and passes the sum on
to the next, so the last stage holds the whole model's (see :mod:`omni_lightning.runtime.pipeline`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.balance.reshard import SplitChunk
from omni_lightning.batch import PackedBatch, PackingSpec, input_key
from omni_lightning.models.adapters.hf_attention import SplitItems, use_tower_attention
from omni_lightning.models.adapters.hf_llm import TP_STYLES, head_norm_plan
from omni_lightning.models.adapters.hf_qwen2_vl import (
    Qwen2VLTextAdapter,
    Qwen2VLVisionAdapter,
    _longest,
    mrope_positions,
    position_columns,
    positions_from_columns,
)
from omni_lightning.models.flops import TRAIN, TRAIN_FIRST_LAYER, attention_pair_flops, matmul_flops
from omni_lightning.models.lora import lora_layer_plan
from omni_lightning.models.moe import combine_experts
from omni_lightning.parallel.expert_parallel import gather_rows, split_rows
from omni_lightning.parallel.local import local_tensor

__all__ = ["FusedExperts", "Qwen3VLMoeTextAdapter", "Qwen3VLVisionAdapter", "RoutedMoE"]

_POSITION_COLUMNS = 4


class Qwen3VLVisionAdapter(Qwen2VLVisionAdapter):
    """Qwen3-VL's tower over packed items: the Conv3d stem plus its learned position table resampled (bilinearly)
    to each item's grid, 2-D rotary blocks, the merger, and the DeepStack mergers after the blocks of
    ``deepstack_visual_indexes``, whose outputs follow the merger's in each output row.

    Parameter names: ``patch_embed.*``, ``pos_embed.*``, ``blocks.{i}.*``, ``projector.*`` (the merger) and
    ``deepstack_mergers.{j}.*``.
    """

    def __init__(self, visual: nn.Module) -> None:
        nn.Module.__init__(self)
        config = visual.config
        self.config = config
        self.patch_embed = visual.patch_embed
        self.pos_embed = visual.pos_embed
        self.rotary_pos_emb = visual.rotary_pos_emb
        self.blocks = visual.blocks
        self.projector = visual.merger
        self.deepstack_mergers = visual.deepstack_merger_list
        self.deepstack_indexes = list(config.deepstack_visual_indexes)
        #: Decoder layers that take DeepStack features: each output row carries as many further ``dim`` columns.
        self.deepstack_layers = len(self.deepstack_indexes)
        self.merge = config.spatial_merge_size
        self.tokens_per_output = self.merge * self.merge
        self.n_heads = config.num_heads
        self.grid_side = int(config.num_position_embeddings**0.5)
        use_tower_attention(config)

    def embed(self, patches: torch.Tensor, positions: torch.Tensor,
              grids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        if patches.shape[-1] != self.patch_width:
            raise ValueError(f"patches of {patches.shape[-1]} values do not fit Qwen3-VL's patch stem of "
                             f"{self.patch_width}: pack the data with the model's patch sizes")
        x = self.patch_embed(patches)
        grid_thw = torch.cat([torch.ones_like(grids[:, :1]), grids], dim=1).long()
        # The learned table resampled to each item's own grid, in the patches' merge-window order.
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw, self.grid_side, mode="bilinear", align_corners=True, spatial_merge_size=self.merge)
        table = (self.pos_embed(indices) * weights[:, :, None].to(self.pos_embed.weight.dtype)).sum(1)
        x = x + table.to(x.dtype)
        return torch.cat([x, position_columns(positions, x.dtype)], dim=1), self.item_tokens(patches, positions,
                                                                                               grids)

    def encode(self, x: torch.Tensor, cu_seqlens: torch.Tensor, chunks: Sequence[SplitChunk] = (),
               sp_groups: Mapping[int, dist.ProcessGroup] | None = None) -> torch.Tensor:
        hidden, positions = x[:, :-_POSITION_COLUMNS], positions_from_columns(x[:, -_POSITION_COLUMNS:])
        rotary = self.rotary_pos_emb(hidden, positions)
        cu = cu_seqlens.to(torch.int32)
        longest = _longest(cu)
        split = SplitItems(chunks, sp_groups or {}) if chunks else None
        deep = []
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, cu_seqlens=cu, max_seqlen=longest, position_embeddings=rotary, split_items=split)
            if index in self.deepstack_indexes:
                deep.append(self.deepstack_mergers[self.deepstack_indexes.index(index)](hidden))
        return torch.cat([self.projector(hidden), *deep], dim=1)

    def cost(self) -> ModuleCost:
        """Per patch: the stem, every block (qkv, projection, MLP), a quarter of the merger and of each DeepStack
        merger; per pair of patches of one item, the attention."""
        config, dim = self.config, self.config.hidden_size
        block = matmul_flops(dim, 3 * dim) + matmul_flops(dim, dim) + 2 * matmul_flops(dim, config.intermediate_size)
        merged = dim * self.tokens_per_output
        merger = (matmul_flops(merged, merged) + matmul_flops(merged, config.out_hidden_size)) / self.tokens_per_output
        stem = TRAIN_FIRST_LAYER * matmul_flops(self.patch_width, dim)
        return ModuleCost(linear=stem + TRAIN * (config.depth * block + (1 + self.deepstack_layers) * merger),
                          quadratic=attention_pair_flops(dim, config.depth))


class FusedExperts(nn.Module):
    """A transformers MoE layer's stacked experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) run on rows
    sorted by expert, as :class:`~omni_lightning.models.moe.GroupedExperts` runs them (so expert parallelism shards
    and dispatches them alike). The parameters are the model's own, under their own names."""

    expert_parameter_names = ("gate_up_proj", "down_proj")

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.n_experts = experts.num_experts
        self.act_fn = experts.act_fn
        self.dispatcher: Any = None

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.dispatcher is None:
            return self.compute(rows, counts)
        return self.dispatcher(rows, counts, self.compute)

    def compute(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts held here on ``rows`` sorted by (local) expert, ``counts`` rows each."""
        gate_up, down = (local_tensor(w).to(rows.dtype) for w in (self.gate_up_proj, self.down_proj))
        outputs = []
        # Every local expert runs, even on zero rows, so its weights always get a (possibly zero) gradient.
        for expert, part in enumerate(rows.split(counts.tolist())):
            gate, up = F.linear(part, gate_up[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, down[expert]))
        return torch.cat(outputs)


class RoutedMoE(nn.Module):
    """A transformers sparse MoE block (its ``gate``: the top-k router, and its ``experts``) over the packed tokens.

    Routes as the family does (softmax in fp32, top-k, the chosen weights renormalised) and records the step's
    routing statistics for the load-balancing loss in :attr:`router_stats`: ``[assignments per expert, router
    probability summed per expert, tokens]`` (``2 E + 1`` values; only the probabilities carry gradients).
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.gate = block.gate
        self.experts = FusedExperts(block.experts)
        self.top_k = block.gate.top_k
        self.router_stats: torch.Tensor | None = None
        #: The tensor-parallel peers that split the tokens (each routes its share; outputs all-gathered).
        self.token_split_group: dist.ProcessGroup | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        rows, group = x.shape[0], self.token_split_group
        if group is not None:
            x = split_rows(x, group)
        logits = F.linear(x, self.gate.weight)
        probs = logits.float().softmax(-1)
        top, chosen = probs.topk(self.top_k, dim=-1)
        weights = (top / top.sum(-1, keepdim=True)).to(logits.dtype)
        counts = torch.bincount(chosen.reshape(-1), minlength=probs.shape[1]).to(probs.dtype)
        self.router_stats = torch.cat([counts, probs.sum(0), probs.new_tensor([probs.shape[0]])])
        out = combine_experts(x, chosen, weights, self.experts)
        return (gather_rows(out, rows, group) if group is not None else out).reshape(hidden.shape)


class Qwen3VLMoeTextAdapter(Qwen2VLTextAdapter):
    """Qwen3-VL-MoE's decoder and head: M-RoPE positions as Qwen3-VL counts them (every video frame laid out as its
    own item after its timestamp), mixture-of-experts layers through :class:`RoutedMoE`, DeepStack features added
    after the first layers, and the family's load-balancing loss (:meth:`aux_share`).

    Under tensor parallelism the attention and any dense MLP layers split by the model's own plan; the experts are
    not split (expert parallelism shards them): the peers split the tokens that reach them instead.
    """

    def __init__(self, model: nn.Module) -> None:
        nn.Module.__init__(self)
        config = model.config
        text = config.text_config
        self._adopt(text, model.model.language_model, model.lm_head)
        for layer in self.layers.values():
            if hasattr(layer.mlp, "experts"):
                layer.mlp = RoutedMoE(layer.mlp)
        self.image_token_id, self.video_token_id = config.image_token_id, config.video_token_id
        self.spatial_merge = config.vision_config.spatial_merge_size
        self.n_experts = text.num_experts
        #: Routing statistics of a forward: assignments and probability sums per expert, and tokens.
        self.router_stats_size = 2 * self.n_experts + 1
        self.stats_groups: tuple[dist.ProcessGroup, ...] = ()

    def rope_positions(self, batch: PackedBatch, spec: PackingSpec) -> torch.Tensor:
        """``[3, tokens]`` positions; a video's frames are separate runs (timestamps between them), each at
        temporal position 0 of its own item, as Qwen3-VL's ``get_rope_index`` lays them out."""
        grids = batch[input_key("vision", "grids")]
        return mrope_positions(batch["input_ids"], batch["cu_seqlens"], grids, image_id=self.image_token_id,
                               video_id=self.video_token_id, merge=self.spatial_merge, video_time_interval=0.0)

    def _layer_plan(self) -> dict[str, ParallelStyle]:
        """The model's own plan without its expert entries (expert parallelism shards the experts)."""
        plan = {}
        for pattern, style in (self.config.base_model_tp_plan or {}).items():
            name = pattern.removeprefix("layers.*.")
            if name.startswith("mlp.experts"):
                continue
            if name == pattern or style not in TP_STYLES:
                raise ValueError(f"tensor-parallel plan entry {pattern!r}: {style!r} is not supported (only "
                                 f"'layers.*.<module>' entries with styles {sorted(TP_STYLES)})")
            plan[name] = TP_STYLES[style]()
        return plan

    def layer_tp_plan(self, layer: nn.Module) -> dict[str, ParallelStyle]:
        """The plan's entries that this layer has (a MoE layer has no dense MLP projections)."""
        names = {name for name, _ in layer.named_modules()}
        plan = lora_layer_plan(layer, {name: style for name, style in self._layer_plan().items() if name in names})
        return plan | head_norm_plan(layer)

    def router_stats(self, layers: Iterable[tuple[str, nn.Module]]) -> torch.Tensor | None:
        """The routing statistics of ``layers``' last forward, summed (``None`` if none of them routes)."""
        stats = [layer.mlp.router_stats for _, layer in layers if isinstance(layer.mlp, RoutedMoE)]
        stats = [s for s in stats if s is not None]
        return torch.stack(stats).sum(0) if stats else None

    def aux_share(self, stats: torch.Tensor) -> torch.Tensor:
        """This rank's share of the load-balancing loss, given its statistics over every MoE layer: the assignments
        and tokens are summed over the ranks of the global batch (:attr:`stats_groups`), the probabilities stay
        local, so the shares of the ranks sum to the family's loss over the global batch."""
        experts = self.n_experts
        totals = torch.cat([stats[:experts], stats[-1:]]).detach().clone()
        for group in self.stats_groups:
            dist.all_reduce(totals, group=group)
        assignments, rows = totals[:experts], totals[-1].clamp(min=1.0)
        return experts * (assignments * stats[experts: 2 * experts]).sum() / rows**2

    def moe_aux_loss(self) -> torch.Tensor:
        stats = self.router_stats(self.layers.items())
        return self.aux_share(stats) if stats is not None else torch.zeros((), device=self.norm.weight.device)

    def cost(self) -> ModuleCost:
        """Per token: attention, the router and the ``top_k`` experts of each MoE layer (dense MLPs where the model
        has them), and the LM head."""
        config, dim = self.config, self.config.hidden_size
        head_dim = getattr(config, "head_dim", None) or dim // config.num_attention_heads
        q_width, kv_width = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        attention = matmul_flops(dim, q_width + 2 * kv_width) + matmul_flops(q_width, dim)
        total = 0.0
        for index in range(config.num_hidden_layers):
            if _is_moe_layer(config, index):
                mlp = matmul_flops(dim, config.num_experts) + config.num_experts_per_tok * 3 * matmul_flops(
                    dim, config.moe_intermediate_size)
            else:
                mlp = 3 * matmul_flops(dim, config.intermediate_size)
            total += attention + mlp
        return ModuleCost(linear=TRAIN * (total + matmul_flops(dim, config.vocab_size)),
                          quadratic=attention_pair_flops(q_width, config.num_hidden_layers))


def _is_moe_layer(config: Any, index: int) -> bool:
    """Whether decoder layer ``index`` of a Qwen3-MoE-style text config routes to experts (as the model decides)."""
    return (index not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (index + 1) % config.decoder_sparse_step == 0)
