"""One GPU, the real training path: OmniModule under OmniStrategy, FSDP2 with bf16 compute, NCCL, compiled blocks.

On a CUDA machine the script

1. checks the attention kernel the tensors select (flash-attn's varlen kernel where installed, else
   ``torch.nn.attention.varlen``, else SDPA item by item) against a dense block-diagonal reference on packed,
   variable-length, causal and bidirectional items with grouped-query heads, in bf16;
2. trains a ReferenceMLLM (``--size``) with ``Trainer(strategy=OmniStrategy())`` as a one-rank NCCL world
   (NCCL refuses two ranks on one device) on synthetic ``--workload`` webdataset shards, twice from the same
   seed: with ``param_dtype="bfloat16"`` (FSDP2 mixed precision: bf16 compute, fp32 master weights and gradient
   reduction) and in fp32, both with ``compile_backend`` (``torch.compile`` of the blocks' MLPs);
3. writes ``results/gpu_smoke.json`` (or ``--out``) after each phase: the kernel, tokens/s, model FLOPs
   utilisation against ``--peak-flops`` (known GPUs are looked up by name), peak memory, both runs' losses and
   their largest relative difference.

The last line is ``tokens/s: X  mfu: Y`` (of the bf16 run). ``--dry-run`` runs the same path on the CPU with the
tiny model over gloo and the ``aot_eager`` compile backend, which is how the test suite checks the script.

The GPU machine has no package registry: the pure-Python wheels this package needs beyond torch, lightning and
transformers travel in ``benchmarks/wheels`` (filled here with ``--fetch-wheels``, git-ignored). There::

    pip install --no-index --no-deps benchmarks/wheels/*.whl
    PYTHONPATH=. timeout 540 python benchmarks/gpu_smoke.py --steps 20
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist

from omni_lightning import OmniDataModule, OmniModule, OmniStrategy, SyntheticShards
from omni_lightning.models.config import AudioEncoderConfig, LLMConfig, ReferenceMLLMConfig, VisionEncoderConfig
from omni_lightning.monitor import batch_training_flops
from omni_lightning.parallel.attention import attention_kernel, varlen_attention

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_smoke.json"
WHEELS = Path(__file__).resolve().parent / "wheels"
# What the GPU machine lacks, pinned to the versions CI tests (jsonargparse's signature extras included).
TRAVELLING_WHEELS = ["webdataset==1.0.2", "braceexpand==0.1.7", "torchdata==0.11.0", "jsonargparse==4.53.0",
                     "docstring_parser==0.18.0", "typeshed_client==2.15.0"]
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


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], causal: bool) -> torch.Tensor:
    """Attention over the whole packed sequence with a block-diagonal (and causal) mask, in fp32: slow,
    independent of every kernel under test."""
    total = q.shape[0]
    item = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff()).to(q.device)
    mask = item[:, None] == item[None, :]
    if causal:
        mask &= torch.ones(total, total, dtype=torch.bool, device=q.device).tril()
    groups = q.shape[1] // k.shape[1]
    q, k, v = q.float(), k.float().repeat_interleave(groups, dim=1), v.float().repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


def check_attention(device: torch.device, dtype: torch.dtype, lengths: list[int]) -> dict[str, Any]:
    """The kernel ``dtype`` tensors on ``device`` select, and its largest difference from the dense reference."""
    kernel = attention_kernel("auto", device.type, dtype)
    generator = torch.Generator().manual_seed(0)
    cu = [0, *np.cumsum(lengths).tolist()]
    worst = 0.0
    for causal in (True, False):
        q = torch.randn(cu[-1], 8, 64, generator=generator).to(device, dtype)
        k, v = (torch.randn(cu[-1], 2, 64, generator=generator).to(device, dtype) for _ in range(2))
        cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
        out = varlen_attention(q, k, v, cu_seqlens, causal=causal, backend="auto")
        worst = max(worst, float((out.float() - dense_attention(q, k, v, cu, causal)).abs().max()))
    return {"attention_kernel": kernel, "attention_max_abs_diff": worst}


class StepRecorder(L.Callback):
    """Each step's loss, and the wall time, tokens and model FLOPs of the steps after ``warmup`` (compilation and
    the allocator's first steps excluded), with the device synchronised at the step's ends."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.losses, self.seconds, self.tokens, self.flops = warmup, [], 0.0, 0, 0.0
        self._started = 0.0

    def _sync(self, module: L.LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._sync(module)
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._sync(module)
        seconds = time.perf_counter() - self._started
        self.losses.append(float(outputs["loss"]))
        if len(self.losses) > self.warmup:
            self.seconds += seconds
            self.tokens += sum(mb["input_ids"].numel() for mb in batch.get("micro_batches") or [batch])
            self.flops += batch_training_flops(batch, module.cost_model(), module.packing())


def train(config: ReferenceMLLMConfig, param_dtype: str | None, args: argparse.Namespace, shards: Path,
          accelerator: str) -> dict[str, Any]:
    """One run of the real path; its losses, throughput and peak device memory."""
    L.seed_everything(0)
    if accelerator == "gpu":
        torch.cuda.reset_peak_memory_stats()
    recorder = StepRecorder(args.warmup)
    data = OmniDataModule(f"{shards}/train-{{000000..{args.shards - 1:06d}}}.tar",
                          samples_per_step=args.samples_per_step, group_steps=4,
                          synthetic=SyntheticShards(args.workload, num_shards=args.shards, samples_per_shard=64,
                                                    length_scale=args.length_scale, max_llm_tokens=args.max_llm_tokens),
                          patch_size=config.vision.patch_size, vision_merge=config.vision.merge)
    model = OmniModule(config, learning_rate=args.learning_rate, warmup_steps=2, param_dtype=param_dtype,
                       compile_backend=args.compile_backend)
    trainer = L.Trainer(accelerator=accelerator, devices=1, strategy=OmniStrategy(), max_steps=args.warmup + args.steps,
                        callbacks=[recorder], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    check = torch.ones(2, device=trainer.strategy.root_device)  # the group the run trained on still computes
    dist.all_reduce(check)
    peak = torch.cuda.max_memory_allocated() if accelerator == "gpu" else None
    return {"losses": recorder.losses, "tokens_per_s": recorder.tokens / recorder.seconds,
            "flops_per_s": recorder.flops / recorder.seconds, "peak_memory_bytes": peak,
            "backend": dist.get_backend(), "all_reduce_ok": bool(torch.equal(check.cpu(), torch.ones(2)))}


def fetch_wheels() -> None:
    """Download the wheels the GPU machine cannot install from a registry (here, where one is reachable)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--dest",
                    str(WHEELS), *TRAVELLING_WHEELS], check=True)
    print(f"wheels in {WHEELS}: {sorted(p.name for p in WHEELS.glob('*.whl'))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, gloo, aot_eager: checks the script")
    parser.add_argument("--fetch-wheels", action="store_true", help="download the travelling wheels and exit")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON result goes")
    parser.add_argument("--steps", type=int, default=20, help="timed steps, after --warmup untimed ones")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--workload", default="vlm_dynres")
    parser.add_argument("--shards", type=int, default=4, help="synthetic shards of 64 samples")
    parser.add_argument("--samples-per-step", type=int, default=8)
    parser.add_argument("--length-scale", type=float, default=0.25, help="scales the workload's lengths")
    parser.add_argument("--max-llm-tokens", type=int, default=2048)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend (inductor; dry run aot_eager)")
    parser.add_argument("--peak-flops", type=float, default=None, help="dense bf16 FLOP/s of the device")
    parser.add_argument("--attention-tolerance", type=float, default=2e-2,
                        help="largest |kernel - dense fp32| accepted in bf16: a few bf16 ulps of outputs of size ~1")
    parser.add_argument("--loss-tolerance", type=float, default=5e-2,
                        help="largest relative |bf16 - fp32| loss over the run: bf16 keeps 8 mantissa bits, so one "
                             "step's loss differs by ~1e-2 and the trajectories drift apart slowly from there")
    parser.add_argument("--timeout", type=float, default=560, help="dump every thread's stack and exit after this")
    args = parser.parse_args()
    if args.fetch_wheels:
        fetch_wheels()
        return
    faulthandler.dump_traceback_later(args.timeout, exit=True)  # a hang shows where, inside the device time
    if args.dry_run:
        torch.set_num_threads(1)
        accelerator, device, config, name = "cpu", torch.device("cpu"), SIZES["tiny"], "cpu (dry run)"
        args.compile_backend = args.compile_backend or "aot_eager"
        args.samples_per_step, args.shards = min(args.samples_per_step, 2), min(args.shards, 1)
        args.length_scale, args.max_llm_tokens = min(args.length_scale, 0.03), min(args.max_llm_tokens, 256)
        lengths, peak = [1, 7, 64, 300, 33], args.peak_flops or 1e12  # nominal: the dry run checks the arithmetic
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --dry-run to check the script on the CPU")
        accelerator, device, config = "gpu", torch.device("cuda"), SIZES[args.size]
        args.compile_backend, name = args.compile_backend or "inductor", torch.cuda.get_device_name()
        lengths = [1, 17, 256, 1500, 4096, 77]
        peak = args.peak_flops or next((v for k, v in PEAK_BF16.items() if k in name), None)
        if peak is None:
            raise SystemExit(f"unknown GPU {name!r}: pass --peak-flops (its dense bf16 FLOP/s)")
    result: dict[str, Any] = {"device": name, "size": "tiny" if args.dry_run else args.size, "torch": torch.__version__,
                              "compile_backend": args.compile_backend, "steps": args.steps, "warmup": args.warmup}

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    result.update(check_attention(device, torch.bfloat16, lengths))
    result["attention_ok"] = result["attention_max_abs_diff"] <= args.attention_tolerance
    write()
    with tempfile.TemporaryDirectory() as shards:
        for label, param_dtype in (("bf16", "bfloat16"), ("fp32", None)):
            result[label] = train(config, param_dtype, args, Path(shards), accelerator)
            write()
    bf16, fp32 = result["bf16"], result["fp32"]
    result["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(bf16["losses"], fp32["losses"], strict=True))
    result["losses_ok"] = result["loss_max_rel_diff"] <= args.loss_tolerance and all(map(np.isfinite, bf16["losses"]))
    result["mfu"], result["tokens_per_s"] = bf16["flops_per_s"] / peak, bf16["tokens_per_s"]
    result["bf16_speedup_vs_fp32"] = bf16["tokens_per_s"] / fp32["tokens_per_s"]
    write()
    print(f"device: {name}; attention {result['attention_kernel']} |diff| {result['attention_max_abs_diff']:.2e} "
          f"(<= {args.attention_tolerance:g}: {result['attention_ok']}); {bf16['backend']} all-reduce ok: "
          f"{bf16['all_reduce_ok']}; bf16 vs fp32 loss rel. diff {result['loss_max_rel_diff']:.2e} "
          f"(<= {args.loss_tolerance:g}: {result['losses_ok']}); bf16 {result['bf16_speedup_vs_fp32']:.2f}x fp32")
    if not (result["attention_ok"] and bf16["all_reduce_ok"] and result["losses_ok"]):
        raise SystemExit("smoke test failed: see above")
    print(f"tokens/s: {result['tokens_per_s']:.1f}  mfu: {result['mfu']:.4f}")


if __name__ == "__main__":
    main()
