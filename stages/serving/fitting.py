"""Fitting each request into the engine's context before it is sent.

A long prompt is sent once, with `max_tokens = min(generate.max_tokens, context - prompt
tokens)`, and a prompt that leaves fewer than `generate.min_new_tokens` is not sent (a
`context_overflow`). The context is `generate.context_length`, else the server's
`max_model_len` (serving/probes.py); the prompt is counted on a local render + encode of
exactly what the engine sees (`ChatEncoder.engine_prompt`, chat/encoder.py). Counting is
cheap: a prompt's UTF-8 length bounds its byte-level BPE tokens from above, so only a
prompt whose bound does not fit is encoded, and plain text messages are bounded by their
shape's skeleton, rendered once, plus their texts' bytes (a render is ~50 µs, which a
1,000-in-flight run feels). When the count is off or no context is known, the engine's
own context error is the fallback (serving/client.py). docs/stages.md, generate,
"Context".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from stages.common.errors import StageError
from stages.serving.toolshape import served_tools

log = logging.getLogger(__name__)

# a token covers at least one byte of byte-level BPE text; other tokenizers may add a
# few pieces (a SentencePiece prefix space): this much headroom keeps the bound safe
BOUND_SLACK = 8
# what a chat template may add to a message beyond its text-free skeleton: a content's
# own text can switch a branch (a `</think>` split, a wholly `<tool_response>` user turn
# that is not a query), each worth a few tags. An underestimate costs one rejected
# request: the engine's context error still clamps (stages/serving/client.py)
BRANCH_SLACK = 64
# NFC lengthens UTF-8 text at most threefold (UAX #15); ASCII it leaves alone
NFC_GROWTH = 3


class NotSent:
    """A prompt the fitting decided not to send: a permanent failure of `kind`, without
    a request."""

    kind: str

    def message(self, tokenizer: str) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Unrenderable(NotSent):
    """A prompt the chat template refuses (a system message after the first turn, say):
    the engine would refuse it with the same template."""

    why: str
    kind = "bad_request"

    def message(self, tokenizer: str) -> str:
        return f"{self.why}; not sent"


@dataclass(frozen=True)
class TooLong(NotSent):
    """A prompt that leaves fewer than min_new_tokens in the context: never sent."""

    prompt_tokens: int
    context: int
    min_new_tokens: int
    kind = "context_overflow"

    def message(self, tokenizer: str) -> str:
        return (
            f"the prompt is {self.prompt_tokens} tokens (counted with {tokenizer}) and leaves "
            f"{max(self.context - self.prompt_tokens, 0)} of the context's {self.context} "
            f"tokens for the answer, fewer than generate.min_new_tokens="
            f"{self.min_new_tokens}; not sent"
        )


class PromptCounter:
    """Tokens of a prompt as the engine will see it, or an upper bound when that is
    enough to decide."""

    def __init__(self, spec: str, enable_thinking: bool, engine: Optional[str] = None):
        from stages.chat.encoder import ChatEncoder, is_nfc
        from stages.models.tokenizer import load_once

        self.spec = spec
        self.engine = engine  # whose rendering of tools to count (serving/toolshape.py)
        tok = load_once(spec)
        self.encoder = ChatEncoder(tok, enable_thinking=enable_thinking, name=spec)
        norm = tok.backend_tokenizer.normalizer
        self._normalize = norm.normalize_str if norm else None
        self._nfc_or_none = norm is None or is_nfc(norm)
        self._skeletons: dict[tuple, Optional[int]] = {}  # shape -> rendered bytes
        self.encoded = 0  # prompts whose bound did not settle it

    def render(self, prompt: dict) -> str:
        return self.encoder.engine_prompt(prompt["messages"],
                                          served_tools(self.engine, prompt.get("tools")))

    def quick_bound(self, prompt: dict) -> Optional[int]:
        """At least the token count of `prompt`, without rendering it: its skeleton (the
        same roles with empty texts, rendered once per shape) plus its texts' bytes, at
        their NFC worst. None where that is not safe to say (tools, tool calls, other
        message keys, a normalizer other than NFC): render and count then."""
        if not self._nfc_or_none or prompt.get("tools"):
            return None
        shape, size = [], 0
        for m in prompt["messages"]:
            content, reasoning = m.get("content"), m.get("reasoning_content")
            if type(content) is not str or (reasoning is not None and type(reasoning) is not str):
                return None
            if len(m) != 2 + ("reasoning_content" in m):  # name, tool_calls, ...
                return None
            shape.append((m["role"], bool(reasoning)))
            for text in (content, reasoning or ""):
                size += len(text) if text.isascii() else NFC_GROWTH * len(text.encode())
        key = tuple(shape)
        if key not in self._skeletons:
            self._skeletons[key] = self._skeleton_bytes(key)
        skeleton = self._skeletons[key]
        if skeleton is None:
            return None
        return skeleton + size + BRANCH_SLACK * len(shape) + BOUND_SLACK

    def _skeleton_bytes(self, shape: tuple) -> Optional[int]:
        messages = [
            {"role": role, "content": "", **({"reasoning_content": ""} if r else {})}
            for role, r in shape
        ]  # fmt: skip
        try:
            return self.bound(self.encoder.engine_prompt(messages)) - BOUND_SLACK
        except Exception:  # a template that refuses empty texts: render each prompt
            return None

    def bound(self, text: str) -> int:
        """At least the token count of `text` (its normalized UTF-8 bytes + slack)."""
        if self._normalize is not None:
            text = self._normalize(text)
        return len(text.encode()) + BOUND_SLACK

    def count(self, text: str) -> int:
        self.encoded += 1
        return len(self.encoder.engine_ids(text))


class ContextBudget:
    """max_tokens for each prompt so that prompt + max_tokens fits `context`."""

    def __init__(self, context: int, max_tokens: int, min_new_tokens: int,
                 counter: PromptCounter):
        self.context = context
        self.max_tokens = max_tokens
        self.min_new_tokens = min_new_tokens
        self.counter = counter
        self.fitted = 0  # requests sent with max_tokens lowered
        self.refused = 0  # prompts not sent: too long
        self.unrenderable = 0  # prompts not sent: the chat template refuses them

    def fit(self, prompt: dict) -> "int | NotSent":
        """The max_tokens to send with `prompt`, or why it is not sent. Deterministic: the
        same prompt and params give the same answer, so the request body stays the same."""
        quick = self.counter.quick_bound(prompt)
        if quick is not None and quick + self.max_tokens <= self.context:
            return self.max_tokens
        try:
            text = self.counter.render(prompt)
        except StageError as e:  # this prompt's own failure, never the run's
            self.unrenderable += 1
            return Unrenderable(str(e))
        if self.counter.bound(text) + self.max_tokens <= self.context:
            return self.max_tokens
        n = self.counter.count(text)
        room = self.context - n
        if room >= self.max_tokens:
            return self.max_tokens
        if room < self.min_new_tokens:
            self.refused += 1
            return TooLong(n, self.context, self.min_new_tokens)
        self.fitted += 1
        return room

    def report(self) -> dict:
        return {"context_length": self.context, "tokenizer": self.counter.spec,
                "fitted": self.fitted, "refused": self.refused,
                "unrenderable": self.unrenderable,
                "encoded": self.counter.encoded}


def budget(context: Optional[int], max_tokens: int, min_new_tokens: int,
           tokenizer: Optional[str], enable_thinking: bool,
           engine: Optional[str] = None) -> Optional[ContextBudget]:
    """The budget for a run, or None (no context known, or no tokenizer to count with:
    only the engine's context error clamps then)."""
    if context is None or tokenizer is None:
        return None
    log.info("fitting max_tokens into the %d-token context (prompts counted with %s)",
             context, tokenizer)
    return ContextBudget(context, max_tokens, min_new_tokens,
                         PromptCounter(tokenizer, enable_thinking, engine))
