"""Processors built offline the way a user's checkpoint arrives: a small byte-level BPE trained in milliseconds,
wrapped as a transformers fast tokenizer with Qwen2-VL-like special tokens and a ChatML chat template (with or
without a ``{% generation %}`` region), and a Qwen2-VL image processor (its PIL implementation), saved with
``save_pretrained`` and loaded back through the same path a user's directory takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>", "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>", "<image>", "<s>", "</s>"]
# The multimodal tokens a Qwen-style tokenizer declares by name (tokenizer.image_token, ...).
NAMED = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|AUDIO|>"}
CORPUS = [
    "You are a helpful assistant.", "You describe media.", "system user assistant", "Compare the left and right.",
    "The left one is red, the right one is blue.", "What happens? A cat jumps; someone laughs.",
    "Describe the picture please. A cat sits on a mat.", "这只猫可爱吗？是的，非常可爱！", "🐱😺🎉 emoji and 猫",
]

# In the spirit of Qwen2-VL's template (and Qwen2.5-Omni's audio): typed parts, each media item in its wrappers.
PARTS = (
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'audio' or 'audio' in content %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
)


def chatml(generation: bool) -> str:
    """ChatML as Qwen2-VL writes it; with ``generation``, a region around assistant content and ``<|im_end|>``."""
    # HF's Jinja trims the newline after a block tag (trim_blocks), so after endgeneration it is written as a literal.
    assistant = (f"{{% generation %}}{PARTS}<|im_end|>{{% endgeneration %}}{{{{ '\\n' }}}}" if generation
                 else f"{PARTS}<|im_end|>\n")
    return (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n"
        # Newlines before block tags, as Qwen's templates write them.
        "{% if message['role'] == 'assistant' %}" + assistant + "{% else %}" + PARTS + "<|im_end|>\n{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def train_bpe(corpus: list[str] = CORPUS, vocab_size: int = 600) -> Tokenizer:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(corpus * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return backend


def save_tokenizer(path: Path, backend: Tokenizer, template: str, *, named: bool = False) -> Any:
    """Wrap, save and load back, as a user's checkpoint loads; ``named`` declares the multimodal tokens by name."""
    extra: Any = [t for t in SPECIALS if t not in ("<s>", "<|im_end|>")]
    if named:
        extra = {**{t: t for t in extra if t not in NAMED.values()}, **NAMED}
        extra = {k if k in NAMED else f"extra_{i}": v for i, (k, v) in enumerate(extra.items())}
    wrapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(backend.to_str()), bos_token="<s>",
                                      eos_token="<|im_end|>", pad_token="<|endoftext|>", extra_special_tokens=extra)
    wrapped.chat_template = template
    wrapped.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def save_processor(path: Path, *, generation: bool = True, patch_size: int = 14, merge_size: int = 2,
                   min_pixels: int = 28 * 28, max_pixels: int = 28 * 28 * 16) -> Path:
    """A Qwen2-VL-like processor directory: the tokenizer (named multimodal tokens, ChatML) and the PIL image
    processor with a small pixel budget."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    save_tokenizer(path, train_bpe(), chatml(generation), named=True)
    Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=merge_size, temporal_patch_size=1,
                             size={"shortest_edge": min_pixels, "longest_edge": max_pixels}).save_pretrained(path)
    return path


def save_tiny_qwen_vl(path: Path, family: str = "qwen2_vl", *, seed: int = 0, hidden: int = 32, layers: int = 2,
                      vocab_size: int | None = None) -> Path:
    """A Qwen2-VL (or Qwen2.5-VL: ``family="qwen2_5_vl"``) checkpoint directory as a user keeps one: the model (tiny,
    2 + 2 layers; Qwen2.5-VL's tower with 56-pixel windows and one full-attention block) with its tokenizer (the
    template above, Qwen's vision tokens) and its PIL image processor (temporal patches of 2, a small pixel budget),
    all written with ``save_pretrained``. ``hidden``, ``layers`` and ``vocab_size`` (rows past the tokenizer's)
    make it larger."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = save_tokenizer(path, train_bpe(), chatml(True), named=True)
    Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16}).save_pretrained(path)
    token = tokenizer.convert_tokens_to_ids
    half = hidden // 4 // 2  # half a head (4 heads): M-RoPE splits it over time, height and width as Qwen does
    vision: dict[str, Any] = {"depth": 2, "num_heads": 4, "patch_size": 14, "spatial_merge_size": 2,
                              "temporal_patch_size": 2}
    if family == "qwen2_vl":
        vision |= {"embed_dim": 32, "hidden_size": hidden}
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        vision |= {"hidden_size": 32, "intermediate_size": 48, "out_hidden_size": hidden, "window_size": 56,
                   "fullatt_block_indexes": [1], "tokens_per_second": 4}
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    config = config_class(
        # Padded past the tokenizer, as Qwen's checkpoints are (151936 rows for 151657 tokens).
        text_config={"vocab_size": vocab_size or -(-len(tokenizer) // 8) * 8, "hidden_size": hidden,
                     "intermediate_size": 2 * hidden,
                     "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "tie_word_embeddings": False,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                         "mrope_section": [half // 4, (half - half // 4) // 2,
                                                           half - half // 4 - (half - half // 4) // 2]},
                     "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
                     "pad_token_id": tokenizer.pad_token_id},
        vision_config=vision, image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model_class(config).save_pretrained(path)
    return path


def save_tiny_qwen_omni_thinker(path: Path, *, seed: int = 0, whole: bool = False) -> Path:
    """A Qwen2.5-Omni thinker checkpoint directory: the model (tiny: 2 audio, 2 vision, 2 decoder layers), its
    tokenizer (the template above, Qwen's vision and audio tokens) and one preprocessor file holding the image
    processor and the Whisper feature extractor together, as Qwen2.5-Omni's checkpoints keep them. ``whole``
    writes it as a whole Qwen2.5-Omni (``model_type`` ``qwen2_5_omni``, weights under ``thinker.``), without a
    talker."""
    import json

    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = save_tokenizer(path, train_bpe(), chatml(True), named=True)
    Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16}).save_pretrained(path)
    combined = json.loads((path / "preprocessor_config.json").read_text())
    combined |= transformers.WhisperFeatureExtractor(feature_size=80).to_dict()
    (path / "preprocessor_config.json").write_text(json.dumps(combined))
    token = tokenizer.convert_tokens_to_ids
    config = transformers.Qwen2_5OmniThinkerConfig(
        text_config={"vocab_size": -(-len(tokenizer) // 8) * 8, "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
                     "tie_word_embeddings": False},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 4, "out_hidden_size": 32,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [1]},
        audio_config={"num_mel_bins": 80, "d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 4,
                      "encoder_ffn_dim": 64, "output_dim": 32, "n_window": 8, "max_source_positions": 200},
        audio_token_index=token("<|AUDIO|>"), image_token_index=token("<|image_pad|>"),
        video_token_index=token("<|video_pad|>"), audio_start_token_id=token("<|audio_bos|>"),
        audio_end_token_id=token("<|audio_eos|>"), vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"), tie_word_embeddings=False)
    torch.manual_seed(seed)
    if whole:
        config = transformers.Qwen2_5OmniConfig(thinker_config=config.to_dict(), enable_audio_output=False)
        transformers.Qwen2_5OmniForConditionalGeneration(config).save_pretrained(path)
    else:
        transformers.Qwen2_5OmniThinkerForConditionalGeneration(config).save_pretrained(path)
    return path


def save_tiny_qwen3_vl_moe(path: Path, *, seed: int = 0, hidden: int = 32, layers: int = 4, experts: int = 4,
                           deepstack: tuple[int, ...] = (0, 1, 2), aux_loss: bool = True) -> Path:
    """A Qwen3-VL-MoE checkpoint directory: the model (tiny: a 3-block tower with DeepStack mergers after the blocks
    ``deepstack``, so the decoder's first ``len(deepstack)`` layers take its features; ``layers`` decoder layers,
    every one but the first routed over ``experts`` experts, top 2), its tokenizer (the template above, Qwen's
    vision tokens) and its PIL image processor (16-pixel patches, as Qwen3-VL's). ``aux_loss``: the config asks
    for router logits, so the family's forward adds its load-balancing loss."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = save_tokenizer(path, train_bpe(), chatml(True), named=True)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 16}).save_pretrained(path)
    token = tokenizer.convert_tokens_to_ids
    half = hidden // 4 // 2
    config = transformers.Qwen3VLMoeConfig(
        text_config={"vocab_size": -(-len(tokenizer) // 8) * 8, "hidden_size": hidden, "intermediate_size": 2 * hidden,
                     "moe_intermediate_size": hidden, "num_hidden_layers": layers, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": hidden // 4, "num_experts": experts,
                     "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [0],
                     "output_router_logits": aux_loss, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                                         "mrope_section": [half // 4, (half - half // 4) // 2,
                                                           half - half // 4 - (half - half // 4) // 2]},
                     "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
                     "pad_token_id": tokenizer.pad_token_id},
        vision_config={"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 4,
                       "out_hidden_size": hidden, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "num_position_embeddings": 64, "deepstack_visual_indexes": list(deepstack)},
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    transformers.Qwen3VLMoeForConditionalGeneration(config).save_pretrained(path)
    return path


# Canvases of one to three 44-pixel tiles a side: wide, tall and square images each pick another one.
LLAVA_PINPOINTS = [[44, 44], [44, 88], [88, 44], [88, 88], [44, 132], [132, 44]]


def save_tiny_llava_onevision(path: Path, *, seed: int = 0, tied: bool = True, vision_feature_layer: Any = (-3, -2),
                              vision_aspect_ratio: str = "anyres_max_2") -> Path:
    """A LLaVA-OneVision checkpoint directory as a user keeps one: the model (tiny: a 3-layer SigLIP tower at
    44-pixel tiles, so 3x3 patches of 14 with the last 2 pixels unread, as 384 is 27x27 patches of 14; a 2-layer
    Qwen2 decoder, its head tied to its embedding unless ``tied=False``), its tokenizer (the template above, Qwen's
    vision tokens), its PIL image processor (any-resolution tiling on small canvases) and the combined processor's
    ``processor_config.json`` as LLaVA-OneVision's checkpoints keep it (written as JSON: the processor class needs
    torchvision for its video processor). ``vision_aspect_ratio`` bounds the tiles' features low enough that images
    of a few canvases are scaled down; the default features are two layers' hidden states, the last layer unused."""
    import json

    import torch
    import transformers
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    tokenizer = save_tokenizer(path, train_bpe(), chatml(True), named=True)
    LlavaOnevisionImageProcessorPil(size={"height": 44, "width": 44}, image_grid_pinpoints=LLAVA_PINPOINTS,
                                    image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaOnevisionProcessor", "num_image_tokens": 9, "vision_feature_select_strategy": "full",
        "vision_aspect_ratio": vision_aspect_ratio, "image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}))
    token = tokenizer.convert_tokens_to_ids
    layers = list(vision_feature_layer) if isinstance(vision_feature_layer, tuple) else vision_feature_layer
    config = transformers.LlavaOnevisionConfig(
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 48,
                       "num_hidden_layers": 3, "num_attention_heads": 4, "image_size": 44, "patch_size": 14,
                       "vision_use_head": False},
        text_config={"model_type": "qwen2", "vocab_size": -(-len(tokenizer) // 8) * 8, "hidden_size": 32,
                     "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "tie_word_embeddings": tied, "eos_token_id": tokenizer.eos_token_id,
                     "pad_token_id": tokenizer.pad_token_id},
        image_grid_pinpoints=LLAVA_PINPOINTS, vision_feature_layer=layers, vision_feature_select_strategy="full",
        vision_aspect_ratio=vision_aspect_ratio, image_token_index=token("<|image_pad|>"),
        video_token_index=token("<|video_pad|>"), tie_word_embeddings=tied)
    torch.manual_seed(seed)
    transformers.LlavaOnevisionForConditionalGeneration(config).save_pretrained(path)
    return path
