"""OmniDataModule: balanced streaming in one process (groups, budgets, length policies, bad input, exact resume,
txt members, fsspec URLs), across a fork-started gloo world (plan agreement, exchange, balance quality, bad input
keeping steps aligned), and one Lightning kill-and-resume run that must train on exactly the same samples."""

from __future__ import annotations

import glob
import io
import itertools
import json
import logging
import os
import pickle
import re
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import free_port, run_distributed
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_runs import KillAtStep, RecordKeys, RecordRun, recorded_keys
from PIL import Image
from torchdata.stateful_dataloader import StatefulDataLoader
from webdataset import TarWriter
from webdataset.tariterators import tarfile_samples

from omni_lightning import OmniDataModule, OmniModule, OmniStrategy, ReferenceMLLMConfig
from omni_lightning.balance.workload import SampleMeta
from omni_lightning.batch import BYTE_ROLES
from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.data.reorder_stream import ReorderedStream, ReorderSettings, apply_length_policy, llm_length
from omni_lightning.data.resumable import MARKER_KEY, ResumableLoader, commit_consumed
from omni_lightning.data.shards import existing_shards
from omni_lightning.data.streaming import BadSample, ByteTokenizer, SampleStream, open_shard
from omni_lightning.data.synthetic import make_synthetic_shards
from omni_lightning.modalities import DEFAULT_PACKING
from omni_lightning.models.flops import reference_cost_model

# The byte tokens' roles (ids 0-3) and their first text id.
FIRST_TEXT_ID = BYTE_ROLES.first_free_id
BOS_ID = BYTE_ROLES.bos
IMAGE_ID = BYTE_ROLES.placeholder("image")
AUDIO_ID = BYTE_ROLES.placeholder("audio")

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

COST = reference_cost_model(ReferenceMLLMConfig.tiny())
PACK = DEFAULT_PACKING
SMALL = {"workload": "omni_mix", "length_scale": 0.03, "max_llm_tokens": 160}
BALANCE_LOG = "omni_lightning.data.reorder_stream"

Batch = dict[str, Any]
Raw = dict[str, Any]


# --- helpers ---------------------------------------------------------------------------------------------------


def sample_stream(paths: list[str], *, dp_rank: int = 0, dp_size: int = 1, num_workers: int = 0,
                  on_bad_sample: str = "skip", tokenizer: Any = None) -> SampleStream:
    return SampleStream(paths, dp_rank=dp_rank, dp_size=dp_size, batch_size=1, num_workers=num_workers,
                        packing=PACK, on_bad_sample=on_bad_sample, tokenizer=tokenizer)


def balanced(paths: list[str], *, dp_rank: int = 0, dp_size: int = 1, num_workers: int = 0,
             on_bad_sample: str = "skip", tokenizer: Any = None, group: dist.ProcessGroup | None = None,
             **settings: Any) -> ReorderedStream:
    """The pieces OmniDataModule.train_dataloader assembles, built by hand (``group=None``: a one-rank group)."""
    samples = sample_stream(paths, dp_rank=dp_rank, dp_size=dp_size, num_workers=num_workers,
                            on_bad_sample=on_bad_sample, tokenizer=tokenizer)
    loader = StatefulDataLoader(samples, batch_size=None, num_workers=num_workers, collate_fn=lambda item: item)
    return ReorderedStream(loader, group=group, group_index=0, cost_model=COST, settings=ReorderSettings(**settings),
                          seed=0, packing=PACK)


def take(batches: Iterable[Batch], n: int) -> list[Batch]:
    return list(itertools.islice(batches, n))


def arrival(paths: list[str], n: int, *, dp_rank: int = 0, dp_size: int = 1) -> list[DecodedSample | BadSample]:
    """The first ``n`` records a rank reads, in order (what the balancer buffers, before any reordering)."""
    return list(itertools.islice(sample_stream(paths, dp_rank=dp_rank, dp_size=dp_size).iter_samples(), n))


def flat_keys(batches: Iterable[Batch]) -> list[str]:
    return [key for batch in batches for key in batch["keys"]]


def segments(batch: Batch) -> list[torch.Tensor]:
    """The packed ``input_ids`` of each sample of a micro-batch."""
    cu = batch["cu_seqlens"].tolist()
    return [batch["input_ids"][a:b] for a, b in zip(cu, cu[1:], strict=False)][: batch["num_samples"]]


def carried_keys(state: dict[str, Any]) -> list[str]:
    """Keys of the samples a stream state carries into its group (kept serialised or as samples)."""
    return [(pickle.loads(s) if isinstance(s, bytes) else s).key for s in state["carry"]]


def plan_stats(batch: Batch) -> dict[str, float]:
    return {k: v for k, v in batch["reorder"].items() if k != "reorder_seconds"}


def raw_samples(path: str) -> list[Raw]:
    return [{k: v for k, v in raw.items() if k != "__url__"} for raw in tarfile_samples([{"url": path}])]


def write_shard(path: Path, samples: list[Raw]) -> str:
    with open(path, "wb") as stream, TarWriter(stream, encoder=False, mtime=0) as writer:
        for sample in samples:
            writer.write(sample)
    return str(path)


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def edit(raw: Raw, key: str, members: dict[str, Any] | None = None, **meta: Any) -> Raw:
    """A copy of ``raw`` under ``key`` with members replaced (``None`` deletes) and metadata fields changed."""
    out = {**raw, "__key__": key}
    for name, value in (members or {}).items():
        if value is None:
            out.pop(name)
        else:
            out[name] = value
    if meta:
        out["json"] = json.dumps({**json.loads(raw["json"]), **meta}).encode()
    return out


