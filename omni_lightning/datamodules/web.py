"""WebDataModule: the plain (non-balancing) streaming data module over multimodal webdataset shards."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import replace
from typing import Any, Literal

from lightning.pytorch import LightningDataModule
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override

from omni_lightning.batch import PackingSpec
from omni_lightning.data.failure_notice import FailureNotice
from omni_lightning.data.layouts import Layout, SampleReader
from omni_lightning.data.media import AudioPolicy, ImagePolicy, VideoPolicy
from omni_lightning.data.processor import DataProcessor, byte_processor, load_processor
from omni_lightning.data.resumable import ResumableLoader
from omni_lightning.data.shards import SyntheticShards, existing_shards, expand_shards, synthetic_target
from omni_lightning.data.streaming import ShardStream, assign_shards, check_read_timeout
from omni_lightning.data.synthetic import make_synthetic_shards
from omni_lightning.modalities import packing_spec
from omni_lightning.models.config import ReferenceMLLMConfig
from omni_lightning.parallel.layout import OmniLayout

__all__ = ["WebDataModule"]

log = logging.getLogger(__name__)

_DEFAULT_AUDIO_FPS = 100  # Whisper's: 16 kHz over a 160-sample hop


class WebDataModule(LightningDataModule):
    """Streams packed micro-batches from webdataset shards, each data-parallel rank reading its own shards.

    Args:
        shards: brace pattern, glob, directory or list of ``.tar`` shards.
        batch_size: samples per micro-batch on each data-parallel rank.
        num_workers: loader worker processes per rank (each needs at least one shard).
        seed: seeds the per-epoch shard order.
        synthetic: generate synthetic shards into the directory of ``shards`` if none exist yet.
        val_shards: optional validation shards (same format).
        val_batches: micro-batches per validation pass on every rank (equal counts keep FSDP collectives aligned).
        patch_size, vision_merge, audio_downsample: must match the model's vision/audio configuration; with a
            ``processor`` the first two default to its values (14 and 4 without one), and a value that contradicts
            it is an error. Left unset (and not fixed by the processor), they follow the model's.
        processor: a local Hugging Face processor or tokenizer directory (read offline): the tokenizer, its token
            roles and vocabulary (which a reference model built without explicit sizes adopts), the image, video
            and audio policy. ``None``: UTF-8 bytes with ids 0-3 reserved, as the synthetic demo.
        layout: how shards are read, decided per sample by default (``"auto"``): ``"pairs"`` (``KEY.jpg`` with
            ``KEY.txt`` / ``KEY.json``), ``"conversations"`` (a dialogue in ``KEY.json`` naming its media members),
            ``"synthetic"`` (this project's own shards). See :mod:`omni_lightning.data.layouts`.
        caption_key: the json key holding an image-text pair's caption (else ``txt``, else ``caption``).
        audio_frames_per_second: mel frames per second of decoded audio files (the feature extractor's sampling
            rate over its hop length; 100 without a processor); a value that contradicts the processor is an error.
        video_fps: frames per second sampled from video files (the processor's
            ``video_preprocessor_config.json`` where it has one, else 2).
        video_max_frames: most frames sampled from one video (the processor's where it has one, else 32).
        on_bad_sample: ``"skip"`` counts and logs a sample that cannot be used (``data/skipped``) and goes on,
            ``"error"`` stops at it, naming shard and sample.
        read_timeout: seconds a shard read (its open, or any read) may make no progress before the job fails: the
            rank raises ``StalledRead`` naming itself, the shard and the time waited, and every other rank stops
            within seconds quoting it (through the rendezvous store), long before the process-group timeout.
            ``None``: wait as long as the storage does.

    Errors that stop this rank's reading (a stalled read, a setting the data contradicts, ``on_bad_sample="error"``)
    stop every rank of the job: the failing rank posts its error in the rendezvous store before it raises, and the
    others raise ``JobStopped`` quoting it (see :mod:`omni_lightning.data.failure_notice`).

    The data-parallel rank and size come from ``trainer.strategy.distributed_sampler_kwargs``, so TP/CP/PP peers
    of OmniStrategy read the same samples and any other strategy works too.
    """

    def __init__(
        self,
        shards: str | list[str] | None = "data/tiny_omni/train-{000000..000005}.tar",
        *,
        batch_size: int = 4,
        num_workers: int = 0,
        seed: int = 0,
        synthetic: SyntheticShards | None = None,
        val_shards: str | list[str] | None = None,
        val_batches: int = 4,
        patch_size: int | None = None,
        vision_merge: int | None = None,
        audio_downsample: int = 4,
        processor: str | None = None,
        layout: Layout = "auto",
        caption_key: str | None = None,
        audio_frames_per_second: int | None = None,
        video_fps: float | None = None,
        video_max_frames: int | None = None,
        on_bad_sample: Literal["skip", "error"] = "skip",
        read_timeout: float | None = 300.0,
    ) -> None:
        super().__init__()
        if on_bad_sample not in ("skip", "error"):
            raise ValueError(f"on_bad_sample={on_bad_sample!r} must be 'skip' or 'error'")
        check_read_timeout(read_timeout)
        self.on_bad_sample = on_bad_sample
        self.read_timeout = read_timeout
        self.data_processor: DataProcessor | None = load_processor(processor) if processor is not None else None
        # What the user chose: checked against the model's packing, where defaults give way to it.
        chosen = {"patch_size": patch_size, "vision_merge": vision_merge, "audio_downsample": audio_downsample}
        self._chosen_sizes = {name: value for name, value in chosen.items() if value is not None}
        patch_size, vision_merge, frames_per_second = self._processor_sizes(
            patch_size=patch_size, vision_merge=vision_merge, audio_frames_per_second=audio_frames_per_second)
        self.audio_policy = self._audio_policy(frames_per_second)
        base_video = self.data_processor.video if self.data_processor is not None else VideoPolicy()
        chosen = {"fps": video_fps, "max_frames": video_max_frames}
        self.video_policy = replace(base_video, **{k: v for k, v in chosen.items() if v is not None})
        self.shards = shards
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.synthetic = synthetic
        self.val_shards = val_shards
        self.val_batches = val_batches
        self.packing = packing_spec(patch_size=patch_size, vision_merge=vision_merge, audio_downsample=audio_downsample)
        if self.data_processor is not None:
            self.packing = self._with_processor(self.packing)
        self.layout, self.caption_key = layout, caption_key
        SampleReader(byte_processor(), self.packing, layout)  # checks the layout's name now
        self.dp_rank, self.dp_size = 0, 1
        # OmniStrategy hands its layout over before setup: the ranks, the pipeline, the model's packing and costs.
        self.omni_layout: OmniLayout | None = None
        # The job's failure notice: OmniStrategy hands its own over; under another strategy setup makes one.
        self.failure_notice: FailureNotice | None = None
        self._owns_notice = False

    def _processor_sizes(self, **given: int | None) -> tuple[int, ...]:
        """``patch_size``, ``vision_merge`` and ``audio_frames_per_second``: as given, else the processor's, else 14,
        4 and 100; a given value that contradicts the processor is an error naming both."""
        defaults = {"patch_size": 14, "vision_merge": 4, "audio_frames_per_second": _DEFAULT_AUDIO_FPS}
        fixed = dict(self.data_processor.explicit) if self.data_processor is not None else {}
        for name, value in given.items():
            if value is not None and name in fixed and value != fixed[name]:
                raise ValueError(f"{name}={value} but the processor at {self.data_processor.source} has "
                                 f"{name}={fixed[name]}: leave {name} unset (it defaults to the processor's)")
        return tuple(value if value is not None else fixed.get(name, defaults[name]) for name, value in given.items())

    def _audio_policy(self, frames_per_second: int) -> AudioPolicy:
        """The processor's audio policy (Whisper's without one) at ``frames_per_second`` mel frames a second."""
        policy = self.data_processor.audio if self.data_processor is not None else AudioPolicy()
        if frames_per_second < 1 or policy.sampling_rate % frames_per_second:
            raise ValueError(f"audio_frames_per_second={frames_per_second} must divide the audio sampling rate "
                             f"{policy.sampling_rate} (the mel hop is a whole number of samples)")
        return replace(policy, hop_length=policy.sampling_rate // frames_per_second)

    def reader(self) -> SampleReader:
        """Turns this data module's raw samples into decoded ones by their layout, for the model's packing."""
        processor = self.data_processor or byte_processor(
            ImagePolicy(patch_size=self.packing.patch_size, merge=math.isqrt(self.packing.vision_merge)))
        image = processor.image
        if image.tiled:  # tiles are cut into the model's patches and merge groups
            image = replace(image, patch_size=self.packing.patch_size, merge=math.isqrt(self.packing.vision_merge))
        processor = replace(processor, image=image, audio=self.audio_policy, video=self.video_policy)
        return SampleReader(processor, self.packing, self.layout, self.caption_key,
                            legacy_tokenizer=getattr(self, "tokenizer", None))

    @override
    def prepare_data(self) -> None:
        if self.shards is None:  # a subclass supplies its own samples
            return
        paths = expand_shards(self.shards)
        if self.synthetic is None or (paths and all(os.path.exists(p) for p in paths)):
            return
        out_dir, prefix = synthetic_target(self.shards, paths)
        log.info("writing %d synthetic shards to %s", self.synthetic.num_shards, out_dir)
        make_synthetic_shards(
            out_dir,
            workload=self.synthetic.workload,
            num_shards=self.synthetic.num_shards,
            samples_per_shard=self.synthetic.samples_per_shard,
            seed=self.synthetic.seed,
            length_scale=self.synthetic.length_scale,
            max_llm_tokens=self.synthetic.max_llm_tokens,
            patch_size=self.packing.patch_size,
            prefix=prefix,
        )

    @override
    def setup(self, stage: str) -> None:
        trainer = self.trainer
        if trainer is not None and trainer.world_size > 1:
            kwargs = trainer.strategy.distributed_sampler_kwargs
            self.dp_rank, self.dp_size = kwargs["rank"], kwargs["num_replicas"]
        if trainer is not None:
            module = trainer.lightning_module
            source = getattr(module, "processor_source", None)
            if self.data_processor is None and source is not None:
                self.use_processor(source)
            self._adopt_model_packing(module)
        if self.failure_notice is None and (notice := FailureNotice.for_job()) is not None:
            self.failure_notice, self._owns_notice = notice, True
            notice.watch()
        # Settings that starve a rank's loader fail here, on every rank alike, rather than once the loop has started.
        if stage == "fit" and self.shards is not None:
            assign_shards(existing_shards(self.shards), dp_rank=self.dp_rank, dp_size=self.dp_size,
                          num_workers=self.num_workers)
        if self.val_shards is not None and stage in ("fit", "validate"):
            assign_shards(existing_shards(self.val_shards), dp_rank=self.dp_rank, dp_size=self.dp_size)

    @override
    def teardown(self, stage: str) -> None:
        if self._owns_notice and self.failure_notice is not None:
            self.failure_notice.stop_watching()
            self.failure_notice, self._owns_notice = None, False

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Under a launcher that is not OmniStrategy's (which raises JobStopped itself), say which rank failed first.
        notice = self.failure_notice if self._owns_notice else None
        if notice is not None and (stopped := notice.stopped_by_another_rank(exception)) is not None:
            log.error("%s", stopped)
            if hasattr(exception, "add_note"):
                exception.add_note(str(stopped))

    def use_processor(self, path: str) -> None:
        """Read text and media as the processor at ``path`` does (a checkpoint's own, when none was given): its
        tokenizer and roles, its image, audio and video policies."""
        log.info("the data module reads its samples with the processor of %s", path)
        self.data_processor = load_processor(path)
        self.audio_policy = self.data_processor.audio
        self.video_policy = self.data_processor.video
        self.packing = self._with_processor(self.packing)

    def _adopt_model_packing(self, module: Any) -> None:
        """Pack as the model's encoders expect (else shapes fail deep in a forward): its packing, when the layout
        or the module says it (an OmniModule's ``packing()``, else its reference config's), after checking this
        data module's sizes against it."""
        config = getattr(module, "config", None)
        model = self.omni_layout.packing if self.omni_layout is not None else None
        if model is None and callable(getattr(module, "packing", None)):
            model = module.packing()
        if model is None and isinstance(config, ReferenceMLLMConfig):
            model = config.packing()
        if model is None:
            return
        expected = {"patch_size": model.patch_size, "vision_merge": model.vision_merge,
                    "audio_downsample": model.audio_downsample}
        fixed = {**dict(self.data_processor.explicit if self.data_processor is not None else ()), **self._chosen_sizes}
        for name, value in expected.items():
            if fixed.get(name, value) != value:
                raise ValueError(f"{type(self).__name__}({name}={fixed[name]}) but the model expects "
                                 f"{name}={value}: set {name}={value} on the data module")
        if self.data_processor is not None:
            # The model takes its token roles from this processor (OmniModule.setup) unless it has its own.
            if model.roles != self.packing.roles and getattr(config, "roles", None) is not None:
                raise ValueError(f"the model's token roles {model.roles} differ from those of the processor at "
                                 f"{self.data_processor.source} ({self.packing.roles}): train the model with the "
                                 "tokenizer it was built for")
            model = self._with_processor(model)
        self.packing = model

    def _with_processor(self, spec: PackingSpec) -> PackingSpec:
        """``spec`` with the processor's token roles (modalities it has no placeholder for left out) and pixel
        normalisation."""
        processor = self.data_processor
        assert processor is not None
        image = processor.image
        modalities = tuple(m for m in spec.modalities if processor.roles.has_placeholder(m.name))
        return replace(spec, roles=processor.roles, modalities=modalities, pixel_mean=image.mean, pixel_std=image.std)

    def stream(self, shards: str | list[str], *, dp_rank: int | None = None, dp_size: int | None = None,
               num_workers: int | None = None, max_batches: int | None = None) -> ShardStream:
        """The stream of one data-parallel rank (this process's rank unless given)."""
        return ShardStream(
            existing_shards(shards),
            dp_rank=self.dp_rank if dp_rank is None else dp_rank,
            dp_size=self.dp_size if dp_size is None else dp_size,
            batch_size=self.batch_size,
            num_workers=self.num_workers if num_workers is None else num_workers,
            seed=self.seed,
            packing=self.packing,
            max_batches=max_batches,
            reader=self.reader(),
            on_bad_sample=self.on_bad_sample,
            read_timeout=self.read_timeout,
        )

    @override
    def train_dataloader(self) -> ResumableLoader:
        return ResumableLoader(
            StatefulDataLoader(self.stream(self.shards), batch_size=None, num_workers=self.num_workers),
            notice=self.failure_notice,
        )

    @override
    def val_dataloader(self) -> Any:
        if self.val_shards is None:
            return []
        stream = self.stream(self.val_shards, num_workers=0, max_batches=self.val_batches)
        return StatefulDataLoader(stream, batch_size=None, num_workers=0)
