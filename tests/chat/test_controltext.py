"""Control-token spellings in message text kept text (stages/chat/controltext.py)."""

from __future__ import annotations

import json

import pytest

from stages.chat.controltext import ESC, ControlTokenCodec
from stages.common.errors import StageError

# the bundled Qwen3.6 tokenizer's, as ChatEncoder orders them: longest first
SPELLINGS = sorted(["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                    "</tool_call>", "<tool_response>", "</tool_response>", "<|endoftext|>"],
                   key=len, reverse=True)


@pytest.fixture(scope="module")
def codec():
    return ControlTokenCodec(SPELLINGS, "test")


def test_sanitized_text_spells_no_control_token_and_comes_back_whole(codec):
    odd = f"a<|im_end|>b<|im_{ESC}x{ESC}\U000f0100</think><think>"
    clean = codec.sanitize({"content": odd, "<think>": [odd, 3, None]})
    text = json.dumps(clean, ensure_ascii=False)
    assert not any(s in text for s in SPELLINGS)
    assert codec.has_lookalikes({"content": odd}) and codec.has_lookalikes([], [{"d": ESC}])
    assert not codec.has_lookalikes([{"content": "plain <b>text</b> <|im"}], [{"d": "x"}])
    assert codec.restore(clean["content"]) == odd
    assert codec.restore(clean[codec.sanitize("<think>")][0]) == odd


def test_a_tool_result_in_a_user_turn_keeps_its_wrapper(codec):
    msgs = [{"role": "user", "content": "<tool_response>\n<|im_end|> r\n</tool_response>"},
            {"role": "user", "content": "<tool_response>x</tool_response> and more"},
            {"role": "tool", "content": "<tool_response>y</tool_response>"}]
    wrapped, asked, tool = codec.sanitize_messages(msgs)
    assert wrapped["content"].startswith("<tool_response>\n")
    assert wrapped["content"].endswith("\n</tool_response>") and "<|im_end|>" not in wrapped["content"]
    assert codec.restore(wrapped["content"]) == msgs[0]["content"]
    assert "<tool_response>" not in asked["content"]  # not wholly a tool result: sanitized
    assert "<tool_response>" not in tool["content"]  # the template wraps tool turns itself


def test_a_template_that_cuts_a_spelling_apart_is_refused(codec):
    cut = codec.sanitize("<think>")[:1]  # the sentinel's escape without its index
    with pytest.raises(StageError, match="cut a message string inside a control-token spelling"):
        codec.restore(cut + "\U0010fff0")


def test_raw_lines_that_may_spell_a_control_token_are_found(codec):
    may = codec.json_may_spell
    # only an escape can hide a spelling in a line with no '<' and no sentinel byte
    assert may(rb'{"content": "\u003c|im_end|>"}')
    assert may(rb'{"content": "<\/think>"}') and may(rb'{"content": "a\/b"}')
    assert may(json.dumps({"content": "x <think> y"}).encode())
    assert may(json.dumps({"content": f"x {ESC} y"}, ensure_ascii=False).encode())
    assert not may(rb'{"content": "line\nbreak \"quoted\" <b>bold</b>"}')
    assert not may(json.dumps({"content": "你好 🙂"}, ensure_ascii=False).encode())
