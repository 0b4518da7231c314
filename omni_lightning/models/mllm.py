"""The reference multimodal LLM: encoders whose outputs replace placeholder embeddings of a decoder LLM."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from omni_lightning.balance.calibration import training_passes
from omni_lightning.balance.cost import CostModel
from omni_lightning.batch import Encoded, PackedBatch, PackingSpec, input_key, media_key
from omni_lightning.models.adapters.protocol import EncoderAdapter, LLMAdapter, OutputAssembly
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.encoders import AudioEncoder, VisionEncoder
from omni_lightning.models.flops import TRAIN
from omni_lightning.models.llm import Decoder
from omni_lightning.models.moe import MoEFeedForward
from omni_lightning.parallel.context_parallel import shard_for_context_parallel
from omni_lightning.parallel.layout import ModelGroups
from omni_lightning.parallel.transfer import to_device

__all__ = ["ReferenceMLLM"]


class ReferenceMLLM(nn.Module):
    """Encoders (vision, audio, any more) feeding a Llama-style decoder over one packed micro-batch.

    ``forward(batch, encoded)`` takes a packed micro-batch (:mod:`omni_lightning.batch`) and every encoder's outputs
    for its items (what the runtime's encoder stage produced; ``None`` encodes them here, whole, with :meth:`encode`)
    and returns logits ``[tokens, vocab]`` (a vocabulary-sharded DTensor under tensor parallelism); under context
    parallelism, for this rank's share of the tokens only (:meth:`local_labels` are their labels).

    ``vision``, ``audio`` and ``llm`` replace the reference components with any module implementing
    :class:`~omni_lightning.models.adapters.EncoderAdapter` / :class:`~omni_lightning.models.adapters.LLMAdapter`
    (e.g. the Hugging Face adapters of :mod:`omni_lightning.models.adapters`); their outputs must have the LLM's
    width. ``config`` then describes only the components kept, and the loss settings (``llm.moe_aux_loss_coef``).
    ``encoders`` adds encoders of further modalities, by name, and ``packing`` says how samples pack for all of them
    (default: ``config.packing()``, images, video and audio). ``assembly`` lays out an encoder's outputs media item by
    media item before they fill the placeholders (:class:`~omni_lightning.models.adapters.OutputAssembly`, by
    encoder name: LLaVA-OneVision's), for the encoders whose modalities the packing counts so. ``groups`` are the
    process groups its forward uses (context-parallel peers, the ranks of one global batch); :meth:`use_groups`
    sets them on a model built before they existed.
    """

    def __init__(self, config: ReferenceMLLMConfig, *, vision: EncoderAdapter | None = None,
                 audio: EncoderAdapter | None = None, llm: LLMAdapter | None = None,
                 encoders: Mapping[str, nn.Module] | None = None, packing: PackingSpec | None = None,
                 assembly: Mapping[str, OutputAssembly] | None = None, groups: ModelGroups | None = None) -> None:
        super().__init__()
        self.config = config
        backend = config.attention_backend  # type: ignore[assignment]
        self.vision = vision if vision is not None else VisionEncoder(config.vision, config.llm.dim, backend)
        self.audio = audio if audio is not None else AudioEncoder(config.audio, config.llm.dim, backend)
        self.llm = llm if llm is not None else Decoder(config.llm, backend)
        for name, module in (encoders or {}).items():
            if name in ("vision", "audio", "llm") or hasattr(self, name):
                raise ValueError(f"an extra encoder cannot be named {name!r}: the model has that attribute already")
            self.add_module(name, module)
        # Kept when a rank prunes its encoders (pipeline stages, the LLM pool): placeholders still take outputs.
        self.encoder_names = ("vision", "audio", *(encoders or {}))
        # Also kept when a rank prunes its encoders: the width of the outputs it receives.
        self.deepstack_depths = {name: int(getattr(getattr(self, name), "deepstack_layers", 0))
                                 for name in self.encoder_names}
        self.packing = packing or config.packing()
        if self.packing.encoder_names != self.encoder_names:
            raise ValueError(f"the packing's encoders {list(self.packing.encoder_names)} are not the model's "
                             f"{list(self.encoder_names)} (in that order)")
        if set(assembly or {}) != set(self.packing.assembled_encoders):
            raise ValueError(f"the packing counts assembled outputs of the encoders "
                             f"{list(self.packing.assembled_encoders)} but the model assembles those of "
                             f"{sorted(assembly or {})}")
        # The LLM's side holds them, not the encoders: a rank without encoders (the LLM pool) fills placeholders too.
        self.assembly = nn.ModuleDict(dict(assembly or {}))
        self.groups = ModelGroups()
        self.use_groups(groups or ModelGroups())

    def use_groups(self, groups: ModelGroups) -> None:
        """Run on these process groups from now on (the parallelize plan gives a built model the job's)."""
        self.groups = groups
        # Routing statistics for the load-balance loss are global: over the batch and the peers splitting tokens.
        stats_groups = tuple(group for group in (groups.batch, groups.tp) if group is not None)
        #: The MoE layers (found once: walking every module for them costs about half a millisecond a step).
        self.moe_layers = [module for module in self.llm.modules() if hasattr(module, "token_split_group")]
        #: The tensor-parallel peers the MoE layers split their tokens over (``None``: no split).
        self.moe_token_split_group = groups.tp if self.moe_layers else None
        for module in self.llm.modules():
            if isinstance(module, MoEFeedForward):
                module.stats_groups = stats_groups
            if hasattr(module, "token_split_group"):  # a MoE layer: tensor-parallel peers split its tokens
                module.token_split_group = groups.tp
        if hasattr(self.llm, "stats_groups"):  # a decoder summing its routing statistics over all of its layers
            self.llm.stats_groups = stats_groups

    @property
    def encoders(self) -> dict[str, nn.Module]:
        """The encoders this rank holds, by name (a pipeline stage or the LLM pool may hold none)."""
        return {name: getattr(self, name) for name in self.encoder_names if hasattr(self, name)}

    def cost_model(self) -> CostModel:
        """The cost model of these components (adapters included) in training FLOPs, e.g. for
        ``OmniDataModule(cost_model=...)``, which otherwise prices samples by the reference model's config.

        A module's FLOPs count the backward that runs given what of the model trains (:meth:`training_passes`): a
        frozen encoder costs its forward alone."""
        passes = self.training_passes()
        costs = {name: encoder.cost() for name, encoder in self.encoders.items()} | {"llm": self.llm.cost()}
        return CostModel(**{name: cost.scaled(passes[name] / TRAIN) for name, cost in costs.items()})

    def training_passes(self) -> dict[str, float]:
        """Each encoder's and the ``"llm"``'s training time over its forward's, from its parameters that train
        (:func:`~omni_lightning.balance.calibration.training_passes`): 3 where everything trains. An encoder's inputs
        are data; the LLM's need the gradient wherever an encoder (or its projector) trains."""
        def parameters(module: nn.Module) -> list[tuple[int, bool]]:
            idle = {id(p) for p in (module.idle_parameters() if hasattr(module, "idle_parameters") else ())}
            return [(p.numel(), p.requires_grad) for p in module.parameters() if id(p) not in idle]

        encoders = self.encoders
        passes = {name: training_passes(parameters(encoder), inputs_need_gradient=False)
                  for name, encoder in encoders.items()}
        encoders_train = any(trains for encoder in encoders.values() for _, trains in parameters(encoder))
        return passes | {"llm": training_passes(parameters(self.llm), inputs_need_gradient=encoders_train)}

    def encoder_inputs(self, batch: PackedBatch, name: str) -> tuple[torch.Tensor, ...]:
        """Encoder ``name``'s inputs in ``batch``, in its format's order."""
        return tuple(batch[input_key(name, i)] for i in self.packing.encoder(name).input_names)

    def encoder_stage(self, run: Callable[[], dict[str, tuple[torch.Tensor, ...]]]
                      ) -> dict[str, tuple[torch.Tensor, ...]]:
        """Run an encoder stage (the runtime's ``run``: plan, move, encode, move back) as part of this model: the
        parallelize plan hooks this method, so that what the model's own FSDP unit holds (the encoders' stems and
        projectors) is gathered while it runs, and stays gathered for the forward and the backward."""
        return run()

    def encode(self, batch: PackedBatch) -> dict[str, tuple[torch.Tensor, ...]]:
        """Every encoder's outputs of ``batch``'s items, all encoded here (no resharding), in placeholder order.

        An encoder without items runs a dummy one whose (empty) output still joins the graph, so that every rank
        issues the same FSDP collectives whatever its data.
        """
        encoded = {}
        for name, encoder in self.encoders.items():
            inputs = self.encoder_inputs(batch, name)
            if encoder.item_tokens(*inputs).numel():
                encoded[name] = (encoder(*inputs),)
            else:
                encoded[name] = (encoder(*encoder.dummy_inputs(inputs[0].device))[:0],)
        return encoded

    def forward(self, batch: PackedBatch, encoded: Encoded | None = None) -> torch.Tensor:
        """Logits of ``batch``, its placeholders taking ``encoded`` (:meth:`encode` of it when ``None``)."""
        encoded = self.encode(batch) if encoded is None else encoded
        embeddings, positions = self.embed(batch, encoded), self.positions(batch)
        deepstack = self.deepstack(batch, encoded)
        shard = shard_for_context_parallel(batch["cu_seqlens"], self.groups.cp) if self.groups.cp is not None else None
        if shard is not None:
            local = shard.local_index
            embeddings, positions = embeddings[local], positions[..., local]
            deepstack = deepstack[:, local] if deepstack is not None else None
        if deepstack is None:
            return self.llm(embeddings, positions, batch["cu_seqlens"], shard)
        hidden = self.llm.run_layers(embeddings, positions, batch["cu_seqlens"], self.llm.layers.items(), shard,
                                     deepstack)
        return self.llm.head_logits(hidden)

    def positions(self, batch: PackedBatch) -> torch.Tensor:
        """The LLM's rotary positions of ``batch``: its own (e.g. Qwen2-VL's multimodal ``[3, tokens]``) where it
        computes them, else the text positions restarting per sample."""
        own = getattr(self.llm, "rope_positions", None)
        return batch["position_ids"] if own is None else own(batch, self.packing)

    def embed(self, batch: PackedBatch, encoded: Encoded) -> torch.Tensor:
        """Token embeddings with every placeholder replaced by its encoder's output (laid out media item by media item
        first, where the model assembles that encoder's outputs): the decoder's input."""
        input_ids = batch["input_ids"]
        embeddings = self.llm.embed_tokens(input_ids)
        rows, values = [], []
        for name in self.encoder_names:
            if name not in encoded:
                raise ValueError(f"no outputs of the {name} encoder for this micro-batch (got {sorted(encoded)})")
            output = encoded[name][0]
            if name in self.assembly:  # the model lays the item outputs out per media item (LLaVA-OneVision)
                output = self.assembly[name](output, batch[media_key(name)])
            where = self._placeholders(input_ids, name)
            rows.append(_placeholder_rows(where, output, embeddings.shape[-1] * (1 + self.deepstack_layers(name)),
                                          name))
            values.append(output[:, : embeddings.shape[-1]].to(embeddings.dtype))
        # One copy for all, even with no placeholders: an empty output still carries its encoder's (zero) gradients
        # back. Row indices rather than masked_scatter, whose walk over every element of the mask cost as much as a
        # tenth of a decoder layer on CPU.
        return embeddings.index_copy(0, torch.cat(rows), torch.cat(values))

    def output_width(self, name: str) -> int:
        """The width of encoder ``name``'s output rows: the LLM's, once for its main output and once more per
        DeepStack layer."""
        return self.config.llm.dim * (1 + self.deepstack_depths[name])

    def deepstack_layers(self, name: str) -> int:
        """How many of the first decoder layers take features of encoder ``name`` (each a further ``dim`` columns of
        its outputs)."""
        return self.deepstack_depths[name]

    def deepstack(self, batch: PackedBatch, encoded: Encoded) -> torch.Tensor | None:
        """``[n, tokens, dim]``: the features each encoder injects after each of the first ``n`` decoder layers, at its
        placeholders (zeros elsewhere); ``None`` when no encoder injects any (Qwen3-VL's DeepStack)."""
        depth = max((self.deepstack_layers(name) for name in self.encoder_names), default=0)
        if not depth:
            return None
        input_ids = batch["input_ids"]
        dim = self.config.llm.dim
        features = None
        for name in self.encoder_names:
            layers = self.deepstack_layers(name)
            if not layers:
                continue
            rows = self._placeholders(input_ids, name).nonzero().squeeze(1)
            extra = encoded[name][0][:, dim:].unflatten(1, (layers, dim)).transpose(0, 1)
            if layers < depth:
                extra = torch.cat([extra, extra.new_zeros(depth - layers, *extra.shape[1:])])
            dense = extra.new_zeros(depth, input_ids.numel(), dim).index_copy(1, rows, extra)
            features = dense if features is None else features + dense
        return features

    def _placeholders(self, input_ids: torch.Tensor, name: str) -> torch.Tensor:
        return torch.isin(input_ids, to_device(self.packing.placeholder_ids(name), input_ids.device))

    def local_labels(self, batch: PackedBatch) -> torch.Tensor:
        """The labels of the tokens this rank's logits cover (all of them unless context parallelism is on)."""
        if self.groups.cp is None:
            return batch["labels"]
        return batch["labels"][shard_for_context_parallel(batch["cu_seqlens"], self.groups.cp).local_index]


def _placeholder_rows(where: torch.Tensor, values: torch.Tensor, width: int, what: str) -> torch.Tensor:
    """The token rows that take ``values`` (the outputs of one encoder), checked against them."""
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
