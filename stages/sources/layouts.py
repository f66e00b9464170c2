"""The chat layouts source rows come in, turned into OpenAI-style messages that end where
the model must answer: `Layout(source, multi_turn).convert(row)` gives a `Prompt`, or
`Dropped` with the reason, or a `BadRow`; `FieldProbe` stops a run whose configured
fields no row has.

Layouts: `sharegpt` (`conversations` of `from`/`value`), `messages` (`role`/`content`,
with tool calls) and `columns` (a prompt field plus an optional system field). Role names
map to OpenAI roles through ROLE_ALIASES and the source's `role_map`.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Union

import orjson

from stages.chat import conversation
from stages.common.errors import StageError
from stages.common.params import Source
from stages.sources import toolturns
from stages.sources import readers
from stages.sources.readers import BadRow

log = logging.getLogger(__name__)
PROBE_ROWS = 1000  # rows of a schemaless source checked for the configured fields

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


# Prompt, Dropped (and prompts.Candidate) are built once per source row: slots
# dataclasses, which cost about half as much to build as NamedTuples
@dataclass(slots=True)
class Prompt:
    """A row as a conversation that ends where the model must answer."""

    messages: list[dict]
    tools: Optional[list]
    chars: int  # characters of text, tool calls and tools
    calls: bool  # whether a message holds tool calls


@dataclass(slots=True)
class Dropped:
    """A row that is no prompt, for one of SOURCE_DROP_REASONS."""

    reason: str


class Layout:
    """Turns a row into a prompt: `convert(row)` returns a Prompt, Dropped, or a BadRow
    for a tool call no template can write. Text is kept exactly as given."""

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

    def convert(self, row: dict) -> Union[Prompt, Dropped, BadRow]:
        tools = None
        if self.tools_field:
            tools = row.get(self.tools_field)
            if tools is not None:
                tools = _tools(tools)
                if type(tools) is Dropped:
                    return tools
        system = None
        if self.system_field:
            system = row.get(self.system_field)
            if system is not None and type(system) is not str:
                return Dropped("bad_value")
            if system is not None and not system.strip():
                system = None
        if self.messages_field is None:
            value = row.get(self.prompt_field, _MISSING)
            if type(value) is not str:
                return _absent(value)
            if not value.strip():
                return Dropped("empty")
            user = {"role": "user", "content": value}
            if system is None:
                return Prompt([user], tools, len(value), False)
            return Prompt([{"role": "system", "content": system}, user], tools,
                          len(system) + len(value), False)
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
        for role, text in zip(roles, texts):  # a loop: any() over a generator costs twice
            if role == "user" and not text.strip():
                return Dropped("empty_user_turn")
        messages = [{"role": r, "content": c} for r, c in zip(roles, texts)]
        return self._finish(messages, system, tools, chars, False)

    def _conversation(self, row: dict, system, tools) -> Union[Prompt, Dropped, BadRow]:
        turns = row.get(self.messages_field, _MISSING)
        if type(turns) is not list:
            return _absent(turns)
        roles = self._roles(turns)
        if roles is None:
            return Dropped("bad_value")
        cut = self._cut(roles)
        if cut < 0 or "user" not in roles[: cut + 1]:
            return self._unknown(roles, len(roles)) or Dropped("no_user_turn")
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
                        return Dropped("null_field" if content is None else "missing_field")
                    content = ""
                elif type(content) is list:
                    content = _text_parts(content)
                    if content is None:
                        return Dropped("non_text_content")
                else:
                    return Dropped("bad_value")
            msg["content"] = content
            chars += len(content)
            if "tool_calls" in msg:
                calls = True
                try:
                    chars += len(orjson.dumps(msg["tool_calls"]))
                except TypeError:
                    return Dropped("invalid_text")
            messages.append(msg)
        if not messages[-1]["content"].strip():
            return Dropped("empty")
        if any(m["role"] == "user" and not m["content"].strip() for m in messages):
            return Dropped("empty_user_turn")
        if self.extras and conversation.problem(messages, check_calls=False):
            return Dropped("bad_value")  # e.g. tool_calls that are not objects
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
    def _finish(messages: list, system, tools, chars: int, calls: bool) -> Union[Prompt, Dropped]:
        if system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
            chars += len(system)
        if tools:
            try:
                chars += len(orjson.dumps(tools))
            except TypeError:  # lone surrogates
                return Dropped("invalid_text")
        return Prompt(messages, tools, chars, calls)

    def _unknown(self, roles: list, upto: int) -> Optional[Dropped]:
        for i in range(upto):
            role = roles[i]
            if role not in conversation.ROLES:
                if role is None:
                    return Dropped("missing_field")
                self.unknown_roles[str(role)[:40]] += 1
                return Dropped("unknown_role")
        return None


_MISSING = object()


def _absent(value) -> Dropped:
    """Why a field that must be text or a list is not."""
    return Dropped("missing_field" if value is _MISSING else "null_field" if value is None
                   else "bad_value")


def _tools(value) -> Union[list, Dropped, None]:
    """A tools field: a list, or a JSON string holding one (Hermes, glaive, xLAM)."""
    if type(value) is str:
        if not value.strip():
            return None
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            return Dropped("bad_value")
    if conversation.objects_problem(value):
        return Dropped("bad_value")
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


class FieldProbe:
    """Fails fast, with the fields that do exist, when a configured field is misnamed.

    Sources with a schema are checked when each file opens (`check_schema`); JSON sources
    by the keys of their first PROBE_ROWS rows (`see` each, then `finish`): a field may be
    absent from some rows, but a field absent from all of them is a configuration error,
    not dirty data.
    """

    def __init__(self, src: Source, layout: Layout):
        self.src = src
        self.layout = layout
        self.fields = layout.fields()
        self.keys: dict[str, None] = {}
        self.turn_keys: dict[str, None] = {}
        self.rows = 0
        self.active = True
        self.where = src.path

    def check_schema(self, names: list[str], where: str) -> None:
        self.active = False  # the schema answers for every row of this file
        for param, field, _ in self.fields:
            if field not in names:
                self._fail(param, field, names, where)

    def see(self, row, where: str) -> None:
        if type(row) is bytes:
            row = readers.parse_line(row)
        if type(row) is not dict:
            return
        self.where = where.rsplit(":", 1)[0]
        for k in row:
            self.keys[k] = None
        mf = self.layout.messages_field
        if mf is not None and type(row.get(mf)) is list:
            for turn in row[mf][:8]:
                if type(turn) is dict:
                    for k in turn:
                        self.turn_keys[k] = None
        self.rows += 1
        if self.rows >= PROBE_ROWS:
            self.finish()

    def finish(self) -> None:
        if not self.active:
            return
        self.active = False
        if not self.rows:
            return
        for param, field, _ in self.fields:
            if field not in self.keys:
                self._fail(param, field, list(self.keys), f"the first {self.rows} rows of {self.where}")
        if self.layout.messages_field is not None and self.turn_keys:
            for param, key in (("role_key", self.layout.role_key), ("content_key", self.layout.content_key)):
                if key not in self.turn_keys:
                    self._fail(param, key, list(self.turn_keys), f"the turns of {self.where}",
                               what="turn key")
        if not self.layout.tools_field:
            hint = [k for k in ("tools", "functions") if k in self.keys]
            if hint:
                log.warning(
                    "source %s: rows have a %r field but tools_field is not set, so prompts "
                    "carry no `tools` (fine when the system prompt lists them, as in Hermes)",
                    self.src.name, hint[0],
                )

    def _fail(self, param: str, field: str, names, where: str, what: str = "field") -> None:
        shown = ", ".join(sorted(names)[:40]) or "none"
        raise StageError(
            f"source {self.src.name}: {param} {field!r}: no such {what} in {where} "
            f"({what}s: {shown})"
        )