def modality(raw: Raw) -> str:
    return json.loads(raw["json"])["modality"]


def cut_shard(source: str, target: Path, where: Callable[[list[tarfile.TarInfo]], int]) -> str:
    """Copy the first ``where(members)`` bytes of a shard."""
    with tarfile.open(source) as tar:
        members = tar.getmembers()
    target.write_bytes(Path(source).read_bytes()[: where(members)])
    return str(target)


def sample_members(members: list[tarfile.TarInfo], index: int) -> list[tarfile.TarInfo]:
    key = sorted({m.name.split(".", 1)[0] for m in members})[index]
    return [m for m in members if m.name.split(".", 1)[0] == key]


class RecordPlans:
    """Wraps ``ReorderedStream._plan`` on one instance to keep every group's plan (planned on the training thread,
    so that the plans kept are those of the batches taken: planning ahead is tested in test_reorder_exchange.py)."""

    def __init__(self, stream: ReorderedStream) -> None:
        self.plans: list[Any] = []
        stream.settings = replace(stream.settings, plan_ahead=False)
        original = stream._plan

        def plan(*args: Any) -> Any:
            self.plans.append(original(*args))
            return self.plans[-1]

        stream._plan = plan  # type: ignore[method-assign]


# --- fixtures --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Four omni-mix shards of twelve samples (text, image, video and audio), read-only."""
    return make_synthetic_shards(tmp_path_factory.mktemp("omni_shards"), num_shards=4, samples_per_shard=12, **SMALL)


@pytest.fixture(scope="module")
def pool(shards: list[str]) -> list[Raw]:
    """Every raw sample of ``shards``, to build hand-made shards from."""
    return [raw for path in shards for raw in raw_samples(path)]


# === A. One rank =================================================================================================


