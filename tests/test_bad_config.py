"""Every invalid configuration in docs/configuration_errors.md fails early, with a message naming the numbers and the
fix, and without starting a process or a process group. One case per row of the table (checked at the end)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from hf_processors import save_processor, save_tiny_llava_onevision

from omni_lightning import OmniDataModule, OmniModule, OmniStrategy, ReferenceMLLMConfig, WebDataModule
from omni_lightning.models.config import AudioEncoderConfig, LLMConfig, VisionEncoderConfig
from omni_lightning.parallel.layout import OmniLayout

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration_errors.md"
TINY = ReferenceMLLMConfig.tiny()


def _unsupported_family(shards: str) -> None:
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as path:
        (Path(path) / "config.json").write_text(json.dumps({"model_type": "blip-2"}))
        OmniModule(pretrained=path)


def _llava_onevision(shards: str, name: str, file: str = "config.json", **changes: Any) -> Path:
    """A tiny LLaVA-OneVision checkpoint beside the shards, ``changes`` written into one of its JSON files."""
    import json

    path = save_tiny_llava_onevision(Path(shards.split("{")[0]).parent / name)
    settings = json.loads((path / file).read_text())
    (path / file).write_text(json.dumps({**settings, **changes}))
    return path


def _tiles_otherwise(shards: str) -> None:
    """A data module reading with a processor whose canvases are not the model's."""
    model = OmniModule(pretrained=str(_llava_onevision(shards, "llava")))
    data = OmniDataModule(shards, processor=str(_llava_onevision(shards, "other", "preprocessor_config.json",
                                                                 image_grid_pinpoints=[[44, 44]])))
    data._adopt_model_packing(model)
    data.reader()


def _model(**llm: Any) -> ReferenceMLLMConfig:
    """The tiny reference model with some LLM sizes changed (validated on construction)."""
    return ReferenceMLLMConfig(vision=TINY.vision, audio=TINY.audio, llm=replace(TINY.llm, **llm))


def _trainer(devices: int, accumulate: int = 1, **strategy: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=OmniStrategy(launcher="fork", **strategy),
                      accumulate_grad_batches=accumulate, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)


def _fit(devices: int, config: ReferenceMLLMConfig, **strategy: Any) -> Callable[[str], None]:
    """Trainer.fit with the fork launcher: the model check must fire in this process, before any worker starts."""
    def run(shards: str) -> None:
        with mock.patch("torch.multiprocessing.start_processes") as start:
            try:
                _trainer(devices, **strategy).fit(OmniModule(config), datamodule=WebDataModule(shards))
            finally:
                start.assert_not_called()
    return run


def _mock_layout(trainer: pl.Trainer, config: ReferenceMLLMConfig, dp_rank: int) -> OmniLayout:
    """What OmniStrategy.setup_environment hands over, with this rank's position mocked instead of process groups."""
    omni = trainer.strategy
    layout = OmniLayout(omni.parallel_dims, mock.Mock(**{"local_rank.return_value": dp_rank}), omni.pipeline_settings,
                        omni.placement_settings, rank=0, reshard=False)
    omni._layout, omni._lightning_module = layout, OmniModule(config)
    return layout


def _setup(data: Callable[[str], WebDataModule], devices: int = 4, dp_rank: int = 0, accumulate: int = 1,
           config: ReferenceMLLMConfig = TINY, **strategy: Any) -> Callable[[str], None]:
    """DataModule.setup('fit') on one rank of a job, as Lightning runs it (no process group: the rank is mocked)."""
    def run(shards: str) -> None:
        trainer = _trainer(devices, accumulate, **strategy)
        module = data(shards)
        module.trainer, module.omni_layout = trainer, _mock_layout(trainer, config, dp_rank)
        module.setup("fit")
    return run


def _with_processor(**settings: Any) -> Callable[[str], None]:
    """OmniDataModule with a Qwen2-VL-like processor directory (patch 14, 2x2 merge) and ``settings``."""
    def run(shards: str) -> None:
        processor = save_processor(Path(shards.split("{")[0]).parent / "processor")
        OmniDataModule(shards, processor=str(processor), **settings)
    return run


