"""The data side of a model: its tokenizer, token roles, vocabulary and media policy, from a local Hugging Face
processor or tokenizer directory (offline), or the byte tokenizer of the synthetic demo.

A combined processor (``AutoProcessor``) is tried first; some need ``torchvision`` (video processors), which a CPU
install may not load, so the tokenizer, the image processor (its PIL implementation) and the feature extractor
are then read from the directory one by one.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omni_lightning.batch import BYTE_ROLES, TokenRoles
from omni_lightning.data.media import AudioPolicy, ImagePolicy, VideoPolicy

__all__ = ["DataProcessor", "byte_processor", "load_processor"]

log = logging.getLogger(__name__)

# Where a tokenizer declares no multimodal token of its own, these special tokens are the placeholders.
_GENERIC_PLACEHOLDERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}


@dataclass(frozen=True)
class DataProcessor:
    """How text and media become a model's inputs.

    Attributes:
        source: the processor directory, or ``"bytes"``.
        roles: the token roles (placeholders, BOS/EOS, padding) as ids of the vocabulary.
        vocab_size: ``len(tokenizer)`` (the byte vocabulary's 260 for ``"bytes"``).
        tokenizer: the Hugging Face tokenizer, ``None`` for bytes.
        image, audio, video: how media are resized, featurised and sampled for the model.
        missing_placeholders: modalities the tokenizer has no placeholder token for, with the tokens looked for.
        explicit: the sizes the processor fixes (``patch_size``, ``vision_merge``, ``audio_frames_per_second``), which a
            data module's explicit setting must agree with.
    """

    source: str
    roles: TokenRoles
    vocab_size: int
    tokenizer: Any | None = None
    image: ImagePolicy = field(default_factory=ImagePolicy)
    audio: AudioPolicy = field(default_factory=AudioPolicy)
    video: VideoPolicy = field(default_factory=VideoPolicy)
    missing_placeholders: tuple[tuple[str, tuple[str, ...]], ...] = ()
    explicit: tuple[tuple[str, int], ...] = ()

    @property
    def is_bytes(self) -> bool:
        return self.tokenizer is None

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> np.ndarray:
        """Text ids without special tokens (bytes shifted past the byte roles for ``"bytes"``)."""
        if self.tokenizer is None:
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + BYTE_ROLES.first_free_id
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)

    def placeholder(self, modality: str) -> int:
        """The placeholder id of ``modality``; ``ValueError`` naming the tokens looked for when it has none."""
        for name, looked_for in self.missing_placeholders:
            if name == modality:
                raise ValueError(f"the tokenizer of {self.source} has no {modality} placeholder token (looked for "
                                 f"{', '.join(looked_for)}): add one as a special token, or train without "
                                 f"{modality} samples")
        return self.roles.placeholder(modality)


def byte_processor(image: ImagePolicy | None = None) -> DataProcessor:
    """UTF-8 bytes with the byte roles (ids 0-3 reserved): the synthetic demo's text side."""
    return DataProcessor("bytes", BYTE_ROLES, 260, image=image or ImagePolicy())


def load_processor(path: str | Path) -> DataProcessor:
    """Read a local processor or tokenizer directory (no download): tokenizer, roles, vocabulary, media policy."""
    import transformers

    path = str(path)
    if not Path(path).is_dir():
        raise ValueError(f"processor={path!r} is not a directory (a Hugging Face processor or tokenizer saved with "
                         "save_pretrained)")
    combined = _try(lambda: transformers.AutoProcessor.from_pretrained(path, local_files_only=True), path, "processor")
    tokenizer = combined if _is_tokenizer(combined) else getattr(combined, "tokenizer", None)
    if tokenizer is None:
        tokenizer = _try(lambda: transformers.AutoTokenizer.from_pretrained(path, local_files_only=True), path,
                         "tokenizer")
    if tokenizer is None:
        raise ValueError(f"processor={path!r} holds no tokenizer that transformers can load offline")
    # The PIL backend: its resize is what decode_image reproduces, and it loads without torchvision.
    has_preprocessor = (Path(path) / "preprocessor_config.json").exists()
    image_processor = getattr(combined, "image_processor", None)
    if image_processor is None and has_preprocessor:
        image_processor = _try(lambda: transformers.AutoImageProcessor.from_pretrained(
            path, local_files_only=True, backend="pil"), path, "image processor")
    feature_extractor = getattr(combined, "feature_extractor", None)
    if feature_extractor is None and has_preprocessor:
        feature_extractor = _try(lambda: transformers.AutoFeatureExtractor.from_pretrained(path, local_files_only=True),
                                 path, "feature extractor")
    placeholders, missing = [], []
    for modality, generic in _GENERIC_PLACEHOLDERS.items():
        candidates = [t for t in (getattr(combined, f"{modality}_token", None),
                                  getattr(tokenizer, f"{modality}_token", None), generic) if isinstance(t, str)]
        token_id = next((i for i in (_token_id(tokenizer, t) for t in candidates) if i is not None), None)
        if token_id is None:
            missing.append((modality, tuple(dict.fromkeys(candidates))))
        else:
            placeholders.append((modality, token_id))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    roles = TokenRoles(pad=0 if pad is None else int(pad), bos=tokenizer.bos_token_id, eos=_eos(tokenizer),
                       placeholders=tuple(placeholders))
    explicit: list[tuple[str, int]] = []
    image = ImagePolicy()
    if image_processor is not None and getattr(image_processor, "image_grid_pinpoints", None):
        # Any-resolution tiling (LLaVA-OneVision): the patch size is the vision tower's, not the image processor's.
        image = ImagePolicy.from_image_processor(image_processor)
        explicit += _tile_tokens(Path(path), image)
    elif image_processor is not None and hasattr(image_processor, "patch_size"):
        image = ImagePolicy.from_image_processor(image_processor)
        explicit += [("patch_size", image.patch_size), ("vision_merge", image.merge * image.merge)]
    audio = AudioPolicy()
    if feature_extractor is not None and hasattr(feature_extractor, "hop_length"):
        audio = AudioPolicy.from_feature_extractor(feature_extractor)
        explicit.append(("audio_frames_per_second", audio.sampling_rate // audio.hop_length))
    return DataProcessor(path, roles, len(tokenizer), tokenizer, image, audio, _video_policy(Path(path)),
                         tuple(missing), tuple(explicit))


def _tile_tokens(path: Path, image: ImagePolicy) -> list[tuple[str, int]]:
    """The sizes a LLaVA-OneVision processor fixes: ``num_image_tokens`` of its ``processor_config.json`` are one per
    patch of a tile (no merge), so the patch is the tile side over the patches per side. Read from the JSON: the
    combined processor needs ``torchvision`` (its video processor), which a CPU install may not load."""
    config = path / "processor_config.json"
    tokens = json.loads(config.read_text()).get("num_image_tokens") if config.exists() else None
    if tokens is None or image.tile is None:
        return []
    side = math.isqrt(int(tokens))
    if not 0 < side <= image.tile or side * side != tokens or image.tile // (image.tile // side) != side:
        raise ValueError(f"{config}: num_image_tokens={tokens} is not a square grid of whole patches of a "
                         f"{image.tile}-pixel tile")
    return [("patch_size", image.tile // side), ("vision_merge", 1)]


def _video_policy(path: Path) -> VideoPolicy:
    """The sampling of the directory's video processor, read from its JSON: the processor itself needs
    ``torchvision``, which a CPU install may not load."""
    config = path / "video_preprocessor_config.json"
    if not config.exists():
        return VideoPolicy()
    values = json.loads(config.read_text())
    return VideoPolicy(**{k: type(getattr(VideoPolicy, k))(values[k]) for k in ("fps", "max_frames", "min_frames")
                          if values.get(k) is not None})


def _try(load: Any, path: str, what: str) -> Any:
    try:
        return load()
    except Exception as error:  # transformers raises many types for a directory lacking one part
        log.info("no %s loaded from %s (%s: %s)", what, path, type(error).__name__, error)
        return None


def _is_tokenizer(obj: Any) -> bool:
    from transformers import PreTrainedTokenizerBase

    return isinstance(obj, PreTrainedTokenizerBase)


def _token_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` where it is one token of the vocabulary (not split, not unknown)."""
    ids = tokenizer.convert_tokens_to_ids([token])
    if not ids or ids[0] is None or (tokenizer.unk_token_id is not None and ids[0] == tokenizer.unk_token_id):
        return None
    return int(ids[0])


def _eos(tokenizer: Any) -> int | None:
    return None if tokenizer.eos_token_id is None else int(tokenizer.eos_token_id)
