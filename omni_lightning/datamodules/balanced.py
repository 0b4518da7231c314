"""The balancing loop of a data-parallel rank: buffer a group of steps, plan with the balance group, exchange, pack.

Runs in the training process (loader workers only read and decode): every ``group_steps`` steps it pulls the
rank's next samples, all-gathers their integer metadata over the balance group, computes the shared plan with
:func:`~omni_lightning.balance.reorder.plan_balance_group`, sends the payloads the plan moves with one
``all_to_all_single``, and then yields that rank's packed micro-batches, step by step.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from omni_lightning.balance.cost import CostModel, feature_matrix
from omni_lightning.balance.reorder import GroupPlan, ReorderConfig, plan_balance_group
from omni_lightning.datamodules.collate import DecodedSample, pack_samples
from omni_lightning.datamodules.streaming import BadSample
from omni_lightning.datamodules.workload import SampleMeta
from omni_lightning.models.config import FIRST_TEXT_ID
from omni_lightning.models.mllm import IGNORE_INDEX

__all__ = ["BalanceSettings", "BalancedStream", "apply_length_policy", "llm_length"]

log = logging.getLogger(__name__)

LengthPolicy = Literal["truncate", "drop", "error"]


@dataclass(frozen=True)
class BalanceSettings:
    """How one rank's loader balances.

    Args:
        samples_per_step: samples each rank reads per step (the group buffer is ``group_steps`` times this).
        group_steps: steps planned together.
        micro_batches: micro-batches per step (gradient accumulation or pipeline micro-batches).
        token_budget: most LLM tokens per micro-batch (``None``: unlimited).
        max_seq_len: longest sample, in LLM tokens (``None``: no limit); longer ones follow ``length_policy``.
        length_policy: ``"truncate"`` cuts text (drops the sample if its media alone are too long), ``"drop"``
            skips it, ``"error"`` raises. Truncations and drops are counted.
        balance: ``False`` keeps every sample on the rank that read it, in arrival order (the naive split).
        pp: pipeline stages; micro-batches are ordered for 1F1B when ``pp > 1``.
    """

    samples_per_step: int
    group_steps: int = 8
    micro_batches: int = 1
    token_budget: int | None = None
    max_seq_len: int | None = None
    length_policy: LengthPolicy = "truncate"
    balance: bool = True
    pp: int = 1

    def __post_init__(self) -> None:
        if self.samples_per_step < 1 or self.group_steps < 1 or self.micro_batches < 1:
            raise ValueError("samples_per_step, group_steps and micro_batches must be at least 1")
        if self.length_policy not in ("truncate", "drop", "error"):
            raise ValueError(f"length_policy={self.length_policy!r} must be 'truncate', 'drop' or 'error'")
        if self.token_budget is not None and self.max_seq_len is not None and self.max_seq_len > self.token_budget:
            raise ValueError(
                f"max_seq_len={self.max_seq_len} exceeds token_budget={self.token_budget}: such a sample could never"
                " be placed; lower max_seq_len or raise the budget"
            )


def llm_length(sample: DecodedSample, pack_kwargs: dict[str, int]) -> int:
    """LLM tokens the sample will occupy once packed (BOS, placeholders, text)."""
    patch, merge = pack_kwargs.get("patch_size", 14), pack_kwargs.get("vision_merge", 4)
    vision = sum((img.shape[0] // patch) * (img.shape[1] // patch) // merge for img in sample.images)
    audio = 0 if sample.mel is None else sample.mel.shape[0] // pack_kwargs.get("audio_downsample", 4)
    return 1 + vision + audio + len(sample.tokens)


def apply_length_policy(
    sample: DecodedSample, max_seq_len: int | None, policy: LengthPolicy, pack_kwargs: dict[str, int]
) -> tuple[DecodedSample | None, str]:
    """``(sample or None, what happened)`` where what happened is ``""``, ``"truncated"`` or ``"dropped"``."""
    length = llm_length(sample, pack_kwargs)
    if max_seq_len is None or length <= max_seq_len:
        return sample, ""
    if policy == "error":
        raise ValueError(f"sample {sample.key}: {length} LLM tokens exceed max_seq_len={max_seq_len}")
    keep_text = len(sample.tokens) - (length - max_seq_len)
    if policy == "drop" or keep_text < 1:
        return None, "dropped"
    meta = {**sample.meta, "text_tokens": keep_text}
    meta.pop("llm_tokens", None)
    return replace(sample, tokens=sample.tokens[:keep_text], meta=meta), "truncated"


def _features(sample: DecodedSample) -> np.ndarray:
    meta = {k: v for k, v in sample.meta.items() if k not in ("llm_tokens", "vision_patches", "class_id")}
    meta["text_tokens"] = len(sample.tokens)
    return feature_matrix([SampleMeta.from_json(meta)])[0]


_FILLER = DecodedSample(key="", tokens=np.array([FIRST_TEXT_ID]))


def _pack(samples: list[DecodedSample], pack_kwargs: dict[str, int]) -> dict[str, Any]:
    if samples:
        return pack_samples(samples, **pack_kwargs)
    # An empty micro-batch still runs every module (all ranks must issue the same collectives) but adds no loss.
    batch = pack_samples([_FILLER], **pack_kwargs)
    batch["labels"].fill_(IGNORE_INDEX)
    batch.update(keys=[], num_samples=0)
    return batch


class BalancedStream:
    """Yields this rank's packed micro-batches, planned group by group with the other ranks of its balance group.

    Args:
        loader: a ``StatefulDataLoader`` yielding one :class:`DecodedSample` or :class:`BadSample` at a time.
        group: process group of the balance group (``None`` when it is this rank alone).
        group_index: which balance group this is (breaks ties differently per group, identically per member).
        cost_model: prices samples; what the plan balances.
        settings: see :class:`BalanceSettings`.
        seed: seeds tie-breaking.
        pack_kwargs: patch size and merge factors for packing.

    ``state_dict()`` is the position after the last micro-batch yielded: the loader state where the current
    group began, the samples carried into it, the counters then, and how many of its micro-batches were handed
    out. Resuming
    re-reads and re-plans that group (the plan is deterministic) and skips what was already yielded.
    """

    def __init__(
        self,
        loader: Any,
        *,
        group: dist.ProcessGroup | None,
        group_index: int,
        cost_model: CostModel,
        settings: BalanceSettings,
        seed: int = 0,
        pack_kwargs: dict[str, int] | None = None,
    ) -> None:
        self.loader = loader
        self.group = group
        self.group_index = group_index
        self.cost_model = cost_model
        self.settings = settings
        self.seed = seed
        self.pack_kwargs = pack_kwargs or {}
        self.counters = {"skipped": 0, "truncated": 0, "dropped": 0, "samples_moved": 0, "bytes_moved": 0}
        self._state: dict[str, Any] = {
            "loader": loader.state_dict(), "carry": [], "group": 0, "counters": dict(self.counters), "yielded": 0
        }

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        self._state = dict(state)
        self.counters.update(state["counters"])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        records = iter(self.loader)
        group_number, skip = self._state["group"], self._state["yielded"]
        carry: list[bytes] = list(self._state["carry"])
        while True:
            group_start = {
                "loader": self.loader.state_dict(), "carry": list(carry), "group": group_number,
                "counters": dict(self.counters),
            }
            started = time.perf_counter()
            payloads = carry + [self._admit(next(records)) for _ in range(self._fresh_count(len(carry)))]
            rows = self._rows(payloads)
            gathered = self._all_gather(rows)
            plan = self._plan(gathered, group_number)
            received = self._exchange(payloads, gathered, plan)
            rank = self._rank()
            owned = self._owned_ids(gathered)
            carry = [received[i] if i in received else payloads[i - owned.start] for i in plan.leftover
                     if gathered[i, -2] == rank]
            seconds = time.perf_counter() - started
            self.counters["samples_moved"] += plan.samples_moved
            self.counters["bytes_moved"] += plan.bytes_moved
            yielded = 0
            for step, micro_batches in enumerate(plan.micro_batches[rank]):
                step_mean = float(plan.step_cost[:, step].mean()) or 1.0
                stats = {  # relative to the step's mean over the balance group's ranks
                    "predicted_cost": float(plan.step_cost[rank, step]) / step_mean,
                    "predicted_imbalance": float(plan.step_cost[:, step].max()) / step_mean,
                    "reorder_seconds": seconds,
                    **{k: float(v) for k, v in self.counters.items()},
                }
                for ids in micro_batches:
                    yielded += 1
                    self._state = {**group_start, "yielded": yielded}
                    if yielded <= skip:
                        continue
                    samples = [pickle.loads(received[i] if i in received else payloads[i - owned.start]) for i in ids]
                    yield {**_pack(samples, self.pack_kwargs), "balance": stats}
            group_number, skip = group_number + 1, 0

    # ------------------------------------------------------------------------------------------------ steps
    def _fresh_count(self, carried: int) -> int:
        return max(self.settings.samples_per_step * self.settings.group_steps - carried, 0)

    def _admit(self, record: DecodedSample | BadSample) -> bytes | None:
        """Serialised sample, or ``None`` for one that is skipped (bad) or dropped (too long): counted and logged."""
        if isinstance(record, BadSample):
            self.counters["skipped"] += 1
            log.warning("skipping sample %s of shard %s: %s", record.key, record.shard, record.reason)
            return None
        sample, outcome = apply_length_policy(
            record, self.settings.max_seq_len, self.settings.length_policy, self.pack_kwargs
        )
        if outcome:
            self.counters[outcome] += 1
        return None if sample is None else pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL)

    def _rows(self, payloads: list[bytes | None]) -> np.ndarray:
        """int64 per sample: valid, the six cost features, LLM tokens, owner rank, payload bytes."""
        rows = np.zeros((len(payloads), 10), dtype=np.int64)
        rows[:, 8] = self._rank()
        for i, payload in enumerate(payloads):
            if payload is None:
                continue
            sample = pickle.loads(payload)
            rows[i, 0] = 1
            rows[i, 1:7] = _features(sample)
            rows[i, 7] = llm_length(sample, self.pack_kwargs)
            rows[i, 9] = len(payload)
        return rows

    def _all_gather(self, rows: np.ndarray) -> np.ndarray:
        """Every member's rows, rank-major. Only integers travel: a few dozen bytes per sample."""
        if self.group is None:
            return rows
        size = dist.get_world_size(self.group)
        # Carried samples make buffers differ in length: pad to the longest with invalid rows.
        length = torch.tensor([rows.shape[0]])
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(lengths, length, group=self.group)
        longest = max(int(n) for n in lengths)
        padded = torch.zeros(longest, rows.shape[1], dtype=torch.int64)
        padded[: rows.shape[0]] = torch.from_numpy(rows)
        out = torch.empty(size * longest, rows.shape[1], dtype=torch.int64)
        dist.all_gather_into_tensor(out, padded, group=self.group)
        keep = np.concatenate([np.arange(r * longest, r * longest + int(n)) for r, n in enumerate(lengths)])
        return out.numpy()[keep]

    def _plan(self, gathered: np.ndarray, group_number: int) -> GroupPlan:
        valid = np.flatnonzero(gathered[:, 0])
        n_ranks = 1 if self.group is None else dist.get_world_size(self.group)
        config = ReorderConfig(
            steps=self.settings.group_steps,
            micro_batches=self.settings.micro_batches,
            token_budget=self.settings.token_budget,
            pp=self.settings.pp,
        )
        if self.settings.balance:
            costs = gathered[valid, 1:7].astype(np.float64) @ self.cost_model.coefficients
            plan = plan_balance_group(
                costs, gathered[valid, 7], gathered[valid, 8], gathered[valid, 9], n_ranks=n_ranks, config=config,
                seed=self.seed, epoch=group_number, group_index=self.group_index,
            )
        else:
            plan = _keep_in_place(gathered[valid], n_ranks, config, self.cost_model)
        # Plans index the valid rows; translate back to positions in the gathered arrays.
        plan.micro_batches = [[[valid[mb].tolist() for mb in step] for step in rank] for rank in plan.micro_batches]
        plan.leftover = valid[plan.leftover].tolist()
        return plan

    def _exchange(self, payloads: list[bytes | None], gathered: np.ndarray, plan: GroupPlan) -> dict[int, bytes]:
        """Send every planned sample to its rank with one ``all_to_all_single``; returns those received by id."""
        if self.group is None:
            return {}
        rank, size = self._rank(), dist.get_world_size(self.group)
        destination = np.full(gathered.shape[0], -1)
        for r, steps in enumerate(plan.micro_batches):
            for step in steps:
                for ids in step:
                    destination[ids] = r
        owner, nbytes = gathered[:, 8], gathered[:, 9]
        owned = self._owned_ids(gathered)
        send_ids = [[i for i in owned if destination[i] == r and r != rank] for r in range(size)]
        recv_ids = [np.flatnonzero((owner == r) & (destination == rank) & (r != rank)).tolist() for r in range(size)]
        send = b"".join(payloads[i - owned.start] for ids in send_ids for i in ids)
        send_splits = [int(nbytes[ids].sum()) for ids in send_ids]
        recv_splits = [int(nbytes[ids].sum()) for ids in recv_ids]
        out = torch.empty(sum(recv_splits), dtype=torch.uint8)
        dist.all_to_all_single(out, torch.frombuffer(bytearray(send), dtype=torch.uint8) if send else
                               torch.empty(0, dtype=torch.uint8), recv_splits, send_splits, group=self.group)
        received, offset, data = {}, 0, out.numpy().tobytes()
        for ids in recv_ids:
            for i in ids:
                received[i] = data[offset : offset + int(nbytes[i])]
                offset += int(nbytes[i])
        return received

    def _rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    def _owned_ids(self, gathered: np.ndarray) -> range:
        mine = np.flatnonzero(gathered[:, 8] == self._rank())
        return range(int(mine[0]), int(mine[-1]) + 1) if mine.size else range(0)


def _keep_in_place(rows: np.ndarray, n_ranks: int, config: ReorderConfig, cost_model: CostModel) -> GroupPlan:
    """The naive split as a plan: each rank trains on its own samples, in arrival order, evenly per micro-batch."""
    costs = rows[:, 1:7].astype(np.float64) @ cost_model.coefficients
    micro: list[list[list[list[int]]]] = []
    step_cost = np.zeros((n_ranks, config.steps))
    for r in range(n_ranks):
        mine = np.flatnonzero(rows[:, 8] == r)
        per_micro = np.array_split(mine, config.steps * config.micro_batches)
        micro.append([[per_micro[s * config.micro_batches + m].tolist() for m in range(config.micro_batches)]
                      for s in range(config.steps)])
        for s in range(config.steps):
            step_cost[r, s] = sum(costs[ids].sum() for ids in micro[r][s])
    return GroupPlan(micro, step_cost, [], 0, 0)
