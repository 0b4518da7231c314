"""Reference MLLM: attention backends against a naive reference, packing, encoders, MoE and the loss mask."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from autograd_graph import backward_node_kinds
from hypothesis import given
from hypothesis import strategies as st

from omni_lightning.batch import BYTE_ROLES, IGNORE_INDEX
from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.modalities import DEFAULT_PACKING, patchify
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.models.llm import MoEFeedForward
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.parallel import attention
from omni_lightning.parallel.activation_checkpoint import apply_ac
from omni_lightning.parallel.attention import (
    equal_length_runs,
    flash_attn_available,
    select_attention_kernel,
    varlen_attention,
)
from omni_lightning.runtime.loss import next_token_loss_sum

# The byte tokens' roles (ids 0-3) and their first text id.
BOS_ID = BYTE_ROLES.bos
IMAGE_ID = BYTE_ROLES.placeholder("image")
AUDIO_ID = BYTE_ROLES.placeholder("audio")


def naive_varlen_attention(q, k, v, cu_seqlens, causal):
    """Item-by-item softmax(QK^T / sqrt(d)) V with explicit loops: the ground truth for both backends."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True):
        qi, ki, vi = q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
        scores = qi @ ki.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            n = end - start
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out[start:end] = (scores.softmax(-1) @ vi).transpose(0, 1)
    return out


# Items of distinct lengths; and runs of neighbours of one length (frames, tiles) with an empty item among them.
BOUNDS = [[0, 5, 6, 17, 30], [0, 4, 8, 12, 12, 13, 19, 25, 30]]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("bounds", BOUNDS)
def test_sdpa_varlen_matches_naive_reference(causal: bool, heads: int, kv_heads: int, bounds: list[int]) -> None:
    torch.manual_seed(0)
    cu = torch.tensor(bounds, dtype=torch.int32)
    q = torch.randn(30, heads, 8, requires_grad=True)
    k = torch.randn(30, kv_heads, 8, requires_grad=True)
    v = torch.randn(30, kv_heads, 8, requires_grad=True)
    out = varlen_attention(q, k, v, cu, causal=causal, backend="sdpa")
    ref = naive_varlen_attention(q, k, v, cu, causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_items_of_one_length_attended_together_give_the_bits_of_one_at_a_time(causal: bool) -> None:
    torch.manual_seed(0)
    lengths = [6, 6, 6, 3, 3, 7]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    q, k, v = (torch.randn(int(cu[-1]), 4, 8, requires_grad=True) for _ in range(3))
    together = varlen_attention(q, k, v, cu, causal=causal, backend="sdpa")
    one_at_a_time = torch.cat([varlen_attention(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a], dtype=torch.int32),
                                                causal=causal, backend="sdpa")
                               for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)])
    assert torch.equal(together, one_at_a_time)
    grads = torch.autograd.grad(together.square().sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad(one_at_a_time.square().sum(), (q, k, v)), strict=True):
        assert torch.equal(got, want)


def test_sdpa_varlen_backward_has_one_node_per_run_and_no_slice_per_item() -> None:
    """A slice's backward writes a gradient the size of the whole packed tensor: one per item would make the
    backward quadratic in the items (a rank with a few hundred video frames spent seconds on it)."""
    lengths = [4] * 50 + [3, 5, 5]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    q, k, v = (torch.randn(int(cu[-1]), 2, 8, requires_grad=True) for _ in range(3))
    kinds = backward_node_kinds([varlen_attention(q, k, v, cu, causal=False, backend="sdpa")])
    assert not [kind for kind in kinds if kind.startswith("SliceBackward")]
    assert sum(n for kind, n in kinds.items() if "ScaledDotProduct" in kind) == 3  # runs of 4, 3 and 5 tokens


@given(st.lists(st.integers(0, 4), max_size=30))
def test_equal_length_runs_rebuild_the_lengths_and_merge_every_pair_of_equal_neighbours(lengths: list[int]) -> None:
    runs = equal_length_runs(lengths)
    assert [length for length, count in runs for _ in range(count)] == lengths
    assert all(count > 0 for _, count in runs)
    assert all(a[0] != b[0] for a, b in zip(runs[:-1], runs[1:], strict=True))


