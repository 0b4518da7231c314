"""Dialogue samples (LLaVA, LLaMA-Factory ShareGPT, typed parts) rendered through a chat template into ids with
placeholder runs and a target mask (omni_lightning.data.conversations).

The tokenizers are built offline the way a user's checkpoint arrives: a small byte-level BPE trained here in
milliseconds, wrapped as a transformers fast tokenizer with special tokens and a Qwen2-VL-like ChatML template (with
and without a ``{% generation %}`` region), saved and loaded back with ``AutoTokenizer``. The checks hold the
rendering to the tokenizer's own ``apply_chat_template`` output and its own assistant-token mask, exactly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hf_processors import chatml, save_tokenizer, train_bpe
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_lightning.data.conversations import (
    Dialogue,
    MediaRef,
    Message,
    RenderedDialogue,
    parse_dialogue,
    render_caption,
    render_dialogue,
)

# A LLaVA-1.5-like template: the placeholder is written bare, and texts are trimmed.
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}ASSISTANT: {% else %}USER: {% endif %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] | trim }}"
    "{% endif %}{% endfor %}{% if message['role'] == 'assistant' %}</s>{% endif %}{{ '\\n' }}{% endfor %}"
)
DROPS_IMAGES = "{% for m in messages %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}\n{% endfor %}"
SHOUTS = chatml(False).replace("{{ content['text'] }}", "{{ content['text'] | upper }}")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    backend = train_bpe()
    return {name: save_tokenizer(tmp_path_factory.mktemp(name), backend, chatml(name == "generation"))
            for name in ("plain", "generation")}


@pytest.fixture(scope="module")
def plain(tokenizers: dict[str, Any]) -> Any:
    return tokenizers["plain"]


@pytest.fixture(scope="module")
def generation(tokenizers: dict[str, Any]) -> Any:
    return tokenizers["generation"]


@pytest.fixture(scope="module")
def pids(plain: Any) -> dict[str, int]:
    return {m: plain.convert_tokens_to_ids(t) for m, t in
            (("image", "<|image_pad|>"), ("video", "<|video_pad|>"), ("audio", "<|AUDIO|>"))}


def hf_messages(dialogue: Dialogue) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": [dict(p) for p in m.parts]} for m in dialogue.messages]


def collapse(rendered: RenderedDialogue) -> tuple[np.ndarray, np.ndarray]:
    """The ids and targets with each expanded placeholder run back to its one token."""
    keep = np.ones(len(rendered.input_ids), dtype=bool)
    for start, end in rendered.placeholder_spans:
        keep[start + 1:end] = False
    return rendered.input_ids[keep], rendered.targets[keep]


def target_texts(tokenizer: Any, rendered: RenderedDialogue) -> list[str]:
    """Each contiguous run of targets, decoded."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], rendered.targets.astype(np.int8), [0]])))
    return [tokenizer.decode(rendered.input_ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def assert_tokenizer_output(tokenizer: Any, dialogue: Dialogue, rendered: RenderedDialogue, **kwargs: Any) -> None:
    """Collapsed, the ids are exactly the tokenizer's own apply_chat_template output."""
    ids, _ = collapse(rendered)
    expected = tokenizer.apply_chat_template(hf_messages(dialogue), tokenize=True, return_dict=True, **kwargs)
    assert ids.tolist() == list(expected["input_ids"])


MULTI = {"messages": [
    {"role": "system", "content": "You describe media."},
    {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image", "image": "a.jpg"},
                                 {"type": "text", "text": " and "}, {"type": "image", "image": "b.jpg"},
                                 {"type": "text", "text": " please."}]},
    {"role": "assistant", "content": "The left one is red."},
    {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "What happens? "},
                                 {"type": "audio", "audio": "talk.wav"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A cat jumps; someone laughs."}]},
]}
UNICODE = {"messages": [
    {"role": "user", "content": [{"type": "image", "path": "猫.png"}, {"type": "text", "text": "这只猫可爱吗？🐱"}]},
    {"role": "assistant", "content": "是的，非常可爱！😺🎉"},
]}
EMPTY_ANSWER = {"image": "a.jpg", "conversations": [{"from": "human", "value": "<image>"},
                                                   {"from": "gpt", "value": ""}]}
SHORT_ANSWER = {"conversations": [{"from": "human", "value": "assistant"}, {"from": "gpt", "value": "a"}]}
DIALOGUES = {"multi": MULTI, "unicode": UNICODE, "empty_answer": EMPTY_ANSWER, "short_answer": SHORT_ANSWER}


def _counts(dialogue: Dialogue) -> list[int]:
    return [3 + 2 * i for i in range(len(dialogue.media))]


@pytest.mark.parametrize("name", DIALOGUES)
def test_targets_match_the_generation_mask(name: str, plain: Any, generation: Any, pids: dict[str, int]) -> None:
    """(1) and (2): without a region, targets are content + end-of-turn, found by offsets; with one, transformers'
    own assistant mask exactly; both agree, and the ids are the tokenizer's own."""
    dialogue = parse_dialogue(DIALOGUES[name])
    without = render_dialogue(dialogue, plain, pids, _counts(dialogue))
    with_region = render_dialogue(dialogue, generation, pids, _counts(dialogue))
    np.testing.assert_array_equal(without.input_ids, with_region.input_ids)
    np.testing.assert_array_equal(without.targets, with_region.targets)
    assert without.placeholder_spans == with_region.placeholder_spans
    hf = generation.apply_chat_template(hf_messages(dialogue), tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    assert collapse(with_region)[1].astype(int).tolist() == list(hf["assistant_masks"])
    assert_tokenizer_output(plain, dialogue, without)
    assert_tokenizer_output(generation, dialogue, with_region)
    assert without.input_ids.dtype == np.int64 and without.targets.dtype == np.bool_
    answers = [p["text"] for m in dialogue.messages if m.role == "assistant" for p in m.parts]
    assert target_texts(plain, without) == [a + "<|im_end|>" for a in answers]


def test_multi_turn_placeholders_expand_in_place(plain: Any, pids: dict[str, int]) -> None:
    """(4) and (5): two images amid text in one turn, a video and audio in the next; every run in place, spans right,
    placeholders never targets, every assistant turn trained on."""
    dialogue = parse_dialogue(MULTI)
    assert [(r.modality, r.source) for r in dialogue.media] == [
        ("image", "a.jpg"), ("image", "b.jpg"), ("video", "clip.mp4"), ("audio", "talk.wav")]
    counts = [3, 5, 7, 2]
    rendered = render_dialogue(dialogue, plain, pids, counts)
    hf_ids = plain.apply_chat_template(hf_messages(dialogue), tokenize=True, return_dict=True)["input_ids"]
    at = [i for i, t in enumerate(hf_ids) if t in pids.values()]
    shift = np.concatenate([[0], np.cumsum(np.asarray(counts) - 1)[:-1]])
    assert rendered.placeholder_spans == tuple((p + s, p + s + n) for p, s, n in zip(at, shift, counts, strict=True))
    assert len(rendered.input_ids) == len(hf_ids) + sum(counts) - len(counts)
    inside = np.zeros(len(rendered.input_ids), dtype=bool)
    for (start, end), ref in zip(rendered.placeholder_spans, rendered.media, strict=True):
        assert (rendered.input_ids[start:end] == pids[ref.modality]).all()
        inside[start:end] = True
    assert not np.isin(rendered.input_ids[~inside], list(pids.values())).any()
    assert not rendered.targets[inside].any()
    assert rendered.media == dialogue.media
    assert_tokenizer_output(plain, dialogue, rendered)
    assert target_texts(plain, rendered) == ["The left one is red.<|im_end|>", "A cat jumps; someone laughs.<|im_end|>"]
    start, _ = rendered.placeholder_spans[0]
    assert plain.decode(rendered.input_ids[start - 1:start + 4].tolist()) == (
        "<|vision_start|><|image_pad|><|image_pad|><|image_pad|><|vision_end|>")


SAME_DIALOGUE = {
    "llava": {"id": "x", "image": ["a.jpg", "b.jpg"], "video": "clip.mp4", "conversations": [
        {"from": "system", "value": "You describe media."},
        {"from": "human", "value": "Compare <image> and <image> please."},
        {"from": "gpt", "value": "The left one is red."},
        {"from": "human", "value": "<video>What happens?"},
        {"from": "gpt", "value": "A cat jumps."}]},
    "sharegpt": {"images": ["a.jpg", "b.jpg"], "videos": ["clip.mp4"], "messages": [
        {"role": "system", "content": "You describe media."},
        {"role": "user", "content": "Compare <image> and <image> please."},
        {"role": "assistant", "content": "The left one is red."},
        {"role": "user", "content": "<video>What happens?"},
        {"role": "assistant", "content": "A cat jumps."}]},
    "sharegpt_from_value": {"images": ["a.jpg", "b.jpg"], "videos": "clip.mp4", "conversations": [
        {"from": "system", "value": "You describe media."},
        {"from": "human", "value": "Compare <image> and <image> please."},
        {"from": "gpt", "value": "The left one is red."},
        {"from": "human", "value": "<video>What happens?"},
        {"from": "gpt", "value": "A cat jumps."}]},
    "typed": {"messages": [
        {"role": "system", "content": "You describe media."},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image", "image": "a.jpg"},
                                     {"type": "text", "text": " and "}, {"type": "image", "url": "b.jpg"},
                                     {"type": "text", "text": " please."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "The left one is red."}]},
        {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": ""},
                                     {"type": "text", "text": "What happens?"}]},
        {"role": "assistant", "content": "A cat jumps."}]},
}


