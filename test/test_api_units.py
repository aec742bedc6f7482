"""Pure helpers of the API layer: chat template, think splitting, visible-token alignment, token names,
translate placeholders, error field names."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from infer.api.chat_template import CUE_FAST, CUE_THINK, ThinkSplitter, message_text, render_chat
from infer.api.errors import field_name
from infer.api.logprobs import TokenNames, VisibleTokens, char_offsets
from infer.api.schemas import MAX_STOPS, ChatCompletionRequest, ChatMessage, ResponseRequest
from infer.api.translate import Placeholders, detect_language, keep_spacing, language_name, translate_prompt
from infer.stops import StopMatcher
from infer.tokenizer import IncrementalDecoder, load_world_tokenizer


def messages(*pairs):
    return [ChatMessage(role=r, content=c) for r, c in pairs]


def test_render_chat_layout():
    text = render_chat(messages(("user", "hi"), ("developer", "Be brief."), ("assistant", "Hello!"),
                                ("tool", "ignored"), ("user", "next\r\n\r\n  code\r")), system="Top.")
    assert text == ("System: Top.\nBe brief.\n\nUser: hi\n\nAssistant: Hello!\n\nUser: next\n\n  code" + CUE_FAST)
    assert render_chat(messages(("user", "q")), enable_think=True) == "User: q" + CUE_THINK
    assert render_chat(messages(("user", "  "), ("assistant", None))) == ""
    assert render_chat([], extra_user="from contents").startswith("User: from contents")


def test_message_text_parts():
    msg = ChatMessage.model_validate({"role": "user", "content": ["a", {"type": "text", "text": "b"},
                                                                  {"type": "image_url", "image_url": {"url": "x"}}]})
    assert message_text(msg.content) == "ab"


def split_all(pieces: list[str]) -> tuple[str, str]:
    splitter, reasoning, content = ThinkSplitter(), "", ""
    for piece in pieces:
        r, c = splitter.push(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    return reasoning + r, content + c


def test_think_splitter_examples():
    assert split_all(["> \nI think.\n</think>\n\nAnswer.\n"]) == ("I think.", "Answer.\n")
    assert split_all([">", "a", "</th", "ink>", " b"]) == ("a", "b")
    assert split_all([">never closed </thi"]) == ("never closed </thi", "")
    assert split_all(["no bracket</think>x"]) == ("no bracket", "x")
    assert split_all([]) == ("", "")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([">", "</think>", "</th", "ink>", " ", "\n", "a", "bc", "<", "/"]), max_size=20),
       st.data())
def test_think_splitter_pieces_do_not_matter(tokens, data):
    text = "".join(tokens)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    assert split_all(pieces) == split_all([text])


@pytest.mark.parametrize("stop, shown_text", [
    (" general", "Hello there,"),          # the stop starts on a token boundary: its tokens are hidden
    ("general", "Hello there, general"),   # " general" straddles the cut (its space is shown): kept
])
def test_visible_tokens_follow_released_text(stop, shown_text):
    tok = load_world_tokenizer()
    tokens = tok.encode("Hello there, general Kenobi")
    decoder, stops, visible = IncrementalDecoder(tok), StopMatcher([stop]), VisibleTokens(tok)
    shown = []
    for t in tokens:
        result = stops.push(decoder.push(t))
        shown += [item for _, item in visible.push(t, t, result.text)]
        if result.stopped:
            break
    assert tok.decode(shown) == shown_text
    starts, length = char_offsets(tok, tokens)
    assert starts[:3] == [0, 5, 11] and length == len("Hello there, general Kenobi")


def test_visible_tokens_with_partial_characters():
    tok = load_world_tokenizer()
    raw = "你".encode()
    ids = [tok.encode_bytes(raw[:1])[0], tok.encode_bytes(raw[1:2])[0], tok.encode_bytes(raw[2:])[0]]
    visible = VisibleTokens(tok)
    assert visible.push(ids[0], 0, "") == [] and visible.push(ids[1], 1, "") == []
    assert [i for _, i in visible.push(ids[2], 2, "你")] == [0, 1, 2]
    names = TokenNames(tok)
    assert names(ids[0]) == "bytes:\\xe4" and names(0) == "<|endoftext|>" and names(tok.encode("hi")[0]) == "hi"


def test_placeholders():
    marks = Placeholders(["[[x]]"])
    text = "{0} Hallo <b1></b1> [[x]] Welt"
    assert marks.find(text) == ["{0}", "<b1>", "</b1>", "[[x]]"]
    assert marks.intact(text, "[[x]] hello {0} <b1></b1>") and not marks.intact(text, "{0} hello")
    assert "".join(p for p, _ in marks.split(text)) == text
    assert [p for p, is_mark in marks.split(text) if is_mark] == marks.find(text)
    assert keep_spacing("  Hallo ", " hello\n") == "  hello "


def test_languages():
    assert translate_prompt("Hi", "en", "zh-CN") == "English: Hi\n\nChinese:"
    assert language_name("zh-TW") == "Traditional Chinese" and language_name("xx-YY") == "xx-YY"
    assert [detect_language(t) for t in ("hello", "你好", "カタカナ", "안녕", "привет")] == ["en", "zh-CN", "ja", "ko", "ru"]


@pytest.mark.parametrize("loc, name", [(("body", "messages", 0, "role"), "messages[0].role"), (("body",), "body"),
                                       (("contents", 2), "contents[2]")])
def test_field_name(loc, name):
    assert field_name(loc) == name


def test_list_bounds_do_not_cap_a_single_string():
    long_stop = "a stop string longer than sixteen characters"
    assert ChatCompletionRequest.model_validate({"stop": long_stop}).stop == long_stop
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"stop": ["s"] * (MAX_STOPS + 1)})
    assert len(ResponseRequest.model_validate({"input": "x" * 5000}).input) == 5000
