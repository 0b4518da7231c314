"""Ulysses attention over an item split across ranks equals attention on one rank, outputs and gradients.

Tolerance 1e-5 (absolute and relative): the split only reorders which rank computes which head; fp32 sums inside
each head are the same length, so differences stay at rounding level (~1e-7).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed

from omni_lightning.parallel.sequence_parallel import split_lengths, ulysses_attention


def test_split_lengths() -> None:
    assert split_lengths(13, 4) == [4, 3, 3, 3]
    assert split_lengths(20, 3, multiple=4) == [8, 8, 4]
    assert split_lengths(4, 4, multiple=4) == [4, 0, 0, 0]
    with pytest.raises(ValueError, match="cannot split 13 tokens"):
        split_lengths(13, 2, multiple=4)


def _check_ulysses(rank: int, world_size: int, total: int, causal: bool) -> None:
    torch.manual_seed(0)  # the same full item on every rank, for the reference
    heads, dim = 8, 16
    q, k, v = (torch.randn(total, heads, dim, dtype=torch.float64, requires_grad=True) for _ in range(3))
    reference = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=causal)
    reference = reference.transpose(0, 1)
    weight = torch.randn_like(reference)
    ref_grads = torch.autograd.grad((reference * weight).sum(), (q, k, v))

    lengths = split_lengths(total, world_size)
    start = sum(lengths[:rank])
    chunk = slice(start, start + lengths[rank])
    local = [t.detach()[chunk].clone().requires_grad_(True) for t in (q, k, v)]
    out = ulysses_attention(*local, lengths, dist.group.WORLD, causal=causal)
    torch.testing.assert_close(out, reference[chunk], atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad((out * weight[chunk]).sum(), local)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want[chunk], atol=1e-5, rtol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "total", "causal"), [(2, 12, False), (4, 13, False), (4, 10, True)])
def test_ulysses_matches_one_rank(world_size: int, total: int, causal: bool) -> None:
    """Even and uneven chunks (13 tokens over 4 ranks: no padding), bidirectional and causal."""
    run_distributed(_check_ulysses, world_size, total, causal)


def _check_bad_heads(rank: int, world_size: int) -> None:
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="3 attention heads cannot be split over an SP group of 2"):
        ulysses_attention(x, x, x, [2, 2], dist.group.WORLD)


@pytest.mark.distributed
def test_heads_must_divide_the_group() -> None:
    run_distributed(_check_bad_heads, 2)
