"""Mixed precision (bf16 compute, fp32 master weights and gradient reduction) in every layout, on CPU.

Each layout trains the tiny model 2 steps with ``OmniModule(param_dtype="bfloat16")`` on 2 gloo ranks and is
compared with one process running the same global batches twice: in fp32, and in bf16 as FSDP's mixed precision
computes (parameters cast to bf16 for forward and backward, gradients and the optimizer in fp32).

Tolerances. bf16 keeps 8 significant bits (a relative rounding error of 2**-9 per operation), and CPU kernels
accumulate some reductions (LayerNorm's weight and bias gradients) in bf16, so a gradient that sums many
cancelling terms can be off by several percent while the whole gradient is off by about 1%. Measured over these
layouts: losses within 9e-4 of fp32 and 4e-4 of the bf16 single process; the whole first-step gradient within 1.1%
(fp32) and 0.9% (bf16) of its norm; the worst single tensor (a vision LayerNorm's) within 5% (fp32) and 11% (bf16:
one process sums all tokens in one bf16 reduction where the layout sums halves). Allowed: losses 1e-2 (fp32) and
2e-3 (bf16), the whole gradient 3% (fp32) and 2% (bf16), every tensor 20%. A real fault is far outside: a wrong
loss scale or a missing gradient reduction moves the whole gradient by >= 50%, a dropped encoder output moves
that encoder's tensors by 100%. And the run must differ from fp32 (by > 1e-6 in some loss): a layout that ignored
``param_dtype`` would match fp32 to ~1e-7.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning_runs import LEARNING_RATE, RecordRun, fit, merged_grads, reference_run

from omni_lightning import OmniModule, ReferenceMLLMConfig

pytestmark = pytest.mark.distributed

STEPS = 2
DENSE, MOE = ReferenceMLLMConfig.tiny(), ReferenceMLLMConfig.tiny(moe=True)
# name: (OmniStrategy degrees, data-parallel size of the LLM, config, micro-batches per rank-step, module options)
LAYOUTS = {
    "dp_shard2": ({"dp_shard": 2}, 2, DENSE, 1, {}),
    "hsdp": ({"dp_replicate": 2, "dp_shard": 1}, 2, DENSE, 1, {}),
    "tp2": ({"dp_shard": 1, "tp": 2}, 1, DENSE, 1, {}),
    "cp2": ({"dp_shard": 1, "cp": 2}, 1, DENSE, 1, {}),
    "ep2_moe": ({"dp_shard": 2, "ep": 2}, 2, MOE, 1, {}),
    "enc_sp2": ({"dp_shard": 2, "enc_sp": 2}, 2, DENSE, 1, {}),
    "activation_checkpointing": ({"dp_shard": 2}, 2, DENSE, 1, {"activation_checkpointing": True}),
    "pp2_1f1b_joint": ({"pp": 2, "dp_shard": 1}, 1, DENSE, 2, {}),
    "pp2_1f1b_first_stage": ({"pp": 2, "dp_shard": 1, "pp_encoders": "first_stage"}, 1, DENSE, 2, {}),
    "pp2_gpipe": ({"pp": 2, "dp_shard": 1, "pp_schedule": "GPipe"}, 1, DENSE, 2, {}),
    "pp2_interleaved": ({"pp": 2, "dp_shard": 1, "pp_schedule": "Interleaved1F1B", "pp_virtual_stages": 2}, 1,
                        DENSE, 2, {}),
    "pp2_zero_bubble": ({"pp": 2, "dp_shard": 1, "pp_schedule": "InterleavedZeroBubble", "pp_virtual_stages": 2},
                        1, DENSE, 2, {}),
    "disaggregated": ({"placement": "disaggregated", "encoder_world_size": 1}, 1, DENSE, 2, {}),
}


def _gradient_errors(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
                     ) -> tuple[float, float, str]:
    """The whole gradient's relative error, and the worst tensor's with its name."""
    assert grads.keys() == reference.keys()
    names = list(reference)
    ours, ref = (torch.cat([g[n].float().flatten() for n in names]) for g in (grads, reference))
    errors = {n: ((grads[n].float() - reference[n]).norm() / reference[n].norm()).item() for n in names
              if reference[n].norm() > 0}
    worst = max(errors, key=errors.get)
    return ((ours - ref).norm() / ref.norm()).item(), errors[worst], worst


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_layout_matches_fp32_and_bf16_references(name: str, tmp_path: Path, tiny_shards: str,
                                                      seed_checkpoint: Path, moe_seed: Path) -> None:
    layout, dp, config, micro_batches, options = LAYOUTS[name]
    seed = moe_seed if config is MOE else seed_checkpoint
    module = OmniModule(config, learning_rate=LEARNING_RATE, init_checkpoint=str(seed), param_dtype="bfloat16",
                        **options)
    fit(tmp_path, tiny_shards, seed, layout=layout, devices=2, max_steps=STEPS, module=module,
        callbacks=[RecordRun(tmp_path, grads=True)])
    losses = torch.tensor(list(json.loads((tmp_path / "losses.json").read_text()).values()))
    grads = merged_grads(tmp_path)
    for dtype, loss_rtol, whole_rtol in ((torch.float32, 1e-2, 3e-2), (torch.bfloat16, 2e-3, 2e-2)):
        ref_losses, ref_grads = reference_run(tiny_shards, seed, dp_size=dp, steps=STEPS, config=config,
                                              pipeline_micro_batches=micro_batches,
                                              param_dtype=None if dtype is torch.float32 else dtype)
        ref = torch.tensor(ref_losses)
        torch.testing.assert_close(losses, ref, rtol=loss_rtol, atol=0,
                                   msg=f"{name}: losses against the {dtype} single process")
        if dtype is torch.float32:
            assert (losses - ref).abs().max() > 1e-6, f"{name}: the losses are fp32's: param_dtype was ignored"
        whole, worst, tensor = _gradient_errors(grads, ref_grads)
        assert whole <= whole_rtol, f"{name}: the gradient differs from the {dtype} reference by {whole:.3g}"
        assert worst <= 0.2, f"{name}: the gradient of {tensor} differs from the {dtype} reference by {worst:.3g}"
