"""What the cluster-scale benchmarks share: the model they price samples for and the workloads they run."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from omni_lightning.balance.cost import DEFAULT_ENCODERS, CostModel, feature_matrix, fit_cost_model
from omni_lightning.balance.workload import WORKLOADS_DIR, SampleMeta
from omni_lightning.models.config import AudioEncoderConfig, LLMConfig, ReferenceMLLMConfig, VisionEncoderConfig

SHARED_WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"

# Workload A of MegaScale-Omni: a ~1B-parameter ViT and a LLaMA-12B-class decoder (audio encoder Whisper-sized).
WORKLOAD_A = ReferenceMLLMConfig(
    vision=VisionEncoderConfig(dim=1664, n_layers=32, n_heads=16),
    audio=AudioEncoderConfig(n_mels=128, dim=1280, n_layers=32, n_heads=20),
    llm=LLMConfig(vocab_size=128256, dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden=13824),
)


def default_workloads() -> list[str]:
    """Every spec in ../shared/workloads/ beside the checkout, else the copies bundled with the package."""
    folder = SHARED_WORKLOADS if SHARED_WORKLOADS.is_dir() else WORKLOADS_DIR
    return sorted(str(p) for p in folder.glob("*.yaml"))


def free_port() -> int:
    """A TCP port nothing listens on now, for the rendezvous of a benchmark's process group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fit_to_runs(runs: dict[str, dict[str, Any]], names: tuple[str, ...], steps: slice) -> tuple[CostModel, int]:
    """A cost model in seconds fitted to ``e2e.py``'s measured (rank, step) times of runs ``names`` over ``steps``
    (every rank's samples and thread CPU seconds), for the modules the samples use; and how many rank-steps it saw."""
    calibration = [([SampleMeta.from_json(m) for m in metas], float(seconds))
                   for name in names
                   for step_metas, step_seconds in zip(runs[name]["per_rank_samples"][steps],
                                                       runs[name]["per_rank_step_s"][steps], strict=True)
                   for metas, seconds in zip(step_metas, step_seconds, strict=True)]
    # Fit only the modules the workload exercises: an absent one has no data to determine its coefficients.
    totals = feature_matrix([meta for metas, _ in calibration for meta in metas]).sum(axis=0)
    used = [m for i, m in enumerate((*DEFAULT_ENCODERS, "llm")) if totals[2 * i] > 0]
    return fit_cost_model(calibration, modules=used), len(calibration)
