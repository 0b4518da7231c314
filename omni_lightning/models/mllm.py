"""The reference multimodal LLM: encoders whose outputs replace placeholder embeddings of a decoder LLM."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from omni_lightning.balance.cost import CostModel
from omni_lightning.models.adapters.protocol import EncoderAdapter, LLMAdapter
from omni_lightning.models.config import AUDIO_ID, IMAGE_ID, ReferenceMLLMConfig
from omni_lightning.models.encoders import AudioEncoder, VisionEncoder
from omni_lightning.models.llm import Decoder
from omni_lightning.parallel.context_parallel import shard_for_context_parallel

if TYPE_CHECKING:  # the parallel package builds on the models
    from omni_lightning.runtime.reshard import EncoderBalancer

__all__ = ["ReferenceMLLM", "IGNORE_INDEX", "next_token_loss_sum", "vocab_parallel_loss"]

IGNORE_INDEX = -100


class ReferenceMLLM(nn.Module):
    """Vision + audio encoders feeding a Llama-style decoder over one packed micro-batch.

    ``forward(batch)`` takes the packed micro-batch built by
    :func:`omni_lightning.data.packing.pack_samples` and returns logits ``[tokens, vocab]`` (a
    vocabulary-sharded DTensor under tensor parallelism; see :func:`next_token_loss_sum`); under context
    parallelism, for this rank's share of the tokens only (:meth:`local_labels` are their labels).
    Every encoder runs on every call, on a dummy item when the micro-batch has none of its modality, so that
    all data-parallel ranks issue the same FSDP collectives whatever their data. With an ``encoder_balancer``
    (see :mod:`omni_lightning.runtime.reshard`) the data-parallel ranks share the step's encoder work.

    ``vision``, ``audio`` and ``llm`` replace the reference components with any module implementing
    :class:`~omni_lightning.models.adapters.EncoderAdapter` / :class:`~omni_lightning.models.adapters.LLMAdapter`
    (e.g. the Hugging Face adapters of :mod:`omni_lightning.models.adapters`); their outputs must have the LLM's
    width. ``config`` then describes only the components kept, and the loss settings (``llm.moe_aux_loss_coef``).
    """

    def __init__(self, config: ReferenceMLLMConfig, *, vision: EncoderAdapter | None = None,
                 audio: EncoderAdapter | None = None, llm: LLMAdapter | None = None) -> None:
        super().__init__()
        self.config = config
        backend = config.attention_backend  # type: ignore[assignment]
        self.vision = vision if vision is not None else VisionEncoder(config.vision, config.llm.dim, backend)
        self.audio = audio if audio is not None else AudioEncoder(config.audio, config.llm.dim, backend)
        self.llm = llm if llm is not None else Decoder(config.llm, backend)
        # Set by parallelize_mllm when encoder work is resharded across the data-parallel ranks.
        self.encoder_balancer: EncoderBalancer | None = None
        # Set by parallelize_mllm under context parallelism: the decoder then runs on this rank's token share.
        self.cp_group: dist.ProcessGroup | None = None
        self.forward_cpu_seconds: dict[str, float] = {}
        self._encoder_seconds = 0.0

    def cost_model(self) -> CostModel:
        """The per-sample cost model of these components (adapters included), e.g. for
        ``OmniDataModule(cost_model=...)``, which otherwise prices samples by the reference model's config."""
        return CostModel(vision=self.vision.cost(), audio=self.audio.cost(), llm=self.llm.cost())

    def forward(self, batch: dict[str, torch.Tensor],
                encoded: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits of ``batch``; ``encoded`` gives its vision and audio outputs when another rank encoded them."""
        started = time.thread_time()
        logits = self._forward(batch, encoded)
        # This thread's forward CPU seconds (a blocked collective costs none), for the measured balance.
        llm_seconds = time.thread_time() - started - self._encoder_seconds
        self.forward_cpu_seconds = {"encoders": self._encoder_seconds, "llm": llm_seconds}
        return logits

    def _forward(self, batch: dict[str, torch.Tensor],
                 encoded: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        started = time.thread_time()
        embeddings = self.embed(batch, encoded)
        self._encoder_seconds = time.thread_time() - started
        if self.cp_group is None:
            return self.llm(embeddings, batch["position_ids"], batch["cu_seqlens"])
        shard = shard_for_context_parallel(batch["cu_seqlens"], self.cp_group)
        local = shard.local_index
        return self.llm(embeddings[local], batch["position_ids"][local], batch["cu_seqlens"], shard)

    def embed(self, batch: dict[str, torch.Tensor],
              encoded: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Token embeddings with every placeholder replaced by its encoder output: the decoder's input.

        ``encoded`` gives the vision and audio outputs when they were computed elsewhere (the joint pipeline, the
        encoder pool of the disaggregated placement).
        """
        input_ids = batch["input_ids"]
        embeddings = self.llm.tok_embeddings(input_ids)
        vision, audio = encoded if encoded is not None else self.encode_items(batch)
        rows = (_placeholder_rows(input_ids == IMAGE_ID, vision, embeddings.shape[-1], "vision"),
                _placeholder_rows(input_ids == AUDIO_ID, audio, embeddings.shape[-1], "audio"))
        # One copy for both, even with no placeholders: an empty output still carries its encoder's (zero)
        # gradients back. Row indices rather than masked_scatter, whose walk over every element of the mask cost as
        # much as a tenth of a decoder layer on CPU.
        values = torch.cat([vision.to(embeddings.dtype), audio.to(embeddings.dtype)])
        return embeddings.index_copy(0, torch.cat(rows), values)

    def local_labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The labels of the tokens this rank's logits cover (all of them unless context parallelism is on)."""
        if self.cp_group is None:
            return batch["labels"]
        return batch["labels"][shard_for_context_parallel(batch["cu_seqlens"], self.cp_group).local_index]

    def encode_items(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Vision and audio embeddings of a batch's items (``vision_patches``, ``vision_positions``,
        ``vision_grids``, ``audio_mels``, ``audio_lengths``), in placeholder order."""
        vision_inputs = (batch["vision_patches"], batch["vision_positions"], batch["vision_grids"])
        audio_inputs = (batch["audio_mels"], batch["audio_lengths"])
        balancer = self.encoder_balancer
        if balancer is None:
            return (_encode_locally(self.vision, vision_inputs, batch["vision_grids"].shape[0]),
                    _encode_locally(self.audio, audio_inputs, batch["audio_lengths"].shape[0]))
        steps = balancer.plan(
            {"vision": self.vision.item_tokens(*vision_inputs), "audio": self.audio.item_tokens(*audio_inputs)},
            {"vision": self.vision.tokens_per_output, "audio": self.audio.tokens_per_output},
        )
        vision = balancer.encode(self.vision, vision_inputs, steps["vision"])
        return vision, balancer.encode(self.audio, audio_inputs, steps["audio"], dependency=vision)


def _encode_locally(encoder: nn.Module, inputs: tuple[torch.Tensor, ...], n_items: int) -> torch.Tensor:
    """Encode the items here; with none, a dummy item whose (empty) output still joins the graph."""
    if n_items > 0:
        return encoder(*inputs)
    return encoder(*encoder.dummy_inputs(inputs[0].device))[:0]


def _placeholder_rows(where: torch.Tensor, values: torch.Tensor, width: int, what: str) -> torch.Tensor:
    """The token rows that take ``values`` (the encoder outputs of one modality), checked against them."""
    if values.shape[-1] != width:  # the rows would be filled from the wrong elements
        raise ValueError(f"the {what} encoder outputs width {values.shape[-1]} but the LLM's embeddings have width "
                         f"{width}: build the encoder's projector for the LLM's width")
    rows = where.nonzero().squeeze(1)
    if rows.numel() != values.shape[0]:
        raise ValueError(
            f"the micro-batch has {rows.numel()} {what} placeholder tokens but the {what} encoder produced "
            f"{values.shape[0]} embeddings; sample metadata and media disagree"
        )
    return rows


_loss_parallel_depth = 0


@contextmanager
def vocab_parallel_loss() -> Iterator[None]:
    """``loss_parallel()`` that may be nested: only the outermost one enters and exits, because leaving an inner
    ``loss_parallel`` would switch it off for the outer one (a pipeline schedule computes losses and runs their
    backward inside one such context)."""
    global _loss_parallel_depth
    context = loss_parallel() if _loss_parallel_depth == 0 else nullcontext()
    _loss_parallel_depth += 1
    try:
        with context:
            yield
    finally:
        _loss_parallel_depth -= 1


def next_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy over positions whose label is not ``IGNORE_INDEX``, and how many there were.

    Vocabulary-sharded logits (a DTensor from tensor parallelism) are reduced without gathering them; the backward
    pass must then also run under ``loss_parallel`` (OmniStrategy.backward does that, with
    :func:`vocab_parallel_loss`).
    """
    if isinstance(logits, DTensor):
        with vocab_parallel_loss():
            loss_sum = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        loss_sum = loss_sum.to_local()
    else:
        loss_sum = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, (labels != IGNORE_INDEX).sum()