def test_all_forms_render_the_same(plain: Any, generation: Any, pids: dict[str, int]) -> None:
    """(3): the same dialogue in each form parses to one Dialogue and renders to one RenderedDialogue."""
    dialogues = {form: parse_dialogue(record) for form, record in SAME_DIALOGUE.items()}
    first = dialogues["typed"]
    assert all(d == first for d in dialogues.values())
    assert first.messages[1].parts == (
        {"type": "text", "text": "Compare "}, {"type": "image", "image": "a.jpg"}, {"type": "text", "text": " and "},
        {"type": "image", "image": "b.jpg"}, {"type": "text", "text": " please."})
    for tokenizer in (plain, generation):
        out = [render_dialogue(d, tokenizer, pids, [4, 4, 9]) for d in dialogues.values()]
        for other in out[1:]:
            np.testing.assert_array_equal(other.input_ids, out[0].input_ids)
            np.testing.assert_array_equal(other.targets, out[0].targets)
            assert (other.media, other.placeholder_spans) == (out[0].media, out[0].placeholder_spans)


def test_llava_conventions() -> None:
    """Images without markers go first in the first user turn; a video-only LLaVA-Video record marks it <image>."""
    unmarked = parse_dialogue({"image": ["a.jpg", "b.jpg"], "conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Describe."},
        {"from": "gpt", "value": "Two cats."}]})
    assert unmarked.messages[1] == Message("user", ({"type": "image", "image": "a.jpg"},
                                                    {"type": "image", "image": "b.jpg"},
                                                    {"type": "text", "text": "Describe."}))
    video = parse_dialogue({"video": "v.mp4", "conversations": [
        {"from": "human", "value": "<image>\nWhat happens?"}, {"from": "gpt", "value": "A jump."}]})
    assert video.media == (MediaRef("video", "v.mp4"),)
    assert video.messages[0].parts == ({"type": "video", "video": "v.mp4"}, {"type": "text", "text": "\nWhat happens?"})
    audio = parse_dialogue({"audios": ["x.wav"], "messages": [
        {"from": "human", "value": "Listen: <audio>"}, {"from": "gpt", "value": "Rain."}]})
    assert audio.messages[0].parts == ({"type": "text", "text": "Listen: "}, {"type": "audio", "audio": "x.wav"})