@pytest.mark.parametrize(("device", "dtype", "flash", "torch_varlen", "expected"), [
    ("cuda", torch.bfloat16, True, True, "flash_attn"),
    ("cuda", torch.float16, False, True, "torch_varlen"),
    ("cuda", torch.bfloat16, False, False, "sdpa"),
    ("cuda", torch.float32, True, True, "sdpa"),  # flash-attn refuses fp32
    ("cpu", torch.bfloat16, True, True, "sdpa"),
    ("cpu", torch.float32, False, False, "sdpa"),
])
def test_auto_attention_picks_the_kernel_by_dtype_and_device(device: str, dtype: torch.dtype, flash: bool,
                                                             torch_varlen: bool, expected: str) -> None:
    assert select_attention_kernel("auto", device_type=device, dtype=dtype, flash_installed=flash,
                                   torch_varlen=torch_varlen) == expected
    assert select_attention_kernel("sdpa", device_type=device, dtype=dtype, flash_installed=flash,
                                   torch_varlen=torch_varlen) == "sdpa"


def test_forced_flash_attention_names_what_it_lacks() -> None:
    assert select_attention_kernel("flash", device_type="cuda", dtype=torch.bfloat16, flash_installed=True,
                                   torch_varlen=False) == "flash_attn"
    with pytest.raises(ValueError, match="needs fp16/bf16 CUDA tensors, got torch.float32 on cuda"):
        select_attention_kernel("flash", device_type="cuda", dtype=torch.float32, flash_installed=True,
                                torch_varlen=True)
    with pytest.raises(ValueError, match="needs the flash_attn package"):
        select_attention_kernel("flash", device_type="cuda", dtype=torch.bfloat16, flash_installed=False,
                                torch_varlen=True)


def _fake_varlen_attn(newer: bool) -> Callable[..., torch.Tensor]:
    """A CPU stand-in for ``torch.nn.attention.varlen.varlen_attn`` with its documented semantics, in the signature
    of torch >= 2.11 (``window_size``, ``enable_gqa``) or of 2.10 (``is_causal``, every query head's keys)."""
    def attend(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, gqa, scale=None):
        assert torch.equal(cu_q, cu_k) and max_q == max_k == int(cu_q.diff().max())
        assert gqa or k.shape[1] == q.shape[1], "this kernel wants every query head's keys"
        return varlen_attention(q, k, v, cu_q, causal=causal, backend="sdpa", scale=scale)

    if newer:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False):
            assert window_size in ((-1, -1), (-1, 0))
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=window_size == (-1, 0),
                          gqa=enable_gqa, scale=scale)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal, gqa=False)
    return varlen_attn


@pytest.mark.parametrize("newer", [True, False])
def test_torch_varlen_is_called_with_its_own_causal_and_gqa_arguments(newer: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel itself is CUDA-only; its call (causal as a window or a flag, grouped-query heads) is checked
    against a stand-in with the documented semantics, for both signatures the supported torch versions have."""
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", _fake_varlen_attn(newer))
    call = attention._load_torch_varlen()
    assert call is not None
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 16, 17], dtype=torch.int32)
    q, k, v = torch.randn(17, 4, 8), torch.randn(17, 2, 8), torch.randn(17, 2, 8)
    for causal in (True, False):
        torch.testing.assert_close(call(q, k, v, cu, 11, causal),
                                   varlen_attention(q, k, v, cu, causal=causal, backend="sdpa"))
        # A scale other than head_dim ** -0.5 (Whisper pre-scales its queries and asks for 1.0).
        torch.testing.assert_close(call(q, k, v, cu, 11, causal, 1.0),
                                   varlen_attention(q, k, v, cu, causal=causal, backend="sdpa", scale=1.0))


def test_bf16_attention_on_cpu_runs_sdpa_and_matches_fp32() -> None:
    """CPU bf16 takes SDPA (the fused kernels are CUDA-only); within bf16's rounding of the fp32 result."""
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    q, k, v = torch.randn(16, 4, 8), torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    fp32 = varlen_attention(q, k, v, cu, causal=True)
    bf16 = varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, causal=True)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), fp32, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not flash_attn_available(), reason="flash-attn needs CUDA and the flash_attn package")
