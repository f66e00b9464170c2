"""Message text that spells a control token, kept text: `ControlTokenCodec(spellings,
name)` swaps each spelling (`<|im_start|>`, `<think>`, `<tool_call>`, ... : the added
tokens of a tokenizer) in every string of the messages and tools for a private-use
sentinel before the chat template renders them (`sanitize`, `sanitize_messages`), and
back inside the rendered text pieces before they are encoded (`restore`), so neither the
template's logic nor the tokenizer can take message text for structure.

One exception, which the Qwen3.5/3.6 format defines: a user message that is wholly a
`<tool_response>...</tool_response>` block keeps that wrapper (it is a tool result, not a
query, and the engine read those control tokens); its inside is sanitized.
"""

from __future__ import annotations

import re
from typing import Any

from stages.chat import thinking
from stages.common.errors import StageError

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# A sanitized spelling is ESC followed by one index character; a raw ESC in the text is
# escaped the same way, so every string survives the round trip.
ESC = "\U0010fffd"
INDEX_BASE = 0xF0100


def _strings(obj: Any, out: list[str]) -> None:
    if isinstance(obj, str):
        out.append(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, str):
                out.append(k)
            _strings(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _strings(v, out)


class ControlTokenCodec:
    """Swaps control-token spellings in message text for private-use sentinels and back,
    so text can never be read as a control token."""

    def __init__(self, spellings: list[str], name: str):
        """`spellings`: the control tokens' texts, longest first; `name`: the tokenizer's,
        for messages."""
        self.name = name
        spellings = spellings + [ESC]
        self._lookalike_re = re.compile("|".join(map(re.escape, spellings)))
        self._index = {s: ESC + chr(INDEX_BASE + k) for k, s in enumerate(spellings)}
        self._restore_map = {v: s for s, v in self._index.items()}
        self._restore_re = re.compile(re.escape(ESC) + ".?", re.S)
        # On a raw JSON line: a spelling, or an escape that could hide one
        self._raw_re = re.compile(b"|".join([rb"\\u", rb"\\/",
                                             *(re.escape(x.encode()) for x in spellings)]))
        # A line without the first byte of any spelling (a fast memchr) can only match
        # an escape, which a regex with a literal first byte finds fast too
        self._raw_starts = sorted({x.encode()[:1] for x in spellings})
        self._raw_escape_re = re.compile(rb"\\[u/]")

    def sanitize(self, obj: Any) -> Any:
        """A copy of `obj` whose strings spell no control token (sentinels instead)."""
        if isinstance(obj, str):
            return self._lookalike_re.sub(lambda m: self._index[m.group(0)], obj)
        if isinstance(obj, dict):
            return {self.sanitize(k): self.sanitize(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.sanitize(v) for v in obj]
        return obj

    def sanitize_messages(self, messages: list[dict],
                          inline: dict[int, tuple[str, str]] | None = None) -> list[dict]:
        """`sanitize` for a conversation, but a user message that is wholly one
        `<tool_response>...</tool_response>` block keeps that wrapper: the format gives it
        meaning (a tool result, not a query: it decides which turns keep their thinking),
        and the engine read it as those control tokens. Only the text inside is sanitized.
        `inline`: {index: (reasoning, content)} of messages whose thinking the template
        takes from their content (stages/chat/thinking.py); each keeps the one `</think>` the
        template splits at, between its two parts sanitized.
        """
        out = []
        for i, m in enumerate(messages):
            if inline and i in inline:
                reasoning, rest = inline[i]
                joined = self.sanitize(reasoning) + thinking.CLOSE + self.sanitize(rest)
                out.append({**self.sanitize({k: v for k, v in m.items() if k != "content"}),
                            "content": joined})
                continue
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str) and m.get("role") == "user":
                body = content.strip()
                if (body.startswith(RESPONSE_OPEN) and body.endswith(RESPONSE_CLOSE)
                        and len(body) >= len(RESPONSE_OPEN) + len(RESPONSE_CLOSE)):
                    a = content.index(RESPONSE_OPEN) + len(RESPONSE_OPEN)
                    b = content.rindex(RESPONSE_CLOSE)
                    rest = self.sanitize({k: v for k, v in m.items() if k != "content"})
                    rest["content"] = content[:a] + self.sanitize(content[a:b]) + content[b:]
                    out.append(rest)
                    continue
            out.append(self.sanitize(m))
        return out

    def json_may_spell(self, raw: bytes) -> bool:
        """False when a raw JSON text certainly has no control-token spelling in it
        (a quick scan of the bytes spares walking every string of the parsed row)."""
        if any(start in raw for start in self._raw_starts):
            return self._raw_re.search(raw) is not None
        return self._raw_escape_re.search(raw) is not None

    def has_lookalikes(self, messages: Any, tools: Any = None) -> bool:
        """Whether any string in the messages or tools spells a control token."""
        found: list[str] = []
        _strings(messages, found)
        _strings(tools, found)
        search = self._lookalike_re.search
        return any(search(s) for s in found)

    def restore(self, text: str) -> str:
        """Undo `sanitize` inside a piece of rendered text."""
        if ESC not in text:
            return text
        broken = False

        def back(m: re.Match) -> str:
            nonlocal broken
            s = self._restore_map.get(m.group(0))
            if s is None:
                broken = True
                return m.group(0)
            return s

        out = self._restore_re.sub(back, text)
        if broken:
            raise StageError(
                f"chat template of {self.name!r} cut a message string inside a control-token "
                "spelling; the conversation cannot be rendered safely"
            )
        return out
