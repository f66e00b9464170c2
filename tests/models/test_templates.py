"""The bundled chat formats (stages/models/templates/) against facts about the real ones.

`fixtures/qwen36_renders.jsonl` holds golden renders of the Qwen3.6 format (the Qwen3.5
family): every case must come out byte for byte, errors included. The cases written
out below are further facts of the same format, one feature each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.chat.encoder import ChatEncoder
from stages.common.errors import StageError
from stages.models.tokenizer import template_path

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "qwen36_renders.jsonl"
CASES = [json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").splitlines()]
# Thinking written inline in an assistant's content, rendered by the published Qwen3.6
# template (stages/chat/thinking.py gives its rule): thinking on and off, final turns, history
# before the last query, tool chains after it, several tags, an empty reasoning string.
INLINE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen36_inline_thinking_renders.jsonl"
INLINE_CASES = [json.loads(line) for line in INLINE.read_text(encoding="utf-8").splitlines()]
RENDERED = [c for c in CASES + INLINE_CASES if "text" in c]
USER = "<|im_start|>user\n{}<|im_end|>\n"


@pytest.fixture(scope="module")
def tok():
    from stages.models.tokenizer import load_once

    return load_once("bundled:qwen3.6")


def render(tok, messages, tools=None, gen=False, **kwargs):
    return tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                   add_generation_prompt=gen, **kwargs)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden_renders(tok, case):
    kwargs = {"enable_thinking": case["enable_thinking"]} if "enable_thinking" in case else {}
    args = (tok, case["messages"], case.get("tools"), case.get("add_generation_prompt", False))
    if "error" in case:
        with pytest.raises(Exception, match=f"^{case['error']}$"):
            render(*args, **kwargs)
    else:
        assert render(*args, **kwargs) == case["text"]


@pytest.mark.parametrize("case", INLINE_CASES, ids=[c["name"] for c in INLINE_CASES])
def test_inline_thinking_renders(tok, case):
    kwargs = {"enable_thinking": case["enable_thinking"]} if "enable_thinking" in case else {}
    assert render(tok, case["messages"], case.get("tools"), case.get("add_generation_prompt",
                                                                      False), **kwargs) == case["text"]


@pytest.mark.parametrize("case", RENDERED, ids=[c["name"] for c in RENDERED])
def test_the_encoder_gives_every_golden_render(tok, case):
    """What tokenize trains on and checks with is the golden text byte for byte: a
    training render, a prompt, and the prompt generate counts to fit max_tokens. A
    prompt's ids are the engine's own encode where no control-token spelling is left as
    text (a training row is cut at the end of its generation prompt: `<think>\n` +
    `\n</think>` are not merged into one `\n\n` there, as the engine never saw them so)."""
    enc = ChatEncoder(tok, enable_thinking=case.get("enable_thinking", True))
    if not case.get("add_generation_prompt"):
        (ids, mask, _), = enc.encode(case["messages"], case.get("tools"))
        assert tok.decode(ids.tolist()) == case["text"]
        return
    engine = tok.backend_tokenizer.encode(case["text"], add_special_tokens=False).ids
    assert enc.engine_ids(enc.engine_prompt(case["messages"], case.get("tools"))) == engine
    ids = enc.prompt_ids(case["messages"], case.get("tools")).tolist()
    assert tok.decode(ids) == case["text"]
    if not enc.codec.has_lookalikes([tok.decode(ids, skip_special_tokens=True)]):
        assert ids == engine


def test_golden_file_covers_both_outcomes():
    assert len(CASES) >= 9 and any("error" in c for c in CASES)
    assert {c.get("enable_thinking", True) for c in CASES} == {True, False}


def test_no_user_query_is_an_error(tok):
    only_tools = [{"role": "system", "content": "s"},
                  {"role": "user", "content": "<tool_response>\nx\n</tool_response>"}]
    with pytest.raises(Exception, match="^No user query found in messages.$"):
        render(tok, only_tools, gen=True)


def test_tool_response_user_is_not_a_query(tok):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "first", "reasoning_content": "r1"},
            {"role": "user", "content": " <tool_response>\nout\n</tool_response>\n"},
            {"role": "assistant", "content": "second", "reasoning_content": "r2"}]
    assert render(tok, msgs) == (
        USER.format("q")
        + "<|im_start|>assistant\n<think>\nr1\n</think>\n\nfirst<|im_end|>\n"
        + USER.format("<tool_response>\nout\n</tool_response>")
        + "<|im_start|>assistant\n<think>\nr2\n</think>\n\nsecond<|im_end|>\n")


def test_tool_calls_nested_arguments_and_grouped_results(tok):
    calls = [{"type": "function", "function": {"name": "f", "arguments": {
                 "s": "two\nlines", "n": 3, "x": 1.5, "b": True, "none": None,
                 "obj": {"k": ["v", 1]}, "list": [1, "a"]}}},
             {"function": {"name": "g", "arguments": {}}}]
    msgs = [{"role": "system", "content": " sys "},
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "Calling.", "tool_calls": calls},
            {"role": "tool", "content": "r1"}, {"role": "tool", "content": " r2 "},
            {"role": "assistant", "content": "done"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = render(tok, msgs, tools)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith('<|im_start|>system\n# Tools\n\nYou have access to the following '
                             'functions:\n\n<tools>\n{"type": "function", "function": '
                             '{"name": "f"}}\n</tools>\n\n')
    assert system.endswith("</IMPORTANT>\n\nsys")  # the system text follows the preamble
    assert rest == (
        USER.format("go")
        + "<|im_start|>assistant\n<think>\n\n</think>\n\nCalling.\n\n"
        + "<tool_call>\n<function=f>\n<parameter=s>\ntwo\nlines\n</parameter>\n"
        + "<parameter=n>\n3\n</parameter>\n<parameter=x>\n1.5\n</parameter>\n"
        + "<parameter=b>\nTrue\n</parameter>\n<parameter=none>\nNone\n</parameter>\n"
        + '<parameter=obj>\n{"k": ["v", 1]}\n</parameter>\n'
        + '<parameter=list>\n[1, "a"]\n</parameter>\n</function>\n</tool_call>\n'
        + "<tool_call>\n<function=g>\n</function>\n</tool_call><|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n"
        + "<tool_response>\nr2\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\n<think>\n\n</think>\n\ndone<|im_end|>\n")


def test_reasoning_inline_in_content_is_moved_into_the_block(tok):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"}]
    assert render(tok, msgs).endswith("<think>\nhmm\n</think>\n\nanswer<|im_end|>\n")


def test_content_parts_are_joined(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b "}]}]
    assert render(tok, msgs, gen=True) == USER.format("ab") + "<|im_start|>assistant\n<think>\n"


def test_original_qwen3_format_stays_available(tok):
    qwen3 = template_path("bundled:qwen3").read_text(encoding="utf-8")
    msgs = [{"role": "user", "content": "q"}]
    text = tok.apply_chat_template(msgs, chat_template=qwen3, tokenize=False,
                                   add_generation_prompt=True)
    assert text == USER.format("q") + "<|im_start|>assistant\n"
    with pytest.raises(StageError, match="unknown bundled format.*bundled:qwen3.6"):
        template_path("bundled:nope")


def test_encoder_masks_exactly_what_the_model_generated(tok):
    """Qwen3.6: the generation prompt's `<think>\\n` is not supervised; the rest of the
    block, the answer, the tool calls and <|im_end|> are; earlier turns as rendered."""
    enc = ChatEncoder(tok)
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "reasoning_content": "need f",
             "tool_calls": [{"function": {"name": "f", "arguments": '{"a": {"b": 1}}'}}]},
            {"role": "tool", "content": "r"},
            {"role": "assistant", "content": "A", "reasoning_content": "got r"}]
    (ids, mask, plen), = enc.encode(msgs, policy="all")
    assert tok.decode(ids[:plen]).endswith("<|im_start|>assistant\n<think>\n")
    spans = tok.decode(ids[mask == 1])
    assert spans == ("need f\n</think>\n\n<tool_call>\n<function=f>\n<parameter=a>\n"
                     '{"b": 1}\n</parameter>\n</function>\n</tool_call><|im_end|>'
                     "got r\n</think>\n\nA<|im_end|>")
    (ids, mask, plen), = enc.encode(msgs, policy="last")
    assert tok.decode(ids[mask == 1]) == "got r\n</think>\n\nA<|im_end|>"
    off = ChatEncoder(tok, enable_thinking=False)
    (ids, mask, plen), = off.encode([msgs[0], {"role": "assistant", "content": "A"}])
    assert tok.decode(ids[:plen]).endswith("<think>\n\n</think>\n\n")
    assert tok.decode(ids[mask == 1]) == "A<|im_end|>"
