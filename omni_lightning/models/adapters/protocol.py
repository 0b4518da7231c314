"""What the strategy needs from an encoder and from a decoder LLM, written down as two protocols.

The reference modules (:class:`~omni_lightning.models.encoders.VisionEncoder`,
:class:`~omni_lightning.models.encoders.AudioEncoder`, :class:`~omni_lightning.models.llm.Decoder`) implement them,
and so do the Hugging Face adapters of this package. :class:`~omni_lightning.models.mllm.ReferenceMLLM` takes any of
them in place of its own components, and :func:`~omni_lightning.models.parallelize.parallelize_reference`
parallelises through these members only; the pipeline and context parallelism drive a decoder through
:meth:`LLMAdapter.run_layers` and :meth:`LLMAdapter.head_logits`.

Data format: encoders take their inputs as :mod:`omni_lightning.modalities` packs them (vision: ``patches
[n_patches, 3 * 14 * 14]`` with each 2x2 merge window adjacent, ``positions [n_patches, 2]``, ``grids [n_items, 2]``;
audio: ``mels [n_frames, n_mels]``, ``lengths [n_clips]``) and return one LLM-width embedding per placeholder token
of their modalities, in item order; or, where an :class:`OutputAssembly` lays their outputs out per media item first
(LLaVA-OneVision), the outputs it reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.balance.reshard import SplitChunk
from omni_lightning.batch import MediaShape
from omni_lightning.parallel.context_parallel import ContextShard

__all__ = ["EncoderAdapter", "LLMAdapter", "OutputAssembly"]


@runtime_checkable
class EncoderAdapter(Protocol):
    """A modality encoder: packed items in, LLM-width embeddings out, split into a per-token stem and the rest.

    The split lets encoder resharding move stem tokens between ranks: ``forward(*inputs)`` must equal
    ``encode(tokens, cu_seqlens)`` of ``tokens, lengths = embed(*inputs)`` with ``cu_seqlens`` from ``lengths``.
    """

    #: Transformer blocks: each is its own FSDP unit.
    blocks: Sequence[nn.Module]
    #: Stem tokens per output embedding; a split item is never cut inside such a group.
    tokens_per_output: int
    #: Attention heads: Ulysses sequence parallelism gives each member of an SP group a share of them.
    n_heads: int
    #: Whether ``encode`` runs split-item chunks (``enc_sp > 1``); adapters without it take whole items only.
    supports_sequence_parallel: bool

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Packed items -> ``[n_outputs, llm_dim]``."""
        ...

    def item_tokens(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Stem tokens of each item, from the inputs' metadata alone (the encoder plan is made before the stem)."""
        ...

    def embed(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token stem: ``(tokens [n_tokens, dim], tokens per item)``."""
        ...

    def encode(self, x: torch.Tensor, cu_seqlens: torch.Tensor, chunks: Sequence[SplitChunk] = (),
               sp_groups: Mapping[int, dist.ProcessGroup] | None = None) -> torch.Tensor:
        """Transformer and projector over stem tokens of whole items (``cu_seqlens``), then split-item chunks."""
        ...

    def dummy_inputs(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Inputs of one small item, run by a rank with none so that its collectives match the other ranks'."""
        ...

    def cost(self) -> ModuleCost:
        """Training FLOPs per stem-level cost-model token and per attention pair (see :class:`CostModel`).

        An adapter that keeps parameters its forward never runs (layers past the features it reads, kept for export)
        may name them in an ``idle_parameters()`` method: what of a module trains is counted without them
        (:meth:`~omni_lightning.models.mllm.ReferenceMLLM.training_passes`)."""
        ...


@runtime_checkable
class LLMAdapter(Protocol):
    """A decoder LLM over one packed sequence: embeddings in, logits out.

    ``layers`` holds the transformer blocks keyed ``"0" .. "n-1"`` (pipeline stages keep these names, so their
    checkpoints load into the unsplit model); each block is an FSDP unit. ``tok_embeddings``, ``norm`` and
    ``output`` (the LM head) are the remaining pieces a pipeline places on its first and last stages.
    """

    tok_embeddings: nn.Module
    layers: nn.ModuleDict
    norm: nn.Module
    output: nn.Module

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[tokens, dim]``, into which the model writes the encoders' outputs."""
        ...

    def forward(self, embeddings: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                cp_shard: ContextShard | None = None) -> torch.Tensor:
        """``embeddings [tokens, dim]``, positions reset per packed sample -> logits ``[tokens, vocab]``; attention
        never crosses the samples that ``cu_seqlens`` delimits. With ``cp_shard`` (context parallelism) the tokens
        and positions are this rank's share of the packed batch: :meth:`head_logits` of :meth:`run_layers` over
        every layer."""
        ...

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                   layers: Iterable[tuple[str, nn.Module]], cp_shard: ContextShard | None = None,
                   deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[tokens, dim]`` through ``layers`` (``(name, block)`` pairs of :attr:`layers`, in order: a
        pipeline stage runs its own). ``positions`` are what :meth:`ReferenceMLLM.positions` computed (``[tokens]``,
        or e.g. ``[3, tokens]`` for multimodal rotary positions), cut to the tokens given. ``deepstack``
        ``[n, tokens, dim]`` (models that inject encoder features into their first ``n`` layers, as Qwen3-VL's
        DeepStack does) is added to the output of layer ``i < n``; zero rows leave a token as it is."""
        ...

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head: hidden states -> logits (vocabulary-sharded under TP)."""
        ...

    def check_tp(self, tp: int) -> None:
        """Raise ``ValueError`` naming the first size that ``tp`` does not divide."""
        ...

    def tp_plan(self) -> dict[str, ParallelStyle]:
        """Tensor-parallel styles of the embedding and head, by attribute name. The head's logits stay sharded
        over the vocabulary (the loss runs under ``loss_parallel``)."""
        ...

    def layer_tp_plan(self, layer: nn.Module) -> dict[str, ParallelStyle]:
        """Tensor-parallel styles of one block's submodules, by name relative to the block."""
        ...

    def moe_aux_loss(self) -> torch.Tensor:
        """This rank's share of the MoE load-balance loss of the last forward (a zero scalar for dense models)."""
        ...

    def cost(self) -> ModuleCost:
        """Training FLOPs per token (every layer and the head) and per causal attention pair."""
        ...


@runtime_checkable
class OutputAssembly(Protocol):
    """Lays out one encoder's outputs media item by media item before they fill the placeholders, where a model's
    placeholders are not one per output (LLaVA-OneVision unpads an image's tiles into one map with a newline
    embedding per row, and pools video frames): the modalities of that encoder then count their placeholders with
    :attr:`~omni_lightning.batch.Modality.assembled_tokens`, and packed batches list their media
    (:func:`~omni_lightning.batch.media_key`).

    It runs on the LLM's side of the step (:meth:`~omni_lightning.models.mllm.ReferenceMLLM.embed`), after the encoder
    stage has brought every item's outputs back, so items stay the unit that encoder resharding balances.
    """

    def forward(self, outputs: torch.Tensor, media: Sequence[tuple[str, MediaShape]]) -> torch.Tensor:
        """``outputs [n_outputs, llm_dim]``: the encoder's outputs of a micro-batch's items, in placeholder order;
        ``media``: its media items in the same order, as ``(modality name, size)``. Returns their placeholders'
        embeddings in that order. Its parameters must take part even when ``media`` is empty, so that every rank's
        gradients cover the same parameters (FSDP reduces them together)."""
        ...
