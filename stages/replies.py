"""What a chat completion reply must be before it is cached: the one definition that the
client applies to every 200 and the cache reader applies to every record it reads back.

A reply is kept only if everything the completion row takes from it has the type the
later stages expect, and every string in it can be written as UTF-8 JSON (a server can
send `"\\ud800"`, a lone surrogate, which parses but cannot be written). Anything else is
a bad reply: never cached, counted as a failure of kind `bad_reply`.
"""

from __future__ import annotations

from typing import Any, Optional

from stages import messages as contract
from stages.errors import json_type, writable

MAX_TOKENS = 2**31  # usage counts above this are not token counts
TEXT_FIELDS = ("content", "reasoning_content", "reasoning")
MAX_FINISH = 64  # "stop", "length", "tool_calls", "content_filter": a name, not a text


def problem(data: Any) -> Optional[str]:
    """Why the parsed body `data` is not a reply to keep, in a few words; None if it is."""
    if not isinstance(data, dict):
        return f"the body is {json_type(data)}, not an object"
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        return "no choices"
    choice = choices[0]
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        return "choices[0].message is not an object"
    msg = choice["message"]
    for name in TEXT_FIELDS:
        why = _text(msg.get(name), f"message.{name}")
        if why:
            return why
    why = _tool_calls(msg.get("tool_calls"))
    if why:
        return why
    why = _text(choice.get("finish_reason"), "finish_reason")
    if why:
        return why
    if len(choice.get("finish_reason") or "") > MAX_FINISH:
        return f"finish_reason is longer than {MAX_FINISH} characters"
    usage = data.get("usage")
    if usage is None:
        return None
    if not isinstance(usage, dict):
        return f"usage is {json_type(usage)}, not an object"
    for name in ("prompt_tokens", "completion_tokens"):
        value = usage.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_TOKENS:
            return f"usage.{name} is {json_type(value)} {_short(value)}, not a token count"
    return None


def _tool_calls(calls: Any) -> Optional[str]:
    if calls is None:
        return None
    if not isinstance(calls, list):
        return f"message.tool_calls is {json_type(calls)}, not an array"
    if calls and contract.objects_problem(calls) == f"nest deeper than {contract.MAX_DEPTH} levels":
        # tokenize refuses such a row: cached, it would stop every later run there
        return f"message.tool_calls nest deeper than {contract.MAX_DEPTH} levels"
    for k, call in enumerate(calls):
        where = f"message.tool_calls[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            return f"{where} is not an object with a 'function' object"
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            return f"{where}.function.name is not a non-empty string"
        args = fn.get("arguments")
        if args is not None and not isinstance(args, (str, dict)):
            return f"{where}.function.arguments is {json_type(args)}, not a string or an object"
        if not writable(call):
            return f"{where} holds text that cannot be written as UTF-8 (a lone surrogate)"
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
