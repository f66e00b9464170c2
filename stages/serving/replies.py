"""What a chat completion reply must be before it is cached: the one definition that the
client applies to every 200 and the cache reader applies to every record it reads back.

A reply is kept only if everything the completion row takes from it has the type the
later stages expect, its tool calls are ones a template can write (stages/chat/conversation.py:
arguments a JSON object or a string holding one), and every string in it can be written
as UTF-8 JSON (a server can send `"\\ud800"`, a lone surrogate, which parses but cannot be
written). Anything else is never cached: a failure of kind `bad_tool_call` or `bad_reply`.
"""

from __future__ import annotations

from typing import Any, Optional

from stages.chat import conversation
from stages.common.errors import json_type
from stages.common.reading import MAX_DEPTH, writable

MAX_TOKENS = 2**31  # usage counts above this are not token counts
TEXT_FIELDS = ("content", "reasoning_content", "reasoning")
MAX_FINISH = 64  # "stop", "length", "tool_calls", "content_filter": a name, not a text


BAD_REPLY = "bad_reply"
BAD_TOOL_CALL = "bad_tool_call"  # a tool call no template can write (stages/chat/conversation.py)


def problem(data: Any) -> Optional[str]:
    """Why the parsed body `data` is not a reply to keep, in a few words; None if it is."""
    found = check(data)
    return found[1] if found else None


def check(data: Any) -> Optional[tuple[str, str]]:
    """(failure kind, why in a few words) when the parsed body `data` is not a reply to
    keep; None when it is. The kind is `bad_tool_call` for a tool call a template could
    not write (its arguments not a JSON object, no `function`), else `bad_reply`."""
    if not isinstance(data, dict):
        return BAD_REPLY, f"the body is {json_type(data)}, not an object"
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        return BAD_REPLY, "no choices"
    choice = choices[0]
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        return BAD_REPLY, "choices[0].message is not an object"
    msg = choice["message"]
    for name in TEXT_FIELDS:
        why = _text(msg.get(name), f"message.{name}")
        if why:
            return BAD_REPLY, why
    found = _tool_calls(msg.get("tool_calls"))
    if found:
        return found
    why = _text(choice.get("finish_reason"), "finish_reason")
    if why:
        return BAD_REPLY, why
    if len(choice.get("finish_reason") or "") > MAX_FINISH:
        return BAD_REPLY, f"finish_reason is longer than {MAX_FINISH} characters"
    usage = data.get("usage")
    if usage is None:
        return None
    if not isinstance(usage, dict):
        return BAD_REPLY, f"usage is {json_type(usage)}, not an object"
    for name in ("prompt_tokens", "completion_tokens"):
        value = usage.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_TOKENS:
            return BAD_REPLY, (f"usage.{name} is {json_type(value)} {_short(value)}, "
                               "not a token count")
    return None


def _tool_calls(calls: Any) -> Optional[tuple[str, str]]:
    if calls is None:
        return None
    if not isinstance(calls, list):
        return BAD_REPLY, f"message.tool_calls is {json_type(calls)}, not an array"
    too_deep = f"nest deeper than {MAX_DEPTH} levels"
    if calls and conversation.objects_problem(calls) == too_deep:
        # tokenize refuses such a row: cached, it would stop every later run there
        return BAD_REPLY, f"message.tool_calls {too_deep}"
    for k, call in enumerate(calls):
        where = f"message.tool_calls[{k}]"
        why = conversation.tool_call_problem(call)
        if why:  # cached, it would stop tokenize on every later run
            return BAD_TOOL_CALL, f"{where} {why}"
        if not writable(call):
            return BAD_REPLY, f"{where} holds text that cannot be written as UTF-8 (a lone surrogate)"
    return None


def _text(value: Any, where: str) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, str):
        return f"{where} is {json_type(value)}, not a string or null"
    if not writable(value):
        return f"{where} holds text that cannot be written as UTF-8 (a lone surrogate)"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."
