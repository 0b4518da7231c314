"""A user's JSONL manifest with image and mel files, converted to shards and trained on (README, "Your own data")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from distributed import free_port
from PIL import Image

from omni_lightning.cli import main
from omni_lightning.data.jsonl import jsonl_to_shards
from omni_lightning.data.streaming import ByteTokenizer, DecodedSample, ShardStream

REPO = Path(__file__).resolve().parents[1]


def _manifest(root: Path, records: list[dict]) -> Path:
    path = root / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def user_data(tmp_path: Path) -> Path:
    (tmp_path / "img").mkdir()
    Image.new("RGB", (100, 60), (255, 0, 0)).save(tmp_path / "img" / "wide.png")
    Image.new("RGB", (900, 900), (0, 0, 255)).save(tmp_path / "img" / "huge.jpg")
    np.save(tmp_path / "clip.npy", np.ones((42, 80), dtype=np.float32))
    return _manifest(tmp_path, [
        {"id": "a", "text": "red", "images": ["img/wide.png"]},
        {"id": "b", "text": "blue and a clip", "images": ["img/huge.jpg", "img/wide.png"], "audio": "clip.npy"},
        {"text": "just text"},
    ])


def test_manifest_round_trips_through_the_loader(user_data: Path, tmp_path: Path) -> None:
    paths = jsonl_to_shards(user_data, tmp_path / "shards", samples_per_shard=2, max_side=448)
    assert [Path(p).name for p in paths] == ["train-000000.tar", "train-000001.tar"]
    stream = ShardStream(paths, dp_rank=0, dp_size=1, batch_size=1, shuffle_shards=False)
    samples = [s for s, _ in zip(stream.iter_samples(), range(3), strict=False)]
    assert all(isinstance(s, DecodedSample) for s in samples)  # metadata agrees with every payload
    wide, both, text = samples
    assert [s.key for s in samples] == ["a", "b", "line000003"]
    assert both.tokens.tolist() == ByteTokenizer().encode("blue and a clip")  # the default tokenizer
    # Resized to whole 2x2 windows of 14-pixel patches, aspect kept, longest side at most 448.
    assert wide.images[0].shape == (56, 112, 3)
    assert both.images[0].shape == (448, 448, 3)
    assert both.mel.shape == (40, 80)  # cut to a multiple of the 4-frame audio merge
    assert text.images == [] and text.mel is None


@pytest.mark.parametrize("record, problem", [
    ({"id": "x", "text": "t", "images": ["missing.png"]}, "missing.png"),
    ({"id": "x", "images": []}, "'text' must be a non-empty string"),
    ({"id": "x.y", "text": "t"}, "not made of letters"),
    ({"id": "x", "text": "t", "audio": "short.npy"}, "fewer than 4 mel frames"),
])
def test_bad_line_names_its_line_and_problem(tmp_path: Path, record: dict, problem: str) -> None:
    np.save(tmp_path / "short.npy", np.ones((3, 80)))
    manifest = _manifest(tmp_path, [{"id": "ok", "text": "fine"}, record])
    with pytest.raises(ValueError, match=rf"data.jsonl:2.*{problem}"):
        jsonl_to_shards(manifest, tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.tar"))  # nothing that looks like a finished shard


@pytest.mark.distributed
def test_readme_example_converts_and_trains(tmp_path: Path) -> None:
    """The README's commands for one's own data: generate the demo manifest, convert it, train 2 steps."""
    subprocess.run([sys.executable, str(REPO / "examples" / "make_demo_jsonl.py"), str(tmp_path / "data" /
                    "demo_jsonl"), "--samples", "24"], check=True, capture_output=True)
    main(["make-shards", "--from-jsonl", str(tmp_path / "data" / "demo_jsonl" / "captions.jsonl"),
          "--out", str(tmp_path / "data" / "demo_jsonl" / "shards"), "--samples-per-shard", "8"])
    os.environ["MASTER_PORT"] = str(free_port())
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the config's paths are relative to the repository root, as in the README
    try:
        main(["fit", "--config", str(REPO / "examples" / "jsonl.yaml"), "--trainer.max_steps", "2",
              "--trainer.strategy.launcher", "fork", "--trainer.enable_progress_bar", "false",
              "--trainer.logger", "false", "--data.init_args.group_steps", "2"])
    finally:
        os.chdir(cwd)