def test_bare_placeholder_and_trimming_template(plain: Any) -> None:
    """A LLaVA-1.5-like template writes ``<image>`` bare and trims texts; the trimmed answer is still found."""
    dialogue = parse_dialogue({"image": "a.jpg", "conversations": [
        {"from": "human", "value": "<image>Describe the picture please."},
        {"from": "gpt", "value": "  A cat sits on a mat.\n"}]})
    image_id = plain.convert_tokens_to_ids("<image>")
    rendered = render_dialogue(dialogue, plain, {"image": image_id}, [6], chat_template=LLAVA_TEMPLATE)
    (start, end), = rendered.placeholder_spans
    assert end - start == 6 and (rendered.input_ids[start:end] == image_id).all()
    # " A" is one token, so the space the template writes before the answer comes along (as in transformers' mask).
    assert target_texts(plain, rendered) == [" A cat sits on a mat.</s>"]
    assert_tokenizer_output(plain, dialogue, rendered, chat_template=LLAVA_TEMPLATE)


def test_media_in_an_assistant_turn_with_a_region(generation: Any, pids: dict[str, int]) -> None:
    """With a region, an assistant turn may hold media: its wrappers are targets, its placeholders never."""
    dialogue = parse_dialogue({"messages": [
        {"role": "user", "content": "Draw a cat."},
        {"role": "assistant", "content": [{"type": "text", "text": "Here: "}, {"type": "image", "image": "c.png"}]}]})
    rendered = render_dialogue(dialogue, generation, pids, [4])
    (start, end), = rendered.placeholder_spans
    assert not rendered.targets[start:end].any()
    assert rendered.targets[start - 1] and rendered.targets[end]  # <|vision_start|>, <|vision_end|>


