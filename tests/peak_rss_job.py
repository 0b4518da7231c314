"""One Lightning job of a pretrained family on 4 fresh processes (Lightning's subprocess launcher re-runs this
script), each rank writing how far its resident memory rose while the model was built and loaded.

    python tests/peak_rss_job.py CHECKPOINT_DIR SHARDS OUT_DIR
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from omni_lightning import OmniDataModule, OmniModule, OmniStrategy


def _resident_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


class ResidentGrowth(pl.Callback):
    """Resident bytes before the model is configured, and the peak after it (ru_maxrss: the process's peak)."""

    def __init__(self, out: Path) -> None:
        self.out, self.before = out, 0

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        self.before = _resident_bytes()

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in module.model.parameters())
        (self.out / f"rss_rank{trainer.global_rank}.json").write_text(json.dumps(
            {"grew": peak - self.before, "local_parameters": local}))


def main() -> None:
    checkpoint, shards, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=OmniStrategy(dp_shard=4, timeout=300), max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[ResidentGrowth(out)])
    trainer.fit(OmniModule(pretrained=checkpoint), datamodule=OmniDataModule(shards, samples_per_step=1,
                                                                             group_steps=1))


if __name__ == "__main__":
    main()
