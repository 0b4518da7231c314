"""Write a tiny Qwen2.5-VL checkpoint with its processor, offline: a stand-in for the checkpoint a user fine-tunes.

    python examples/make_tiny_hf_vlm.py data/tiny_qwen2_5_vl [--tokenizer data/demo_chat/processor] [--preset 1b]

The directory is what ``save_pretrained`` writes for a real one: ``config.json`` and safetensors weights of a
``Qwen2_5_VLForConditionalGeneration`` (2 vision blocks with 56-pixel windows, 2 decoder layers, widths of 64), the
tokenizer (``--tokenizer``: the demo conversations' own, so the model reads their text; else one trained here in
milliseconds on a few sentences) and Qwen2-VL's image processor (temporal patches of 2). ``--preset 1b`` writes the
same family at about a billion parameters (16 decoder layers of width 2048 over a 32768-token vocabulary, a 12-block
vision tower of width 1024), randomly initialised: the size ``benchmarks/gpu_smoke.py`` measures on a GPU. Then
(README, "Hugging Face models, whole"):

    omni-lightning fit --config examples/hf_vlm.yaml
    omni-lightning export-hf --checkpoint checkpoints/hf_vlm/last.ckpt --out data/tuned_qwen2_5_vl
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
PART = ("{% for c in message['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
        "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>{% else %}{{ c['text'] }}"
        "{% endif %}{% endfor %}")
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
            "{% generation %}" + PART + "<|im_end|>{% endgeneration %}{{ '\\n' }}{% else %}" + PART
            + "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Decoder and vision tower shapes; "1b" follows Qwen2.5-VL's proportions (grouped-query heads of 128, its M-RoPE
# split, windowed vision attention with every fourth block global).
PRESETS = {
    "tiny": {"text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "mrope_section": [2, 3, 3], "vocab_multiple": 64},
             "vision": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "window_size": 56,
                        "fullatt_block_indexes": [1]},
             "dtype": torch.float32},
    "1b": {"text": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16,
                    "num_key_value_heads": 2, "mrope_section": [16, 24, 24], "vocab_multiple": 32768},
           "vision": {"depth": 12, "hidden_size": 1024, "intermediate_size": 2816, "num_heads": 16, "window_size": 112,
                      "fullatt_block_indexes": [3, 7, 11]},
           "dtype": torch.bfloat16},  # as released checkpoints are stored
}
CORPUS = ["You are a helpful assistant.", "Describe the picture.", "A red square on a blue field.",
          "What happens in the video?", "Something moves from left to right."]


def tokenizer(source: Path | None) -> transformers.PreTrainedTokenizerBase:
    if source is not None:
        return transformers.AutoTokenizer.from_pretrained(source, local_files_only=True)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS * 8, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    made = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    made.chat_template = TEMPLATE
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer directory to ship with the model")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="the model's size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    text_shape, vision_shape = dict(PRESETS[args.preset]["text"]), PRESETS[args.preset]["vision"]
    mrope_section, vocab_multiple = text_shape.pop("mrope_section"), text_shape.pop("vocab_multiple")
    text = tokenizer(args.tokenizer)
    text.save_pretrained(args.out)
    Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 24}).save_pretrained(args.out)
    token = text.convert_tokens_to_ids
    config = transformers.Qwen2_5_VLConfig(
        text_config={"vocab_size": -(-len(text) // vocab_multiple) * vocab_multiple, **text_shape,
                     "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": text.eos_token_id,
                     "pad_token_id": text.pad_token_id,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                           "mrope_section": mrope_section}},
        vision_config={**vision_shape, "out_hidden_size": text_shape["hidden_size"], "patch_size": 14,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, "tokens_per_second": 4},
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    model.to(PRESETS[args.preset]["dtype"]).save_pretrained(args.out)
    print(f"wrote a {args.preset} Qwen2.5-VL checkpoint with its processor to {args.out}")


if __name__ == "__main__":
    main()
