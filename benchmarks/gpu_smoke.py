"""One-GPU smoke test: flash-attn against SDPA on packed items, NCCL, and bf16 training speed of the reference MLLM.

On a CUDA machine (with ``pip install -e '.[gpu]'`` for flash-attn):

1. ``varlen_attention`` with flash-attn and with per-item SDPA on the same packed, variable-length, causal and
   bidirectional items, GQA included: the largest difference, in bf16, must stay under ``--attention-tolerance``;
2. a one-process NCCL group all-reduces a tensor (the backend initialises and computes);
3. ``--steps`` training steps of a ReferenceMLLM (ViT + audio encoder + decoder, ``--size``) in bf16 autocast
   on packed micro-batches of the ``--workload`` samples: tokens/s and the model FLOPs utilisation against
   ``--peak-flops`` (dense bf16 FLOP/s of the GPU; known GPUs are looked up by name).

``--dry-run`` runs the same code on the CPU with a tiny model, SDPA against a dense block-diagonal mask and gloo
instead of flash-attn and NCCL, so the script is tested without a GPU. Results go to ``results/gpu_smoke.json``
(or ``--out``); the last line is ``tokens/s: X  mfu: Y``.

    python benchmarks/gpu_smoke.py [--dry-run] [--steps 20] [--size small] [--peak-flops 989e12]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from common import free_port

from omni_lightning.balance.workload import load_workload, sample_metadata
from omni_lightning.batch import BYTE_ROLES
from omni_lightning.data.packing import DecodedSample, pack_samples
from omni_lightning.models.config import (
    AudioEncoderConfig,
    LLMConfig,
    ReferenceMLLMConfig,
    VisionEncoderConfig,
)
from omni_lightning.models.flops import reference_cost_model
from omni_lightning.models.mllm import ReferenceMLLM
from omni_lightning.monitor import batch_training_flops
from omni_lightning.parallel.attention import varlen_attention
from omni_lightning.runtime.loss import next_token_loss_sum

FIRST_TEXT_ID = BYTE_ROLES.first_free_id

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_smoke.json"
# Dense bf16 tensor-core peaks (no sparsity), by a substring of torch.cuda.get_device_name().
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}
SIZES = {
    "tiny": ReferenceMLLMConfig.tiny(),
    "small": ReferenceMLLMConfig(
        vision=VisionEncoderConfig(dim=768, n_layers=12, n_heads=12),
        audio=AudioEncoderConfig(n_mels=80, dim=512, n_layers=6, n_heads=8),
        llm=LLMConfig(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_hidden=5632, vocab_size=32000),
    ),
}


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], causal: bool) -> torch.Tensor:
    """Attention over the whole packed sequence with a block-diagonal (and causal) mask: slow, independent."""
    total = q.shape[0]
    item = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff()).to(q.device)
    mask = item[:, None] == item[None, :]
    if causal:
        mask &= torch.ones(total, total, dtype=torch.bool, device=q.device).tril()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


def check_attention(device: torch.device, dtype: torch.dtype, dry_run: bool) -> float:
    """Largest difference between the two attention paths over causal and bidirectional packed items."""
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 7, 64, 300, 33] if dry_run else [1, 17, 256, 1500, 4096, 77]
    cu = [0, *np.cumsum(lengths).tolist()]
    worst = 0.0
    for causal in (True, False):
        q = torch.randn(cu[-1], 8, 64, generator=generator).to(device, dtype)
        k, v = (torch.randn(cu[-1], 2, 64, generator=generator).to(device, dtype) for _ in range(2))
        cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
        sdpa = varlen_attention(q, k, v, cu_seqlens, causal=causal, backend="sdpa")
        other = (_dense_reference(q, k, v, cu, causal) if dry_run
                 else varlen_attention(q, k, v, cu_seqlens, causal=causal, backend="flash"))
        worst = max(worst, float((sdpa.float() - other.float()).abs().max()))
    return worst


def check_collective(backend: str) -> bool:
    """A one-process group of ``backend`` all-reduces a tensor."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        x = torch.arange(4.0, device="cuda" if backend == "nccl" else "cpu")
        dist.all_reduce(x)
        return bool(torch.equal(x.cpu(), torch.arange(4.0)))
    finally:
        dist.destroy_process_group()


