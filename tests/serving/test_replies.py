"""What a reply must be before it is cached (stages/serving/replies.py)."""

from __future__ import annotations

import copy
import json

import pytest

from stages.serving.replies import check, problem
from tests.helpers.fakeserver import DEFAULTS, reply_for

GOOD = reply_for({"messages": [{"role": "user", "content": "hi"}]}, DEFAULTS)
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": 1}'}}


def changed(path: str, value) -> dict:
    reply = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node = reply
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    node[last] = value
    return reply


@pytest.mark.parametrize("reply", [
    GOOD,
    changed("choices.0.message.content", None),
    changed("choices.0.message.tool_calls", [CALL]),
    changed("choices.0.message.tool_calls", [{"function": {"name": "f", "arguments": {"q": 1}}}]),
    changed("choices.0.message.tool_calls", []),
    changed("choices.0.finish_reason", None),
    changed("usage", None),
    changed("choices.0.message.content", "émoji 🎉 fine"),
], ids=["plain", "no-content", "tool-call", "args-object", "no-calls", "no-finish", "no-usage", "unicode"])  # fmt: skip
def test_well_formed_replies_pass(reply):
    assert problem(reply) is None
    assert problem(json.loads(json.dumps(reply))) is None


@pytest.mark.parametrize("reply, why", [
    ([GOOD], "the body is an array, not an object"),
    (changed("choices", []), "no choices"),
    (changed("choices", ["x"]), "choices[0].message is not an object"),
    (changed("choices.0.message", "hi"), "choices[0].message is not an object"),
    (changed("choices.0.message.content", {"text": "hi"}), "message.content is an object"),
    (changed("choices.0.message.content", 42), "message.content is a number"),
    (changed("choices.0.message.content", ["hi"]), "message.content is an array"),
    (changed("choices.0.message.reasoning_content", 7), "message.reasoning_content is a number"),
    (changed("choices.0.message.reasoning", True), "message.reasoning is a boolean"),
    (changed("choices.0.message.content", "a \ud800 b"), "lone surrogate"),
    (changed("choices.0.message.tool_calls", "lookup()"), "message.tool_calls is a string"),
    (changed("choices.0.message.tool_calls", ["x"]), "tool_calls[0] is not an object"),
    (changed("choices.0.message.tool_calls", [{"function": {"arguments": "{}"}}]), "name is not"),
    (changed("choices.0.message.tool_calls", [{"function": {"name": "f", "arguments": 3}}]), "arguments is a number"),
    (changed("choices.0.message.tool_calls", [{"function": {"name": "f", "arguments": '{"q": "\udfff"}'}}]), "lone surrogate"),
    (changed("choices.0.finish_reason", 1), "finish_reason is a number"),
    (changed("choices.0.finish_reason", ["stop"]), "finish_reason is an array"),
    (changed("choices.0.finish_reason", "s" * 65), "finish_reason is longer than 64"),
    (changed("choices.0.message.tool_calls", [{"function": {"name": "f", "arguments": json.loads('{"a": ' * 60 + "1" + "}" * 60)}}]), None),
    (changed("choices.0.message.tool_calls", [{"function": {"name": "f", "arguments": json.loads('{"a": ' * 70 + "1" + "}" * 70)}}]),
     "tool_calls nest deeper than 64 levels"),
    (changed("usage", "many"), "usage is a string"),
    (changed("usage.completion_tokens", "12"), "usage.completion_tokens is a string"),
    (changed("usage.prompt_tokens", -1), "not a token count"),
    (changed("usage.prompt_tokens", 2**70), "not a token count"),
    (changed("usage.prompt_tokens", 1.5), "not a token count"),
    (changed("usage.prompt_tokens", True), "not a token count"),
])  # fmt: skip
def test_bad_replies_are_named(reply, why):
    if why is None:  # a near miss that must pass
        assert problem(reply) is None
        return
    assert why in problem(reply)


@pytest.mark.parametrize("call, why", [
    ({"function": {"name": "f", "arguments": "{not json"}}, "arguments is not JSON: '{not json'"),
    ({"function": {"name": "f", "arguments": "[1,2]"}}, "arguments is an array, not a JSON object"),
    ({"function": {"name": "f", "arguments": '"text"'}}, "arguments is a string, not a JSON object"),
    ({"function": {"name": "f", "arguments": None}}, "arguments is null, not a JSON object"),
    ({"type": "function", "name": "f", "arguments": "{}"}, "has no 'function' object"),
    ({"function": "f"}, "has no 'function' object"),
], ids=["not-json", "array", "json-string", "null", "flat", "function-string"])  # fmt: skip
def test_tool_calls_a_template_cannot_write_are_their_own_kind(call, why):
    """Never cached: tokenize would fail on the row on every run, or train on
    `<function=>`; a retry may get a well-formed call."""
    kind, said = check(changed("choices.0.message.tool_calls", [CALL, call]))
    assert kind == "bad_tool_call" and said.startswith("message.tool_calls[1] ")
    assert said.endswith(why)
    assert check(changed("choices.0.message.tool_calls", [CALL, {"function": {
        "name": "f"}}])) is None  # no arguments at all: the template writes none
