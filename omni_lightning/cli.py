"""The ``omni-lightning`` command: LightningCLI subcommands (fit, validate, ...) plus ``make-shards`` and
``simulate``."""

from __future__ import annotations

import argparse
import sys

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI

import omni_lightning  # noqa: F401  (registers strategy="omni")
from omni_lightning.datamodules.synthetic import make_synthetic_shards
from omni_lightning.module import OmniModule
from omni_lightning.sim.report import simulate_main

__all__ = ["main", "OmniCLI", "make_shards_main"]


class OmniCLI(LightningCLI):
    """LightningCLI for :class:`OmniModule` and any data module (``--data.class_path`` picks a user's own)."""

    def __init__(self, args: list[str] | None = None, **kwargs: object) -> None:
        super().__init__(
            OmniModule,
            LightningDataModule,
            subclass_mode_data=True,
            args=args,
            **kwargs,  # type: ignore[arg-type]
        )


def make_shards_main(argv: list[str]) -> None:
    """``omni-lightning make-shards``: write synthetic multimodal webdataset shards from a workload spec."""
    parser = argparse.ArgumentParser(
        prog="omni-lightning make-shards", description="Write synthetic multimodal webdataset shards."
    )
    parser.add_argument("--out", required=True, help="output directory")
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


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``omni-lightning``; ``argv`` defaults to the command line."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "make-shards":
        make_shards_main(args[1:])
        return
    if args and args[0] == "simulate":
        simulate_main(args[1:])
        return
    OmniCLI(args=argv)


if __name__ == "__main__":
    main()
