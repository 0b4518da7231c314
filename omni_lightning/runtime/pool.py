"""The disaggregated placement at run time: encoder outputs stream from the encoder pool to the LLM pool.

See :mod:`omni_lightning.parallel.placement` for who serves whom. A training step of ``n`` micro-batches runs, on
every rank of both pools, as:

* **LLM data-parallel leader** (the first LLM rank of a data-parallel rank): at the start of the step it sends, for
  every micro-batch, each serving encoder rank the inputs of the items it is to encode (image grids and clip lengths,
  then patches, patch positions and mel frames), all at once and asynchronously; the items of a micro-batch are
  shared among the serving ranks by predicted cost (:func:`share_items`).
* **Encoder rank**: receives micro-batch ``j``'s items from every LLM data-parallel rank it serves, encodes them
  all in one pass per encoder (evened out over the pool by the encoder balancer), sends each LLM rank its outputs,
  then runs the backward of ``j - 1`` once its gradients are back. So the encoder forward of ``j + 1`` overlaps the
  LLM's forward and backward of ``j``, and at most two micro-batches' encoder activations are alive (without a
  pipeline; see below).
* **LLM ranks that embed** (the first pipeline stage's: the leader and its TP and CP peers): receive micro-batch
  ``j``'s outputs, put them in item order as leaves of the embedding, run the LLM's forward and backward (alone, or
  inside a pipeline schedule), and as soon as the backward has produced the leaves' gradients (an autograd hook) the
  leader sends them back: summed over CP peers (each holds its share of the tokens), scaled so the encoder pool's
  averaging FSDP reduction yields the gradient of the global loss (see :meth:`EncoderPoolLink.send_gradients`).

With a pipeline, stage 0 runs ``p`` forwards of 1F1B before its first backward, so the encoder rank runs the backward
of ``j - p`` after the forward of ``j`` (``lag``; after every forward under GPipe) and holds at most ``p + 1``
micro-batches' activations.

Every transfer is point to point on a process group of its own, so it never meets the pools' collectives, and every
encoder rank runs every encoder on every micro-batch (a dummy item where it has none), so the encoder pool's FSDP
collectives line up whatever the data.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from omni_lightning.balance.cost import ModuleCost
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.parallel.placement import PoolLayout
from omni_lightning.runtime.joint import share_items

__all__ = ["EncoderPoolLink", "EncoderPoolWorker", "item_owners", "arrival_order"]

_COUNTS, _SHAPES, _PATCHES, _POSITIONS, _MELS, _VISION_OUT, _AUDIO_OUT, _VISION_GRAD, _AUDIO_GRAD = range(9)
_KINDS = 9


def _tag(micro_batch: int, kind: int) -> int:
    return micro_batch * _KINDS + kind


def item_owners(batch: dict[str, Any], config: ReferenceMLLMConfig, costs: dict[str, ModuleCost],
                n_servers: int) -> tuple[np.ndarray, np.ndarray]:
    """Which serving encoder rank (by position in :meth:`PoolLayout.serving`) encodes each vision item and each
    audio clip of a micro-batch (pure): longest first onto the least-loaded server, the same on every LLM rank."""
    grids = batch["vision_grids"].cpu().numpy().reshape(-1, 2)
    clip_tokens = batch["audio_lengths"].cpu().numpy() // config.audio.downsample
    loads = np.zeros(n_servers)
    vision = share_items(grids.prod(1) if len(grids) else np.zeros(0), costs["vision"], loads)
    audio = share_items(clip_tokens, costs["audio"], loads)
    return vision, audio


def arrival_order(rows: np.ndarray, owner: np.ndarray, n_servers: int) -> np.ndarray:
    """Row index that turns outputs received server by server (each server's items in order) into item order."""
    rows = np.asarray(rows, dtype=np.int64)
    arrival = np.concatenate([np.flatnonzero(owner == s) for s in range(n_servers)]).astype(np.int64)
    start = np.zeros(len(rows), dtype=np.int64)
    start[arrival] = np.concatenate([[0], np.cumsum(rows[arrival])[:-1]]) if len(arrival) else []
    pieces = [np.arange(start[i], start[i] + rows[i]) for i in range(len(rows))]
    return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)


def _output_rows(batch: dict[str, Any], config: ReferenceMLLMConfig) -> tuple[np.ndarray, np.ndarray]:
    """Embeddings each vision item and audio clip of a micro-batch produce (placeholder tokens)."""
    grids = batch["vision_grids"].cpu().numpy().reshape(-1, 2)
    return grids.prod(1) // config.vision.merge, batch["audio_lengths"].cpu().numpy() // config.audio.downsample


