"""The ``omni-lightning`` command: LightningCLI subcommands (fit, validate, ...) plus ``make-shards``, ``export-hf``
and ``simulate``."""

from __future__ import annotations

import argparse
import inspect
import sys
import textwrap
from typing import Any

import docstring_parser
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, LRSchedulerTypeTuple
from torch.optim import Optimizer
from typing_extensions import override

import omni_lightning  # noqa: F401  (registers strategy="omni")
from omni_lightning.data.conversation_shards import conversations_to_shards
from omni_lightning.data.jsonl import jsonl_to_shards
from omni_lightning.data.synthetic import make_synthetic_shards
from omni_lightning.datamodules.omni import OmniDataModule
from omni_lightning.deprecations import warn_renamed
from omni_lightning.export import export_hf
from omni_lightning.module import OmniModule
from omni_lightning.sim.report import simulate_main
from omni_lightning.strategies.omni import OmniStrategy

__all__ = ["main", "OmniCLI", "argument_reference", "export_hf_main", "make_shards_main"]

_SUBCOMMANDS = ("fit", "validate", "test", "predict")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help, with the epilog's line breaks kept."""


def argument_reference(cls: type, flag_prefix: str) -> str:
    """Every ``__init__`` argument of ``cls`` with its docstring description, as help text."""
    described = {p.arg_name: p.description or "" for p in docstring_parser.parse(cls.__doc__ or "").params}
    lines = []
    for name in inspect.signature(cls.__init__).parameters:
        if name == "self":
            continue
        text = " ".join(described.get(name, "(undocumented)").split())
        lines.append(textwrap.fill(text, width=100, initial_indent=f"  {flag_prefix}{name}: ",
                                   subsequent_indent="      "))
    return "\n".join(lines)


def _epilog() -> str:
    return "\n\n".join([
        "OmniStrategy arguments (with --trainer.strategy omni, or strategy: {class_path: omni_lightning.OmniStrategy,"
        " init_args: {...}} in YAML):\n" + argument_reference(OmniStrategy, "--trainer.strategy."),
        "OmniDataModule arguments (with --data omni_lightning.OmniDataModule, or data: {class_path: ..., init_args:"
        " {...}} in YAML):\n" + argument_reference(OmniDataModule, "--data."),
    ])


class OmniCLI(LightningCLI):
    """LightningCLI for :class:`OmniModule` and any data module (``--data.class_path`` picks a user's own).

    Each subcommand's ``--help`` ends with every OmniStrategy and OmniDataModule argument and its meaning.
    """

    def __init__(self, args: list[str] | None = None, **kwargs: Any) -> None:
        help_kwargs = {"formatter_class": _HelpFormatter, "epilog": _epilog()}
        parser_kwargs = kwargs.pop("parser_kwargs", None) or {}
        super().__init__(
            OmniModule,
            LightningDataModule,
            subclass_mode_data=True,
            args=args,
            # The root parser's formatter prints the subcommands' help too, so it needs the raw epilog as well.
            parser_kwargs={"formatter_class": _HelpFormatter,
                           **{sub: {**help_kwargs, **parser_kwargs.get(sub, {})} for sub in _SUBCOMMANDS}},
            **kwargs,
        )

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # LightningCLI's own --optimizer builds from the module's parameters and patches configure_optimizers; the
        # module builds its parameter groups itself (frozen parts out, no decay for norms), so both go to it.
        parser.add_optimizer_args((Optimizer,), link_to="model.optimizer")
        parser.add_lr_scheduler_args(LRSchedulerTypeTuple, link_to="model.lr_scheduler")


