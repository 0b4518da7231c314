"""Context parallelism: head-tail sharding (pure) and all-gather-KV causal attention against one rank.

Tolerance 1e-5: each query's softmax runs over the same keys in the same order as on one rank (the gathered keys
are restored to global order), so results differ only by fp32 rounding in the collectives' copies (none) and in
SDPA's masked versus causal kernels (~1e-7).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from hypothesis import given
from hypothesis import strategies as st

from omni_lightning.parallel.attention import varlen_attention
from omni_lightning.parallel.context_parallel import cp_attention, head_tail_indices, shard_for_context_parallel


def _causal_work(share: list[int], lengths: list[int]) -> int:
    """Keys a rank's queries attend to: each query's in-sample position + 1."""
    starts = [sum(lengths[:s]) for s in range(len(lengths))]
    return sum(i - max(s for s in starts if s <= i) + 1 for i in share)


@given(st.lists(st.integers(1, 64), min_size=1, max_size=8), st.sampled_from([1, 2, 3, 4]))
def test_head_tail_shards_partition_the_batch(lengths: list[int], cp: int) -> None:
    kept = head_tail_indices(lengths, cp)
    assert sorted(i for share in kept for i in share) == list(range(sum(lengths)))
    assert all(share == sorted(share) for share in kept)  # by sample, head before tail


@given(st.lists(st.integers(1, 8), min_size=1, max_size=6), st.sampled_from([1, 2, 3, 4]))
def test_head_tail_evens_causal_work(units: list[int], cp: int) -> None:
    """Chunk r (early, cheap) with chunk 2cp-1-r (late, dear): equal causal work on every rank when each sample
    is a multiple of 2 cp tokens (otherwise the remainder tokens make the difference)."""
    lengths = [u * 2 * cp for u in units]
    work = [_causal_work(share, lengths) for share in head_tail_indices(lengths, cp)]
    assert len(set(work)) == 1


def test_head_tail_layout_of_one_sample() -> None:
    assert head_tail_indices([8], 2) == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert head_tail_indices([3, 5], 2) == [[0, 3, 4, 7], [1, 2, 5, 6]]


def _check_cp(rank: int, world: int, lengths: list[int]) -> None:
    torch.manual_seed(0)  # the same full batch on every rank, for the reference
    heads, kv_heads, dim = 4, 2, 8
    total = sum(lengths)
    q = torch.randn(total, heads, dim, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(total, kv_heads, dim, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    reference = varlen_attention(q, k, v, cu_seqlens, causal=True, backend="sdpa")
    weight = torch.randn_like(reference)
    ref_grads = torch.autograd.grad((reference * weight).sum(), (q, k, v))

    shard = shard_for_context_parallel(cu_seqlens, dist.group.WORLD)
    local = shard.local_index
    mine = [t.detach()[local].clone().requires_grad_(True) for t in (q, k, v)]
    out = cp_attention(*mine, shard)
    torch.testing.assert_close(out, reference[local], atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad((out * weight[local]).sum(), mine, allow_unused=True)
    # Each rank's key/value gradient covers only its queries' use of them; the owner gets the sum over peers.
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want[local], atol=1e-5, rtol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world", "lengths"),
    [(2, [8, 5, 16]), (4, [13, 3, 30]), (4, [1, 2])],
    ids=["cp2", "cp4-short-sample", "cp4-rank-without-tokens"],
)
def test_cp_attention_matches_one_rank(world: int, lengths: list[int]) -> None:
    """Uneven samples; one shorter than 2 * cp (some ranks hold none of it); a batch so short that a rank holds
    no token at all and must still take part in every exchange."""
    run_distributed(_check_cp, world, lengths)
