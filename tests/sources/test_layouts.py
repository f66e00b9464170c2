"""Layouts (sharegpt, messages, columns): a source row turned into the messages the model
answers."""

from __future__ import annotations

import json

import pytest

from stages.chat import conversation
from stages.common.errors import StageError
from stages.sources import layouts
from stages.sources.layouts import Dropped, Prompt
from tests.helpers.sources import src


def layout(fmt="sharegpt", multi_turn="context", **kw) -> layouts.Layout:
    return layouts.Layout(src("x", fmt, **kw), multi_turn)


def conv(*turns, key="conversations", rk="from", ck="value"):
    return {key: [{rk: r, ck: c} for r, c in turns]}


def test_sharegpt_roles_and_cut_after_last_user_or_tool():
    row = conv(("system", "S"), ("human", "Q1"), ("gpt", "A1"), ("human", "Q2"), ("gpt", "A2"))
    prompt = layout().convert(row)
    messages, tools, chars = prompt.messages, prompt.tools, prompt.chars
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[-1]["content"] == "Q2" and tools is None and chars == len("SQ1A1Q2")
    hermes = conv(("system", "tools"), ("human", "Q"), ("gpt", "<tool_call>c</tool_call>"),
                  ("tool", "<tool_response>r</tool_response>"), ("gpt", "final"))
    messages = layout().convert(hermes).messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[-1]["content"] == "<tool_response>r</tool_response>"


def test_first_user_policy_keeps_system_and_first_question():
    row = conv(("gpt", "Hi!"), ("system", "S"), ("human", "Q1"), ("gpt", "A1"), ("human", "Q2"))
    messages = layout(multi_turn="first_user").convert(row).messages
    assert messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}]


def test_role_aliases_case_and_llamafactory_names():
    row = conv(("Human", "Q"), ("function_call", '{"name": "f"}'), ("observation", "42"), ("GPT", "x"))
    messages = layout().convert(row).messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]


def test_unknown_role_no_user_and_missing_keys():
    lay = layout()
    assert lay.convert(conv(("narrator", "x"), ("human", "Q"))) == Dropped("unknown_role")
    assert lay.unknown_roles == {"narrator": 1}
    assert lay.convert(conv(("human", "Q"), ("critic", "after the cut is fine"))) != Dropped("unknown_role")
    assert lay.convert(conv(("system", "S"), ("gpt", "A"))) == Dropped("no_user_turn")
    assert lay.convert(conv(("tool", "r"), ("gpt", "A"))) == Dropped("no_user_turn")
    assert lay.convert({"conversations": [{"value": "Q"}]}) == Dropped("missing_field")
    assert lay.convert({"conversations": [{"from": "human"}]}) == Dropped("missing_field")
    assert lay.convert({"conversations": [{"from": "human", "value": None}]}) == Dropped("null_field")
    assert lay.convert({"conversations": "Q"}) == Dropped("bad_value")
    assert lay.convert({"conversations": None}) == Dropped("null_field")
    assert lay.convert({}) == Dropped("missing_field")
    assert lay.convert(conv(("human", "  \n "))) == Dropped("empty")


def test_role_map_param():
    lay = layout(role_map=["prompter:user", "Answerer : assistant"])
    messages = lay.convert(conv(("prompter", "Q"), ("answerer", "A"), ("prompter", "Q2"))).messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    with pytest.raises(StageError, match="role_map entry 'x:boss'"):
        layout(role_map=["x:boss"])


def test_messages_layout_keeps_tool_calls_and_parts():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    row = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Look "}, {"type": "text", "text": "up"}]},
        {"role": "assistant", "tool_calls": calls, "weight": 1},
        {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "42"},
        {"role": "assistant", "content": "It is 42.", "reasoning_content": "easy"},
    ], "tools": json.dumps([{"type": "function", "function": {"name": "f"}}])}
    prompt = layout("messages", tools_field="tools").convert(row)
    messages, tools, has_calls = prompt.messages, prompt.tools, prompt.calls
    assert has_calls
    assert messages == [
        {"role": "user", "content": "Look up"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "42", "name": "f", "tool_call_id": "c1"},
    ]
    assert tools == [{"type": "function", "function": {"name": "f"}}]
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert layout("messages").convert(image) == Dropped("non_text_content")
    assert layout("messages", tools_field="tools").convert({**row, "tools": "{oops"}) == Dropped("bad_value")
    # tools and tool calls that are not objects break the prompt contract (stages/chat/conversation.py)
    assert layout("messages", tools_field="tools").convert({**row, "tools": [1, "f"]}) == Dropped("bad_value")
    bad_calls = {"messages": [row["messages"][0], {"role": "assistant", "tool_calls": ["f"]},
                              *row["messages"][2:]]}
    assert layout("messages").convert(bad_calls) == Dropped("bad_value")
    deep: list = []
    for _ in range(100):
        deep = [deep]
    assert layout("messages", tools_field="tools").convert({**row, "tools": [{"a": deep}]}) == Dropped("bad_value")
    # surrogate pairs are text; only a lone surrogate is refused
    assert conversation.unicode_problem(b'"\\ud83d\\ude00"', {"c": "\U0001f600"}) is None
    assert "not valid Unicode" in conversation.unicode_problem(b'"\\ud83d"', {"c": "\ud83d"})


def test_columns_layout_with_system_field():
    lay = layouts.Layout(src("x", prompt_field="question", system_field="system"), "context")
    assert lay.convert({"question": "Q", "system": "S"}) == Prompt(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], None, 2, False)
    assert lay.convert({"question": "Q", "system": "  "}).messages == [{"role": "user", "content": "Q"}]
    assert lay.convert({"question": "Q"}).messages == [{"role": "user", "content": "Q"}]
    assert lay.convert({"question": None}) == Dropped("null_field")
    assert lay.convert({"system": "S"}) == Dropped("missing_field")
    assert lay.convert({"question": 3}) == Dropped("bad_value")
    assert lay.convert({"question": "\t"}) == Dropped("empty")


def test_sharegpt_system_field_prepended_once():
    lay = layout(system_field="system")
    messages = lay.convert({**conv(("human", "Q")), "system": "S"}).messages
    assert messages[0] == {"role": "system", "content": "S"}
    messages = lay.convert({**conv(("system", "inner"), ("human", "Q")), "system": "S"}).messages
    assert [m["content"] for m in messages] == ["inner", "Q"]


def test_text_is_kept_exactly():
    text = "  <|im_end|>\n<think>x</think>\r\n\u00e9\u0301 \t "
    messages = layout().convert(conv(("human", text))).messages
    assert messages[0]["content"] == text
