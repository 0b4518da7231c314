"""Samples for simulated steps: a priced pool per modality, and each data-parallel rank's reads of a step.

Drawing millions of samples one by one with ``sample_metadata`` is too slow for thousands of GPUs, so each modality
gets a pool of samples drawn once (cut to the micro-batch length, as the loader's ``max_llm_tokens`` policy does)
and priced with the cost model; steps then pick from the pools. Every encoder item is kept: each image, each video
frame (frames are separate attention items, so a long video spreads over ranks frame by frame) and each audio clip.

A step's modality mix is the spec's weights, or, with ``concentration``, drawn per step from a Dirichlet
distribution around them (mean the spec's weights; smaller concentration, larger swings): the shifting mix that a
statically sized encoder pool cannot follow. Each rank reads samples in arrival order and packs them first-fit
into ``micro_batches`` sequences of ``seq_len`` tokens, starting a new one when a sample does not fit: what a plain
data loader with sequence packing hands the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from omni_lightning.balance.cost import CostModel, meta_llm_tokens
from omni_lightning.balance.workload import WorkloadSpec, sample_metadata
from omni_lightning.batch import PackingSpec
from omni_lightning.modalities import DEFAULT_PACKING

__all__ = ["SamplePool", "StepDraw", "draw_step"]


@dataclass
class SamplePool:
    """Priced samples of every modality of a workload, and their encoder items.

    Per sample: ``llm`` and ``encoder`` cost (FLOPs), ``tokens`` (LLM); per item: ``item_sample`` (the sample it
    belongs to), ``item_cost``, ``item_tokens`` (encoder tokens), ``item_llm_tokens`` (what it becomes in the LLM),
    ``item_encoder`` (the encoder that encodes it, a position in ``encoder_names``, the packing's encoders).
    ``by_modality`` lists the sample indices of each modality, in the spec's order.
    """

    llm: np.ndarray
    encoder: np.ndarray
    tokens: np.ndarray
    item_sample: np.ndarray
    item_cost: np.ndarray
    item_tokens: np.ndarray
    item_llm_tokens: np.ndarray
    item_encoder: np.ndarray
    encoder_names: tuple[str, ...]
    by_modality: list[np.ndarray]
    weights: np.ndarray

    @classmethod
    def build(cls, spec: WorkloadSpec, cost_model: CostModel, *, seq_len: int, per_modality: int = 2048,
              seed: int = 0, packing: PackingSpec = DEFAULT_PACKING) -> SamplePool:
        """Draw ``per_modality`` samples of each modality of ``spec``, cut to ``seq_len`` LLM tokens; ``packing``
        (the model's) cuts media into encoder items."""
        rng = np.random.default_rng(seed)
        metas = []
        by_modality = []
        for name, modality in spec.modalities.items():
            alone = replace(spec, modalities={name: replace(modality, weight=1.0)})
            start = len(metas)
            metas.extend(sample_metadata(alone, rng, max_llm_tokens=seq_len) for _ in range(per_modality))
            by_modality.append(np.arange(start, len(metas)))
        costs = cost_model.costs(metas, packing)
        item_sample, item_cost, item_tokens, item_llm, item_encoder = [], [], [], [], []
        for index, meta in enumerate(metas):
            for name, shapes in meta.media_shapes().items():  # every encoder item, by its modality's rule
                modality = packing.modality(name)
                cost = cost_model.module(modality.encoder)
                encoder = packing.encoder_names.index(modality.encoder)
                for shape in shapes:
                    sizes = modality.item_tokens(shape, packing)
                    for n, llm in zip(sizes, _llm_tokens(name, shape, meta.merge_dict, len(sizes)), strict=True):
                        item_sample.append(index)
                        item_cost.append(cost(n, n * n))
                        item_tokens.append(n)
                        item_llm.append(llm)
                        item_encoder.append(encoder)
        order = np.argsort(np.asarray(item_sample, dtype=np.int64), kind="stable")
        return cls(
            llm=costs[:, -1].copy(),
            encoder=costs[:, :-1].sum(axis=1),
            tokens=np.array([meta_llm_tokens(m, packing) for m in metas], dtype=np.int64),
            item_sample=np.asarray(item_sample, dtype=np.int64)[order],
            item_cost=np.asarray(item_cost, dtype=np.float64)[order],
            item_tokens=np.asarray(item_tokens, dtype=np.float64)[order],
            item_llm_tokens=np.asarray(item_llm, dtype=np.float64)[order],
            item_encoder=np.asarray(item_encoder, dtype=np.int64)[order],
            encoder_names=packing.encoder_names,
            by_modality=by_modality,
            weights=np.array([m.weight for m in spec.modalities.values()]),
        )

    def items_of(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Item indices of ``samples`` (pool indices), and for each item its position in ``samples``."""
        starts = np.searchsorted(self.item_sample, samples, side="left")
        ends = np.searchsorted(self.item_sample, samples, side="right")
        counts = ends - starts
        position = np.repeat(np.arange(samples.size), counts)
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        return np.repeat(starts, counts) + offsets, position


def _llm_tokens(modality: str, shape: tuple[int, ...], merge: dict[str, int], items: int) -> list[int]:
    """What each of the ``items`` encoder items of a media item of ``shape`` becomes in the LLM, by the workload's
    merge factors (as :func:`~omni_lightning.balance.cost.meta_llm_tokens` counts)."""
    if modality == "audio":
        return [shape[0] // merge["audio"]]
    return [shape[-2] * shape[-1] // merge[modality]] * items


@dataclass
class StepDraw:
    """What every data-parallel rank read in one step: ``samples[r]`` (pool indices, arrival order) and its
    first-fit packing ``micro_batches[r][j]`` (positions into ``samples[r]``)."""

    samples: list[np.ndarray]
    micro_batches: list[list[list[int]]]


def draw_step(pool: SamplePool, *, ranks: int, micro_batches: int, seq_len: int, rng: np.random.Generator,
              concentration: float | None) -> StepDraw:
    """Each of ``ranks`` ranks reads samples until ``micro_batches`` packed sequences are full (module docstring).

    ``rng`` draws the step's mix first, then each rank's reads in rank order: the first ranks read the same samples
    whatever ``ranks`` is."""
    weights = pool.weights if not concentration else rng.dirichlet(concentration * pool.weights)
    mean_tokens = float(sum(w * pool.tokens[ix].mean() for w, ix in zip(weights, pool.by_modality, strict=True)))
    chunk = int(2 * micro_batches * seq_len / max(mean_tokens, 1.0)) + 16
    # The pools of all modalities end to end, so that a chunk's picks are one vectorised draw.
    sizes = np.array([ix.size for ix in pool.by_modality], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    by_modality = np.concatenate(pool.by_modality)
    samples, packed = [], []
    for _ in range(ranks):
        read: list[int] = []
        batches: list[list[int]] = [[]]
        used = 0
        while True:
            modality = rng.choice(len(weights), size=chunk, p=weights)
            picks = by_modality[starts[modality] + rng.integers(sizes[modality])].tolist()
            full = False
            for sample in picks:
                tokens = int(pool.tokens[sample])
                if used + tokens > seq_len:
                    if len(batches) == micro_batches:
                        full = True
                        break
                    batches.append([])
                    used = 0
                batches[-1].append(len(read))
                read.append(sample)
                used += tokens
            if full:
                break
        samples.append(np.array(read, dtype=np.int64))
        packed.append(batches)
    return StepDraw(samples, packed)
