"""Test-suite set-up: one thread per process, heavy modules imported once before any fork, shared fixtures."""

from __future__ import annotations

from pathlib import Path

# Fork-started ranks inherit these imports instead of paying seconds each (see research/feasibility.md).
import lightning.pytorch  # noqa: F401
import pytest
import torch
import torch._dynamo  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401
from hypothesis import settings

from omni_lightning.data.synthetic import make_synthetic_shards
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.module import initial_state_dict

torch.set_num_threads(1)

# The test command draws the same examples on every run, so that a counterexample fails the commit that brings it
# rather than a later, unrelated one that happens to draw it; `pytest --hypothesis-profile=explore` draws fresh ones,
# and `--hypothesis-seed=N` (which derandomizing would override) the draws of that seed.
settings.register_profile("deterministic", derandomize=True)
settings.register_profile("explore", derandomize=False)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("hypothesis_profile", None) is None and config.getoption("hypothesis_seed", None) is None:
        settings.load_profile("deterministic")


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Eight small omni-mix shards (text, image, video and audio samples) shared by the distributed tests."""
    out = tmp_path_factory.mktemp("shards")
    make_synthetic_shards(out, workload="omni_mix", num_shards=8, samples_per_shard=24, seed=0,
                          length_scale=0.03, max_llm_tokens=160)
    return str(out / "train-{000000..000007}.tar")


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seed checkpoint (torchtitan's term): the full initial weights every layout starts from."""
    path = tmp_path_factory.mktemp("seed") / "seed.pt"
    torch.save(initial_state_dict(ReferenceMLLMConfig.tiny(), seed=1234), path)
    return path


@pytest.fixture(scope="session")
def moe_seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Seed checkpoint of the MoE variant of the tiny reference model."""
    path = tmp_path_factory.mktemp("moe_seed") / "seed.pt"
    torch.save(initial_state_dict(ReferenceMLLMConfig.tiny(moe=True), seed=99), path)
    return path
