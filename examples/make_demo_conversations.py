"""Write a small stand-in for a user's conversation dataset and the processor it is trained with, all offline.

    python examples/make_demo_conversations.py data/demo_chat [--dialogues 96]

It writes ``data/demo_chat/dialogues.json`` (LLaVA, ShareGPT and typed-content dialogues: images of several sizes,
one dialogue with two images, multi-turn ones, a short video and an audio clip), their media under
``data/demo_chat/media``, and ``data/demo_chat/processor``: a byte-level BPE tokenizer trained here in
milliseconds with Qwen2-VL's special tokens and a ChatML chat template, and a Qwen2-VL image processor. Then
convert and train (README, "Your own data"):

    omni-lightning make-shards --from-conversations data/demo_chat/dialogues.json --media-root data/demo_chat/media \
        --out data/demo_chat/shards --samples-per-shard 24
    omni-lightning fit --config examples/conversations.yaml
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import av
import numpy as np
import soundfile
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

COLOURS = {"red": (200, 40, 40), "green": (40, 160, 60), "blue": (40, 70, 200), "yellow": (220, 200, 40)}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>", "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
PART = ("{% for c in message['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
        "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
        "{% elif c['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>{% else %}{{ c['text'] }}{% endif %}"
        "{% endfor %}")
# ChatML as Qwen2-VL writes it, with a generation region so the loss trains on the answers alone.
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
            "{% generation %}" + PART + "<|im_end|>{% endgeneration %}{{ '\\n' }}{% else %}" + PART
            + "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_processor(out: Path, texts: list[str]) -> None:
    """The tokenizer (trained on the dialogues' own text) and the image processor, as save_pretrained writes them."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    named = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|AUDIO|>"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        extra_special_tokens=named)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=1,
                             size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 24}).save_pretrained(out)


def _picture(rng: np.random.Generator, colour: str, height: int, width: int) -> np.ndarray:
    return np.clip(np.array(COLOURS[colour]) + rng.normal(0, 25, (height, width, 3)), 0, 255).astype(np.uint8)


def write_video(path: Path, rng: np.random.Generator, colour: str, frames: int = 8) -> None:
    """A short MP4 (H.264 from the FFmpeg PyAV bundles), a patch drifting across a coloured background."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for t in range(frames):
            pixels = _picture(rng, colour, 48, 64)
            pixels[16:32, 4 + 6 * t: 20 + 6 * t] = 255
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())


def dialogue(i: int, rng: np.random.Generator, media: Path) -> dict[str, Any]:
    colour, other = (str(c) for c in rng.choice(list(COLOURS), 2, replace=False))
    image = f"{i:05d}.jpg"
    height, width = (int(v) for v in rng.integers(30, 160, size=2))
    Image.fromarray(_picture(rng, colour, height, width)).save(media / image)
    if i % 12 == 5:  # a video
        write_video(media / f"{i:05d}.mp4", rng, colour)
        return {"id": f"video{i}", "messages": [
            {"role": "user", "content": [{"type": "video", "video": f"{i:05d}.mp4"},
                                         {"type": "text", "text": "What moves?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"A white patch on {colour}."}]}]}
    if i % 12 == 7:  # an audio clip: a tone whose pitch names the colour
        tone = np.sin(2 * np.pi * (220 + 110 * list(COLOURS).index(colour)) * np.arange(8000) / 16000)
        soundfile.write(media / f"{i:05d}.wav", (0.3 * tone).astype(np.float32), 16000)
        return {"id": f"audio{i}", "messages": [
            {"role": "user", "content": "<audio>Which colour does this tone stand for?"},
            {"role": "assistant", "content": f"It stands for {colour}."}], "audios": [f"{i:05d}.wav"]}
    if i % 4 == 1:  # two images, ShareGPT
        second = f"{i:05d}b.png"
        Image.fromarray(_picture(rng, other, 64, 48)).save(media / second)
        return {"id": f"pair{i}", "messages": [
            {"role": "user", "content": "<image><image>Which is on the left?"},
            {"role": "assistant", "content": f"The {colour} one is on the left, the {other} one on the right."}],
            "images": [image, second]}
    return {"id": f"llava{i}", "image": image, "conversations": [  # multi-turn, LLaVA
        {"from": "human", "value": "<image>\nWhat colour is this picture?"},
        {"from": "gpt", "value": f"It is {colour}."},
        {"from": "human", "value": "How big is it?"},
        {"from": "gpt", "value": f"{width} by {height} pixels."}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dialogues", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    media = args.out / "media"
    media.mkdir(parents=True, exist_ok=True)
    records = [dialogue(i, rng, media) for i in range(args.dialogues)]
    (args.out / "dialogues.json").write_text(json.dumps(records, indent=1))
    texts = [json.dumps(r) for r in records] * 4
    write_processor(args.out / "processor", texts)
    print(f"wrote {len(records)} dialogues, their media and a processor to {args.out}")


if __name__ == "__main__":
    main()