def _flash(installed: bool) -> Callable[[str], None]:
    """Trainer.fit of a model that insists on flash-attn, in a process that has it or not (CPU, fp32 either way)."""
    def run(shards: str) -> None:
        with mock.patch("omni_lightning.parallel.attention.FLASH_ATTN_INSTALLED", installed):
            _fit(1, replace(TINY, attention_backend="flash"))(shards)
    return run


def _vision(**changes: Any) -> Callable[[str], None]:
    return lambda _: ReferenceMLLMConfig(vision=VisionEncoderConfig(**changes))


@dataclass(frozen=True)
class Case:
    trigger: Callable[[str], Any]  # gets the tiny shard pattern
    message: str  # regex the error must match: the numbers and the fix


CASES: dict[str, Case] = {
    # ---- strategy arguments: OmniStrategy(...)
    "degree-not-positive": Case(lambda _: OmniStrategy(tp=0), r"tp must be a positive integer, got 0"),
    "dp-shard-invalid": Case(lambda _: OmniStrategy(dp_shard=0), r"dp_shard must be a positive integer or -1"),
    "ep-not-dividing-dp-shard-cp": Case(lambda _: OmniStrategy(dp_shard=2, ep=4),
                                        r"ep=4 must divide dp_shard\*cp = 2\*1 = 2 \(expert parallelism borrows"),
    "enc-sp-not-power-of-two": Case(lambda _: OmniStrategy(dp_shard=4, enc_sp=3), r"enc_sp=3 must be a power of two"),
    "enc-sp-not-dividing-dp": Case(lambda _: OmniStrategy(dp_shard=3, enc_sp=2),
                                   r"enc_sp=2 must divide the data-parallel size dp_replicate\*dp_shard = 1\*3 = 3"),
    "enc-sp-without-reshard": Case(lambda _: OmniStrategy(dp_shard=4, enc_sp=2, encoder_reshard=False),
                                   r"enc_sp=2 splits items planned by the resharder: drop encoder_reshard"),
    "launcher-unknown": Case(lambda _: OmniStrategy(launcher="thread"), r"launcher='thread' must be 'subprocess'"),
    "timeout-not-positive": Case(lambda _: OmniStrategy(timeout=0), r"timeout=0 must be a positive number"),
    "nonfinite-policy-unknown": Case(lambda _: OmniStrategy(on_nonfinite="ignore"),
                                     r"on_nonfinite='ignore' must be 'skip' or 'stop'"),
    "pp-schedule-unknown": Case(lambda _: OmniStrategy(pp_schedule="1f1b"), r"pp_schedule='1f1b' must be one of"),
    "pp-encoders-unknown": Case(lambda _: OmniStrategy(pp_encoders="last"), r"pp_encoders='last' must be 'joint'"),
    "pp-setting-below-one": Case(lambda _: OmniStrategy(pp_microbatches=0), r"pp_microbatches=0 must be at least 1"),
    "pp-calibration-steps-negative": Case(lambda _: OmniStrategy(pp_calibration_steps=-1),
                                          r"pp_calibration_steps=-1 must be a non-negative integer"),
    "reshard-calibration-steps-negative": Case(lambda _: OmniStrategy(reshard_calibration_steps=-1),
                                               r"reshard_calibration_steps=-1 must be a non-negative integer"),
    "virtual-stages-need-interleaved-schedule": Case(
        lambda _: OmniStrategy(pp=2, pp_virtual_stages=2),
        r"pp_schedule='1F1B' runs one stage per rank but pp_virtual_stages=2: use pp_virtual_stages=1 or "
        r"pp_schedule='Interleaved1F1B'"),
    "interleaved-microbatches-not-multiple-of-pp": Case(
        lambda _: OmniStrategy(pp=2, pp_schedule="Interleaved1F1B", pp_virtual_stages=2, pp_microbatches=3),
        r"needs pp_microbatches \(3\) to be a multiple of pp=2: use pp_microbatches=4"),
    "placement-unknown": Case(lambda _: OmniStrategy(placement="separate"),
                              r"placement='separate' must be 'multiplexed' or 'disaggregated'"),
    "pool-size-without-disaggregated": Case(lambda _: OmniStrategy(encoder_world_size=2),
                                            r"encoder_world_size and pool_workload size the encoder pool of "
                                            r"placement='disaggregated'"),
    "disaggregated-with-interleaved-pipeline": Case(
        lambda _: OmniStrategy(pp=2, pp_schedule="Interleaved1F1B", pp_virtual_stages=2, placement="disaggregated",
                               encoder_world_size=1),
        r"placement='disaggregated' streams encoder outputs into a 1F1B or GPipe pipeline, not "
        r"pp_schedule='Interleaved1F1B'"),
    "disaggregated-pool-unsized": Case(lambda _: OmniStrategy(placement="disaggregated"),
                                       r"placement='disaggregated' needs encoder_world_size=N, or pool_workload=FILE"),
    # ---- degrees against the world size: Trainer(devices=..., num_nodes=...)
    "encoder-pool-takes-the-world": Case(lambda _: _trainer(4, placement="disaggregated", encoder_world_size=4),
                                         r"encoder_world_size=4 must leave the LLM pool at least one of the 4 ranks"),
    "enc-sp-not-dividing-encoder-pool": Case(
        lambda _: _trainer(4, placement="disaggregated", encoder_world_size=3, enc_sp=2),
        r"enc_sp=2 must divide encoder_world_size=3 \(SP blocks are aligned ranks of the encoder pool\)"),
    "world-not-divisible": Case(lambda _: _trainer(6, tp=4),
                                r"world size 6 is not divisible by pp\*dp_replicate\*cp\*tp = 1\*1\*1\*4 = 4"),
    "degrees-product-not-world": Case(lambda _: _trainer(4, dp_shard=4, tp=2),
                                      r"pp\*dp_replicate\*dp_shard\*cp\*tp = 1\*1\*4\*1\*2 = 8 must equal the world "
                                      r"size 4"),
    "ep-not-dividing-resolved-dp-shard": Case(lambda _: _trainer(8, tp=2, ep=8),
                                              r"ep=8 must divide dp_shard\*cp = 4\*1 = 4"),
    "enc-sp-not-dividing-resolved-dp": Case(lambda _: _trainer(6, tp=2, enc_sp=2),
                                            r"enc_sp=2 must divide the data-parallel size dp_replicate\*dp_shard = "
                                            r"1\*3 = 3"),
    # ---- model sizes against the layout: Trainer.fit, before workers start
    "tp-not-dividing-heads": Case(_fit(4, _model(dim=96, n_heads=6, n_kv_heads=2), tp=4),
                                  r"llm.n_heads=6 is not divisible by tp=4; choose a tp that divides it"),
    "tp-not-dividing-kv-heads": Case(_fit(8, TINY, tp=8), r"llm.n_kv_heads=4 is not divisible by tp=8"),
    "tp-not-dividing-ffn-hidden": Case(_fit(4, _model(ffn_hidden=130), tp=4),
                                       r"llm.ffn_hidden=130 is not divisible by tp=4"),
    "tp-not-dividing-vocab": Case(_fit(4, _model(vocab_size=258), tp=4),
                                  r"llm.vocab_size=258 is not divisible by tp=4"),
    "ep-without-moe-layers": Case(_fit(2, TINY, ep=2), r"ep=2 shards MoE experts but the LLM has no MoE layers"),
    "experts-not-divisible-by-ep": Case(_fit(3, ReferenceMLLMConfig.tiny(moe=True), ep=3),
                                        r"llm.n_experts=4 is not divisible by ep=3; pick ep dividing it"),
    "encoder-heads-vs-enc-sp": Case(_fit(8, TINY, enc_sp=8),
                                    r"vision.n_heads=4 is not divisible by enc_sp=8: .* pick enc_sp dividing"),
    "layers-fewer-than-stages": Case(_fit(2, TINY, pp=2, pp_schedule="Interleaved1F1B", pp_virtual_stages=4),
                                     r"4 decoder layers cannot fill 8 pipeline stages .* use fewer stages"),
    "flash-attn-not-installed": Case(_flash(installed=False),
                                     r"attention_backend='flash' needs the flash_attn package .* 'auto' picks"),
    "flash-attn-needs-half-cuda": Case(_flash(installed=True), r"attention_backend='flash' needs fp16/bf16 CUDA "
                                                               r"tensors, got torch.float32 on cpu"),
    # ---- model configuration: ReferenceMLLMConfig(...)
    "model-size-not-positive": Case(lambda _: _model(n_layers=0), r"llm.n_layers must be a positive integer, got 0"),
    "llm-dim-vs-heads": Case(lambda _: _model(dim=60), r"llm.dim=60 must be divisible by llm.n_heads=8"),
    "llm-head-dim-odd": Case(lambda _: _model(dim=24), r"llm.dim / llm.n_heads = 3 must be even: RoPE"),
    "kv-heads-not-dividing-heads": Case(lambda _: _model(n_kv_heads=3),
                                        r"llm.n_heads=8 must be a multiple of llm.n_kv_heads=3"),
    "vocab-too-small": Case(lambda _: _model(vocab_size=3), r"llm.vocab_size=3 must exceed the 4 reserved ids"),
    "moe-top-k-out-of-range": Case(lambda _: _model(moe_every=2, moe_top_k=5),
                                   r"llm.moe_top_k=5 must be in \[1, n_experts=4\]"),
    "moe-every-negative": Case(lambda _: _model(moe_every=-1), r"llm.moe_every=-1 must be 0"),
    "encoder-dim-vs-heads": Case(_vision(dim=30), r"vision.dim=30 must be divisible by vision.n_heads=4"),
    "vision-merge": Case(_vision(merge=2), r"vision.merge=2 must be 1 or 4"),
    "audio-downsample": Case(lambda _: ReferenceMLLMConfig(audio=AudioEncoderConfig(downsample=2)),
                             r"audio.downsample=2 must be 4"),
    "attention-backend-unknown": Case(lambda _: ReferenceMLLMConfig(attention_backend="xformers"),
                                      r"attention_backend='xformers' must be 'auto', 'sdpa' or 'flash'"),
    "pretrained-not-a-checkpoint": Case(lambda s: OmniModule(pretrained=str(Path(s).parent)),
                                        r"has no config.json: give a Hugging Face checkpoint directory"),
    "pretrained-family-unsupported": Case(_unsupported_family,
                                          r"is a 'blip-2' checkpoint; the supported families are \['qwen2_vl'"),
    "pretrained-features-unplaceable": Case(
        lambda s: OmniModule(pretrained=str(_llava_onevision(s, "default", vision_feature_select_strategy="default"))),
        r"vision_feature_select_strategy='default' drops the first patch of every tile, which LLaVA-OneVision's own "
        r"layout of tiles cannot arrange: its checkpoints use 'full'"),
    "pretrained-and-model": Case(lambda s: OmniModule(TINY, pretrained=s),
                                 r"give OmniModule either model or pretrained, not both"),
    "lora-without-pretrained": Case(lambda _: OmniModule(lora={"r": 4}),
                                    r"lora adapts a pretrained decoder: give OmniModule\(pretrained=DIR, lora=...\)"),
    "freeze-unknown-part": Case(lambda _: OmniModule(freeze=["decoder"]).configure_model(),
                                r"freeze names \['decoder'\], which are not parts of the model: choose from"),
    "freeze-everything": Case(lambda _: OmniModule(freeze=["vision", "audio", "projector", "llm"]).configure_model(),
                              r"freezes every part of the model .*: nothing would train"),
    "lr-multiplier-unknown-part": Case(lambda _: OmniModule(lr_multipliers={"text": 0.1}).configure_model(),
                                       r"lr_multipliers names \['text'\], which are not parts of the model"),
    # ---- data settings: OmniDataModule(...) and its setup on every rank
    "processor-not-a-directory": Case(lambda s: OmniDataModule(s, processor="no/such/processor"),
                                      r"processor='no/such/processor' is not a directory"),
    "size-contradicts-processor": Case(_with_processor(patch_size=16),
                                       r"patch_size=16 but the processor at .* has patch_size=14: leave patch_size"),
    "processor-tiles-otherwise": Case(_tiles_otherwise,
                                      r"the model tiles images into 44-pixel tiles on the canvases \[\[44, 44\], .*\], "
                                      r"but the processor at .* has tile=44 and canvases \[\[44, 44\]\]: read the "
                                      r"data with the checkpoint's own processor"),
    "audio-rate-not-a-divisor": Case(lambda s: OmniDataModule(s, audio_frames_per_second=7),
                                     r"audio_frames_per_second=7 must divide the audio sampling rate 16000"),
    "layout-unknown": Case(lambda s: OmniDataModule(s, layout="tfrecord"), r"layout='tfrecord' must be one of"),
    "reorder-unknown": Case(lambda s: OmniDataModule(s, reorder="sorted"),
                            r"reorder='sorted' must be 'grouped' or 'none'"),
    "pipeline-order-unknown": Case(lambda s: OmniDataModule(s, pipeline_order="sorted"),
                                   r"pipeline_order='sorted' must be one of \('disttrain', 'ramp', 'search'\)"),
    "on-bad-sample-unknown": Case(lambda s: OmniDataModule(s, on_bad_sample="warn"),
                                  r"on_bad_sample='warn' must be 'skip' or 'error'"),
    "read-timeout-not-positive": Case(lambda s: OmniDataModule(s, read_timeout=0),
                                      r"read_timeout=0 must be a positive number of seconds \(or None: no limit\)"),
    "reorder-group-size-below-one": Case(lambda s: OmniDataModule(s, reorder_group_size=0),
                                         r"reorder_group_size=0 must be at least 1"),
    "samples-per-step-below-one": Case(lambda s: OmniDataModule(s, samples_per_step=0),
                                       r"samples_per_step, group_steps and micro_batches must be at least 1"),
    "max-seq-len-over-token-budget": Case(lambda s: OmniDataModule(s, token_budget=256, max_seq_len=512),
                                          r"max_seq_len=512 exceeds token_budget=256: .* lower max_seq_len or raise"),
    "shards-missing": Case(_setup(lambda s: OmniDataModule(s.replace("train-", "missing-"))),
                           r"missing \['.*missing-000000.tar', .*\]; run `omni-lightning make-shards` or set "
                           r"data.synthetic"),
    "shards-fewer-than-ranks-x-workers": Case(
        _setup(lambda s: OmniDataModule(s, num_workers=3)),
        r"8 shards cannot feed 4 data-parallel ranks x 3 loader workers: write at least 12 shards or lower "
        r"num_workers"),
    "val-shards-fewer-than-ranks": Case(
        _setup(lambda s: OmniDataModule(s, val_shards=s.replace("{000000..000007}", "{000000..000001}"))),
        r"2 shards cannot feed 4 data-parallel ranks x 1 loader workers: write at least 4 shards"),
    "data-packing-vs-model": Case(_setup(lambda s: OmniDataModule(s, patch_size=16)),
                                  r"OmniDataModule\(patch_size=16\) but the model expects patch_size=14: set "
                                  r"patch_size=14"),
    "reorder-group-not-dividing-dp": Case(_setup(lambda s: OmniDataModule(s, reorder_group_size=3)),
                                          r"reorder_group_size=3 must divide the data-parallel size 4"),
    "micro-batches-vs-accumulation": Case(_setup(lambda s: OmniDataModule(s, micro_batches=2)),
                                          r"OmniDataModule\(micro_batches=2\) .* Trainer\(accumulate_grad_batches=1\):"
                                          r" set OmniDataModule\(micro_batches=1\) or accumulate_grad_batches=2"),
    "micro-batches-vs-pipeline": Case(_setup(lambda s: OmniDataModule(s, micro_batches=2), devices=2, pp=2,
                                             pp_microbatches=4),
                                      r"OmniDataModule\(micro_batches=2\) but the pipeline schedule runs 4 "
                                      r"micro-batches a step: leave micro_batches at 1 or set it to 4"),
    "token-budget-over-pp-max-tokens": Case(_setup(lambda s: OmniDataModule(s, token_budget=1024), devices=2, pp=2,
                                                   pp_max_tokens=512),
                                            r"OmniDataModule\(token_budget=1024\) .* \(OmniStrategy\("
                                            r"pp_max_tokens=512\)\): lower token_budget or raise pp_max_tokens"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_invalid_configuration_fails_early_naming_the_fix(case: str, tiny_shards: str) -> None:
    with pytest.raises(ValueError, match=CASES[case].message):
        CASES[case].trigger(tiny_shards)
    assert not dist.is_initialized()


def test_model_check_runs_before_the_process_group_under_torchrun() -> None:
    """Launched externally (torchrun, SLURM, or the subprocess launcher's children), every rank checks the model in
    setup_environment before creating the process group."""
    trainer = _trainer(4, tp=4)
    trainer.strategy._lightning_module = OmniModule(_model(dim=96, n_heads=6, n_kv_heads=2))
    with mock.patch("torch.distributed.init_process_group") as init, \
            pytest.raises(ValueError, match="llm.n_heads=6 is not divisible by tp=4"):
        trainer.strategy.setup_environment()
    init.assert_not_called()


@pytest.mark.parametrize(("schedule", "planned"), [("1F1B", "ramp"), ("GPipe", "disttrain")])
def test_only_a_1f1b_pipeline_shapes_micro_batches_to_its_profile(tiny_shards: str, schedule: str,
                                                                 planned: str) -> None:
    """The 1F1B cost profile is no shape for GPipe, whose step grows with its largest micro-batch: the loader plans
    even micro-batches for any schedule but 1F1B, whatever ``pipeline_order`` says."""
    trainer = _trainer(2, pp=2, pp_schedule=schedule)
    data = OmniDataModule(tiny_shards, pipeline_order="ramp")
    data.trainer, data.omni_layout = trainer, _mock_layout(trainer, TINY, 0)
    data.setup("fit")
    assert (data.settings.pp, data.settings.pipeline_order) == (2, planned)


def test_valid_configurations_pass_the_same_checks(tiny_shards: str) -> None:
    """The checks reject only what they should: the layouts and settings next to the invalid ones are accepted."""
    groups = mock.patch("torch.distributed.new_subgroups_by_enumeration", return_value=(None, []))
    with groups:  # setup goes on to create the reorder groups once everything checked out
        _setup(lambda s: OmniDataModule(s, num_workers=2, reorder_group_size=2))(tiny_shards)
        _setup(lambda s: OmniDataModule(s, micro_batches=2), accumulate=2)(tiny_shards)
    _setup(lambda s: OmniDataModule(s, token_budget=512), devices=2, pp=2, pp_max_tokens=512)(tiny_shards)
    strategy = _trainer(4, tp=4).strategy
    strategy.check_model_fits(OmniModule(_model(dim=128, n_heads=8, n_kv_heads=4)))
    _trainer(2, pp=2, pp_schedule="Interleaved1F1B", pp_virtual_stages=2).strategy.check_model_fits(OmniModule(TINY))
    _trainer(2, ep=2).strategy.check_model_fits(OmniModule(ReferenceMLLMConfig.tiny(moe=True)))
    ReferenceMLLMConfig(llm=LLMConfig(dim=32, n_heads=4, n_kv_heads=1))


def test_docs_table_lists_exactly_the_tested_cases() -> None:
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|", DOC.read_text(), flags=re.MULTILINE)
    assert len(rows) == len(set(rows)), "a row appears twice in docs/configuration_errors.md"
    assert sorted(rows) == sorted(CASES), "docs/configuration_errors.md and CASES have drifted apart"
