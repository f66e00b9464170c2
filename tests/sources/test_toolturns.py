"""Tool turns settled as engines and sglang-router take them: results unwrapped and
given the id of the call they answer, calls as JSON text with a type, and calls no
template can write named."""

from __future__ import annotations

import copy

from stages.sources.toolturns import bad_tool_call, settle_tool_calls, settle_tool_turns


def call(name: str, arguments, **extra) -> dict:
    return {"function": {"name": name, "arguments": arguments}, **extra}


def test_wrapped_results_are_unwrapped_one_message_each_and_answer_their_calls_in_order():
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [call("a", {}), call("b", {}, id="x")]},
                {"role": "tool", "content": "<tool_response>\n1\n</tool_response>\n"
                                            "<tool_response>\n2\n</tool_response>"}]
    assert settle_tool_turns(messages)
    assert [m.get("tool_call_id") for m in messages[2:]] == ["call_1_0", "x"]
    assert [m["content"] for m in messages[2:]] == ["1", "2"]
    assert messages[1]["tool_calls"][0]["id"] == "call_1_0"
    again = copy.deepcopy(messages)
    assert not settle_tool_turns(again) and again == messages  # settled once, the same ids


def test_a_result_without_a_structured_call_gets_its_turns_id():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<tool_call>"},
                {"role": "tool", "content": "r"}]
    assert settle_tool_turns(messages) and messages[2]["tool_call_id"] == "call_2"
    assert not settle_tool_turns([{"role": "user", "content": "no tools"}])


def test_calls_become_json_text_with_a_type_and_each_repair_is_named():
    messages = [{"role": "assistant", "content": "",
                 "tool_calls": [call("a", {"k": "é"}), call("b", None), call("c", "{}", type="function")]}]
    assert settle_tool_calls(messages) == ["tool_call_arguments_to_string", "tool_call_type_added",
                                           "tool_call_arguments_null", "tool_call_type_added"]
    assert [c["function"]["arguments"] for c in messages[0]["tool_calls"]] == ['{"k": "é"}', "{}", "{}"]
    assert all(c["type"] == "function" for c in messages[0]["tool_calls"])
    assert settle_tool_calls(messages) == []


def test_a_call_no_template_can_write_is_named_by_place():
    good = [{"role": "assistant", "content": "", "tool_calls": [call("a", None), call("b", '{"x": 1}')]}]
    assert bad_tool_call(good) is None  # null arguments are settled as {}
    bad = [{"role": "user", "content": "q"},
           {"role": "assistant", "content": "", "tool_calls": [call("a", {}), call("b", "[1]")]}]
    assert bad_tool_call(bad).startswith("messages[1].tool_calls[1] ")
    assert bad_tool_call([{"role": "assistant", "tool_calls": [{"name": "f"}]}]).startswith(
        "messages[0].tool_calls[0] ")
