"""The GPU smoke script runs on the CPU in its dry mode: the same training path (OmniModule under OmniStrategy,
FSDP2 with bf16 compute, a compiled backend) as a one-rank gloo world, and the attention kernel check."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_smoke.py"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["reference", "qwen2_5_vl"])
def test_gpu_smoke_dry_run(model: str, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--model", model, "--steps", "2", "--warmup", "1",
                          "--out", str(tmp_path / "r.json")],
                         check=True, capture_output=True, text=True, timeout=300).stdout
    assert re.fullmatch(r"tokens/s: [0-9.]+  mfu: [0-9.]+", out.strip().splitlines()[-1])
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["attention_kernel"] == "sdpa" and result["attention_ok"] and result["model"] == model
    # Both runs took their first step from the same weights and batch: the gradients agree to bf16 rounding.
    assert result["gradients_ok"] and result["first_step_grad_cosine"]["min"] > 0.999
    assert result["compile_backend"] == "aot_eager"
    for run in ("bf16", "fp32"):
        assert result[run]["backend"] == "gloo" and result[run]["all_reduce_ok"]
        assert len(result[run]["losses"]) == 3 and result[run]["tokens_per_s"] > 0
    # bf16 compute took effect (the runs differ) and stayed close to fp32.
    assert 0 < result["loss_max_rel_diff"] <= 5e-2 and result["losses_ok"] and result["tokens_per_s"] > 0
