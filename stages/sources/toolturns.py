"""Tool turns as engines and sglang-router take them, settled by prepare after it hashed
a prompt's id (so ids stay those of the source's conversation).

Every `tool` message gets a `tool_call_id` and loses a `<tool_response>` wrapper the
source already wrote; every structured tool call gets `"type": "function"` and its
`arguments` as JSON text (the router, 0.3.2, refuses anything else; SGLang and vLLM parse
the text back for the template, so the rendering is the same). A call no template can
write (arguments that are not a JSON object, no `function` object: stages/chat/conversation.py)
cannot be settled: `bad_tool_call` says what is wrong with it, and prepare refuses the
row (per `prepare.on_bad_row`).
"""

from __future__ import annotations

import json
import re
from typing import Optional

from stages.chat import conversation


_RESPONSE = re.compile(r"\s*<tool_response>\n?(.*?)\n?</tool_response>\s*", re.S)


def settle_tool_turns(messages: list) -> bool:
    """Tool turns as chat templates and sglang-router take them; True when any changed.

    A tool result the source already wrapped in <tool_response> (Hermes) is unwrapped,
    one message per block: every Qwen-style template (the engine's and tokenize's)
    wraps each tool message itself. Every tool message gets a `tool_call_id` (the
    router rejects one without): the id of the assistant call it answers, in order,
    the call given an id `call_<turn>_<k>` when it has none; `call_<turn>` when
    there is no structured call to answer (calls written as text). Ids depend only on
    the conversation, so a prompt sends the same request in every run.
    """
    if "tool" not in [m["role"] for m in messages]:  # called per row: no generator
        return False
    changed = _unwrap_responses(messages)
    pending: list[str] = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            pending, named = _call_ids(m, i)
            changed = changed or named
        elif m["role"] == "tool":
            answered = m.get("tool_call_id")
            if type(answered) is str and answered:
                if answered in pending:
                    pending.remove(answered)
            else:
                m["tool_call_id"] = pending.pop(0) if pending else f"call_{i}"
                changed = True
    return changed


def bad_tool_call(messages: list) -> Optional[str]:
    """What makes a tool call of the conversation one no template can write (arguments
    that are not a JSON object, no `function` object; stages/chat/conversation.py), or None.
    Null arguments are not: `settle_tool_calls` writes them as `{}`."""
    for i, m in enumerate(messages):
        for k, call in enumerate(m.get("tool_calls") or ()):
            fn = call.get("function") if type(call) is dict else None
            if type(fn) is dict and "arguments" in fn and fn["arguments"] is None:
                call = {**call, "function": {**fn, "arguments": {}}}
            bad = conversation.tool_call_problem(call)
            if bad:
                return f"messages[{i}].tool_calls[{k}] {bad}"
    return None


# what settle_tool_calls repairs, by reason (counted in reports/prepare.json `repaired`)
TOOL_CALL_REPAIRS = ("tool_call_arguments_to_string", "tool_call_arguments_null",
                     "tool_call_type_added")


def settle_tool_calls(messages: list) -> list[str]:
    """Tool calls as sglang-router takes them (it refuses arguments that are not a string
    and a call without `"type"`; SGLang and vLLM parse the string back for the template,
    so the rendering is the same): arguments written as JSON text, null ones as `{}`, and
    `"type": "function"`. Returns the repairs made, one reason per repair."""
    repairs: list[str] = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            continue
        out = []
        for call in calls:
            fn = call["function"]
            if "arguments" in fn and type(fn["arguments"]) is not str:
                if fn["arguments"] is None:
                    text, reason = "{}", "tool_call_arguments_null"
                else:
                    text, reason = json.dumps(fn["arguments"], ensure_ascii=False), \
                        "tool_call_arguments_to_string"
                call = {**call, "function": {**fn, "arguments": text}}
                repairs.append(reason)
            if call.get("type") != "function":
                call = {**call, "type": "function"}
                repairs.append("tool_call_type_added")
            out.append(call)
        if out != calls:
            m["tool_calls"] = out
    return repairs


def _unwrap_responses(messages: list) -> bool:
    changed = False
    i = 0
    while i < len(messages):
        m = messages[i]
        text = m["content"] if m["role"] == "tool" else None
        if type(text) is str and text.lstrip().startswith("<tool_response>"):
            blocks, pos = [], 0
            for match in _RESPONSE.finditer(text):
                if match.start() != pos:
                    break
                blocks.append(match.group(1))
                pos = match.end()
            whole = blocks and pos == len(text) and not any("<tool_response>" in b for b in blocks)
            if whole and (len(blocks) == 1 or "tool_call_id" not in m):
                messages[i : i + 1] = [{**m, "content": b} for b in blocks]
                i += len(blocks) - 1
                changed = True
        i += 1
    return changed


def _call_ids(message: dict, turn: int) -> tuple[list[str], bool]:
    """(ids of an assistant turn's structured calls, whether one had to be given an id)."""
    calls = message.get("tool_calls")
    if type(calls) is not list:
        return [], False
    ids, out, named = [], [], False
    for k, call in enumerate(calls):
        if type(call) is dict:
            if not (type(call.get("id")) is str and call["id"]):
                call, named = {"id": f"call_{turn}_{k}", **call}, True
            ids.append(call["id"])
        out.append(call)
    if named:
        message["tool_calls"] = out
    return ids, named