class EncoderPoolLink:
    """The LLM side: sends items to the encoder pool and feeds its outputs to the embedding (see module docstring).

    Args:
        layout: both pools' ranks.
        group: a process group over the whole world, for these transfers only.
        config: the model's configuration (item sizes, output widths).
        costs: the encoders' cost models, to share a micro-batch's items among serving ranks.
        dtype: dtype of the encoder outputs.
        cp_group: this rank's CP peers, whose output gradients are summed (``None`` without CP).
        gradient_scale: factor applied to the outputs' gradients before they travel (see :meth:`send_gradients`).
    """

    def __init__(self, layout: PoolLayout, group: dist.ProcessGroup, config: ReferenceMLLMConfig,
                 costs: dict[str, ModuleCost], *, dtype: torch.dtype, cp_group: dist.ProcessGroup | None,
                 gradient_scale: float) -> None:
        rank = dist.get_rank()
        self.layout, self.group, self.config, self.costs, self.dtype = layout, group, config, costs, dtype
        self.cp_group, self.gradient_scale = cp_group, gradient_scale
        dp_rank = layout.dp_rank_of(rank)
        self.servers = layout.serving(dp_rank)
        self.is_leader = layout.consumers(dp_rank)[0] == rank
        self._plans: list[dict[str, Any]] = []
        self._sends: list[dist.Work] = []
        self._leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def start(self, micro_batches: list[dict[str, Any]], *, train: bool) -> None:
        """Before the first micro-batch: the leader sends every micro-batch's items; every rank posts receives."""
        self.train = train
        self._plans = []
        width = self.config.llm.dim
        for m, batch in enumerate(micro_batches):
            owners = item_owners(batch, self.config, self.costs, len(self.servers))
            rows = _output_rows(batch, self.config)
            device = batch["input_ids"].device
            incoming = []
            for modality, kind in ((0, _VISION_OUT), (1, _AUDIO_OUT)):
                buffers = [torch.empty(int(rows[modality][owners[modality] == s].sum()), width, dtype=self.dtype,
                                       device=device) for s in range(len(self.servers))]
                works = [self._irecv(buffer, server, _tag(m, kind))
                         for buffer, server in zip(buffers, self.servers, strict=True) if buffer.shape[0]]
                incoming.append((buffers, works))
            self._plans.append({"owners": owners, "rows": rows, "incoming": incoming})
            if self.is_leader:
                for s, server in enumerate(self.servers):
                    self._send_items(batch, m, server, owners[0] == s, owners[1] == s)

    def outputs(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``m``'s vision and audio outputs in item order, as leaves that collect their gradients."""
        plan, leaves = self._plans[m], []
        for modality in (0, 1):
            buffers, works = plan["incoming"][modality]
            for work in works:
                work.wait()
            order = arrival_order(plan["rows"][modality], plan["owners"][modality], len(self.servers))
            leaf = torch.cat(buffers)[torch.as_tensor(order, device=buffers[0].device)].requires_grad_(self.train)
            if self.train:
                leaf.register_post_accumulate_grad_hook(lambda _, m=m: self._gradient_ready(m))
            leaves.append(leaf)
        self._leaves[m] = (leaves[0], leaves[1])
        return self._leaves[m]

    def before_forward(self, m: int) -> None:
        """Nothing to do before a stage's forward: the outputs are already on their way (pipeline interface)."""

    def sync_gradients(self) -> None:
        """Nothing to reduce here: the encoder pool owns the encoders' gradients (pipeline interface)."""

    def _gradient_ready(self, m: int) -> None:
        """Autograd hook: once the backward has produced every output gradient of ``m``, send them at once."""
        if m in self._leaves and all(leaf.grad is not None or not leaf.numel() for leaf in self._leaves[m]):
            self.send_gradients(m)

    def send_gradients(self, m: int) -> None:
        """After the LLM's backward of ``m``: the leader sends each server the gradients of its outputs.

        The LLM's loss is scaled by its data-parallel size (its FSDP averages over those ranks), and the encoder
        pool's FSDP averages over the encoder ranks, so the gradients travel times ``gradient_scale`` = encoder
        FSDP size / LLM data-parallel size: the encoders' averaged gradients are then those of the global loss.
        """
        plan = self._plans[m]
        for modality, kind in ((0, _VISION_GRAD), (1, _AUDIO_GRAD)):
            leaf = self._leaves[m][modality]
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            if self.cp_group is not None:  # each CP peer's loss covers its share of the tokens
                dist.all_reduce(grad, group=self.cp_group)
            if not self.is_leader:
                continue
            owner, rows = plan["owners"][modality], plan["rows"][modality]
            order = arrival_order(rows, owner, len(self.servers))
            by_arrival = torch.empty_like(grad)
            by_arrival[torch.as_tensor(order, device=grad.device)] = grad * self.gradient_scale
            sizes = [int(rows[owner == s].sum()) for s in range(len(self.servers))]
            for piece, server in zip(by_arrival.split(sizes), self.servers, strict=True):
                if piece.shape[0]:
                    self._sends.append(dist.isend(piece.contiguous(), dst=server, group=self.group,
                                                  tag=_tag(m, kind)))
        del self._leaves[m]

    def finish(self) -> None:
        """After the last micro-batch: send what no hook sent (outputs without items), then wait until every
        transfer of the step has left."""
        if self.train:
            for m in sorted(self._leaves):
                self.send_gradients(m)
        for work in self._sends:
            work.wait()
        self._sends.clear()
        self._leaves.clear()
        self._plans = []

    def _send_items(self, batch: dict[str, Any], m: int, server: int, vision: np.ndarray, audio: np.ndarray) -> None:
        grids = batch["vision_grids"].reshape(-1, 2)
        lengths = batch["audio_lengths"]
        vision_items, audio_items = np.flatnonzero(vision), np.flatnonzero(audio)
        device = grids.device  # every transfer on the device: NCCL moves device tensors only
        counts = torch.tensor([len(vision_items), len(audio_items)], dtype=torch.int64, device=device)
        shapes = torch.cat([grids[torch.as_tensor(vision_items, dtype=torch.long, device=device)].reshape(-1),
                            lengths[torch.as_tensor(audio_items, dtype=torch.long, device=device)]]).to(torch.int64)
        self._isend(counts, server, _tag(m, _COUNTS))
        if shapes.numel():
            self._isend(shapes, server, _tag(m, _SHAPES))
        patch_rows = _rows_of(grids.prod(1), vision_items).to(device)
        if patch_rows.numel():
            self._isend(batch["vision_patches"][patch_rows], server, _tag(m, _PATCHES))
            self._isend(batch["vision_positions"][patch_rows], server, _tag(m, _POSITIONS))
        frame_rows = _rows_of(lengths, audio_items).to(device)
        if frame_rows.numel():
            self._isend(batch["audio_mels"][frame_rows], server, _tag(m, _MELS))

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._sends.append(dist.isend(tensor.contiguous(), dst=dst, group=self.group, tag=tag))

    def _irecv(self, buffer: torch.Tensor, src: int, tag: int) -> dist.Work:
        return dist.irecv(buffer, src=src, group=self.group, tag=tag)


def _rows_of(sizes: torch.Tensor, items: np.ndarray) -> torch.Tensor:
    """Row indices of ``items`` in a tensor holding every item's ``sizes[i]`` rows back to back."""
    starts = np.concatenate([[0], np.cumsum(sizes.cpu().numpy())]).astype(np.int64)
    pieces = [np.arange(starts[i], starts[i + 1]) for i in items.tolist()]
    return torch.as_tensor(np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64), dtype=torch.long)