def test_render_caption(plain: Any, pids: dict[str, int]) -> None:
    media = [MediaRef("image", "a.jpg"), MediaRef("audio", "a.wav")]
    bos, eos = plain.convert_tokens_to_ids("<s>"), plain.convert_tokens_to_ids("</s>")
    caption = plain.encode("A cat sits on a mat. 猫🐱", add_special_tokens=False)
    rendered = render_caption("A cat sits on a mat. 猫🐱", plain, media, pids, [3, 2], bos_id=bos, eos_id=eos)
    assert rendered.input_ids.tolist() == [bos] + [pids["image"]] * 3 + [pids["audio"]] * 2 + caption + [eos]
    assert rendered.targets.tolist() == [False] * 6 + [True] * (len(caption) + 1)
    assert rendered.placeholder_spans == ((1, 4), (4, 6)) and rendered.media == tuple(media)
    bare = render_caption("A cat.", plain, [], pids, [], bos_id=None, eos_id=None)
    assert bare.input_ids.tolist() == plain.encode("A cat.", add_special_tokens=False) and bare.targets.all()
    with pytest.raises(ValueError, match="phantom image"):
        render_caption("a <|image_pad|>", plain, media, pids, [3, 2], bos_id=bos, eos_id=eos)


_USER = {"role": "user", "content": "hi"}
_ASSISTANT = {"role": "assistant", "content": "hello"}
BAD_RECORDS = {
    "not_a_mapping": (["hi"], "must be a mapping, got list"),
    "no_dialogue": ({"text": "hi"}, "neither 'conversations' nor 'messages'"),
    "both_lists": ({"conversations": [], "messages": []}, "both 'conversations' and 'messages'"),
    "empty": ({"messages": []}, "ShareGPT record: empty dialogue"),
    "empty_llava": ({"conversations": [], "image": "a.jpg"}, "LLaVA record: empty dialogue"),
    "turns_not_a_list": ({"messages": "hi"}, "must be a list of turns"),
    "turn_not_a_mapping": ({"messages": ["hi", _ASSISTANT]}, "turn 0 is a str, not a mapping"),
    "no_assistant": ({"messages": [_USER, _USER]}, r"no assistant turn \(roles: user, user\)"),
    "no_assistant_typed": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
                           "typed-parts record: no assistant turn"),
    "unknown_role": ({"conversations": [{"from": "human", "value": "x"}, {"from": "bot", "value": "y"}]},
                     "LLaVA record: turn 1 has unknown role 'bot'"),
    "unhashable_role": ({"messages": [{"role": ["user"], "content": "x"}, _ASSISTANT]}, "unknown role"),
    "no_role": ({"messages": [{"content": "x"}, _ASSISTANT]}, "turn 0 has no 'role'"),
    "no_content": ({"messages": [{"role": "user"}, _ASSISTANT]}, "turn 0 has no 'content'"),
    "number_text": ({"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "y"}]},
                    r"turn 0 \(user\) text must be a string"),
    "dict_text": ({"messages": [_USER, {"role": "assistant", "content": {"text": "y"}}]},
                  "text must be a string"),
    "number_text_part": ({"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}, _ASSISTANT]},
                         "typed-parts record: turn 0 part 0 text must be a string"),
    "unknown_part": ({"messages": [{"role": "user", "content": [{"type": "pdf", "pdf": "x"}]}, _ASSISTANT]},
                     "part 0 must be a mapping with 'type'"),
    "part_not_a_mapping": ({"messages": [{"role": "user", "content": ["x"]}, _ASSISTANT]}, "part 0 must be a mapping"),
    "image_without_path": ({"messages": [{"role": "user", "content": [{"type": "image"}]}, _ASSISTANT]},
                           r"part 0 \(image\) needs a path string"),
    "more_markers": ({"image": "a.jpg", "conversations": [{"from": "human", "value": "<image><image>"},
                                                          {"from": "gpt", "value": "y"}]},
                     r"LLaVA record: 2 <image> marker\(s\) in the text but 1 image item\(s\)"),
    "more_media": ({"image": ["a.jpg", "b.jpg"], "conversations": [{"from": "human", "value": "<image> x"},
                                                                   {"from": "gpt", "value": "y"}]},
                   r"1 <image> marker\(s\) in the text but 2 image item\(s\)"),
    "markers_without_media": ({"messages": [{"role": "user", "content": "<video> x"}, _ASSISTANT]},
                              r"ShareGPT record: 1 <video> marker\(s\) in the text but 0 video item\(s\)"),
    "audio_mismatch": ({"audios": ["a.wav", "b.wav"], "messages": [{"role": "user", "content": "<audio>"},
                                                                   _ASSISTANT]}, r"1 <audio> marker\(s\)"),
    "path_not_a_string": ({"images": [3], "messages": [_USER, _ASSISTANT]}, "'images' must be a path or a list"),
    "empty_path": ({"image": "", "conversations": [_USER, _ASSISTANT]}, "'image' must be a path"),
    "singular_and_plural": ({"image": "a", "images": ["b"], "messages": [_USER, _ASSISTANT]}, "both"),
    "media_keys_beside_parts": ({"images": ["a"], "messages": [
        {"role": "user", "content": [{"type": "image", "image": "a"}]}, _ASSISTANT]}, "beside typed parts"),
    "no_user_for_unmarked": ({"image": "a.jpg", "conversations": [{"from": "gpt", "value": "x"}]},
                             "no user turn to put them in"),
}


@pytest.mark.parametrize("name", BAD_RECORDS)
def test_bad_records_raise_value_error(name: str) -> None:
    record, message = BAD_RECORDS[name]
    with pytest.raises(ValueError, match=message):
        parse_dialogue(record)


class _SlowTokenizer:
    is_fast = False


BAD_RENDERS = {
    "phantom_placeholder": ({"messages": [{"role": "user", "content": "look <|image_pad|> here"}, _ASSISTANT]},
                            {}, "contains the image placeholder token '<|image_pad|>'"),
    "template_drops_images": ({"image": "a.jpg", "conversations": [{"from": "human", "value": "<image>x"},
                                                                   {"from": "gpt", "value": "y"}]},
                              {"chat_template": DROPS_IMAGES}, r"0 image placeholder token\(s\) for 1 image item"),
    "template_rewrites_answers": ({"messages": [_USER, _ASSISTANT]}, {"chat_template": SHOUTS}, "cannot be located"),
    "no_placeholder_id": ({"videos": ["v.mp4"], "messages": [{"role": "user", "content": "<video>"}, _ASSISTANT]},
                          {"placeholder_ids": {"image": 5}}, "no placeholder id for modality video"),
    "same_placeholder_ids": ({"messages": [_USER, _ASSISTANT]}, {"placeholder_ids": {"image": 5, "video": 5}},
                             "must differ per modality"),
    "too_few_counts": ({"images": ["a", "b"], "messages": [{"role": "user", "content": "<image><image>"},
                                                           _ASSISTANT]},
                       {"tokens_per_item": [3]}, "one positive count per media item: 2 item"),
    "zero_count": ({"images": ["a"], "messages": [{"role": "user", "content": "<image>"}, _ASSISTANT]},
                   {"tokens_per_item": [0]}, "one positive count"),
    "assistant_media_without_region": ({"messages": [_USER, {"role": "assistant", "content": [
        {"type": "image", "image": "c.png"}]}]}, {}, "assistant turn holds a media part"),
}


@pytest.mark.parametrize("name", BAD_RENDERS)
def test_bad_renders_raise_value_error(name: str, plain: Any, pids: dict[str, int]) -> None:
    record, overrides, message = BAD_RENDERS[name]
    dialogue = parse_dialogue(record)
    kwargs = {"placeholder_ids": pids, "tokens_per_item": [4] * len(dialogue.media), **overrides}
    with pytest.raises(ValueError, match=message):
        render_dialogue(dialogue, plain, **kwargs)


def test_slow_tokenizer_is_a_setup_error(pids: dict[str, int]) -> None:
    with pytest.raises(TypeError, match="fast"):
        render_dialogue(parse_dialogue({"messages": [_USER, _ASSISTANT]}), _SlowTokenizer(), pids, [])


# Random JSON-like records, biased towards the keys, roles, markers and part types the parser looks at, so that
# about half parse and the renderer is fuzzed too.
_WORDS = st.sampled_from(["", "x", "<image>", "a <video> b <image>", "<audio>", "human", "gpt", "user", "assistant",
                          "system", "bot", "text", "image", "video", "audio", "a.jpg", "<|image_pad|>"])
_LEAF = st.none() | st.booleans() | st.integers() | st.floats() | _WORDS | st.text(max_size=6)
_JSON = st.recursive(_LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    _WORDS | st.text(max_size=3), inner, max_size=3), max_leaves=12)
_MEDIA_PART = st.sampled_from([(m, k) for m in ("image", "video", "audio") for k in (m, "path", "url")]).flatmap(
    lambda mk: st.fixed_dictionaries({"type": st.just(mk[0]), mk[1]: _WORDS}))
_TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": _WORDS})
_ODD_PART = st.fixed_dictionaries({}, optional={"type": _WORDS | _JSON, "text": _JSON, "image": _JSON, "url": _JSON})
_CONTENT = (_WORDS | st.lists(_TEXT_PART | _MEDIA_PART, max_size=4)
            | st.lists(_TEXT_PART | _MEDIA_PART | _ODD_PART | _JSON, max_size=4) | _JSON)
_ROLE = st.sampled_from(["user", "assistant", "system", "human", "gpt"])
_GOOD_TURN = st.fixed_dictionaries({"role": _ROLE, "content": _CONTENT}) | st.fixed_dictionaries(
    {"from": _ROLE, "value": _WORDS})
_ODD_TURN = st.fixed_dictionaries({}, optional={"role": _ROLE | _JSON, "from": _JSON, "content": _JSON}) | _JSON
_MEDIA = _WORDS | st.lists(_WORDS, max_size=3) | _JSON
_MEDIA_KEYS = st.sampled_from([(), ("image", "video"), ("images", "videos", "audios"), ("image", "images")]).flatmap(
    lambda keys: st.fixed_dictionaries({}, optional=dict.fromkeys(keys, _MEDIA)))
_STRUCTURED = st.builds(lambda key, turns, media: {key: turns, **media}, st.sampled_from(["conversations", "messages"]),
                        st.lists(_GOOD_TURN, min_size=1, max_size=4) | st.lists(_GOOD_TURN | _ODD_TURN, max_size=3)
                        | _JSON, _MEDIA_KEYS)
# Hypothesis' one_of favours the simplest branch, so the mix is drawn explicitly: three structured records in five.
RECORDS = st.sampled_from([_STRUCTURED] * 3 + [st.dictionaries(_WORDS, _JSON), _JSON]).flatmap(lambda s: s)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record=RECORDS)
def test_fuzzed_records_raise_only_value_error(record: Any, plain: Any, pids: dict[str, int]) -> None:
    """Whatever a record holds, parsing (and rendering what parses) raises ValueError or nothing else."""
    try:
        dialogue = parse_dialogue(record)
    except ValueError:
        return
    assert any(m.role == "assistant" for m in dialogue.messages)
    assert [r.modality for r in dialogue.media] == [
        p["type"] for m in dialogue.messages for p in m.parts if p["type"] != "text"]
    try:
        rendered = render_dialogue(dialogue, plain, pids, [2] * len(dialogue.media))
    except ValueError:
        return
    assert len(rendered.placeholder_spans) == len(dialogue.media)
