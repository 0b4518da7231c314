"""Fuzzing the loader with bad data: members dropped, emptied, truncated or replaced by random bytes, metadata that
contradicts the payload, and random damage anywhere in a shard's bytes.

With ``on_bad_sample="skip"`` every good sample comes out, in order, and every bad one is counted once (by the
sample stream and by the balancer); with ``"error"`` the first bad sample raises ``ValueError`` naming the shard and
the key. Nothing else may escape, and every read ends (the streams are read a bounded number of records)."""

from __future__ import annotations

import io
import itertools
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_omni_datamodule import SMALL, Raw, balanced, raw_samples, sample_stream, take, write_shard

from omni_lightning.data.packing import DecodedSample
from omni_lightning.data.streaming import BadSample
from omni_lightning.data.synthetic import make_synthetic_shards

# Shards are small (a few ms each to write and read), so these bounds keep the file to a few seconds; no deadline
# because a loaded CI machine makes per-example timing meaningless, and every read is bounded anyway.
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NPY_MAGIC = b"\x93NUMPY"


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> list[Raw]:
    """Good raw samples of every modality (text, image, video, audio) to build shards from."""
    paths = make_synthetic_shards(tmp_path_factory.mktemp("fuzz_pool"), num_shards=2, samples_per_shard=12, seed=11,
                                  **SMALL)
    return [raw for path in paths for raw in raw_samples(path)]


def _members(raw: Raw) -> list[str]:
    return sorted(k for k in raw if not k.startswith("__"))


@st.composite
def broken(draw: st.DrawFn, raw: Raw, key: str) -> Raw:
    """A copy of ``raw`` under ``key`` with one change the loader must reject: a member dropped, emptied, truncated
    or replaced by random bytes, or metadata that contradicts the payload."""
    out = {**raw, "__key__": key}
    member = draw(st.sampled_from(_members(raw)))
    how = draw(st.sampled_from(["drop", "empty", "truncate", "garbage", "metadata"]))
    data = raw[member]
    if how == "drop":
        del out[member]
    elif how == "empty":
        out[member] = b""
    elif how == "truncate":  # a PNG keeps at most half its bytes: its pixel data then surely ends early
        out[member] = data[: draw(st.integers(0, len(data) // 2 if member.endswith(".png") else len(data) - 1))]
    elif how == "garbage":
        garbage = st.binary(min_size=1, max_size=64)
        if member == "json":  # also well-formed JSON that is not an object
            garbage |= st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8),
                                 st.lists(st.integers(), max_size=3)).map(lambda v: json.dumps(v).encode())
        out[member] = draw(garbage.filter(lambda b: _never_valid(member, b)))
    else:
        meta = json.loads(raw["json"])
        if draw(st.booleans()):
            meta["text_tokens"] += draw(st.integers(1, 5)) * draw(st.sampled_from([-1, 1]))
        else:
            meta["images"] = [*meta["images"], [2, 2]]  # an image the sample does not hold
        out["json"] = json.dumps(meta).encode()
    return out


def _never_valid(member: str, data: bytes) -> bool:
    """Random bytes the loader must reject for ``member`` (not a .npy header, not a JSON object)."""
    if member.endswith(".npy"):
        return not data.startswith(NPY_MAGIC[: len(data)])
    if member == "json":
        try:
            return not isinstance(json.loads(data), dict)
        except ValueError:
            return True
    return True  # an image that decodes from 64 random bytes cannot match the patch grid in its metadata


@st.composite
def shard_plans(draw: st.DrawFn, pool: list[Raw]) -> list[tuple[Raw, bool]]:
    """A shard's samples in order, each with whether it is bad: 0-6 good ones and 1-4 broken ones, interleaved."""
    goods = draw(st.lists(st.sampled_from(range(len(pool))), max_size=6, unique=True))
    bads = draw(st.lists(st.sampled_from(range(len(pool))), min_size=1, max_size=4))
    items = [(pool[i], False) for i in goods] + [
        (draw(broken(pool[i], f"bad_{n:02d}")), True) for n, i in enumerate(bads)
    ]
    return draw(st.permutations(items))


def _write(folder: str, plan: list[tuple[Raw, bool]]) -> str:
    return write_shard(Path(folder) / "fuzz.tar", [raw for raw, _ in plan])


@FUZZ
@given(data=st.data())
def test_skip_yields_every_good_sample_and_counts_every_bad_one(pool: list[Raw], data: st.DataObject) -> None:
    plan = data.draw(shard_plans(pool))
    expected = [None if bad else raw["__key__"] for raw, bad in plan]
    with tempfile.TemporaryDirectory() as folder:
        path = _write(folder, plan)
        # One epoch plus the first record of the next: the epoch holds exactly one record per sample.
        records = list(itertools.islice(sample_stream([path]).iter_samples(), len(plan) + 1))
        assert [r.key if isinstance(r, DecodedSample) else None for r in records[:-1]] == expected
        bad = [r for r in records[:-1] if isinstance(r, BadSample)]
        assert [r.key for r in bad] == [raw["__key__"] for raw, is_bad in plan if is_bad]
        assert all(r.shard == path for r in bad)
        assert (records[-1].key, type(records[-1])) == (records[0].key, type(records[0])), "the next epoch"
        # The balancer: one record per micro-batch (a bad one an empty filler), and its skip counter.
        batches = take(balanced([path], samples_per_step=1, group_steps=1), len(plan))
        assert [b["keys"] for b in batches] == [[] if key is None else [key] for key in expected]
        assert batches[-1]["reorder"]["skipped"] == len(bad)


@FUZZ
@given(data=st.data())
def test_error_raises_naming_the_shard_and_the_first_bad_sample(pool: list[Raw], data: st.DataObject) -> None:
    plan = data.draw(shard_plans(pool))
    first_bad = next(i for i, (_, bad) in enumerate(plan) if bad)
    with tempfile.TemporaryDirectory() as folder:
        path = _write(folder, plan)
        stream = sample_stream([path], on_bad_sample="error").iter_samples()
        good = [next(stream).key for _ in range(first_bad)]
        assert good == [raw["__key__"] for raw, _ in plan[:first_bad]]
        with pytest.raises(ValueError, match=rf"^shard {re.escape(path)}, sample {plan[first_bad][0]['__key__']}: "):
            next(stream)


@FUZZ
@given(data=st.data(), on_bad_sample=st.sampled_from(["skip", "error"]))
def test_random_damage_anywhere_in_a_shard(pool: list[Raw], data: st.DataObject, on_bad_sample: str) -> None:
    """Bytes overwritten or the file cut anywhere (tar headers included): only documented outcomes, and the
    samples whose bytes were not touched still come out."""
    samples = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=5, unique_by=lambda r: r["__key__"]))
    with tempfile.TemporaryDirectory() as folder:
        path = write_shard(Path(folder) / "whole.tar", samples)
        content = bytearray(Path(path).read_bytes())
        damaged_from = data.draw(st.integers(0, len(content) - 1))
        if data.draw(st.booleans()):
            del content[damaged_from:]
        else:
            patch = data.draw(st.binary(min_size=1, max_size=32))
            content[damaged_from : damaged_from + len(patch)] = patch
        Path(path).write_bytes(bytes(content))
        untouched = _samples_before(samples, damaged_from)
        stream = sample_stream([path], on_bad_sample=on_bad_sample).iter_samples()
        records: list[Any] = []
        try:
            # Each sample gives at most two records (itself incomplete, then the shard's read error).
            records.extend(itertools.islice(stream, 2 * len(samples) + 1))
        except ValueError as error:
            assert on_bad_sample == "error"
            assert str(error).startswith(f"shard {path}, sample "), error
        decoded = [r.key for r in records if isinstance(r, DecodedSample)]
        assert decoded[: len(untouched)] == untouched
        assert all(isinstance(r, DecodedSample | BadSample) for r in records)