def make_shards_main(argv: list[str]) -> None:
    """``omni-lightning make-shards``: write synthetic multimodal webdataset shards from a workload spec, or
    convert a JSONL manifest with its image and mel files (``--from-jsonl``) or a file of conversations with their
    media folder (``--from-conversations``)."""
    parser = argparse.ArgumentParser(
        prog="omni-lightning make-shards",
        description="Write synthetic multimodal webdataset shards, or convert a JSONL manifest (--from-jsonl) or a "
                    "file of conversations (--from-conversations).",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--from-jsonl", default=None, metavar="FILE",
                        help="convert this manifest instead (one {id, text, images, audio} object per line; see "
                             "omni_lightning.data.jsonl); --samples-per-shard, --patch-size, --n-mels and "
                             "--prefix apply, the workload arguments do not")
    parser.add_argument("--from-conversations", default=None, metavar="FILE",
                        help="convert dialogues (a .json list or .jsonl; LLaVA, ShareGPT or typed-content messages; "
                             "see omni_lightning.data.conversation_shards) with their media under --media-root, "
                             "stored as they are; --samples-per-shard and --prefix apply")
    parser.add_argument("--media-root", default=None,
                        help="folder the conversations' media paths are relative to (default: the file's own)")
    parser.add_argument("--root", default=None, help="folder the manifest's paths are relative to (default: its own)")
    parser.add_argument("--max-side", type=int, default=448, help="longest image side after resizing, in pixels")
    parser.add_argument("--workload", default="omni_mix", help="preset name or path to a workload YAML")
    parser.add_argument("--num-shards", type=int, default=8)
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--length-scale", type=float, default=1.0, help="multiplies every drawn length")
    parser.add_argument("--max-llm-tokens", type=int, default=None, help="cap on a sample's LLM sequence length")
    parser.add_argument("--patch-size", type=int, default=14)
    parser.add_argument("--n-mels", type=int, default=80)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--prefix", default="train")
    args = parser.parse_args(argv)
    if args.from_jsonl is not None and args.from_conversations is not None:
        parser.error("--from-jsonl and --from-conversations are alternatives: give one")
    if args.from_conversations is not None:
        paths = conversations_to_shards(args.from_conversations, args.out, media_root=args.media_root,
                                        samples_per_shard=args.samples_per_shard, prefix=args.prefix)
        print(f"wrote {len(paths)} shards to {args.out}")
        return
    if args.from_jsonl is not None:
        paths = jsonl_to_shards(args.from_jsonl, args.out, root=args.root, samples_per_shard=args.samples_per_shard,
                                patch_size=args.patch_size, max_side=args.max_side, n_mels=args.n_mels,
                                prefix=args.prefix)
        print(f"wrote {len(paths)} shards to {args.out}")
        return
    paths = make_synthetic_shards(
        args.out,
        workload=args.workload,
        num_shards=args.num_shards,
        samples_per_shard=args.samples_per_shard,
        seed=args.seed,
        length_scale=args.length_scale,
        max_llm_tokens=args.max_llm_tokens,
        patch_size=args.patch_size,
        n_mels=args.n_mels,
        vocab_size=args.vocab_size,
        prefix=args.prefix,
    )
    print(f"wrote {len(paths)} shards to {args.out}")


def export_hf_main(argv: list[str]) -> None:
    """``omni-lightning export-hf``: a training checkpoint of a Hugging Face family in the family's own format."""
    parser = argparse.ArgumentParser(
        prog="omni-lightning export-hf",
        description="Write the model of a training checkpoint (any layout, sharded or not) as a Hugging Face "
                    "checkpoint of its family (config, safetensors, the processor files), which from_pretrained "
                    "reads. The module must have been trained from OmniModule(pretrained=DIR).")
    parser.add_argument("--checkpoint", required=True, help="a checkpoint written by training (.ckpt file or dir)")
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--merge-lora", action="store_true", help="LoRA adapters merged into the weights")
    parser.add_argument("--adapter-only", action="store_true",
                        help="the LoRA adapters alone, as a peft adapter directory for the original checkpoint")
    args = parser.parse_args(argv)
    try:
        out = export_hf(args.checkpoint, args.out, merge_lora=args.merge_lora, adapter_only=args.adapter_only)
    except ValueError as error:
        parser.error(str(error))
    print(f"exported {args.checkpoint} to {out}")


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``omni-lightning``; ``argv`` defaults to the command line."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "make-shards":
        make_shards_main(args[1:])
        return
    if args and args[0] == "export-hf":
        export_hf_main(args[1:])
        return
    if args and args[0] == "simulate":
        simulate_main([_renamed_flag(arg) for arg in args[1:]])
        return
    OmniCLI(args=argv)


def _renamed_flag(arg: str) -> str:
    flag, equals, value = arg.partition("=")
    if flag != "--balance-group":
        return arg
    warn_renamed("omni-lightning simulate --balance-group")
    return "--reorder-group" + equals + value


if __name__ == "__main__":
    main()
