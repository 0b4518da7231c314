"""What the SDPA attention path (fp32 anywhere, any dtype on CPU) costs forward and backward over many packed items.

``varlen_attention`` splits the packed tensors once and gives runs of neighbouring items of one length (a video's
frames, an image's tiles) to SDPA as one batch. Before 2026-12-06 it sliced the packed tensors once per item, and
each slice's backward wrote a gradient the size of the whole packed tensor, so the backward grew with items times
tokens: a per-item cost no cost model priced. This times both over the reference model's vision attention shape
(``benchmarks/e2e.py``'s encoder: heads and head size), for ``--items`` items of ``--tokens`` tokens each (frames)
and of lengths spread around it (distinct neighbours, so no batching: the split alone). The least of ``--repeats``.

    python benchmarks/attention_items.py [--items 16 64 256] [--tokens 80] [--repeats 3]

The last line is ``attention forward+backward, N frames of T tokens: X ms sliced per item, Y ms now``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from e2e import CONFIG

from omni_lightning.parallel.attention import varlen_attention


def sliced_per_item(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The SDPA path as it was: one slice of the packed tensors and one call per item."""
    bounds = cu_seqlens.tolist()
    return torch.cat([
        F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                       v[a:b].transpose(0, 1)[None])[0].transpose(0, 1)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ])


def now(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return varlen_attention(q, k, v, cu_seqlens, causal=False, backend="sdpa")


def least_ms(attend: Callable[..., torch.Tensor], lengths: list[int], repeats: int) -> float:
    """Least milliseconds of one forward and backward over items of ``lengths``."""
    heads = CONFIG.vision.n_heads
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    q, k, v = (torch.randn(int(cu[-1]), heads, CONFIG.vision.dim // heads, requires_grad=True) for _ in range(3))
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms the allocator
        start = time.thread_time()
        attend(q, k, v, cu).square().sum().backward()
        best = min(best, time.thread_time() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--tokens", type=int, default=80, help="tokens per frame (the e2e videos' 10x8 patches)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(f"vision attention: {CONFIG.vision.n_heads} heads of {CONFIG.vision.dim // CONFIG.vision.n_heads}, fp32, "
          f"1 thread, training-thread CPU, least of {args.repeats}")
    line = ""
    for items in args.items:
        mixed = rng.integers(args.tokens // 2, 3 * args.tokens // 2, size=items).tolist()
        for what, lengths in ((f"{items} frames of {args.tokens} tokens", [args.tokens] * items),
                              (f"{items} items of {args.tokens // 2}-{3 * args.tokens // 2} tokens", mixed)):
            before, after = (least_ms(attend, lengths, args.repeats) for attend in (sliced_per_item, now))
            print(f"  {what:<32} sliced per item {before:9.1f} ms, now {after:8.1f} ms ({before / after:5.1f}x)")
            if lengths == [args.tokens] * items:
                line = f"attention forward+backward, {what}: {before:.1f} ms sliced per item, {after:.1f} ms now"
    print(line)


if __name__ == "__main__":
    main()
