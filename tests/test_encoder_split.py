"""Encoder work on every GPU: tensor- and context-parallel peers hold the same samples, so they split the encoder
items instead of each encoding all of them. On 2 gloo ranks: the gathered outputs equal one process encoding
everything, each peer encodes only its share of the tokens, and after the gradients' reduction every peer holds the
whole gradient. Tensor-parallel peers hold the same gradient of the outputs (the encoders' weight gradients are summed
over them); context-parallel peers each hold the part of their own token share (summed before each peer's backward,
while FSDP sums the weight gradients over them, as the test does by hand)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from omni_lightning import ReferenceMLLM, ReferenceMLLMConfig
from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.runtime.encoders import LocalEncoders
from omni_lightning.runtime.peers import SamplePeers


def _batch() -> dict:
    rng = np.random.default_rng(0)
    samples = []
    for i, (h, w) in enumerate([(28, 56), (56, 56), (28, 28), (84, 28), (56, 112)]):
        mel = rng.standard_normal((8 * (i + 1), 80)).astype(np.float32) if i % 2 else None
        samples.append(DecodedSample(f"s{i}", np.arange(5, 12), images=[rng.integers(0, 255, (h, w, 3), np.uint8)],
                                     mel=mel))
    return pack_samples(samples)


def _encoded_tokens(model: ReferenceMLLM) -> list[int]:
    """Tokens each encoder's ``encode`` saw on this rank (its share)."""
    seen: list[int] = []
    for encoder in model.encoders.values():
        original = encoder.encode

        def counting(x, *args, _original=original, **kwargs):
            seen.append(x.shape[0])
            return _original(x, *args, **kwargs)
        encoder.encode = counting
    return seen


def _world(rank: int, world_size: int, kind: str) -> None:
    torch.manual_seed(0)
    model = ReferenceMLLM(ReferenceMLLMConfig.tiny())
    batch = _batch()
    weights = {name: torch.randn(out.shape) for name, (out,) in model.encode(batch).items()}
    reference = {name: out.detach() for name, (out,) in model.encode(batch).items()}
    sum(((model.encode(batch)[name][0] * w).sum() for name, w in weights.items()), torch.zeros(())).backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    seen = _encoded_tokens(model)
    world = dist.group.WORLD
    peers = SamplePeers(world, None, world) if kind == "tp" else SamplePeers(world, world, None)
    source = LocalEncoders(model, peers=peers)
    source.start([batch], train=True)
    outputs = source.outputs(0)
    split = {name: outputs[name][0] for name in weights}
    for name, out in split.items():
        torch.testing.assert_close(out, reference[name], rtol=0, atol=1e-6)
    if kind == "cp":  # each peer holds the gradient of its own rows only (its token share's placeholders)
        weights = {name: w * (torch.arange(w.shape[0])[:, None] % world_size == rank) for name, w in weights.items()}
    sum((split[name] * w).sum() for name, w in weights.items()).backward()
    source.sync_gradients()
    if kind == "cp":  # what FSDP does over the context-parallel ranks
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
    for name, grad in whole.items():  # the same terms summed in another order (per peer, then over the peers)
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=0,
                                   atol=1e-5 * float(grad.abs().max()) + 1e-9)
    # Each peer encoded a share: together the whole once, neither all of it.
    shares = torch.tensor(seen, dtype=torch.long)
    totals = [torch.zeros_like(shares) for _ in range(world_size)]
    dist.all_gather(totals, shares)
    items = [int(model.encoders[n].item_tokens(*model.encoder_inputs(batch, n)).sum()) for n in weights]
    assert (sum(totals) == torch.tensor(items)).all() and all((t < torch.tensor(items)).all() for t in totals)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["tp", "cp"])
def test_peers_holding_the_same_samples_split_the_encoder_items(kind: str) -> None:
    run_distributed(_world, 2, kind)
