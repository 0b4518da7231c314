"""The GPU smoke script runs on the CPU in its dry mode: the same checks with SDPA against a dense mask and gloo."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_smoke.py"


@pytest.mark.slow
def test_gpu_smoke_dry_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--steps", "1", "--out", str(tmp_path / "r.json")],
                         check=True, capture_output=True, text=True, timeout=300).stdout
    assert re.fullmatch(r"tokens/s: [0-9.]+  mfu: [0-9.]+", out.strip().splitlines()[-1])
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["attention_ok"] and result["gloo_all_reduce_ok"] and result["tokens_per_s"] > 0
