"""Encoder items inside packed batches: their sizes, selecting some of them, cutting a batch into micro-batches.

Every encoder's inputs sit in a packed batch item after item (:mod:`omni_lightning.batch`), each input with one row
per item or a fixed number per stem token; these helpers find each item's rows from the small per-item inputs alone,
so no pixel leaves the device to be counted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from omni_lightning.batch import IGNORE_INDEX, PackedBatch, PackingSpec, input_key, media_key
from omni_lightning.parallel.attention import host_bounds
from omni_lightning.parallel.transfer import to_device

__all__ = ["filler_batch", "item_layout", "select_items", "split_micro_batches"]


def item_layout(batch: PackedBatch, spec: PackingSpec, encoder: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """``encoder``'s items in ``batch``: the stem tokens of each, and for every input the rows each takes."""
    fmt = spec.encoder(encoder)
    per_item = {name: batch[input_key(encoder, name)].cpu().numpy() for name in fmt.per_item_names}
    return np.asarray(fmt.item_tokens(per_item, spec), dtype=np.int64), fmt.item_rows(per_item, spec)


def select_items(inputs: tuple[torch.Tensor, ...], rows: list[np.ndarray], items: np.ndarray
                 ) -> tuple[torch.Tensor, ...]:
    """The inputs of ``items`` (indices, in the order given) out of packed ``inputs`` whose items take ``rows``."""
    picked = []
    for tensor, item_rows in zip(inputs, rows, strict=True):
        starts = np.concatenate([[0], np.cumsum(item_rows)]).astype(np.int64)
        pieces = [np.arange(starts[i], starts[i + 1]) for i in np.asarray(items, dtype=np.int64).tolist()]
        index = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        picked.append(tensor[to_device(index, tensor.device)])
    return tuple(picked)


def filler_batch(spec: PackingSpec, device: torch.device) -> PackedBatch:
    """A micro-batch of one filler token and no loss, for a step with fewer samples than micro-batches."""
    batch: PackedBatch = {
        "input_ids": to_device([spec.roles.filler], device),
        "labels": to_device([IGNORE_INDEX], device),
        "position_ids": torch.zeros(1, dtype=torch.long, device=device),
        "cu_seqlens": to_device([0, 1], device, torch.int32),
        "keys": [], "num_samples": 0,
    }
    for fmt in spec.encoders:
        for name, empty in zip(fmt.input_names, fmt.empty(spec), strict=True):
            batch[input_key(fmt.name, name)] = to_device(empty, device)
    batch.update({media_key(name): [] for name in spec.assembled_encoders})
    return batch


def _placeholders_per_sample(batch: PackedBatch, spec: PackingSpec) -> dict[str, list[int]]:
    """Each encoder's placeholder tokens in each sample of ``batch``, from one read of the device for all of them
    (not one a sample: on an accelerator each read waits for the work queued before it)."""
    ids, names = batch["input_ids"], [fmt.name for fmt in spec.encoders]
    if not names:
        return {}
    bounds = batch["cu_seqlens"].long()
    start = torch.zeros(1, dtype=torch.int64, device=ids.device)
    counts = []
    for name in names:
        wanted = to_device(spec.placeholder_ids(name), ids.device)
        counts.append(torch.cat([start, torch.isin(ids, wanted).cumsum(0)])[bounds].diff())
    return dict(zip(names, torch.stack(counts).tolist(), strict=True))


def split_micro_batches(batch: PackedBatch, n: int, spec: PackingSpec) -> list[PackedBatch]:
    """Cut one packed batch into ``n`` packed micro-batches of whole samples, contiguous and even by tokens (a
    micro-batch no sample falls in is a :func:`filler_batch`)."""
    cu = list(host_bounds(batch["cu_seqlens"]))
    ids = batch["input_ids"]
    placeholders = _placeholders_per_sample(batch, spec)
    # Each encoder's items of each sample, in packing order: a sample's placeholders consume its items' outputs (or,
    # where the model assembles them, its media items' assembled tokens).
    item_bounds, media_bounds, layouts = {}, {}, {}
    by_name = {m.name: m for m in spec.modalities}
    for fmt in spec.encoders:
        tokens, rows = item_layout(batch, spec, fmt.name)
        if fmt.name in spec.assembled_encoders:  # (items, placeholders) of each media item
            units = [(len(by_name[m].item_tokens(shape, spec)), spec.media_placeholders(by_name[m], shape))
                     for m, shape in batch[media_key(fmt.name)]]
        else:
            units = [(1, int(n)) for n in tokens // fmt.tokens_per_output(spec)]
        items, units_taken, unit = [0], [0], 0
        for remaining in placeholders[fmt.name]:
            taken = 0
            while remaining > 0:
                remaining -= units[unit][1]
                taken += units[unit][0]
                unit += 1
            items.append(items[-1] + taken)
            units_taken.append(unit)
        item_bounds[fmt.name], media_bounds[fmt.name] = items, units_taken
        layouts[fmt.name] = [np.concatenate([[0], np.cumsum(r)]).astype(np.int64).tolist() for r in rows]
    # Even by tokens: sample s goes to the group its token midpoint falls in.
    midpoints = [(a + b) / 2 / max(cu[-1], 1) for a, b in zip(cu[:-1], cu[1:], strict=True)]
    groups = [[s for s in range(len(cu) - 1) if min(int(midpoints[s] * n), n - 1) == g] for g in range(n)]
    out = []
    for group in groups:
        if not group:
            out.append(filler_batch(spec, ids.device))
            continue
        first, last = group[0], group[-1]
        tokens = slice(cu[first], cu[last + 1])
        micro: dict[str, Any] = {
            "input_ids": ids[tokens], "labels": batch["labels"][tokens], "position_ids": batch["position_ids"][tokens],
            "cu_seqlens": (batch["cu_seqlens"][first : last + 2] - cu[first]).to(torch.int32),
            "keys": list(batch.get("keys", []))[first : last + 1], "num_samples": len(group),
        }
        for fmt in spec.encoders:
            start, stop = item_bounds[fmt.name][first], item_bounds[fmt.name][last + 1]
            for name, bounds in zip(fmt.input_names, layouts[fmt.name], strict=True):
                micro[input_key(fmt.name, name)] = batch[input_key(fmt.name, name)][bounds[start] : bounds[stop]]
            if fmt.name in spec.assembled_encoders:
                start, stop = media_bounds[fmt.name][first], media_bounds[fmt.name][last + 1]
                micro[media_key(fmt.name)] = batch[media_key(fmt.name)][start:stop]
        out.append(micro)
    return out
