"""One attention entry point for packed variable-length sequences.

Items (images, audio clips, text samples) are packed back to back into one token dimension and delimited by
``cu_seqlens`` (cumulative lengths, ``[0, l0, l0+l1, ...]``). Which kernel runs is decided by the tensors
(:func:`select_attention_kernel`): fp16/bf16 tensors on CUDA go straight to flash-attn's varlen kernel where it
is installed, else to PyTorch's own (``torch.nn.attention.varlen``) where this torch has it; everything else
(fp32 anywhere, any dtype on CPU) runs PyTorch SDPA item by item (optionally causal), which does the same work,
``sum(len_i ** 2)``, at the cost of one call per run of neighbouring items of one length.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = ["AttentionBackend", "AttentionKernel", "attention_kernel", "cu_seqlens_from_lengths",
           "equal_length_runs", "flash_attn_available", "host_bounds", "select_attention_kernel", "varlen_attention"]

AttentionBackend = Literal["auto", "sdpa", "flash"]
AttentionKernel = Literal["flash_attn", "torch_varlen", "sdpa"]

_HALF = (torch.float16, torch.bfloat16)


def cu_seqlens_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``[l0, l1, ...]`` -> int32 ``[0, l0, l0+l1, ...]``."""
    return F.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)


# Each live cu_seqlens tensor's host copy, by id: (the tensor, weakly; its version when read; the bounds).
_HOST_BOUNDS: dict[int, tuple[weakref.ref[torch.Tensor], int, tuple[int, ...]]] = {}


