"""End to end on a Hugging Face family: what a Lightning user writes today against OmniStrategy (``e2e.py --model hf``).

Both configurations fine-tune the same tiny Qwen2.5-VL checkpoint (``examples/make_tiny_hf_vlm.py``) on the same
ranks and the same conversation data: a few hundred ShareGPT-form dialogues generated here with a vlm_dynres-like
mix (one or two images of sizes from 28 to 448 pixels a side at aspect ratios 1:2 to 2:1, answers of 3 to
160 words, some multi-turn), one global batch of ``--samples-per-step`` dialogues per rank and step:

* (f) what the Lightning and transformers docs lead to: ``ModelParallelStrategy`` with FSDP2 on the HF model's
  decoder layers, vision blocks and root (``configure_model``); a ``DataLoader`` over the dialogues (Lightning's
  distributed sampler; the dataset opens each dialogue's image files) whose collate function does what TRL's
  vision-language SFT collator does with the model's processor: the chat template, each image's placeholder
  expanded to its merged patches, ``padding=True``, labels on the assistant tokens only (the template's generation
  region). ``Qwen2_5_VLProcessor`` itself cannot be built here (its video processor needs torchvision, which does
  not load against the CPU torch wheel), so the collate function calls its tokenizer and image processor as the
  processor would. The HF model's own forward and loss.
* (g) OmniStrategy with everything on: ``OmniModule(pretrained=...)``, packed samples (no padding), grouped
  reordering in the loader, encoder resharding with long-short sequence parallelism (``enc_sp=2``).

Each run trains two epochs; the second (every dialogue once, in both configurations) is timed. A rank's compute per
step is the CPU its process spends from one step's end to the next (the loader included: both load in the training
process), as the larger of its training thread's and its other threads' CPU time; the *modeled step time* is the
slowest rank's, as in ``e2e.py``. Every configuration runs ``--repeats`` times, interleaved, and each (step, rank)
keeps its least time. Results go to ``benchmarks/results/e2e_hf.txt`` and ``e2e_hf.json`` (``e2e_hf_quick.*`` with
``--quick``); the last line is
``modeled speedup (g)/(f): X``.

    python benchmarks/e2e.py --model hf [--ranks 4] [--dialogues 384] [--repeats 2] [--quick]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from common import free_port
from e2e import ForkedModelParallel
from PIL import Image
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

from omni_lightning import OmniDataModule, OmniModule, OmniStrategy
from omni_lightning.data.jsonl import write_shards

RESULTS = Path(__file__).resolve().parent / "results"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIGURATIONS = {
    "f": "Lightning ModelParallelStrategy + FSDP2 on the HF model, padded processor batches",
    "g": "OmniStrategy: packed, grouped reordering, encoder resharding/LSSP",
}
WORDS = ("red", "green", "blue", "yellow", "square", "circle", "field", "picture", "video", "moves", "left", "right",
         "small", "large", "bright", "dark", "the", "a", "of", "on", "in", "and", "with", "near", "above", "below",
         "shape", "colour", "light", "shadow", "corner", "edge", "centre")
PROMPTS = ("Describe the picture.", "What is in the image?", "Compare the two pictures.", "What colour is it?",
           "Tell me about the scene in detail.")
LEARNING_RATE = 1e-4


def dialogues(count: int, seed: int) -> list[dict[str, Any]]:
    """ShareGPT-form dialogues (``messages`` with ``<image>`` markers, ``images``) and their PIL images."""
    rng = np.random.default_rng(seed)
    made = []
    for _ in range(count):
        # Every dialogue has an image: (f)'s FSDP-wrapped vision blocks would hang on a rank whose batch had none.
        n_images = int(rng.choice([1, 2], p=[0.8, 0.2]))
        images = []
        for _ in range(n_images):
            side = float(np.exp(rng.uniform(np.log(28), np.log(448))))
            aspect = float(np.exp(rng.uniform(np.log(0.5), np.log(2.0))))
            height, width = max(28, int(side * aspect ** 0.5)), max(28, int(side / aspect ** 0.5))
            colour = tuple(int(c) for c in rng.integers(0, 256, 3))
            images.append(Image.new("RGB", (width, height), colour))
        turns = 2 if rng.random() < 0.2 else 1
        messages = []
        for turn in range(turns):
            prompt = PROMPTS[int(rng.integers(len(PROMPTS)))]
            markers = "<image>" * n_images if turn == 0 else ""
            words = int(np.exp(rng.uniform(np.log(3), np.log(160))))
            answer = " ".join(WORDS[int(i)] for i in rng.integers(len(WORDS), size=words)) + "."
            messages += [{"role": "user", "content": markers + prompt}, {"role": "assistant", "content": answer}]
        made.append({"messages": messages, "images": images})
    return made


def write_dialogues(made: list[dict[str, Any]], out: Path, shards: int) -> tuple[str, list[dict[str, Any]]]:
    """The dialogues the two ways users keep them: webdataset shards of a ShareGPT json and its images as PNG members
    (for (g)), and a list of records naming PNG files in a folder (for (f)'s dataset, which opens them)."""
    samples, records = [], []
    (out / "media").mkdir(parents=True, exist_ok=True)
    for index, dialogue in enumerate(made):
        names = [f"{i}.png" for i in range(len(dialogue["images"]))]
        sample: dict[str, Any] = {"__key__": f"d{index:06d}",
                                  "json": json.dumps({"messages": dialogue["messages"], "images": names}).encode()}
        paths = []
        for name, image in zip(names, dialogue["images"], strict=True):
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            sample[name] = buffer.getvalue()
            paths.append(out / "media" / f"d{index:06d}_{name}")
            paths[-1].write_bytes(sample[name])
        samples.append(sample)
        records.append({"messages": dialogue["messages"], "images": paths})
    write_shards(samples, out, prefix="chat", samples_per_shard=len(samples) // shards)
    return str(out / f"chat-{{000000..{shards - 1:06d}}}.tar"), records


class _Dialogues(Dataset):
    """A user's dataset over dialogue records: each item's images opened from their files when it is read."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.records[index]
        images = [Image.open(path).convert("RGB") for path in record["images"]]
        return {"messages": record["messages"], "images": images}


class ProcessorCollator:
    """TRL's vision-language SFT collation with the model's processor: chat template, image placeholders expanded
    to each image's merged patches, right padding to the batch's longest, labels on the assistant tokens only."""

    def __init__(self, checkpoint: Path) -> None:
        import transformers
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
        self.images = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)
        self.image_pad = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows, masks, images = [], [], []
        for dialogue in batch:
            conversation = []
            for message in dialogue["messages"]:
                text = message["content"]
                parts: list[dict[str, str]] = [{"type": "image"}] * text.count("<image>")
                conversation.append({"role": message["role"],
                                     "content": [*parts, {"type": "text", "text": text.replace("<image>", "")}]})
            rendered = self.tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                                          return_assistant_tokens_mask=True)
            rows.append(rendered["input_ids"])
            masks.append(rendered["assistant_masks"])
            images += dialogue["images"]
        vision: dict[str, torch.Tensor] = {}
        if images:
            vision = dict(self.images(images=images, return_tensors="pt"))
            merged = (vision["image_grid_thw"].prod(-1) // self.images.merge_size ** 2).tolist()
            counts = iter(merged)
            for i, (ids, mask) in enumerate(zip(rows, masks, strict=True)):
                expanded_ids, expanded_mask = [], []
                for token, target in zip(ids, mask, strict=True):
                    repeat = next(counts) if token == self.image_pad else 1
                    expanded_ids += [token] * repeat
                    expanded_mask += [target] * repeat
                rows[i], masks[i] = expanded_ids, expanded_mask
        longest = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), longest), self.tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), longest), dtype=torch.long)
        labels = torch.full((len(rows), longest), -100, dtype=torch.long)
        for i, (ids, mask) in enumerate(zip(rows, masks, strict=True)):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            attention[i, : len(ids)] = 1
            labels[i, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
        return {"input_ids": input_ids, "attention_mask": attention, "labels": labels, **vision}


class UserHFModule(pl.LightningModule):
    """A Lightning user's module for the HF model: FSDP2 on its decoder layers, vision blocks and root."""

    def __init__(self, checkpoint: Path) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        import transformers

        if self.model is not None:
            return
        model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(self.checkpoint)
        mesh = self.device_mesh["data_parallel"]
        for block in [*model.model.language_model.layers, *model.model.visual.blocks]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LEARNING_RATE)


class _StepCPU(pl.Callback):
    """Every rank's CPU per step, end to end (the loader's work in between included): its training thread's, and
    the rest of its process's (loader threads); rank 0 saves them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[list[list[float]]] = []
        self.wall: list[float] = []
        self._last: tuple[float, float] | None = None

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._last = (time.thread_time(), time.process_time())

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        thread, process = time.thread_time(), time.process_time()
        assert self._last is not None
        main = thread - self._last[0]
        others = max(0.0, process - self._last[1] - main)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [main, others])
        self.rows.append(gathered)
        self.wall.append(time.perf_counter())
        self._last = (time.thread_time(), time.process_time())  # the gather itself is measurement, not training

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps({"cpu": self.rows, "wall": self.wall}))


def run(name: str, checkpoint: Path, shards: str, dialogue_files: list[dict[str, Any]], args: argparse.Namespace,
        out: Path) -> dict[str, Any]:
    os.environ["MASTER_PORT"] = str(free_port())
    record = out / f"{name}.json"
    steps_per_epoch = len(dialogue_files) // (args.ranks * args.samples_per_step)
    if name == "f":
        strategy: Any = ForkedModelParallel(data_parallel_size=args.ranks, tensor_parallel_size=1)
        module: pl.LightningModule = UserHFModule(checkpoint)
        loader = DataLoader(_Dialogues(dialogue_files), batch_size=args.samples_per_step, shuffle=True, drop_last=True,
                            collate_fn=ProcessorCollator(checkpoint))
        fit_args: dict[str, Any] = {"train_dataloaders": loader}
    else:
        strategy = OmniStrategy(launcher="fork", timeout=600, dp_shard=args.ranks, encoder_reshard=True,
                                enc_sp=args.enc_sp)
        module = OmniModule(pretrained=str(checkpoint), learning_rate=LEARNING_RATE)
        fit_args = {"datamodule": OmniDataModule(shards, samples_per_step=args.samples_per_step,
                                                 group_steps=args.group_steps, reorder="grouped", seed=args.seed)}
    trainer = pl.Trainer(accelerator="cpu", devices=args.ranks, strategy=strategy, max_steps=2 * steps_per_epoch,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, use_distributed_sampler=True, callbacks=[_StepCPU(record)])
    trainer.fit(module, **fit_args)
    return json.loads(record.read_text())


def summarize(records: list[dict[str, Any]], timed: slice) -> dict[str, Any]:
    """Modeled step (slowest rank's critical path, least over repeats) and wall rates of the timed epoch."""
    cpu = np.min([np.array(record["cpu"])[timed] for record in records], axis=0)  # [step, rank, (main, others)]
    critical = cpu.max(axis=2)
    seconds = min(float(r["wall"][timed.stop - 1] - r["wall"][timed.start - 1]) for r in records)
    return {"modeled_step_s": float(critical.max(axis=1).mean()),
            "imbalance": float((critical.max(axis=1) / critical.mean(axis=1)).mean()),
            "mean_rank_cpu_s": float(cpu.sum(axis=2).mean()), "wall_step_s": seconds / critical.shape[0],
            "per_rank_step_s": critical.tolist()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--dialogues", type=int, default=384)
    parser.add_argument("--samples-per-step", type=int, default=4)
    parser.add_argument("--group-steps", type=int, default=4)
    parser.add_argument("--enc-sp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="256 dialogues, one repeat")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.dialogues, args.repeats = 256, 1
    per_step = args.ranks * args.samples_per_step
    if args.dialogues % (per_step * args.group_steps):
        raise SystemExit(f"--dialogues {args.dialogues} must be a multiple of ranks x samples per step x group steps "
                         f"({per_step * args.group_steps}), so that an epoch is whole reorder groups")
    torch.set_num_threads(1)
    made = dialogues(args.dialogues, args.seed)
    steps = args.dialogues // per_step
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = Path(scratch) / "qwen2_5_vl"
        subprocess.run([sys.executable, str(EXAMPLES / "make_tiny_hf_vlm.py"), str(checkpoint)], check=True,
                       stdout=subprocess.DEVNULL)
        shards, dialogue_files = write_dialogues(made, Path(scratch) / "data", shards=2 * args.ranks)
        records: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGURATIONS}
        for repeat in range(args.repeats):  # interleaved, so a slow spell of this shared machine hits both,
            for name in list(records)[:: 1 - 2 * (repeat % 2)]:  # and alternating which goes first
                records[name].append(run(name, checkpoint, shards, dialogue_files, args, Path(scratch)))
    results = {name: summarize(runs, slice(steps, 2 * steps)) for name, runs in records.items()}
    base = results["f"]["modeled_step_s"]
    lines = [f"tiny Qwen2.5-VL, {args.dialogues} dialogues: {args.ranks} ranks, {args.samples_per_step} dialogues per "
             f"rank and step, second epoch ({steps} steps) timed, least of {args.repeats} repeat(s)"]
    for name, label in CONFIGURATIONS.items():
        r = results[name]
        lines.append(f"({name}) {label:<78} modeled step {r['modeled_step_s'] * 1e3:7.1f} ms, max/mean "
                     f"{r['imbalance']:.3f}, mean rank CPU {r['mean_rank_cpu_s'] * 1e3:7.1f} ms, wall step "
                     f"{r['wall_step_s'] * 1e3:7.1f} ms, vs (f) {base / r['modeled_step_s']:.3f}x")
    lines.append(f"modeled speedup (g)/(f): {base / results['g']['modeled_step_s']:.3f}")
    stem = "e2e_hf_quick" if args.quick else "e2e_hf"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    (RESULTS / f"{stem}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