@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_every_sample_once_per_group(shards: list[str], balance: bool, micro_batches: int) -> None:
    S, G, groups = 2, 3, 3  # noqa: N806
    stream = balanced(shards, samples_per_step=S, group_steps=G, micro_batches=micro_batches, reorder=balance)
    recorder = RecordPlans(stream)
    batches = take(stream, groups * G * micro_batches)
    read = arrival(shards, groups * G * S)
    assert all(isinstance(s, DecodedSample) for s in read)
    by_key = {s.key: s for s in read}
    assert len(recorder.plans) == groups, "one plan per group of steps"
    for g, plan in enumerate(recorder.plans):
        (rank_plan,) = plan.micro_batches
        assert len(rank_plan) == G and all(len(step) == micro_batches for step in rank_plan)
        group_batches = batches[g * G * micro_batches : (g + 1) * G * micro_batches]
        group_read = [s.key for s in read[g * G * S : (g + 1) * G * S]]
        assert sorted(flat_keys(group_batches)) == sorted(group_read), f"group {g}"
        if not balance:  # the naive split: arrival order, evenly over steps and micro-batches
            assert flat_keys(group_batches) == group_read
            assert [b["num_samples"] for b in group_batches] == [S // micro_batches] * (G * micro_batches)
    for batch in batches:
        # Packed lengths are what llm_length predicts (the balancer budgets with it).
        assert [len(seg) for seg in segments(batch)] == [llm_length(by_key[k], PACK) for k in batch["keys"]]
        assert batch["reorder"]["samples_moved"] == 0, "a one-rank group moves nothing"


@pytest.mark.parametrize(("samples_per_step", "micro_batches", "budget"), [(4, 1, 48), (4, 2, 32)])
def test_token_budget_and_leftovers_carried(shards: list[str], samples_per_step: int, micro_batches: int,
                                            budget: int) -> None:
    """Samples that fit no micro-batch wait for the next group: none is lost, none is trained twice."""
    G, groups = 2, 6  # noqa: N806
    per_group = G * micro_batches
    stream = balanced(shards, samples_per_step=samples_per_step, group_steps=G, micro_batches=micro_batches,
                      token_budget=budget, max_seq_len=budget)
    batches, carried_in = [], []
    iterator = iter(stream)
    for i in range((groups + 1) * per_group):
        batches.append(next(iterator))
        if i % per_group == 0:  # the first micro-batch of a group: the state holds what was carried into it
            carried_in.append(carried_keys(stream.state_dict()))
    for batch in batches:
        assert batch["input_ids"].numel() <= budget, batch["keys"]
        assert len(batch["keys"]) == batch["num_samples"]
    assert any(carried_in), "the budget is tight enough that some samples wait for a later group"
    # Fresh reads per group fill the buffer up to group_steps * samples_per_step.
    fresh = sum(G * samples_per_step - len(carry) for carry in carried_in[:groups])
    records = arrival(shards, fresh)
    admitted = [s.key for s in records if apply_length_policy(s, budget, "truncate", PACK)[0] is not None]
    trained = flat_keys(batches[: groups * per_group])
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert not set(trained) & set(carried_in[groups])
    assert sorted(trained + carried_in[groups]) == sorted(admitted)
    carried = {k for carry in carried_in[:groups] for k in carry}
    assert carried <= set(trained) | set(carried_in[groups]), "a carried sample was lost"


def test_naive_split_respects_token_budget(shards: list[str]) -> None:
    stream = balanced(shards, samples_per_step=4, group_steps=2, token_budget=48, max_seq_len=48, reorder=False)
    assert [b["input_ids"].numel() for b in take(stream, 10) if b["input_ids"].numel() > 48] == []


# --- max_seq_len policies --------------------------------------------------------------------------------------


def _image_sample(text: int = 10) -> DecodedSample:
    image = np.zeros((28, 56, 3), dtype=np.uint8)  # 2 x 4 patches -> 2 merged vision tokens
    meta = SampleMeta("image", text, images=((2, 4),)).to_json()
    return DecodedSample("k-1", np.arange(FIRST_TEXT_ID, FIRST_TEXT_ID + text), images=[image], meta=meta)


def test_apply_length_policy_unit() -> None:
    sample = _image_sample()
    assert llm_length(sample, PACK) == 1 + 2 + 10
    for limit in (None, 13):  # no limit, or within it: the very same sample
        kept, outcome = apply_length_policy(sample, limit, "error", PACK)
        assert kept is sample and outcome == ""
    cut, outcome = apply_length_policy(sample, 8, "truncate", PACK)
    assert outcome == "truncated" and llm_length(cut, PACK) == 8
    assert cut.tokens.tolist() == sample.tokens[:5].tolist()
    assert cut.meta["text_tokens"] == 5 and "llm_tokens" not in cut.meta
    assert len(sample.tokens) == 10, "the original is left alone"
    assert apply_length_policy(sample, 3, "truncate", PACK) == (None, "dropped")  # media alone fill the limit
    assert apply_length_policy(sample, 12, "drop", PACK) == (None, "dropped")
    with pytest.raises(ValueError, match=r"sample k-1: 13 LLM tokens exceed max_seq_len=12"):
        apply_length_policy(sample, 12, "error", PACK)
    with pytest.raises(ValueError, match="length_policy"):
        ReorderSettings(samples_per_step=1, length_policy="cut")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_seq_len=64 exceeds token_budget=32"):
        ReorderSettings(samples_per_step=1, token_budget=32, max_seq_len=64)


def test_apply_length_policy_boundary_of_truncation() -> None:
    """keep_text = max_seq_len - 1 - media; exactly one text token left is still a sample."""
    sample = _image_sample()
    cut, outcome = apply_length_policy(sample, 4, "truncate", PACK)
    assert outcome == "truncated" and cut is not None and cut.tokens.tolist() == [FIRST_TEXT_ID]


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_length_policy_in_the_stream(shards: list[str], policy: str) -> None:
    limit, S, G = 24, 4, 3  # noqa: N806
    stream = balanced(shards, samples_per_step=S, group_steps=G, max_seq_len=limit, length_policy=policy)
    batches = take(stream, G)
    read = arrival(shards, S * G)
    lengths = {s.key: llm_length(s, PACK) for s in read}
    media_only = {s.key for s in read if lengths[s.key] - len(s.tokens) >= limit}
    too_long = {k for k, n in lengths.items() if n > limit}
    assert media_only and too_long - media_only, "the data holds both kinds of over-long sample"
    dropped = media_only if policy == "truncate" else too_long
    truncated = too_long - dropped
    stats = batches[-1]["reorder"]
    assert (stats["dropped"], stats["truncated"]) == (len(dropped), len(truncated))
    assert sorted(flat_keys(batches)) == sorted(set(lengths) - dropped)
    by_key = {s.key: s for s in read}
    for batch in batches:
        for key, seg in zip(batch["keys"], segments(batch), strict=True):
            assert len(seg) == (limit if key in truncated else lengths[key])
            text = by_key[key].tokens
            media = lengths[key] - len(text)  # BOS and placeholders, kept whole
            assert seg[media:].tolist() == text[: len(seg) - media].tolist(), "text is cut at its end"


def test_length_policy_error_names_the_sample(shards: list[str]) -> None:
    limit = 24
    first = next(s for s in arrival(shards, 24) if llm_length(s, PACK) > limit)
    stream = balanced(shards, samples_per_step=4, group_steps=3, max_seq_len=limit, length_policy="error")
    with pytest.raises(ValueError, match=rf"sample {first.key}: {llm_length(first, PACK)} LLM tokens exceed "
                                         rf"max_seq_len={limit}"):
        next(iter(stream))


# --- bad input -------------------------------------------------------------------------------------------------


def _bad_cases(pool: list[Raw]) -> dict[str, Raw]:
    """One of each kind of bad sample, under fresh keys."""
    image = next(r for r in pool if "img0.png" in r)
    audio = next(r for r in pool if "mel.npy" in r)
    text = next(r for r in pool if modality(r) == "text")
    n_mels = np.load(io.BytesIO(audio["mel.npy"])).shape[1]
    return {
        "missing_tokens": edit(text, "bad_missing_tokens", {"tokens.npy": None}),
        "undecodable_png": edit(image, "bad_undecodable_png", {"img0.png": b"\x89PNG garbage, not an image"}),
        "zero_length_mel": edit(audio, "bad_zero_length_mel", {"mel.npy": npy(np.zeros((0, n_mels), np.float16))},
                                audio_frames=0),
        "metadata_mismatch": edit(text, "bad_metadata_mismatch",
                                  text_tokens=len(np.load(io.BytesIO(text["tokens.npy"]))) + 3),
    }


BAD_REASONS = {
    "missing_tokens": "member 'tokens.npy' is missing",
    "undecodable_png": "img0.png cannot be decoded",
    "zero_length_mel": "a zero-length audio clip",
    "metadata_mismatch": "text tokens, metadata says",
    "truncated_shard": "unreadable shard after",
}


def _goods(pool: list[Raw], n: int, skip: int = 0) -> list[Raw]:
    """``n`` good samples of distinct keys from the last shards of ``pool`` (the bad ones derive from the first)."""
    return pool[len(pool) // 2 + skip :][:n]


def _truncated_shard(pool: list[Raw], folder: Path) -> tuple[str, list[str], str]:
    """A shard of four good samples cut in the middle of sample 2's second member: (path, keys of the complete
    samples before the cut, key of the cut sample)."""
    samples = _goods(pool, 4, skip=12)
    whole = write_shard(folder / "whole.tar", samples)
    path = cut_shard(whole, folder / "truncated.tar",
                     lambda ms: (m := sample_members(ms, 2)[1]).offset_data + m.size // 2)
    keys = [s["__key__"] for s in samples[:2]]
    return path, keys, samples[2]["__key__"]


@pytest.fixture(scope="module")
def bad_shards(pool: list[Raw], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three shards: two with good samples around the bad ones, one truncated; and per shard the expected records
    (a key, or ``None`` for a bad one) in read order."""
    folder = tmp_path_factory.mktemp("bad_shards")
    bad = _bad_cases(pool)
    goods = _goods(pool, 6)
    shard_a = [goods[0], bad["missing_tokens"], goods[1], bad["undecodable_png"], goods[2]]
    shard_b = [goods[3], bad["zero_length_mel"], goods[4], bad["metadata_mismatch"], goods[5]]
    truncated, truncated_keys, cut = _truncated_shard(pool, folder)
    paths = [write_shard(folder / "a.tar", shard_a), write_shard(folder / "b.tar", shard_b), truncated]
    expected = {
        paths[0]: [None if s["__key__"].startswith("bad_") else s["__key__"] for s in shard_a],
        paths[1]: [None if s["__key__"].startswith("bad_") else s["__key__"] for s in shard_b],
        paths[2]: [*truncated_keys, None, None],  # the cut sample (incomplete), then the shard's read error
    }
    bad_keys = {paths[0]: [bad["missing_tokens"]["__key__"], bad["undecodable_png"]["__key__"]],
                paths[1]: [bad["zero_length_mel"]["__key__"], bad["metadata_mismatch"]["__key__"]],
                paths[2]: [cut]}
    return {"paths": paths, "expected": expected, "bad_keys": bad_keys}


def test_bad_samples_are_skipped_counted_and_logged(bad_shards: dict[str, Any],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """One sample per step and group: every record of the epoch becomes exactly one micro-batch (a bad one an
    empty, loss-free filler), so the steps of all ranks would stay aligned."""
    paths = bad_shards["paths"]
    # Read group by group: a group read ahead would log its own bad samples before its batches are taken.
    stream = balanced(paths, samples_per_step=1, group_steps=1, plan_ahead=False)
    order = stream.loader.dataset.epoch_shards(0, 0)
    expected = [key for path in order for key in bad_shards["expected"][path]]
    with caplog.at_level(logging.WARNING, logger=BALANCE_LOG):
        batches = take(stream, len(expected) + 1)
    assert [b["keys"] for b in batches[:-1]] == [[] if key is None else [key] for key in expected]
    next_epoch = stream.loader.dataset.epoch_shards(0, 1)[0]
    assert batches[-1]["keys"] == [bad_shards["expected"][next_epoch][0]], "the next epoch starts over"
    fillers = [b for b in batches if not b["keys"]]
    assert all(b["num_samples"] == 0 and bool((b["labels"] == -100).all()) for b in fillers)
    stats = batches[len(expected) - 1]["reorder"]
    assert stats["skipped"] == 6 == len(fillers)
    warnings = [r.getMessage() for r in caplog.records if r.name == BALANCE_LOG and r.levelno == logging.WARNING]
    assert len(warnings) == 6
    for path, keys in bad_shards["bad_keys"].items():
        for key in keys:
            assert any(f"skipping sample {key} of shard {path}" in w for w in warnings), (key, warnings)
    for reason in BAD_REASONS.values():
        assert any(reason in w for w in warnings), reason


@pytest.mark.parametrize("case", sorted(BAD_REASONS))
def test_bad_input_raises_with_shard_and_key(pool: list[Raw], tmp_path: Path, case: str) -> None:
    reason = BAD_REASONS[case]
    if case == "truncated_shard":
        path, _, key = _truncated_shard(pool, tmp_path)
        reason = "is missing"  # the first record past the cut is the incomplete sample itself
    else:
        bad = _bad_cases(pool)[case]
        path, key = write_shard(tmp_path / f"{case}.tar", [*_goods(pool, 1), bad, *_goods(pool, 1, skip=1)]), \
            bad["__key__"]
    stream = balanced([path], on_bad_sample="error", samples_per_step=1, group_steps=1)
    with pytest.raises(ValueError, match=rf"shard {re.escape(path)}, sample {key}: .*{reason}"):
        take(stream, 4)


def _records(paths: list[str], n: int) -> list[tuple[str, str | None]]:
    return [(type(r).__name__, r.key) for r in itertools.islice(sample_stream(paths).iter_samples(), n)]


@pytest.mark.parametrize(
    "cut",
    [
        pytest.param("second_member", id="inside-a-later-member"),
        pytest.param("first_member", id="inside-the-first-member"),
        pytest.param("header", id="inside-a-header"),
    ],
)
def test_truncated_shard_keeps_every_complete_sample(pool: list[Raw], tmp_path: Path, cut: str) -> None:
    samples = _goods(pool, 4, skip=12)
    whole = write_shard(tmp_path / "whole.tar", samples)

    def where(members: list[tarfile.TarInfo]) -> int:
        first, second = sample_members(members, 2)[:2]
        if cut == "second_member":
            return second.offset_data + second.size // 2
        return first.offset_data + first.size // 2 if cut == "first_member" else first.offset + 100

    path = cut_shard(whole, tmp_path / "cut.tar", where)
    keys = [s["__key__"] for s in samples]
    complete = [("DecodedSample", keys[0]), ("DecodedSample", keys[1])]
    if cut == "second_member":  # sample 2 arrives incomplete, then the read error: two skips, both naming it
        assert _records([path], 4) == [*complete, ("BadSample", keys[2]), ("BadSample", keys[2])]
    else:  # nothing of sample 2 was read: the read error names the last sample read
        assert _records([path], 3) == [*complete, ("BadSample", keys[1])]


@pytest.mark.parametrize("member", ["mel.npy", "tokens.npy"])
def test_zero_byte_member_is_one_bad_sample(pool: list[Raw], tmp_path: Path, member: str) -> None:
    audio = next(r for r in pool if "mel.npy" in r)
    goods = _goods(pool, 2)
    path = write_shard(tmp_path / "zero.tar", [goods[0], edit(audio, "bad_zero_bytes", {member: b""}), goods[1]])
    assert _records([path], 3) == [("DecodedSample", goods[0]["__key__"]), ("BadSample", "bad_zero_bytes"),
                                   ("DecodedSample", goods[1]["__key__"])]


def test_repeated_member_is_a_bad_shard_not_a_crash(pool: list[Raw], tmp_path: Path) -> None:
    """Two consecutive samples under one key (a writer bug) repeat members within a webdataset sample."""
    goods = _goods(pool, 3)
    path = write_shard(tmp_path / "repeated.tar", [goods[0], goods[1], {**goods[2], "__key__": goods[1]["__key__"]}])
    # The shard ends at the repetition; the samples completed before it still count.
    assert _records([path], 3) == [("DecodedSample", goods[0]["__key__"]), ("DecodedSample", goods[1]["__key__"]),
                                   ("BadSample", goods[1]["__key__"])]


def _png(height: int, width: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((height, width, 3), np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _unpackable(pool: list[Raw], case: str) -> Raw:
    audio = next(r for r in pool if "mel.npy" in r)
    text = next(r for r in pool if modality(r) == "text")
    image = next(r for r in pool if modality(r) == "image" and "img1.png" not in r)
    if case == "odd_patch_grid":  # 3 x 3 patches, as the metadata says, cannot be merged 2 x 2
        return edit(image, "bad_unpackable", {"img0.png": _png(42, 42)}, images=[[3, 3]])
    if case == "image_not_whole_patches":  # 30 x 28 pixels: the grid check floors it to the 2 x 2 the metadata says
        return edit(image, "bad_unpackable", {"img0.png": _png(30, 28)}, images=[[2, 2]])
    if case == "mel_frames_not_a_multiple_of_4":
        mel = np.load(io.BytesIO(audio["mel.npy"]))[:6]
        return edit(audio, "bad_unpackable", {"mel.npy": npy(mel)}, audio_frames=6)
    tokens = np.load(io.BytesIO(text["tokens.npy"])).copy()
    tokens[0] = 0  # a reserved id
    return edit(text, "bad_unpackable", {"tokens.npy": npy(tokens)})


@pytest.mark.parametrize("case", ["mel_frames_not_a_multiple_of_4", "reserved_token_id", "odd_patch_grid",
                                  "image_not_whole_patches"])
def test_decodable_but_unusable_sample_is_skipped(pool: list[Raw], tmp_path: Path, case: str) -> None:
    goods = _goods(pool, 2)
    path = write_shard(tmp_path / "unusable.tar", [goods[0], _unpackable(pool, case), goods[1]])
    batches = take(balanced([path], samples_per_step=1, group_steps=1), 3)
    assert [b["keys"] for b in batches] == [[goods[0]["__key__"]], [], [goods[1]["__key__"]]]
    assert batches[-1]["reorder"]["skipped"] == 1


# --- exact resume ----------------------------------------------------------------------------------------------


RESUME = {"samples_per_step": 4, "group_steps": 2, "micro_batches": 2, "token_budget": 32, "max_seq_len": 32}


# Four micro-batches a group: k=4 resumes at a group boundary, the other k inside a group; the largest k of each
# worker count lands in the group that the data carries a sample into (workers interleave, so it differs).
@pytest.mark.parametrize(("num_workers", "k"), [(0, 0), (0, 2), (0, 4), (0, 7), (0, 14), (2, 0), (2, 4), (2, 7),
                                                (2, 38)])
def test_exact_resume(shards: list[str], num_workers: int, k: int) -> None:
    after = 5

    def run() -> ResumableLoader:
        return ResumableLoader(balanced(shards, num_workers=num_workers, **RESUME))

    reference = take(run(), k + after)
    interrupted = run()
    batches = iter(interrupted)
    trained = take(batches, k + 1)  # Lightning prefetches one batch beyond the one it trains on
    for batch in trained[:k]:
        commit_consumed(batch)
    state = pickle.loads(pickle.dumps(interrupted.state_dict()))  # as a checkpoint would store it
    group = state["inner"]
    assert (group["group"], group["yielded"]) == (((k - 1) // 4, (k - 1) % 4 + 1) if k else (0, 0))
    assert bool(group["carry"]) == (k in (14, 38)), "the data should carry a sample into these groups only"
    assert [b["keys"] for b in trained] == [b["keys"] for b in reference[: k + 1]]
    resumed = run()
    resumed.load_state_dict(state)
    continued = take(resumed, after)
    assert [b["keys"] for b in continued] == [b["keys"] for b in reference[k:]]
    assert [plan_stats(b) for b in continued] == [plan_stats(b) for b in reference[k:]]
    for got, want in zip(continued, reference[k:], strict=True):
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert isinstance(got[MARKER_KEY], type(want[MARKER_KEY]))


def test_resume_uses_carried_samples(shards: list[str]) -> None:
    """The tight budget of RESUME leaves samples over at some group boundary: their payloads are in the state."""
    stream = balanced(shards, **RESUME)
    states = [stream.state_dict() for _ in itertools.islice(stream, 6 * 4)]
    carried = [s for s in states if s["carry"]]
    assert carried, "no group carried samples: the resume test does not cover carry"
    for state in carried:  # a checkpoint stores the carried samples themselves
        assert carried_keys(pickle.loads(pickle.dumps(state))) == carried_keys(state)


def test_exact_resume_over_bad_input(bad_shards: dict[str, Any]) -> None:
    paths = bad_shards["paths"]
    reference = take(ResumableLoader(balanced(paths, samples_per_step=2, group_steps=2)), 14)
    for k in (3, 7, 9):
        interrupted = ResumableLoader(balanced(paths, samples_per_step=2, group_steps=2))
        for batch in take(interrupted, k):
            commit_consumed(batch)
        resumed = ResumableLoader(balanced(paths, samples_per_step=2, group_steps=2))
        resumed.load_state_dict(interrupted.state_dict())
        continued = take(resumed, 14 - k)
        assert [b["keys"] for b in continued] == [b["keys"] for b in reference[k:]], k
        assert [plan_stats(b) for b in continued] == [plan_stats(b) for b in reference[k:]], k


# --- txt members, fsspec URLs and the data module itself -------------------------------------------------------


def test_txt_member_is_tokenized_as_bytes(tmp_path: Path, pool: list[Raw]) -> None:
    text = "héllo, wörld"
    ids = [FIRST_TEXT_ID + b for b in text.encode("utf-8")]
    assert ByteTokenizer().encode(text) == ids
    plain = {"__key__": "txt_plain", "txt": text.encode("utf-8"),
             "json": json.dumps(SampleMeta("text", len(ids)).to_json()).encode()}
    image = next(r for r in pool if modality(r) == "image" and "img1.png" not in r)
    (grid,) = json.loads(image["json"])["images"]
    meta = json.loads(image["json"])
    with_image = edit(image, "txt_image", {"tokens.npy": None, "txt": text.encode("utf-8")}, text_tokens=len(ids),
                      llm_tokens=meta["llm_tokens"] - meta["text_tokens"] + len(ids))
    wrong_length = {**plain, "__key__": "txt_wrong_length",
                    "json": json.dumps(SampleMeta("text", len(text)).to_json()).encode()}  # characters, not bytes
    path = write_shard(tmp_path / "txt.tar", [plain, with_image, wrong_length])
    batches = take(balanced([path], samples_per_step=3, group_steps=1, reorder=False), 1)
    (batch,) = batches
    assert batch["keys"] == ["txt_plain", "txt_image"]
    assert batch["reorder"]["skipped"] == 1
    first, second = segments(batch)
    assert first.tolist() == [BOS_ID, *ids]
    vision = grid[0] * grid[1] // 4
    assert second.tolist() == [BOS_ID, *[IMAGE_ID] * vision, *ids]

    class Shouting:
        def encode(self, text: str) -> list[int]:
            return ByteTokenizer().encode(text.upper())

    shouted = next(iter(sample_stream([path], tokenizer=Shouting()).iter_samples()))
    assert shouted.tokens.tolist() == ByteTokenizer().encode(text.upper())


def test_audio_sample_packs_placeholders(shards: list[str]) -> None:
    sample = next(s for s in arrival(shards, 48) if s.mel is not None)
    (seg,) = segments(pack_samples([sample], PACK))
    audio = sample.mel.shape[0] // 4
    assert seg[: 1 + audio].tolist() == [BOS_ID, *[AUDIO_ID] * audio]


def _memory_copy(paths: list[str], folder: str) -> list[str]:
    import fsspec

    memory = fsspec.filesystem("memory")
    urls = []
    for path in paths:
        url = f"memory://{folder}/{Path(path).name}"
        memory.pipe(url, Path(path).read_bytes())
        with fsspec.open(url, "rb") as stream:  # the copy itself is readable through fsspec
            assert stream.read() == Path(path).read_bytes()
        urls.append(url)
    return urls


def test_open_shard_reads_an_fsspec_memory_url(shards: list[str]) -> None:
    (url,) = _memory_copy(shards[:1], "open_shard")
    assert [raw["__key__"] for raw in open_shard(url)] == [raw["__key__"] for raw in open_shard(shards[0])]


def _data_module(shards: list[str] | str, **kwargs: Any) -> OmniDataModule:
    module = OmniDataModule(shards, samples_per_step=2, group_steps=3, cost_model=COST, **kwargs)
    module.setup("fit")
    return module


def test_data_module_train_dataloader_in_one_process(shards: list[str]) -> None:
    loader = _data_module(shards, reorder_group_size=1).train_dataloader()
    assert isinstance(loader, ResumableLoader)
    got = take(loader, 6)
    want = take(balanced(shards, samples_per_step=2, group_steps=3), 6)
    assert [b["keys"] for b in got] == [b["keys"] for b in want]
    assert all(MARKER_KEY in b and "reorder" in b for b in got)


def test_data_module_streams_fsspec_urls(shards: list[str]) -> None:
    urls = _memory_copy(shards, "data_module")
    got = take(_data_module(urls, reorder_group_size=1).train_dataloader(), 6)
    want = take(balanced(shards, samples_per_step=2, group_steps=3), 6)
    assert [b["keys"] for b in got] == [b["keys"] for b in want]


def test_data_module_rejects_bad_arguments(shards: list[str]) -> None:
    with pytest.raises(ValueError, match="reorder"):
        OmniDataModule(shards, reorder="sorted")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_bad_sample"):
        OmniDataModule(shards, on_bad_sample="ignore")  # type: ignore[arg-type]


def test_data_module_defaults_work_on_one_rank(shards: list[str]) -> None:
    _data_module(shards).train_dataloader()


# === B. A gloo world of data-parallel ranks ======================================================================


def _checksum(segment: torch.Tensor) -> int:
    return int((segment * torch.arange(1, len(segment) + 1)).sum())


def _world_balance(rank: int, world_size: int, shards: str, out: Path) -> None:
    paths = existing_shards(shards)
    group, _ = dist.new_subgroups_by_enumeration([list(range(world_size))])
    result: dict[str, Any] = {}
    for balance in (True, False):
        stream = balanced(paths, dp_rank=rank, dp_size=world_size, group=group, samples_per_step=2, group_steps=3,
                          reorder=balance)
        result[str(balance)] = [
            {"keys": b["keys"], "checksums": [_checksum(s) for s in segments(b)], **plan_stats(b)}
            for b in take(stream, 9)
        ]
    result["read"] = [s.key for s in arrival(paths, 18, dp_rank=rank, dp_size=world_size)]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        (out / "world.json").write_text(json.dumps(gathered))


@pytest.mark.distributed
def test_balance_group_of_four_ranks(tiny_shards: str, tmp_path: Path) -> None:
    S, G, ranks = 2, 3, 4  # noqa: N806
    run_distributed(_world_balance, ranks, tiny_shards, tmp_path)
    world = json.loads((tmp_path / "world.json").read_text())
    paths = existing_shards(tiny_shards)
    expected_checksum = {
        s.key: _checksum(segments(pack_samples([s], PACK))[0])
        for r in range(ranks) for s in arrival(paths, 18, dp_rank=r, dp_size=ranks)
    }
    imbalance = {}
    for mode in ("True", "False"):
        steps = [[world[r][mode][i] for r in range(ranks)] for i in range(3 * G)]
        moved_before = 0.0
        for g in range(3):
            group_steps = steps[g * G : (g + 1) * G]
            read = [world[r]["read"][g * G * S : (g + 1) * G * S] for r in range(ranks)]
            trained = [[k for step in group_steps for k in step[r]["keys"]] for r in range(ranks)]
            everyone = [k for keys in trained for k in keys]
            # (i) every sample of the group, on exactly one rank
            assert sorted(everyone) == sorted(k for keys in read for k in keys), (mode, g)
            # the payloads that travelled arrive intact
            for step in group_steps:
                for r in range(ranks):
                    assert step[r]["checksums"] == [expected_checksum[k] for k in step[r]["keys"]]
            # (iv) the counter counts samples trained away from the rank that read them
            moved = sum(len(set(trained[r]) - set(read[r])) for r in range(ranks))
            counters = {step[r]["samples_moved"] for step in group_steps for r in range(ranks)}
            assert counters == {moved_before + moved}, (mode, g)
            moved_before += moved
            if mode == "False":
                assert trained == read and moved == 0
        for step in steps:
            # (ii) every rank reports the same plan statistics for the step
            assert len({step[r]["predicted_imbalance"] for r in range(ranks)}) == 1
            costs = [step[r]["predicted_cost"] for r in range(ranks)]
            assert sum(costs) / ranks == pytest.approx(1.0)
            assert max(costs) == pytest.approx(step[0]["predicted_imbalance"])
        imbalance[mode] = float(np.mean([step[0]["predicted_imbalance"] for step in steps]))
        # (iv) balancing moves samples (and their bytes); the naive split moves none
        assert (moved_before > 0, steps[-1][0]["bytes_moved"] > 0) == ((True, True) if mode == "True" else (False,
                                                                                                           False))
    # (iii) balancing lowers the predicted max/mean step cost over ranks
    assert imbalance["True"] < imbalance["False"], imbalance


def _world_bad_input(rank: int, world_size: int, paths: list[str], out: Path) -> None:
    group, _ = dist.new_subgroups_by_enumeration([list(range(world_size))])
    stream = balanced(paths, dp_rank=rank, dp_size=world_size, group=group, samples_per_step=1, group_steps=3)
    batches = take(stream, 6)  # two groups: one epoch of each rank's two shards of three samples
    result = {"steps": [{"keys": b["keys"], **plan_stats(b)} for b in batches]}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        (out / "world.json").write_text(json.dumps(gathered))


@pytest.mark.distributed
def test_bad_sample_on_one_rank_keeps_steps_aligned(tmp_path: Path) -> None:
    """Rank 0's first shard holds a bad sample: both ranks still run the same steps; rank 0 counts one skip."""
    paths = make_synthetic_shards(tmp_path / "src", num_shards=4, samples_per_shard=3, **SMALL)
    first = raw_samples(paths[0])
    first[1] = edit(first[1], first[1]["__key__"], {"tokens.npy": None})
    paths[0] = write_shard(tmp_path / "bad-000000.tar", first)
    run_distributed(_world_bad_input, 2, paths, tmp_path)
    world = json.loads((tmp_path / "world.json").read_text())
    assert [len(w["steps"]) for w in world] == [6, 6]
    good = [s.key for r in range(2) for s in arrival(paths, 6, dp_rank=r, dp_size=2) if isinstance(s, DecodedSample)]
    assert len(good) == 11
    trained = [k for w in world for step in w["steps"] for k in step["keys"]]
    assert sorted(trained) == sorted(good)
    assert [w["steps"][-1]["skipped"] for w in world] == [1, 0]
    for mine, theirs in zip(world[0]["steps"], world[1]["steps"], strict=True):
        assert mine["predicted_imbalance"] == theirs["predicted_imbalance"]


# === C. Lightning: kill after a checkpoint, resume on exactly the same samples ===================================


LAYOUT = {"dp_shard": 2, "tp": 2}


def fit_omni(out_dir: Path, shards: str, seed_checkpoint: Path, *, max_steps: int, callbacks: list[pl.Callback],
             ckpt_path: str | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ["MASTER_PORT"] = str(free_port())
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=OmniStrategy(launcher="fork", timeout=120, **LAYOUT),
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), callbacks=callbacks,
    )
    module = OmniModule(ReferenceMLLMConfig.tiny(), learning_rate=1e-3, init_checkpoint=str(seed_checkpoint))
    data = OmniDataModule(shards, samples_per_step=2, group_steps=3, reorder_group_size=None)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)


def _keys(run: Path) -> list[dict[int, list[str]]]:
    return recorded_keys(run, 4)


def _losses(run: Path) -> dict[int, float]:
    return {int(step): loss for step, loss in json.loads((run / "losses.json").read_text()).items()}


@pytest.fixture(scope="module")
def omni_runs(tmp_path_factory: pytest.TempPathFactory, tiny_shards: str, seed_checkpoint: Path) -> dict[str, Path]:
    uninterrupted = tmp_path_factory.mktemp("omni_uninterrupted")
    fit_omni(uninterrupted, tiny_shards, seed_checkpoint, max_steps=7,
             callbacks=[RecordRun(uninterrupted), RecordKeys(uninterrupted)])
    killed = tmp_path_factory.mktemp("omni_killed")
    callbacks = [ModelCheckpoint(dirpath=killed / "ckpt", every_n_train_steps=4, save_top_k=-1), RecordRun(killed),
                 RecordKeys(killed), KillAtStep(4)]
    with pytest.raises(Exception, match="exit code 17"):
        fit_omni(killed, tiny_shards, seed_checkpoint, max_steps=7, callbacks=callbacks)
    (checkpoint,) = glob.glob(str(killed / "ckpt" / "*step=4.ckpt"))
    resumed = tmp_path_factory.mktemp("omni_resumed")
    fit_omni(resumed, tiny_shards, seed_checkpoint, max_steps=7, callbacks=[RecordRun(resumed), RecordKeys(resumed)],
             ckpt_path=checkpoint)
    return {"uninterrupted": uninterrupted, "killed": killed, "checkpoint": Path(checkpoint), "resumed": resumed}


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_trains_on_the_same_samples_and_losses(omni_runs: dict[str, Path]) -> None:
    uninterrupted, resumed = _keys(omni_runs["uninterrupted"]), _keys(omni_runs["resumed"])
    assert all(sorted(keys) == list(range(1, 8)) for keys in uninterrupted)
    assert all(sorted(keys) == [5, 6, 7] for keys in resumed)
    for rank in range(4):
        assert resumed[rank] == {s: uninterrupted[rank][s] for s in (5, 6, 7)}, f"rank {rank}"
    losses, reference = _losses(omni_runs["resumed"]), _losses(omni_runs["uninterrupted"])
    assert sorted(losses) == [5, 6, 7]
    assert [losses[s] for s in (5, 6, 7)] == [reference[s] for s in (5, 6, 7)]
    killed = _losses(omni_runs["killed"])
    assert killed == {s: reference[s] for s in (1, 2, 3, 4)}


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_peers_share_samples_and_data_parallel_ranks_split_them(omni_runs: dict[str, Path]) -> None:
    keys = _keys(omni_runs["uninterrupted"])
    # Which ranks are TP peers depends on the mesh; with dp_shard=2 x tp=2 there are two pairs of equal streams.
    pairs = {tuple(r for r in range(4) if keys[r] == keys[rank]) for rank in range(4)}
    assert len(pairs) == 2 and all(len(p) == 2 for p in pairs), pairs
    a, b = (keys[p[0]] for p in sorted(pairs))
    for step in range(1, 8):
        assert not set(a[step]) & set(b[step])
    everything = [k for step in range(1, 8) for k in a[step] + b[step]]
    assert len(everything) == len(set(everything)), "a sample was trained twice"
    # Two full groups (steps 1-6) of three steps x two samples on each of the two data-parallel ranks.
    assert len([k for step in range(1, 7) for k in a[step] + b[step]]) == 2 * 3 * 2 * 2


@pytest.mark.distributed
@pytest.mark.slow
def test_checkpoint_holds_the_consumed_position_of_every_rank(omni_runs: dict[str, Path]) -> None:
    meta = torch.load(omni_runs["checkpoint"] / "meta.pt", weights_only=False)
    ranks = meta["omni"]["ranks"]
    assert sorted({r["dp_rank"] for r in ranks}) == [0, 1]
    for record in ranks:
        (state,) = record["loader"]
        # Step 4 is the first micro-batch of the second group (group_steps=3): not the prefetched second one.
        assert (state["inner"]["group"], state["inner"]["yielded"]) == (1, 1)