def host_bounds(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """``cu_seqlens`` as host integers, read once per tensor (again after an in-place change that bumps its version
    counter; a write through ``.data`` or a NumPy view does not).

    Every layer of a forward attends over the same boundaries, and so does the recomputation of its checkpointed
    blocks; on an accelerator each read waits for the device to finish all work queued before it, which would stall
    the host's run-ahead at every layer. An inference tensor (validation under ``torch.inference_mode``) keeps no
    version counter to tell an in-place change by, so it is read every time."""
    if cu_seqlens.is_inference():
        return _read_bounds(cu_seqlens)
    key = id(cu_seqlens)
    cached = _HOST_BOUNDS.get(key)
    if cached is not None and cached[0]() is cu_seqlens and cached[1] == cu_seqlens._version:
        return cached[2]
    bounds = _read_bounds(cu_seqlens)
    # Dropped with the tensor, so that a later tensor given the same id is read afresh.
    alive = weakref.ref(cu_seqlens, lambda _, key=key: _HOST_BOUNDS.pop(key, None))
    _HOST_BOUNDS[key] = (alive, cu_seqlens._version, bounds)
    return bounds


def _read_bounds(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    return tuple(cu_seqlens.tolist())


# Looked up once, at import: the kernel choice runs inside compiled graphs, which should not trace a lookup.
FLASH_ATTN_INSTALLED = importlib.util.find_spec("flash_attn") is not None


def flash_attn_available() -> bool:
    """Whether the flash-attn varlen kernel can be used in this process."""
    return torch.cuda.is_available() and FLASH_ATTN_INSTALLED


def _load_torch_varlen() -> Callable[..., torch.Tensor] | None:
    """PyTorch's varlen attention (torch >= 2.10), called as flash-attn is, or ``None`` where this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    gqa = "enable_gqa" in parameters

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_seqlen: int,
             causal: bool, scale: float | None = None) -> torch.Tensor:
        if not gqa and k.shape[1] != q.shape[1]:  # older kernels want every query head's keys
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        kwargs: dict[str, Any] = {"enable_gqa": True} if gqa and k.shape[1] != q.shape[1] else {}
        if scale is not None and "scale" in parameters:
            kwargs["scale"] = scale
        elif scale is not None:  # a kernel without the argument: fold the scale into the queries
            q = q * (scale * q.shape[-1] ** 0.5)
        if "window_size" in parameters:  # torch > 2.10
            kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
        else:
            kwargs["is_causal"] = causal
        return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)

    return call


_TORCH_VARLEN = _load_torch_varlen()


def select_attention_kernel(backend: AttentionBackend, *, device_type: str, dtype: torch.dtype,
                            flash_installed: bool, torch_varlen: bool) -> AttentionKernel:
    """The kernel for tensors of ``dtype`` on ``device_type``: the fused varlen kernels take fp16/bf16 on CUDA
    only (flash-attn first, then PyTorch's), everything else runs SDPA item by item. ``backend="flash"`` insists
    on flash-attn (``ValueError`` naming what is missing), ``"sdpa"`` on SDPA."""
    fused = device_type == "cuda" and dtype in _HALF
    if backend == "sdpa":
        return "sdpa"
    if backend == "flash":
        if not flash_installed:
            raise ValueError("attention_backend='flash' needs the flash_attn package (pip install -e '.[gpu]'); "
                             "'auto' picks a kernel by dtype and device")
        if not fused:
            raise ValueError(f"attention_backend='flash' needs fp16/bf16 CUDA tensors, got {dtype} on {device_type}: "
                             "train with param_dtype='bfloat16' on a GPU, or use 'auto'")
        return "flash_attn"
    if backend != "auto":
        raise ValueError(f"attention backend {backend!r} must be 'auto', 'sdpa' or 'flash'")
    if fused and flash_installed:
        return "flash_attn"
    if fused and torch_varlen:
        return "torch_varlen"
    return "sdpa"


def attention_kernel(backend: AttentionBackend, device_type: str, dtype: torch.dtype) -> AttentionKernel:
    """The kernel :func:`varlen_attention` runs for tensors of ``dtype`` on ``device_type`` in this process."""
    return select_attention_kernel(backend, device_type=device_type, dtype=dtype,
                                   flash_installed=FLASH_ATTN_INSTALLED, torch_varlen=_TORCH_VARLEN is not None)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    causal: bool,
    max_seqlen: int | None = None,
    backend: AttentionBackend = "auto",
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over packed items.

    Args:
        q: ``[total, n_heads, head_dim]``.
        k, v: ``[total, n_kv_heads, head_dim]``; ``n_heads`` must be a multiple of ``n_kv_heads`` (GQA).
        cu_seqlens: int32 ``[n_items + 1]`` cumulative item lengths.
        causal: mask future tokens inside each item.
        max_seqlen: longest item (flash-attn needs it; computed when omitted).
        backend: ``"flash"`` insists on flash-attn, ``"sdpa"`` on the per-item SDPA path, ``"auto"`` picks by dtype
            and device (:func:`select_attention_kernel`).
        scale: the softmax scale (``None``: ``head_dim ** -0.5``).

    Returns:
        ``[total, n_heads, head_dim]``.
    """
    total, n_heads, _ = q.shape
    if n_heads % k.shape[1]:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of key/value heads ({k.shape[1]})")
    if total == 0:
        # Keep q, k and v in the graph so that a rank with nothing to attend still produces (zero) gradients for
        # every projection: FSDP reduce-scatters expect the same gradients on every rank.
        return q + 0.0 * (k.sum() + v.sum())
    kernel = attention_kernel(backend, q.device.type, q.dtype)
    if kernel != "sdpa":
        if max_seqlen is None:
            bounds = host_bounds(cu_seqlens)
            max_seqlen = max(end - start for start, end in itertools.pairwise(bounds))
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        if kernel == "flash_attn":
            from flash_attn import flash_attn_varlen_func

            return flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=causal, softmax_scale=scale)
        assert _TORCH_VARLEN is not None
        return _TORCH_VARLEN(q, k, v, cu, max_seqlen, causal, scale)
    # Item by item: the work is sum(len_i ** 2), as with flash-attn, where a block-diagonal mask over the packed
    # sequence would cost (sum len_i) ** 2 and make the cost model's per-item attention term wrong. Neighbours of one
    # length (a video's frames, an image's tiles) go in one call, as a batch.
    bounds = host_bounds(cu_seqlens)
    if bounds[-1] != total:
        raise ValueError(f"cu_seqlens covers {bounds[-1]} tokens but the packed tensor has {total}")
    runs = equal_length_runs([end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)])
    sizes = [length * count for length, count in runs]
    outputs = []
    # One split, not a slice per item: each slice's backward would write a gradient the size of the whole packed
    # tensor, which makes the backward quadratic in the number of items.
    for (length, count), q_run, k_run, v_run in zip(runs, q.split(sizes), k.split(sizes), v.split(sizes),
                                                     strict=True):
        if not length:
            continue
        # [items, heads, len, dim]: with a batch dimension SDPA can take its fused (flash) kernels, which keep no
        # attention matrix for the backward; 3-D inputs fall back to the math kernel, which keeps one per item.
        out = F.scaled_dot_product_attention(
            *(t.unflatten(0, (count, length)).transpose(1, 2) for t in (q_run, k_run, v_run)),
            is_causal=causal,
            enable_gqa=n_heads != k.shape[1],
            scale=scale,
        )
        outputs.append(out.transpose(1, 2).flatten(0, 1))
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def equal_length_runs(lengths: list[int]) -> list[tuple[int, int]]:
    """``lengths`` as ``(length, count)`` runs of neighbours of equal length, in order."""
    return [(length, len(list(run))) for length, run in itertools.groupby(lengths)]
