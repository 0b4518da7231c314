"""Summing many tensors over a group in buckets: the sums of one all-reduce each, in fewer collectives."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from omni_lightning.parallel.coalesced import all_reduce_coalesced


def _tensors(rank: int) -> list[torch.Tensor]:
    """Shapes, dtypes and strides of a model's gradients: a transposed (non-contiguous) view, bf16 beside fp32,
    an empty shard, a scalar."""
    generator = torch.Generator().manual_seed(rank)
    big = torch.randn(6, 5, generator=generator)
    return [torch.randn(3, 4, generator=generator), big.t(), torch.randn(7, generator=generator).bfloat16(),
            torch.zeros(0), torch.randn((), generator=generator), torch.randn(2, 2, generator=generator).bfloat16()]


def _check(rank: int, world: int, bucket_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = []
    for tensor in _tensors(rank):
        alone = tensor.clone()
        dist.all_reduce(alone)
        expected.append(alone)
    calls: Counter[str] = Counter()
    all_reduce = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["all_reduce"] += 1
        return all_reduce(*args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting)
    mine = _tensors(rank)
    issued = all_reduce_coalesced(mine, None, bucket_bytes=bucket_bytes)
    monkeypatch.undo()
    for got, want in zip(mine, expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same sums: fp32 and bf16 sums of two addends
    assert issued == calls["all_reduce"]
    # Two dtypes: one bucket each when they fit; with 40-byte buckets the 120-byte view sits alone.
    assert issued == (2 if bucket_bytes >= 2**20 else 4), issued


@pytest.mark.parametrize("bucket_bytes", [2**20, 40])
def test_buckets_sum_each_tensor_as_its_own_all_reduce_would(bucket_bytes: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    run_distributed(_check, 2, bucket_bytes, monkeypatch)