def _batch(config: ReferenceMLLMConfig, args: argparse.Namespace, seed: int) -> dict[str, torch.Tensor]:
    spec, rng = load_workload(args.workload), np.random.default_rng(seed)
    decoded = []
    for i in range(args.samples_per_step):
        meta = sample_metadata(spec, rng, length_scale=args.length_scale, max_llm_tokens=args.max_llm_tokens)
        grids = list(meta.images) + [meta.video_grid] * meta.video_frames
        patch = config.vision.patch_size
        images = [rng.integers(0, 256, (h * patch, w * patch, 3), dtype=np.uint8) for h, w in grids]
        mel = (rng.standard_normal((meta.audio_frames, config.audio.n_mels)).astype(np.float32)
               if meta.audio_frames else None)
        tokens = rng.integers(FIRST_TEXT_ID, config.llm.vocab_size, meta.text_tokens)
        decoded.append(DecodedSample(f"smoke-{i}", tokens, images, mel))
    return pack_samples(decoded, config.packing())


def train_speed(config: ReferenceMLLMConfig, device: torch.device, dtype: torch.dtype, args: argparse.Namespace
                ) -> tuple[float, float, float]:
    """(tokens/s, model FLOP/s, last loss) of ``args.steps`` timed training steps after two warm-up steps."""
    torch.manual_seed(0)
    model = ReferenceMLLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [_batch(config, args, seed) for seed in range(4)]
    batches = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]
    cost = reference_cost_model(config)
    tokens = flops = 0.0
    started = 0.0
    for step in range(args.steps + 2):
        if step == 2:  # warm-up done (allocator, kernels, autotuning)
            if device.type == "cuda":
                torch.cuda.synchronize()
            started, tokens, flops = time.perf_counter(), 0.0, 0.0
        batch = batches[step % len(batches)]
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss_sum, count = next_token_loss_sum(model(batch), batch["labels"])
            loss = loss_sum / count
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += batch["input_ids"].numel()
        flops += batch_training_flops(batch, cost, config.packing())
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return tokens / seconds, flops / seconds, loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, no flash-attn or NCCL")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON result goes")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--workload", default="vlm_dynres")
    parser.add_argument("--samples-per-step", type=int, default=8)
    parser.add_argument("--length-scale", type=float, default=0.25, help="scales the workload's lengths")
    parser.add_argument("--max-llm-tokens", type=int, default=2048)
    parser.add_argument("--peak-flops", type=float, default=None, help="dense bf16 FLOP/s of the device")
    parser.add_argument("--attention-tolerance", type=float, default=2e-2,
                        help="largest |flash - sdpa| accepted in bf16 (a few bf16 ulps of outputs of size ~1)")
    args = parser.parse_args()
    if args.dry_run:
        device, dtype, backend, config = torch.device("cpu"), torch.float32, "gloo", SIZES["tiny"]
        args.steps, args.samples_per_step, tolerance = min(args.steps, 3), min(args.samples_per_step, 2), 1e-4
        args.length_scale, args.max_llm_tokens = min(args.length_scale, 0.03), min(args.max_llm_tokens, 256)
        peak = args.peak_flops or 1e12  # nominal: the dry run checks the arithmetic, not a real device
        name = "cpu (dry run)"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --dry-run to check the script on the CPU")
        device, dtype, backend, config = torch.device("cuda"), torch.bfloat16, "nccl", SIZES[args.size]
        tolerance, name = args.attention_tolerance, torch.cuda.get_device_name()
        peak = args.peak_flops or next((v for k, v in PEAK_BF16.items() if k in name), None)
        if peak is None:
            raise SystemExit(f"unknown GPU {name!r}: pass --peak-flops (its dense bf16 FLOP/s)")
    attention_error = check_attention(device, dtype, args.dry_run)
    collective_ok = check_collective(backend)
    tokens_per_s, flops_per_s, loss = train_speed(config, device, dtype, args)
    result = {"device": name, "dtype": str(dtype), "size": "tiny" if args.dry_run else args.size,
              "attention_max_abs_diff": attention_error, "attention_ok": attention_error <= tolerance,
              f"{backend}_all_reduce_ok": collective_ok, "tokens_per_s": tokens_per_s, "flops_per_s": flops_per_s,
              "mfu": flops_per_s / peak, "last_loss": loss, "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"device: {name}; attention |diff| {attention_error:.2e} (<= {tolerance:g}: {result['attention_ok']}); "
          f"{backend} all-reduce ok: {collective_ok}; loss {loss:.3f}")
    if not (result["attention_ok"] and collective_ok and np.isfinite(loss)):
        raise SystemExit("smoke test failed: see above")
    print(f"tokens/s: {tokens_per_s:.1f}  mfu: {result['mfu']:.4f}")


if __name__ == "__main__":
    main()
