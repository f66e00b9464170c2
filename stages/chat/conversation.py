"""The conversation contract every stage shares: what a row's `messages` and `tools` may
hold. prepare writes only rows that meet it, and generate (prompts) and tokenize
(completions) refuse a row that does not, so a hand-edited or foreign file fails with one
line naming the row instead of deep inside a chat template. Also the digest of token ids
that a completion keeps of what the engine served and tokenize checks its render with."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Optional

import numpy as np
import orjson

from stages.common.errors import json_type

from stages.common.reading import MAX_DEPTH, deeper_than

ROLES = ("system", "user", "assistant", "tool")

# optional keys of a message and the types they may hold (besides null)
_OPTIONAL = {"reasoning_content": str, "name": str, "tool_call_id": str, "tool_calls": list}
_NAMES = {str: "string", list: "list"}

# a JSON escape of a UTF-16 surrogate: only these can decode to a lone surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


def problem(messages: Any, tools: Any = None, check_calls: bool = True) -> Optional[str]:
    """What in `messages` / `tools` breaks the contract (a short phrase), or None. With
    `check_calls` false, tool calls are held only to being objects (prepare checks the
    rest itself, before it settles them)."""
    if type(messages) is not list or not messages:
        return "'messages' must be a non-empty list"
    for i, m in enumerate(messages):
        if type(m) is not dict or type(m.get("role")) is not str or m["role"] not in ROLES:
            return f"messages[{i}] must be an object with role {', '.join(ROLES)}"
        bad = _content_problem(m.get("content"))
        if bad:
            return f"messages[{i}].content{bad}"
        for key, kind in _OPTIONAL.items():
            value = m.get(key)
            if value is not None and type(value) is not kind:
                return (f"messages[{i}].{key} must be a {_NAMES[kind]} or null, "
                        f"got {json_type(value)}")
        calls = m.get("tool_calls")
        if calls:
            bad = objects_problem(calls)
            if bad:
                return f"messages[{i}].tool_calls {bad}"
            for k, call in enumerate(calls if check_calls else ()):
                bad = tool_call_problem(call)
                if bad:
                    return f"messages[{i}].tool_calls[{k}] {bad}"
    if tools is not None:
        bad = objects_problem(tools)
        if bad:
            return f"'tools' {bad}"
    return None


def objects_problem(value: Any) -> Optional[str]:
    """What keeps `value` (tools, tool calls) from being a list of objects nested at most
    MAX_DEPTH levels, or None."""
    if type(value) is not list or not all(type(t) is dict for t in value):
        return "must be a list of objects"
    if deeper_than(value, MAX_DEPTH):
        return f"nest deeper than {MAX_DEPTH} levels"
    return None


def tool_call_problem(call: Any) -> Optional[str]:
    """What keeps `call` from being a tool call a template can write (a short phrase), or
    None: an object whose `function` is an object with a non-empty string `name` and,
    unless absent, `arguments` that are a JSON object or a string holding one (engines
    parse the string; the template writes one parameter per key)."""
    if type(call) is not dict:
        return "is not an object"
    fn = call.get("function")
    if type(fn) is not dict:
        return "has no 'function' object"
    if type(fn.get("name")) is not str or not fn["name"]:
        return "function.name is not a non-empty string"
    if "arguments" not in fn:
        return None
    args = fn["arguments"]
    if type(args) is str:
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return f"function.arguments is not JSON: {_quoted(fn['arguments'])}"
    if type(args) is not dict:
        return f"function.arguments is {json_type(args)}, not a JSON object"
    if deeper_than(args, MAX_DEPTH):
        return f"function.arguments nest deeper than {MAX_DEPTH} levels"
    return None


def _quoted(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def unicode_problem(raw: bytes, row: dict) -> Optional[str]:
    """A phrase when the JSON line `raw` (parsed as `row`) holds a lone surrogate, text
    that cannot be written as UTF-8 (nor tokenized); None otherwise."""
    if _SURROGATE_ESCAPE.search(raw) is None:
        return None
    try:
        orjson.dumps(row)  # pairs are fine; a lone surrogate is refused
    except TypeError as e:
        if "surrogate" in str(e):
            return "text that is not valid Unicode (a lone surrogate such as \\ud800)"
    return None


def _content_problem(content: Any) -> Optional[str]:
    if content is None or type(content) is str:
        return None
    if type(content) is not list:
        return f" must be a string, a list of text parts or null, got {json_type(content)}"
    for j, part in enumerate(content):
        if type(part) is str:
            continue
        if type(part) is not dict or part.get("type") != "text" \
                or type(part.get("text")) is not str:
            return f"[{j}] must be a string or {{\"type\": \"text\", \"text\": <string>}}"
    return None


# ------------------------------------------------- what a completion keeps of the engine


def token_ids_digest(ids: Any) -> str:
    """The digest a completion row keeps of the engine's prompt ids (generate's
    `engine_tokens.prompt_sha256`) and tokenize compares its own prompt ids with: sha256
    of the ids as little-endian uint32, 16 hex digits.
    Raises ValueError (or TypeError) for anything but a flat list of token ids."""
    a = np.asarray(ids)
    if a.ndim != 1 or (a.size and (a.dtype.kind not in "iu" or a.min() < 0
                                   or a.max() >= 1 << 32)):
        raise ValueError("not a list of token ids")
    return hashlib.sha256(a.astype("<u4").tobytes()).hexdigest()[:16]
