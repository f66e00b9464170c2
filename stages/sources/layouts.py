"""The chat layouts source rows come in, turned into OpenAI-style messages that end where
the model must answer: `Layout(source, multi_turn).convert(row)`.

Layouts: `sharegpt` (`conversations` of `from`/`value`), `messages` (`role`/`content`,
with tool calls) and `columns` (a prompt field plus an optional system field). Role names
map to OpenAI roles through ROLE_ALIASES and the source's `role_map`.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Union

import orjson

from stages.chat import conversation
from stages.common.errors import StageError
from stages.common.params import Source
from stages.sources import toolturns
from stages.sources.readers import BadRow


# Role names seen in public chat datasets, lower-cased, mapped to OpenAI roles.
# `function_call` (LLaMA-Factory ShareGPT) is the assistant's own call text.
ROLE_ALIASES: dict[str, str] = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user", "prompter": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "bot": "assistant",
    "chatgpt": "assistant", "ai": "assistant", "function_call": "assistant",
    "tool_call": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",
    "function_response": "tool", "tool_response": "tool",
}

# Every reason a source row can be dropped for by prepare, in report order.
SOURCE_DROP_REASONS = (
    "malformed_json",     # a line that is not JSON (on_bad_row: skip)
    "not_an_object",      # valid JSON that is not an object (on_bad_row: skip)
    "missing_field",      # the configured field, or a turn's role/content key, is absent
    "null_field",         # ... or is null
    "bad_value",          # ... or has the wrong type (e.g. conversations is a string)
    "unknown_role",       # a turn whose role maps to no OpenAI role
    "non_text_content",   # content parts that are not text (images, audio)
    "no_user_turn",       # nothing for the model to answer
    "empty",              # the turn to answer is empty or whitespace only
    "empty_user_turn",    # an earlier user turn is empty (sglang-router refuses it)
    "bad_tool_call",      # a tool call no template can write (on_bad_row: skip)
    "too_long",           # prompt characters over prepare.max_prompt_chars
    "invalid_text",       # text that is not valid Unicode (lone surrogates)
    "contaminated",       # shares n-grams with an evaluation set (prepare.decontaminate)
    "duplicate",          # same normalized prompt earlier in this source
    "duplicate_cross_source",  # same normalized prompt in an earlier source
    "over_limit",         # not drawn by the per-source `limit` sample
)

# Keys of a `messages`-layout turn kept besides role and content (the prompt contract).
_EXTRA_KEYS = ("reasoning_content", "tool_calls", "name", "tool_call_id")

Prompt = tuple  # (messages: list[dict], tools: list | None, chars: int, has tool calls: bool)


class Layout:
    """Turns a row into a prompt: `convert(row)` returns `(messages, tools, chars,
    has_calls)`, or the drop reason as a string. Text is kept exactly as given."""

    def __init__(self, src: Source, multi_turn: str):
        self.src = src
        self.first_user = multi_turn == "first_user"
        self.format = src.format
        self.unknown_roles: Counter = Counter()
        self.aliases = dict(ROLE_ALIASES)
        for entry in src.role_map:
            name, _, role = entry.rpartition(":")
            name, role = name.strip().lower(), role.strip()
            if not name or role not in conversation.ROLES:
                raise StageError(
                    f"source {src.name}: role_map entry {entry[:100]!r}: expected 'NAME:ROLE' with "
                    f"ROLE one of {', '.join(conversation.ROLES)}"
                )
            self.aliases[name] = role
        self.system_field = src.system_field
        self.tools_field = src.tools_field
        if src.format == "columns":
            self.prompt_field = src.prompt_field
            self.messages_field = None
        else:
            sharegpt = src.format == "sharegpt"
            self.messages_field = src.messages_field or ("conversations" if sharegpt else "messages")
            self.role_key = src.role_key or ("from" if sharegpt else "role")
            self.content_key = src.content_key or ("value" if sharegpt else "content")
            self.extras = () if sharegpt else _EXTRA_KEYS

    def fields(self) -> list[tuple[str, str, bool]]:
        """(param name, field, required) for every configured top-level field."""
        out = []
        if self.messages_field is None:
            out.append(("prompt_field", self.prompt_field, True))
        else:
            out.append(("messages_field", self.messages_field, True))
        if self.system_field:
            out.append(("system_field", self.system_field, False))
        if self.tools_field:
            out.append(("tools_field", self.tools_field, False))
        return out

    def columns(self) -> list[str]:
        return [f for _, f, _ in self.fields()]

    # -- conversion -----------------------------------------------------------------

    def convert(self, row: dict) -> Union[Prompt, str]:
        tools = None
        if self.tools_field:
            tools = row.get(self.tools_field)
            if tools is not None:
                tools = _tools(tools)
                if type(tools) is str:
                    return tools
        system = None
        if self.system_field:
            system = row.get(self.system_field)
            if system is not None and type(system) is not str:
                return "bad_value"
            if system is not None and not system.strip():
                system = None
        if self.messages_field is None:
            value = row.get(self.prompt_field, _MISSING)
            if type(value) is not str:
                return "missing_field" if value is _MISSING else "null_field" if value is None else "bad_value"
            if not value.strip():
                return "empty"
            user = {"role": "user", "content": value}
            if system is None:
                return [user], tools, len(value), False
            return [{"role": "system", "content": system}, user], tools, len(system) + len(value), False
        turns = row.get(self.messages_field, _MISSING)
        if self.first_user or type(turns) is not list:
            return self._conversation(row, system, tools)
        # Fast path for turns of just role and text; anything unusual takes the careful path.
        rk, ck, aliases = self.role_key, self.content_key, self.aliases
        try:
            if self.extras and any(len(t) != 2 for t in turns):
                raise KeyError
            roles = [aliases[t[rk]] for t in turns]
            cut = len(roles) - 1
            while cut >= 0 and roles[cut] != "user" and roles[cut] != "tool":
                cut -= 1
            if cut < 0:
                raise KeyError
            roles = roles[: cut + 1]
            texts = [t[ck] for t in turns[: cut + 1]]
            chars = len("".join(texts))  # TypeError unless every content is a string
        except (KeyError, TypeError, IndexError):
            return self._conversation(row, system, tools)
        if "user" not in roles or not texts[-1].strip():
            return self._conversation(row, system, tools)
        if any(r == "user" and not t.strip() for r, t in zip(roles, texts)):
            return "empty_user_turn"
        messages = [{"role": r, "content": c} for r, c in zip(roles, texts)]
        return self._finish(messages, system, tools, chars, False)

    def _conversation(self, row: dict, system, tools) -> Union[Prompt, str]:
        turns = row.get(self.messages_field, _MISSING)
        if type(turns) is not list:
            return "missing_field" if turns is _MISSING else "null_field" if turns is None else "bad_value"
        roles = self._roles(turns)
        if roles is None:
            return "bad_value"
        cut = self._cut(roles)
        if cut < 0 or "user" not in roles[: cut + 1]:
            return self._unknown(roles, len(roles)) or "no_user_turn"
        bad = self._unknown(roles, cut + 1)
        if bad:
            return bad
        messages = []
        chars = 0
        calls = False
        ck = self.content_key
        for i in range(cut + 1):
            role = roles[i]
            if self.first_user and i < cut and role != "system":
                continue
            turn = turns[i]
            msg = {"role": role, "content": None}
            for key in self.extras:
                value = turn.get(key)
                if value is not None:
                    msg[key] = value
            if role == "assistant" and "function_call" in turn and turn["function_call"] is not None \
                    and self.extras and "tool_calls" not in msg:
                msg["tool_calls"] = [{"type": "function", "function": turn["function_call"]}]
            content = turn.get(ck, _MISSING)
            if type(content) is not str:
                if content is None or content is _MISSING:
                    # an assistant turn that only calls tools may omit its content
                    if role != "assistant" or "tool_calls" not in msg:
                        return "null_field" if content is None else "missing_field"
                    content = ""
                elif type(content) is list:
                    content = _text_parts(content)
                    if content is None:
                        return "non_text_content"
                else:
                    return "bad_value"
            msg["content"] = content
            chars += len(content)
            if "tool_calls" in msg:
                calls = True
                try:
                    chars += len(orjson.dumps(msg["tool_calls"]))
                except TypeError:
                    return "invalid_text"
            messages.append(msg)
        if not messages[-1]["content"].strip():
            return "empty"
        if any(m["role"] == "user" and not m["content"].strip() for m in messages):
            return "empty_user_turn"
        if self.extras and conversation.problem(messages, check_calls=False):
            return "bad_value"  # e.g. tool_calls that are not objects
        if calls:
            bad = toolturns.bad_tool_call(messages)
            if bad:
                return BadRow("bad_tool_call", bad)
        return self._finish(messages, system, tools, chars, calls)

    def _roles(self, turns: list) -> Optional[list]:
        """Each turn's role, aliases mapped (an unknown name kept as is); None when a turn
        is not an object."""
        rk, aliases = self.role_key, self.aliases
        roles = []
        for turn in turns:
            if type(turn) is not dict:
                return None
            name = turn.get(rk)
            role = aliases.get(name) if type(name) is str else None
            if role is None and type(name) is str:
                role = aliases.get(name.strip().lower())
            roles.append(role if role is not None else name)
        return roles

    def _cut(self, roles: list) -> int:
        """The turn the model answers after: the last user or tool turn (or the first user
        turn); -1 when there is none."""
        if self.first_user:
            return next((i for i, role in enumerate(roles) if role == "user"), -1)
        return next((i for i in range(len(roles) - 1, -1, -1)
                     if roles[i] == "user" or roles[i] == "tool"), -1)

    @staticmethod
    def _finish(messages: list, system, tools, chars: int, calls: bool) -> Union[Prompt, str]:
        if system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
            chars += len(system)
        if tools:
            try:
                chars += len(orjson.dumps(tools))
            except TypeError:  # lone surrogates
                return "invalid_text"
        return messages, tools, chars, calls

    def _unknown(self, roles: list, upto: int) -> Optional[str]:
        for i in range(upto):
            role = roles[i]
            if role not in conversation.ROLES:
                if role is None:
                    return "missing_field"
                self.unknown_roles[str(role)[:40]] += 1
                return "unknown_role"
        return None


_MISSING = object()


def _tools(value) -> Union[list, str, None]:
    """A tools field: a list, or a JSON string holding one (Hermes, glaive, xLAM)."""
    if type(value) is str:
        if not value.strip():
            return None
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            return "bad_value"
    if conversation.objects_problem(value):
        return "bad_value"
    return value or None


def _text_parts(parts: list) -> Optional[str]:
    """OpenAI content parts: the texts joined, or None when a part is not text."""
    out = []
    for part in parts:
        if type(part) is str:
            out.append(part)
        elif type(part) is dict and part.get("type") == "text" and type(part.get("text")) is str:
            out.append(part["text"])
        else:
            return None
    return "".join(out)