class EncoderPoolWorker:
    """The encoder side: encodes the items the LLM pool sends, a micro-batch at a time (see module docstring).

    Args:
        layout: both pools' ranks.
        group: the same world-wide transfer group as the LLM side's.
        model: the MLLM pruned to its encoders; ``model.encode_items(batch)`` encodes a packed batch of items.
        config: the model's configuration.
        device: where the inputs go.
        dtype: dtype of the outputs sent.
    """

    def __init__(self, layout: PoolLayout, group: dist.ProcessGroup, model: torch.nn.Module,
                 config: ReferenceMLLMConfig, *, device: torch.device, dtype: torch.dtype) -> None:
        rank = dist.get_rank()
        self.layout, self.group, self.model, self.config = layout, group, model, config
        self.device, self.dtype = device, dtype
        self.clients = layout.served_by(rank)  # LLM data-parallel ranks, in the order outputs are concatenated
        self.consumers = [layout.consumers(d) for d in self.clients]
        self.leaders = [consumers[0] for consumers in self.consumers]
        self.rank = rank
        self.peak_in_flight = 0

    def step(self, n_microbatches: int, *, train: bool, lag: int = 1) -> None:
        """Encode ``n_microbatches`` micro-batches as they arrive; the backward of each ``lag`` micro-batches later,
        once its gradients are back (1 without a pipeline, ``pp`` under 1F1B, every micro-batch under GPipe)."""
        in_flight: dict[int, tuple[torch.Tensor, torch.Tensor, list[list[int]]]] = {}
        sends: list[dist.Work] = []
        self.peak_in_flight = 0
        for m in range(n_microbatches):
            batch, per_client_rows = self._receive_items(m)
            with torch.set_grad_enabled(train):
                vision, audio = self.model.encode_items(batch)
            for modality, (out, kind) in enumerate(((vision, _VISION_OUT), (audio, _AUDIO_OUT))):
                pieces = out.detach().to(self.dtype).split([rows[modality] for rows in per_client_rows])
                for consumers, piece in zip(self.consumers, pieces, strict=True):
                    if piece.shape[0]:
                        sends += [dist.isend(piece.contiguous(), dst=consumer, group=self.group, tag=_tag(m, kind))
                                  for consumer in consumers]
            if train:
                in_flight[m] = (vision, audio, per_client_rows)
                self.peak_in_flight = max(self.peak_in_flight, len(in_flight))
                if m >= lag:
                    self._backward(m - lag, *in_flight.pop(m - lag))
        for m in sorted(in_flight):
            self._backward(m, *in_flight.pop(m))
        for work in sends:
            work.wait()

    def _receive_items(self, m: int) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        """Micro-batch ``m``'s items from every client, packed client after client, and each client's output rows."""
        vision, audio = self.config.vision, self.config.audio
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("grids", "lengths", "patches", "positions", "mels")}
        per_client_rows = []
        device = self.device
        for leader in self.leaders:
            counts = torch.empty(2, dtype=torch.int64, device=device)
            dist.recv(counts, src=leader, group=self.group, tag=_tag(m, _COUNTS))
            n_vision, n_audio = counts.tolist()
            shapes = torch.empty(2 * n_vision + n_audio, dtype=torch.int64, device=device)
            if shapes.numel():
                dist.recv(shapes, src=leader, group=self.group, tag=_tag(m, _SHAPES))
            grids, lengths = shapes[: 2 * n_vision].view(-1, 2), shapes[2 * n_vision:]
            patch_rows, frame_rows = int(grids.prod(1).sum()), int(lengths.sum())
            patches = torch.empty(patch_rows, vision.patch_dim, device=device)
            positions = torch.empty(patch_rows, 2, dtype=torch.long, device=device)
            mels = torch.empty(frame_rows, audio.n_mels, device=device)
            if patch_rows:
                dist.recv(patches, src=leader, group=self.group, tag=_tag(m, _PATCHES))
                dist.recv(positions, src=leader, group=self.group, tag=_tag(m, _POSITIONS))
            if frame_rows:
                dist.recv(mels, src=leader, group=self.group, tag=_tag(m, _MELS))
            for key, value in (("grids", grids), ("lengths", lengths), ("patches", patches),
                               ("positions", positions), ("mels", mels)):
                parts[key].append(value)
            per_client_rows.append([int(grids.prod(1).sum()) // vision.merge, frame_rows // audio.downsample])
        batch = {"vision_grids": torch.cat(parts["grids"]), "audio_lengths": torch.cat(parts["lengths"]),
                 "vision_patches": torch.cat(parts["patches"]), "vision_positions": torch.cat(parts["positions"]),
                 "audio_mels": torch.cat(parts["mels"])}
        return batch, per_client_rows

    def _backward(self, m: int, vision: torch.Tensor, audio: torch.Tensor, per_client_rows: list[list[int]]) -> None:
        grads = []
        for modality, (out, kind) in enumerate(((vision, _VISION_GRAD), (audio, _AUDIO_GRAD))):
            pieces = []
            for leader, rows in zip(self.leaders, per_client_rows, strict=True):
                piece = torch.empty(rows[modality], out.shape[1], dtype=self.dtype, device=out.device)
                if piece.shape[0]:
                    dist.recv(piece, src=leader, group=self.group, tag=_tag(m, kind))
                pieces.append(piece)
            grads.append(torch.cat(pieces).to(out.dtype))
        # Outputs of no item still carry their dummy encoder pass: an empty gradient keeps the FSDP hooks in line.
        torch.autograd.backward([vision, audio], grads)