def test_flash_varlen_matches_sdpa() -> None:
    torch.manual_seed(0)
    cu = torch.tensor([0, 7, 40, 64], dtype=torch.int32, device="cuda")
    q = torch.randn(64, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(64, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(64, 2, 64, device="cuda", dtype=torch.bfloat16)
    flash = varlen_attention(q, k, v, cu, causal=True, backend="flash")
    sdpa = varlen_attention(q, k, v, cu, causal=True, backend="sdpa")
    torch.testing.assert_close(flash.float(), sdpa.float(), atol=2e-2, rtol=2e-2)


def test_host_bounds_are_read_once_per_tensor_and_again_after_an_in_place_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[tuple[int, ...]] = []
    monkeypatch.setattr(attention, "_read_bounds", lambda cu: reads.append(tuple(cu.tolist())) or reads[-1])
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert attention.host_bounds(cu) is attention.host_bounds(cu) and reads == [(0, 3, 7)]
    cu[2] = 9
    assert attention.host_bounds(cu) == (0, 3, 9) and len(reads) == 2
    other = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert attention.host_bounds(other) == (0, 3, 7) and len(reads) == 3
    key = id(cu)
    del cu
    assert key not in attention._HOST_BOUNDS  # dropped with its tensor: a later tensor with that id reads afresh
    with torch.inference_mode():  # no version counter: read every time, and still right
        frozen = torch.tensor([0, 2, 5], dtype=torch.int32)
        assert attention.host_bounds(frozen) == attention.host_bounds(frozen) == (0, 2, 5) and len(reads) == 5
        q = torch.randn(5, 2, 4)
        torch.testing.assert_close(varlen_attention(q, q, q, frozen, causal=True),
                                   varlen_attention(q, q, q, frozen.clone(), causal=True))


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_forward_and_backward_read_each_packed_batchs_bounds_once(checkpointed: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every attention layer of the LLM and of each encoder takes its bounds from one read of their tensor, also where
    the backward recomputes checkpointed blocks (on an accelerator each read waits for the device)."""
    seen: list[torch.Tensor] = []  # kept alive, so that no two of them share an id
    reads: list[int] = []
    host_bounds, read_bounds = attention.host_bounds, attention._read_bounds
    monkeypatch.setattr(attention, "host_bounds", lambda cu: seen.append(cu) or host_bounds(cu))
    monkeypatch.setattr(attention, "_read_bounds", lambda cu: reads.append(id(cu)) or read_bounds(cu))
    torch.manual_seed(0)
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    if checkpointed:
        apply_ac([*model.llm.layers.values(), *(block for encoder in model.encoders.values() for block in
                                                 encoder.blocks)])
    rng = np.random.default_rng(2)
    batch = pack_samples([_sample(rng, "a", images=2), _sample(rng, "b", audio_frames=12)])
    model(batch).float().square().mean().backward()
    forward_calls = sum(len(model.encoders[name].blocks) for name in model.encoders) + len(model.llm.layers)
    assert len(seen) == forward_calls * (2 if checkpointed else 1)
    assert sorted(reads) == sorted({id(cu) for cu in seen}) and len(reads) == 1 + len(model.encoders)


def test_empty_attention_keeps_inputs_in_the_graph() -> None:
    q = torch.zeros(0, 4, 8, requires_grad=True)
    k = torch.zeros(0, 4, 8, requires_grad=True)
    out = varlen_attention(q, k, k, torch.tensor([0], dtype=torch.int32), causal=True)
    assert out.shape == (0, 4, 8)
    out.sum().backward()
    assert q.grad is not None and k.grad is not None


def _sample(rng: np.random.Generator, key: str, *, images: int = 0, audio_frames: int = 0) -> DecodedSample:
    return DecodedSample(
        key,
        rng.integers(4, 256, int(rng.integers(3, 12))).astype(np.int32),
        [rng.integers(0, 256, (28 * int(rng.integers(1, 3)), 28 * 2, 3), dtype=np.uint8) for _ in range(images)],
        rng.standard_normal((audio_frames, 80)).astype(np.float16) if audio_frames else None,
    )


def test_patchify_groups_each_2x2_window() -> None:
    image = np.arange(28 * 56 * 3, dtype=np.uint8).reshape(28, 56, 3)
    patches, positions, grid = patchify(image[None], DEFAULT_PACKING)
    assert grid.tolist() == [[2, 4]]
    assert positions.tolist()[:8] == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    # Patch (row 1, col 2) holds pixels [14:28, 28:42] in (channel, y, x) order.
    expected = torch.from_numpy(image[14:28, 28:42].astype(np.float32)).div(127.5).sub(1).permute(2, 0, 1)
    torch.testing.assert_close(torch.from_numpy(patches[6]), expected.reshape(-1))
    with pytest.raises(ValueError, match="even"):
        patchify(np.zeros((1, 14, 28, 3), dtype=np.uint8), DEFAULT_PACKING)


def test_pack_layout_and_loss_mask() -> None:
    rng = np.random.default_rng(0)
    samples = [_sample(rng, "a", images=1), _sample(rng, "b"), _sample(rng, "c", audio_frames=8)]
    batch = pack_samples(samples)
    ids, labels, cu = batch["input_ids"], batch["labels"], batch["cu_seqlens"].tolist()
    vision_tokens = int(batch["vision_grids"].prod(-1).sum()) // 4
    assert int((ids == IMAGE_ID).sum()) == vision_tokens
    assert int((ids == AUDIO_ID).sum()) == 2
    assert ids[cu[:-1]].tolist() == [BOS_ID] * 3
    assert batch["position_ids"][cu[:-1]].tolist() == [0, 0, 0]
    for start, end, sample in zip(cu[:-1], cu[1:], samples, strict=True):
        text = torch.from_numpy(sample.tokens.astype(np.int64))
        # Every text token is predicted exactly once, from the position before it; nothing else is a target.
        assert labels[start:end][labels[start:end] != IGNORE_INDEX].tolist() == text.tolist()
        assert labels[end - 1] == IGNORE_INDEX


def test_packing_equals_running_samples_one_by_one() -> None:
    """Block-diagonal masks and per-sample positions make a packed batch equal to its samples run alone."""
    torch.manual_seed(0)
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny(moe=True))
    rng = np.random.default_rng(1)
    samples = [_sample(rng, "a", images=2), _sample(rng, "b", audio_frames=12), _sample(rng, "c", images=1)]
    packed = model(pack_samples(samples))
    alone = torch.cat([model(pack_samples([s])) for s in samples])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_every_parameter_gets_a_gradient_without_media() -> None:
    """A text-only micro-batch still runs both encoders (dummy items), so FSDP reduces the same tensors everywhere."""
    torch.manual_seed(0)
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny(moe=True))
    batch = pack_samples([_sample(np.random.default_rng(2), "t")])
    loss_sum, count = next_token_loss_sum(model(batch), batch["labels"])
    (loss_sum / count).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert missing == []


def test_placeholder_mismatch_is_reported() -> None:
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    batch = pack_samples([_sample(np.random.default_rng(3), "x", images=1)])
    batch["input_ids"][1] = 10  # one vision placeholder fewer than the encoder produces
    with pytest.raises(ValueError, match="vision placeholder"):
        model(batch)


def test_moe_matches_dense_top_k_reference() -> None:
    torch.manual_seed(0)
    moe = MoEFeedForward(dim=16, hidden=32, n_experts=4, top_k=2)
    x = torch.randn(20, 16)
    probs = moe.router(x).softmax(-1)
    weights, chosen = probs.topk(2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    experts = moe.experts

    def expert(e: int, row: torch.Tensor) -> torch.Tensor:
        return (F.silu(row @ experts.w1[e].t()) * (row @ experts.w3[e].t())) @ experts.w2[e].t()

    expected = torch.stack(
        [sum(w * expert(int(e), x[t]) for w, e in zip(weights[t], chosen[t], strict=True)) for t in range(20)]
    )
    torch.testing.assert_close(moe(x), expected, atol=1e-5, rtol=1e-5)


def test_load_balance_loss_is_minimal_for_uniform_routing() -> None:
    """n_experts * sum f_e p_e is 1 when routing and probabilities are uniform, larger when one expert dominates."""
    moe = MoEFeedForward(dim=8, hidden=16, n_experts=4, top_k=1)
    probs = torch.full((8, 4), 0.25)
    chosen = torch.arange(8).remainder(4)[:, None]
    torch.testing.assert_close(moe._load_balance_share(probs, chosen), torch.tensor(1.0))
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(8, 1)
    assert moe._load_balance_share(skewed, torch.zeros(8, 1, dtype=torch.long)) > 2.5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_heads": 5}, "divisible by llm.n_heads"),
        ({"n_kv_heads": 3}, "multiple of llm.n_kv_heads"),
        ({"vocab_size": 3}, "reserved ids"),
    ],
)
def test_bad_model_config_is_named(change: dict[str, int], message: str) -> None:
    config = ReferenceMLLMConfig.tiny()
    for key, value in change.items():
        setattr(config.llm, key, value)
    with pytest.raises(ValueError, match=message):
        ReferenceMLLMConfig(vision=config.vision, audio=config.audio, llm=config.llm)
