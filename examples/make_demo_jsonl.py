"""Write a small stand-in for a user's dataset: a JSONL manifest of captions, an image folder and mel files.

    python examples/make_demo_jsonl.py data/demo_jsonl [--samples 128]

Then convert and train (README, "Your own data"):

    omni-lightning make-shards --from-jsonl data/demo_jsonl/captions.jsonl --out data/demo_jsonl/shards
    omni-lightning fit --config examples/jsonl.yaml
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image

COLOURS = {"red": (200, 40, 40), "green": (40, 160, 60), "blue": (40, 70, 200), "yellow": (220, 200, 40)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    (args.out / "images").mkdir(parents=True, exist_ok=True)
    (args.out / "mels").mkdir(exist_ok=True)
    with (args.out / "captions.jsonl").open("w") as manifest:
        for i in range(args.samples):
            name = str(rng.choice(list(COLOURS)))
            # Photos come in all sizes; a few are large, as in real data (the converter resizes them to patches).
            width, height = (int(v) for v in rng.integers(40, 520 if i % 8 == 0 else 200, size=2))
            pixels = np.clip(np.array(COLOURS[name]) + rng.normal(0, 25, (height, width, 3)), 0, 255)
            record: dict = {"id": f"demo-{i:05d}", "text": f"A {name} picture, {width} by {height} pixels."}
            if i % 5:
                Image.fromarray(pixels.astype(np.uint8)).save(args.out / "images" / f"{i:05d}.jpg")
                record["images"] = [f"images/{i:05d}.jpg"]
            if i % 3 == 0:
                np.save(args.out / "mels" / f"{i:05d}.npy", rng.standard_normal((int(rng.integers(8, 160)), 80)))
                record["audio"] = f"mels/{i:05d}.npy"
            manifest.write(json.dumps(record) + "\n")
    print(f"wrote {args.samples} samples to {args.out}")


if __name__ == "__main__":
    main()