def _samples_before(samples: list[Raw], offset: int) -> list[str]:
    """Keys of the samples whose tar entries (headers and data) all end before byte ``offset``."""
    keys, end = [], 0
    for raw in samples:
        for name in _members(raw):
            end += 512 + -(-len(raw[name]) // 512) * 512  # header block + data padded to whole blocks
        if end > offset:
            break
        keys.append(raw["__key__"])
    return keys


def _npy_with_broken_header() -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.arange(3, dtype=np.int32) + 300)
    # Null bytes in an unclosed header: numpy's fallback parser raises tokenize.TokenError, not ValueError.
    return buffer.getvalue().replace(b"'shape': (3,), }", b"'shape': (3,\x00\x00\x00\x00\x00")


@pytest.mark.parametrize(("member", "data", "reason"), [
    pytest.param("json", b"7", "metadata 'json' is a JSON int, not an object", id="metadata-not-an-object"),
    pytest.param("tokens.npy", _npy_with_broken_header(), "tokens.npy cannot be decoded", id="npy-header-tokenize"),
])
def test_what_fuzzing_found_is_a_bad_sample(pool: list[Raw], tmp_path: Path, member: str, data: bytes,
                                            reason: str) -> None:
    """Inputs the fuzz tests found crashing the loader with other exceptions, kept as fixed regressions."""
    text = next(raw for raw in pool if json.loads(raw["json"])["modality"] == "text")
    path = write_shard(tmp_path / "found.tar", [{**text, "__key__": "bad_found", member: data}])
    (record,) = itertools.islice(sample_stream([path]).iter_samples(), 1)
    assert isinstance(record, BadSample) and reason in record.reason, record
