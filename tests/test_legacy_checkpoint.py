"""A checkpoint written by omni-lightning 0.1 (``tests/fixtures/legacy_checkpoint``) still resumes exactly.

The fixture is a sharded checkpoint at step 3 of a 2-rank FSDP job with grouped reordering and encoder resharding,
whose loader states carry samples over to the next group (an image and a video among them), and the losses of steps
1-6 of the uninterrupted run. Resuming it must give the same steps 4-6: weights, optimizer state, the pickled
configuration classes, every rank's loader position and its carried samples all restore.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

FIXTURE = Path(__file__).parent / "fixtures" / "legacy_checkpoint"
sys.path.insert(0, str(FIXTURE))

import job  # noqa: E402  (the fixture's own job definition)

from omni_lightning.models.config import ReferenceMLLMConfig  # noqa: E402

pytestmark = pytest.mark.distributed


def test_a_checkpoint_of_release_0_1_resumes_exactly(tmp_path: Path) -> None:
    losses = tmp_path / "losses.json"
    job.trainer(job.LAST_STEP, [job.RecordLosses(losses)]).fit(
        job.module(), job.datamodule(), ckpt_path=str(FIXTURE / "checkpoint.ckpt"))
    resumed = json.loads(losses.read_text())
    recorded = json.loads((FIXTURE / "losses.json").read_text())
    steps = [str(s) for s in range(job.CHECKPOINT_STEP + 1, job.LAST_STEP + 1)]
    assert sorted(resumed) == steps
    # Same code path as the run that wrote it: only float reassociation (another BLAS) may differ, ~1e-7.
    torch.testing.assert_close(torch.tensor([resumed[s] for s in steps]), torch.tensor([recorded[s] for s in steps]),
                               rtol=1e-5, atol=0)


def test_its_pickled_configuration_loads_with_fields_added_since() -> None:
    """The hyper-parameters hold 0.1's ``ReferenceMLLMConfig`` objects, pickled before ``temporal_patch_size``
    existed; they load under the classes' old import path (``omni_lightning.models.config``) with the new default."""
    hyper = torch.load(FIXTURE / "checkpoint.ckpt" / "meta.pt", weights_only=True)
    configs = [v for v in _walk(hyper) if isinstance(v, ReferenceMLLMConfig)]
    assert configs, "no pickled configuration in the fixture"
    for config in configs:
        assert "temporal_patch_size" not in vars(config.vision)  # pickled by 0.1
        assert config.vision.temporal_patch_size == 1
        assert config.packing().temporal_patch_size == 1


def _walk(value: object) -> list[object]:
    if isinstance(value, dict):
        return [value, *(x for v in value.values() for x in _walk(v))]
    if isinstance(value, (list, tuple)):
        return [value, *(x for v in value for x in _walk(v))]
    return [value]
