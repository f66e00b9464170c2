"""Thinking written inline in an assistant's `content`, as the Qwen chat formats read it
(and, by `split_reply`, as an engine's reasoning parser cuts a raw reply).

When a message has no `reasoning_content` string and its trimmed content holds `</think>`:

    reasoning = the text before the first `</think>`, newlines at its end removed, after
                the last `<think>` in it, newlines at its start removed (then trimmed)
    content   = the text after the last `</think>`, newlines at its start removed (not
                trimmed again: leading spaces stay)

The published Qwen3 and Qwen3.6 templates and the bundled ones (models/templates/) apply
this rule themselves, and every render goes through the template; encoder.py, which hides
control-token spellings in message text from the template, hands it the two parts cut
here, joined by the one real `</think>` the template splits at (`inline_parts`).
"""

from __future__ import annotations

from typing import Any, Optional

OPEN, CLOSE = "<think>", "</think>"
# the names a message's reasoning goes by (transformers passes each to templates)
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def split_inline(text: str) -> Optional[tuple[str, str]]:
    """(reasoning, content) of a content text holding `</think>`, by the rule above (the
    reasoning before the template's own trim); None when the text holds no `</think>`."""
    text = text.strip()
    if CLOSE not in text:
        return None
    before, after = text.split(CLOSE, 1)[0], text.rsplit(CLOSE, 1)[-1]
    return before.rstrip("\n").rsplit(OPEN, 1)[-1].lstrip("\n"), after.lstrip("\n")


def split_reply(content: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(reasoning, content) of an engine's raw reply text, when the server has no
    reasoning parser: SGLang's qwen3 parser's rule, not the templates'. Text before the
    first `</think>` is reasoning (the opening `<think>` may be in the prompt or the
    reply); an opened, never closed block is all reasoning and no content."""
    if not content:
        return None, content
    text = content
    stripped = text.lstrip()
    opened = stripped.startswith(OPEN)
    if opened:
        text = stripped[len(OPEN):]
    if CLOSE in text:
        reasoning, _, rest = text.partition(CLOSE)
        return reasoning.strip("\n") or None, rest.lstrip("\n") or None
    if opened:
        return text.strip("\n") or None, None
    return None, content


def recorded_reasoning(reasoning: Optional[str], content: Optional[str]) -> Optional[str]:
    """The reasoning a row records with an engine's answer: a string ("" when the engine
    gave none) whenever the content holds `</think>`, which the model wrote into its
    answer (thinking off, or again after its thinking), so that every render takes that
    content as written instead of the text before its `</think>` for thinking."""
    if reasoning is None and content and CLOSE in content:
        return ""
    return reasoning


def content_text(content: Any) -> Optional[str]:
    """A message content as the templates read it: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") if isinstance(p, dict) else p for p in content]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)
    return None


def has_reasoning(message: dict) -> bool:
    """Whether the template takes the message's reasoning from a field, not its content."""
    return any(isinstance(message.get(k), str) for k in REASONING_KEYS)


def inline_parts(messages: list[dict]) -> dict[int, tuple[str, str]]:
    """{index: (reasoning, content)} of the assistant messages whose thinking the template
    takes from their content."""
    found = {}
    for i, m in enumerate(messages):
        if m.get("role") != "assistant" or has_reasoning(m):
            continue
        text = content_text(m.get("content"))
        parts = split_inline(text) if text is not None and CLOSE in text else None
        if parts is not None:
            found[i] = parts
    return found


def answered_after_closed_block(message: dict) -> dict:
    """The final answer of a row generated with thinking off: the model wrote it after
    the generation prompt's closed, empty thinking block, so any `<think>` text in it is
    part of the answer. An empty `reasoning_content` tells the template so."""
    return message if has_reasoning(message) else {**message, "reasoning_content": ""}
