"""One GPU, the real training path: OmniModule under OmniStrategy, FSDP2 with bf16 compute, NCCL, compiled blocks.

On a CUDA machine the script

1. checks the attention kernel the tensors select (flash-attn's varlen kernel where installed, else
   ``torch.nn.attention.varlen``, else SDPA item by item) against a dense block-diagonal reference on packed,
   variable-length, causal and bidirectional items with grouped-query heads, in bf16: outputs and the gradients of
   q, k and v, on contiguous inputs and on the transposed views the Hugging Face layers pass;
2. trains with ``Trainer(strategy=OmniStrategy())`` as a one-rank NCCL world (NCCL refuses two ranks on one
   device), twice from the same seed: with ``param_dtype="bfloat16"`` (FSDP2 mixed precision: bf16 compute, fp32
   master weights and gradient reduction) and in fp32. The model is either a ReferenceMLLM (``--model reference``,
   ``--size``) on synthetic ``--workload`` webdataset shards, its MLPs compiled with ``compile_backend``, or
   (``--model qwen2_5_vl``) a Qwen2.5-VL checkpoint of about a billion parameters written here
   (``examples/make_tiny_hf_vlm.py --preset 1b``, random weights) loaded with ``OmniModule(pretrained=...)``
   and fine-tuned on ``--dialogues`` ShareGPT dialogues with images (``e2e_hf.py``'s vlm_dynres-like mix) in
   webdataset shards, as packed samples through its own processor (the HF layers run eagerly);
3. writes ``results/gpu_smoke.json`` (or ``--out``) after each phase: the kernel, tokens/s, model FLOPs
   utilisation against ``--peak-flops`` (known GPUs are looked up by name), peak memory, the cosine between the
   two runs' first gradients per parameter (same weights, same batch: a kernel or cast that bends a gradient shows
   here, where loss curves of fresh weights drift apart anyway), both runs' losses and their largest relative
   difference.

The last line is ``tokens/s: X  mfu: Y`` (of the bf16 run). ``--dry-run`` runs the same path on the CPU with the
tiny model (``--model qwen2_5_vl``: the tiny preset) over gloo and the ``aot_eager`` compile backend, which is how
the test suite checks the script.

The GPU machine has no package registry: the pure-Python wheels this package needs beyond torch, lightning and
transformers travel in ``benchmarks/wheels`` (filled here with ``--fetch-wheels``, git-ignored). There::

    pip install --no-index --no-deps benchmarks/wheels/*.whl
    PYTHONPATH=. timeout 540 python benchmarks/gpu_smoke.py --steps 20 [--model qwen2_5_vl]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from e2e_hf import dialogues, write_dialogues
from torch.distributed.tensor import DTensor

from omni_lightning import OmniDataModule, OmniModule, OmniStrategy, SyntheticShards
from omni_lightning.models.config import AudioEncoderConfig, LLMConfig, ReferenceMLLMConfig, VisionEncoderConfig
from omni_lightning.monitor import batch_training_flops
from omni_lightning.parallel.attention import attention_kernel, varlen_attention

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_smoke.json"
MAKE_HF_CHECKPOINT = Path(__file__).resolve().parents[1] / "examples" / "make_tiny_hf_vlm.py"
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
    """The kernel ``dtype`` tensors on ``device`` select, and its largest differences from the dense reference:
    outputs (absolute) and the gradients of q, k and v (relative to the largest reference gradient), on contiguous
    ``[tokens, heads, dim]`` inputs and on the transposed views the Hugging Face layers hand it."""
    kernel = attention_kernel("auto", device.type, dtype)
    generator = torch.Generator().manual_seed(0)
    cu = [0, *np.cumsum(lengths).tolist()]
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
    worst_out = worst_grad = 0.0
    for causal, transposed in ((True, False), (False, False), (True, True), (False, True)):
        heads_first = [torch.randn(heads, cu[-1], 64, generator=generator).to(device, dtype) for heads in (8, 2, 2)]
        q, k, v = (x.transpose(0, 1) if transposed else x.transpose(0, 1).contiguous() for x in heads_first)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        upstream = torch.randn(cu[-1], 8, 64, generator=generator).to(device)
        out = varlen_attention(q, k, v, cu_seqlens, causal=causal, backend="auto")
        grads = torch.autograd.grad(out, (q, k, v), upstream.to(dtype))
        leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
        reference = dense_attention(*leaves, cu, causal)
        reference_grads = torch.autograd.grad(reference, leaves, upstream)
        worst_out = max(worst_out, float((out.detach().float() - reference.detach()).abs().max()))
        for grad, expected in zip(grads, reference_grads, strict=True):
            worst_grad = max(worst_grad, float((grad.float() - expected).abs().max() / expected.abs().max()))
    return {"attention_kernel": kernel, "attention_max_abs_diff": worst_out, "attention_grad_max_rel_diff": worst_grad}


class StepRecorder(L.Callback):
    """Each step's loss, and the wall time, tokens and model FLOPs of the steps after ``warmup`` (compilation and
    the allocator's first steps excluded), with the device synchronised at the step's ends."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.losses, self.seconds, self.tokens, self.flops = warmup, [], 0.0, 0, 0.0
        self.thread_cpu_seconds, self._started, self._started_cpu = 0.0, 0.0, 0.0

    def _sync(self, module: L.LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._sync(module)
        self._started, self._started_cpu = time.perf_counter(), time.thread_time()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._sync(module)
        seconds, cpu = time.perf_counter() - self._started, time.thread_time() - self._started_cpu
        self.losses.append(float(outputs["loss"]))
        if len(self.losses) > self.warmup:
            self.seconds += seconds
            self.thread_cpu_seconds += cpu
            self.tokens += sum(mb["input_ids"].numel() for mb in batch.get("micro_batches") or [batch])
            self.flops += batch_training_flops(batch, module.cost_model(), module.packing())


class FirstGradients(L.Callback):
    """The first step's gradients, whole, in fp32 on the host: both runs take that step from the same weights and
    batch, so a parameter whose bf16 gradient points away from its fp32 one implicates a kernel or a cast, which the
    loss curves of a freshly initialised model (where bf16 rounding soon sends two runs apart) cannot show."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        if self.grads:
            return
        for name, parameter in module.named_parameters():
            if parameter.grad is not None:
                grad = parameter.grad
                self.grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().float().cpu()


def gradient_agreement(bf16: dict[str, torch.Tensor], fp32: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Cosine between the two runs' first gradients, per parameter either run moved (0 where only one did)."""
    if bf16.keys() != fp32.keys():
        raise SystemExit(f"the runs trained different parameters: {sorted(bf16.keys() ^ fp32.keys())[:5]}")
    cosines = {}
    for name, reference in fp32.items():
        low, high = bf16[name].flatten(), reference.flatten()
        if low.norm() == 0 and high.norm() == 0:
            continue
        cosines[name] = float(torch.nn.functional.cosine_similarity(low, high, dim=0))
    worst = sorted(cosines.items(), key=lambda item: item[1])[:5]
    return {"min": worst[0][1], "worst": dict(worst), "parameters_compared": len(cosines)}


def train(make_module: Callable[[], OmniModule], make_data: Callable[[], OmniDataModule], args: argparse.Namespace,
          accelerator: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One run of the real path: its losses, throughput and peak device memory, and its first gradients."""
    L.seed_everything(0)
    if accelerator == "gpu":
        torch.cuda.reset_peak_memory_stats()
    recorder, first = StepRecorder(args.warmup), FirstGradients()
    model = make_module()
    trainer = L.Trainer(accelerator=accelerator, devices=1, strategy=OmniStrategy(), max_steps=args.warmup + args.steps,
                        callbacks=[recorder, first], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0)
    trainer.fit(model, datamodule=make_data())
    check = torch.ones(2, device=trainer.strategy.root_device)  # the group the run trained on still computes
    dist.all_reduce(check)
    peak = torch.cuda.max_memory_allocated() if accelerator == "gpu" else None
    summary = {"losses": recorder.losses, "tokens_per_s": recorder.tokens / recorder.seconds,
               "flops_per_s": recorder.flops / recorder.seconds, "peak_memory_bytes": peak,
               "tokens_per_step": recorder.tokens / args.steps, "step_s": recorder.seconds / args.steps,
               # near step_s: the step waits on the training thread's Python (launches, hooks), not on the device
               "training_thread_cpu_per_step_s": recorder.thread_cpu_seconds / args.steps,
               "model_flops_per_token": recorder.flops / recorder.tokens,
               "parameters": sum(p.numel() for p in model.parameters()), "backend": dist.get_backend(),
               "all_reduce_ok": bool(torch.equal(check.cpu(), torch.ones(2)))}
    return summary, first.grads


def reference_run(config: ReferenceMLLMConfig, args: argparse.Namespace, shards: Path
                  ) -> tuple[Callable[[str | None], OmniModule], Callable[[], OmniDataModule]]:
    """The ReferenceMLLM on synthetic ``--workload`` shards (written into ``shards`` by the first run)."""
    def make_data() -> OmniDataModule:
        return OmniDataModule(f"{shards}/train-{{000000..{args.shards - 1:06d}}}.tar",
                              samples_per_step=args.samples_per_step, group_steps=4,
                              synthetic=SyntheticShards(args.workload, num_shards=args.shards, samples_per_shard=64,
                                                        length_scale=args.length_scale,
                                                        max_llm_tokens=args.max_llm_tokens),
                              patch_size=config.vision.patch_size, vision_merge=config.vision.merge)

    def make_module(param_dtype: str | None) -> OmniModule:
        return OmniModule(config, learning_rate=args.learning_rate, warmup_steps=2, param_dtype=param_dtype,
                          compile_backend=args.compile_backend)
    return make_module, make_data


def qwen2_5_vl_run(preset: str, args: argparse.Namespace, scratch: Path
                   ) -> tuple[Callable[[str | None], OmniModule], Callable[[], OmniDataModule]]:
    """A Qwen2.5-VL checkpoint of ``preset`` size written into ``scratch`` with its processor, and conversation
    shards of ``--dialogues`` generated dialogues with images."""
    checkpoint = scratch / f"qwen2_5_vl_{preset}"
    subprocess.run([sys.executable, str(MAKE_HF_CHECKPOINT), str(checkpoint), "--preset", preset], check=True,
                   stdout=subprocess.DEVNULL)
    shards, _ = write_dialogues(dialogues(args.dialogues, seed=0), scratch / "dialogues", shards=args.shards)

    def make_data() -> OmniDataModule:
        return OmniDataModule(shards, samples_per_step=args.samples_per_step, group_steps=4, reorder="grouped")

    def make_module(param_dtype: str | None) -> OmniModule:
        return OmniModule(pretrained=str(checkpoint), learning_rate=args.learning_rate, warmup_steps=2,
                          param_dtype=param_dtype)
    return make_module, make_data


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
    parser.add_argument("--model", choices=("reference", "qwen2_5_vl"), default="reference",
                        help="the ReferenceMLLM (--size) or a ~1B Qwen2.5-VL checkpoint on conversation data")
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="of the ReferenceMLLM")
    parser.add_argument("--dialogues", type=int, default=2048, help="conversation samples of --model qwen2_5_vl")
    parser.add_argument("--workload", default="vlm_dynres")
    parser.add_argument("--shards", type=int, default=4, help="webdataset shards (synthetic ones hold 64 samples)")
    parser.add_argument("--samples-per-step", type=int, default=8)
    parser.add_argument("--length-scale", type=float, default=0.25, help="scales the workload's lengths")
    parser.add_argument("--max-llm-tokens", type=int, default=2048)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend (inductor; dry run aot_eager)")
    parser.add_argument("--peak-flops", type=float, default=None, help="dense bf16 FLOP/s of the device")
    parser.add_argument("--attention-tolerance", type=float, default=2e-2,
                        help="largest |kernel - dense fp32| accepted in bf16 (outputs; gradients relative to the "
                             "largest one): a few bf16 ulps of values of size ~1")
    parser.add_argument("--loss-tolerance", type=float, default=5e-2,
                        help="largest relative |bf16 - fp32| loss over the run: bf16 keeps 8 mantissa bits, so one "
                             "step's loss differs by ~1e-2 and the trajectories drift apart slowly from there")
    parser.add_argument("--gradient-tolerance", type=float, default=0.99,
                        help="least cosine between a parameter's first bf16 and fp32 gradient: bf16 products keep ~3 "
                             "significant digits, so a sound path agrees to ~0.9999 (0.9997 seen on CPU)")
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
        args.dialogues = min(args.dialogues, 2 * (args.warmup + args.steps + 4))
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
    size = "tiny" if args.dry_run else args.size if args.model == "reference" else "1b"
    result: dict[str, Any] = {"device": name, "model": args.model, "size": size, "torch": torch.__version__,
                              "compile_backend": args.compile_backend, "steps": args.steps, "warmup": args.warmup}

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    result.update(check_attention(device, torch.bfloat16, lengths))
    result["attention_ok"] = (result["attention_max_abs_diff"] <= args.attention_tolerance
                              and result["attention_grad_max_rel_diff"] <= args.attention_tolerance)
    write()
    with tempfile.TemporaryDirectory() as scratch:
        make_module, make_data = (reference_run(config, args, Path(scratch)) if args.model == "reference"
                                  else qwen2_5_vl_run(size, args, Path(scratch)))
        first_gradients: dict[str, dict[str, torch.Tensor]] = {}
        for label, param_dtype in (("bf16", "bfloat16"), ("fp32", None)):
            result[label], first_gradients[label] = train(lambda dtype=param_dtype: make_module(dtype), make_data, args,
                                                          accelerator)
            write()
    bf16, fp32 = result["bf16"], result["fp32"]
    result["first_step_grad_cosine"] = gradient_agreement(first_gradients["bf16"], first_gradients["fp32"])
    result["gradients_ok"] = result["first_step_grad_cosine"]["min"] >= args.gradient_tolerance
    result["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(bf16["losses"], fp32["losses"], strict=True))
    result["losses_ok"] = result["loss_max_rel_diff"] <= args.loss_tolerance and all(map(np.isfinite, bf16["losses"]))
    result["mfu"], result["tokens_per_s"] = bf16["flops_per_s"] / peak, bf16["tokens_per_s"]
    result["bf16_speedup_vs_fp32"] = bf16["tokens_per_s"] / fp32["tokens_per_s"]
    write()
    print(f"device: {name}; attention {result['attention_kernel']} |diff| {result['attention_max_abs_diff']:.2e} "
          f"grad rel. diff {result['attention_grad_max_rel_diff']:.2e} "
          f"(<= {args.attention_tolerance:g}: {result['attention_ok']}); {bf16['backend']} all-reduce ok: "
          f"{bf16['all_reduce_ok']}; first-step gradient cosine bf16 vs fp32 >= "
          f"{result['first_step_grad_cosine']['min']:.4f} (>= {args.gradient_tolerance:g}: {result['gradients_ok']}); "
          f"bf16 vs fp32 loss rel. diff {result['loss_max_rel_diff']:.2e} "
          f"(<= {args.loss_tolerance:g}: {result['losses_ok']}); bf16 {result['bf16_speedup_vs_fp32']:.2f}x fp32")
    if not (result["attention_ok"] and bf16["all_reduce_ok"] and result["gradients_ok"] and result["losses_ok"]):
        raise SystemExit("smoke test failed: see above")
    print(f"tokens/s: {result['tokens_per_s']:.1f}  mfu: {result['mfu']:.4f}")


if __name__ == "__main__":
    main()
