"""Encoder items inside packed batches: their sizes, selecting some of them, cutting a batch into micro-batches.

Every encoder's inputs sit in a packed batch item after item (:mod:`omni_lightning.batch`), each input with one row
per item or a fixed number per stem token; these helpers find each item's rows from the small per-item inputs alone,
so no pixel leaves the device to be counted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from omni_lightning.batch import IGNORE_INDEX, PackedBatch, PackingSpec, input_key

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
        picked.append(tensor[torch.as_tensor(index, device=tensor.device)])
    return tuple(picked)


def filler_batch(spec: PackingSpec, device: torch.device) -> PackedBatch:
    """A micro-batch of one filler token and no loss, for a step with fewer samples than micro-batches."""
    batch: PackedBatch = {
        "input_ids": torch.tensor([spec.roles.filler], device=device),
        "labels": torch.tensor([IGNORE_INDEX], device=device),
        "position_ids": torch.zeros(1, dtype=torch.long, device=device),
        "cu_seqlens": torch.tensor([0, 1], dtype=torch.int32, device=device),
        "keys": [], "num_samples": 0,
    }
    for fmt in spec.encoders:
        for name, empty in zip(fmt.input_names, fmt.empty(spec), strict=True):
            batch[input_key(fmt.name, name)] = torch.from_numpy(empty).to(device)
    return batch


def split_micro_batches(batch: PackedBatch, n: int, spec: PackingSpec) -> list[PackedBatch]:
    """Cut one packed batch into ``n`` packed micro-batches of whole samples, contiguous and even by tokens (a
    micro-batch no sample falls in is a :func:`filler_batch`)."""
    cu = batch["cu_seqlens"].long().tolist()
    ids = batch["input_ids"]
    # Each encoder's items of each sample, in packing order: a sample's placeholders consume its items' outputs.
    item_bounds, layouts = {}, {}
    for fmt in spec.encoders:
        tokens, rows = item_layout(batch, spec, fmt.name)
        outputs = (tokens // fmt.tokens_per_output(spec)).tolist()
        placeholder = torch.isin(ids, torch.tensor(spec.placeholder_ids(fmt.name), device=ids.device))
        bounds, item = [0], 0
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            remaining = int(placeholder[a:b].sum())
            while remaining > 0:
                remaining -= outputs[item]
                item += 1
            bounds.append(item)
        item_bounds[fmt.name] = bounds
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
        out.append(micro)
    return out
