"""Shard lists: brace patterns, globs and directories expanded, checked to exist, and synthetic shards on demand."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import braceexpand

__all__ = ["SyntheticShards", "existing_shards", "expand_shards", "synthetic_target"]


@dataclass
class SyntheticShards:
    """Shards to generate on first use when the configured ones do not exist (see ``omni-lightning make-shards``)."""

    workload: str = "omni_mix"
    num_shards: int = 8
    samples_per_shard: int = 64
    seed: int = 0
    length_scale: float = 0.05
    max_llm_tokens: int | None = 512


def expand_shards(shards: str | list[str]) -> list[str]:
    """Expand brace patterns (``train-{000000..000007}.tar``), globs and directories into a sorted shard list."""
    patterns = [shards] if isinstance(shards, str) else list(shards)
    paths: list[str] = []
    for pattern in patterns:
        for expanded in braceexpand.braceexpand(pattern):
            if os.path.isdir(expanded):
                paths.extend(sorted(glob.glob(os.path.join(expanded, "*.tar"))))
            elif any(ch in expanded for ch in "*?["):
                paths.extend(sorted(glob.glob(expanded)))
            else:
                paths.append(expanded)
    return paths


def synthetic_target(shards: str | list[str], paths: list[str]) -> tuple[Path, str]:
    """Directory and file prefix for generated shards: named like the pattern's ``PREFIX-NNNNNN.tar`` files, or
    ``train-NNNNNN.tar`` inside a directory (or a glob's directory) that holds no shards yet."""
    if paths and paths[0].endswith(".tar"):
        return Path(paths[0]).parent, Path(paths[0]).name.rsplit("-", 1)[0]
    pattern = Path(shards if isinstance(shards, str) else shards[0])
    return (pattern.parent if any(ch in str(pattern) for ch in "*?[") else pattern), "train"


def existing_shards(shards: str | list[str] | None) -> list[str]:
    """The expanded shard list; ``ValueError`` if it is empty or names missing local files (URLs are not checked)."""
    if shards is None:
        raise ValueError("no shards given: pass shards=... (a brace pattern, glob, directory or list of .tar files)")
    paths = expand_shards(shards)
    missing = [p for p in paths if "://" not in p and not os.path.exists(p)]
    if not paths or missing:
        raise ValueError(f"shards {shards!r}: {'no files match' if not paths else f'missing {missing[:3]}'};"
                         " run `omni-lightning make-shards` or set data.synthetic to generate them")
    return paths
