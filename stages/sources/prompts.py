"""Source rows made into prompt lines: `work(spec, items)` (in prepare's process or in a
worker) gives, per raw item, None for a blank line, a `Candidate` (the line to write,
with its id, dedup key and sample hash), a layouts.Dropped, a readers.BadRow, or a
decontam.Match. prepare then does the dedup check, the `limit` and the writing.

A line is {"id": "<32 hex>", "source": "<name>", "messages": [...], "tools": [...]},
`tools` only when the source has them, `turns` only for a conversation regenerated turn
by turn (`multi_turn: regenerate`; the field is stages/chat/regenerate.py's). The id is XXH3-128 of the source name and the
compact JSON of the messages (+ tools) as converted from the row, before tool turns are
settled (stages/sources/toolturns.py). Converted turns always have one key order, so keys
are sorted only in rows with tools or tool calls, whose structures come as the source
wrote them: a prompt keeps its id in every run, whatever the row order.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import orjson
import xxhash

from stages.chat import regenerate
from stages.common import params
from stages.common.errors import json_type
from stages.sources import decontam, layouts, readers, toolturns
from stages.sources.layouts import Dropped, Prompt
from stages.sources.selection import dedup_key


@dataclass(frozen=True)
class PromptSpec:
    """What it takes to turn raw rows of one source into prompt lines (sent to workers)."""

    token: str  # unique per source per run: workers cache their maker by it
    index: int
    src: params.Source
    multi_turn: str
    dedup: str
    max_chars: int
    seed: int
    sampled: bool
    evals: Optional[str]  # key of the decontamination index (decontam.opened)
    tool_conversations: str = "cut"  # with multi_turn: regenerate (params.Prepare)


@dataclass(slots=True)
class Candidate:
    """A row made into a prompt line, before the dedup check and the `limit`."""

    id: bytes  # 32 hex digits, as the line starts: {"id":"<id>"
    line: bytes
    key: Optional[int]  # dedup key; None with dedup: off
    chars: int
    multi_turn: bool  # earlier turns kept as context
    has_tools: bool  # tools, tool calls or a tool result to answer
    sample: Optional[int]  # the `limit` keeps the lowest; None without a limit
    repairs: Sequence[str]  # what settling its tool calls did (toolturns.TOOL_CALL_REPAIRS)
    regen: str = ""  # multi_turn: regenerate: one of REGEN_KINDS ("" otherwise)

    def __reduce__(self):  # from a worker as a tuple: fields by name pickle at twice the cost
        return (Candidate, (self.id, self.line, self.key, self.chars, self.multi_turn,
                            self.has_tools, self.sample, self.repairs, self.regen))


# what multi_turn: regenerate made of a prompt, counted per source in prepare's report
REGEN_KINDS = ("single_turn", "regenerated", "tool_cut", "tool_context", "system_cut")


class Prepared(NamedTuple):
    """One group of rows made: a result per item, and the unknown role names seen."""

    results: list
    unknown_roles: dict[str, int]


class PromptMaker:
    """Raw items of one source -> results (see the module docstring), decontamination
    checked when the run has evaluation sets."""

    def __init__(self, spec: PromptSpec):
        self.spec = spec
        self.layout = layouts.Layout(spec.src, spec.multi_turn)
        self.id_prefix = spec.src.name.encode() + b"\0"
        self.line_prefix = b'","source":' + orjson.dumps(spec.src.name) + b","
        self.seed = spec.seed  # in xxh3's range: params.Prepare.seed
        self.evals = decontam.opened(spec.evals) if spec.evals else None

    def make_all(self, items: list) -> list:
        if self.evals is None:
            make = self.make
            return [make(item) for item in items]
        results, texts, counts = self.make_unchecked(items)
        return self.drop_matches(results, self.evals.check(texts, counts))

    def make_unchecked(self, items: list) -> tuple[list, list[str], list[int]]:
        """The results of `make`, and what decontamination checks of the candidates among
        them: their message texts in a row, and how many texts each has."""
        make = self.make
        texts: list[str] = []
        counts: list[int] = []
        results = [make(item, texts, counts) for item in items]
        return results, texts, counts

    def drop_matches(self, results: list, hits: list) -> list:
        """`results` with each candidate that has a hit (one per candidate, in order)
        replaced by its decontam.Match."""
        if hits.count(None) == len(hits):
            return results
        at = [i for i, res in enumerate(results) if type(res) is Candidate]
        for i, hit in zip(at, hits):
            if hit is not None:
                where = self.evals.where(hit.item)
                results[i] = decontam.Match(results[i].id.decode(), *where, hit.ngram)
        return results

    def make(self, item, texts: Optional[list] = None, counts: Optional[list] = None):
        if type(item) is bytes:
            try:
                item = orjson.loads(item)
            except orjson.JSONDecodeError:
                item = readers.parse_line(item)
        if type(item) is not dict:
            if item is None or type(item) is readers.BadRow:
                return item
            return readers.BadRow("not_an_object", f"expected a JSON object, got {json_type(item)}")
        prompt = self.layout.convert(item)
        if type(prompt) is not Prompt:
            return prompt
        messages, tools, chars, calls = prompt.messages, prompt.tools, prompt.chars, prompt.calls
        spec = self.spec
        if chars > spec.max_chars:
            return Dropped("too_long")
        turns, regen = None, ""
        if spec.multi_turn == "regenerate":
            parts = regenerate.split(messages)
            if parts is None and spec.tool_conversations != "context":
                return Dropped("no_user_turn")
            if parts is not None and (not parts.tool_cut or spec.tool_conversations == "cut"):
                messages, turns = parts.request, parts.turns or None
                calls = any("tool_calls" in m for m in messages)
                regen = "tool_cut" if parts.tool_cut else "system_cut" if parts.system_cut \
                    else "regenerated" if turns else "single_turn"
            else:
                regen = "tool_context"
        payload = {"messages": messages, "tools": tools} if tools else {"messages": messages}
        if turns:
            payload[regenerate.TURNS_KEY] = turns
        try:
            body = orjson.dumps(payload)
        except TypeError:  # lone surrogates cannot be written as UTF-8
            return Dropped("invalid_text")
        # messages are built with a fixed key order; only tool structures need sorting
        structured = tools or calls
        canon = orjson.dumps(payload, option=orjson.OPT_SORT_KEYS) if structured else body
        every = messages if not turns else messages + [m for t in turns for m in t]
        key = None if spec.dedup == "off" else dedup_key(every, tools, spec.dedup)
        pid = xxhash.xxh3_128_hexdigest(self.id_prefix + canon).encode()
        # after the id and dedup key: adding tool_call_ids, unwrapping <tool_response> and
        # writing arguments as text keep the ids prompts had before, and depend only on
        # the conversation
        repairs = toolturns.settle_tool_calls(messages) if calls else ()
        if toolturns.settle_tool_turns(messages) or repairs:
            body = orjson.dumps(payload)
        line = b"".join((b'{"id":"', pid, self.line_prefix, memoryview(body)[1:], b"\n"))
        sample = xxhash.xxh3_64_intdigest(pid, seed=self.seed) if spec.sampled else None
        multi = bool(turns) or len(messages) - (messages[0]["role"] == "system") > 1
        if texts is not None:
            # what decontamination checks: all but the answers kept as context, which stay
            # as empty texts (no words) so that each candidate keeps one text per message.
            # Strings, not the messages: holding a batch of dicts alive until its check
            # made the garbage collector's passes cost ~3% of prepare's time
            if multi:
                texts.extend([m["content"] if m["role"] != "assistant" else "" for m in every])
            else:  # a system and a user turn at most: no comprehension to run
                texts.extend(map(_CONTENT, messages))
            counts.append(len(every))
        return Candidate(pid, line, key, chars, multi,
                         bool(structured or messages[-1]["role"] == "tool"), sample, repairs,
                         regen)


_CONTENT = operator.itemgetter("content")
_MAKERS: dict[str, PromptMaker] = {}


def maker(spec: PromptSpec) -> PromptMaker:
    """The maker of `spec`'s source, made once per process."""
    made = _MAKERS.get(spec.token)
    if made is None:
        _MAKERS.clear()
        made = _MAKERS[spec.token] = PromptMaker(spec)
    return made


def unknown_roles(made: PromptMaker) -> dict[str, int]:
    """The unknown role names `made` has seen since the last call, by count."""
    unknown = dict(made.layout.unknown_roles)
    made.layout.unknown_roles.clear()
    return unknown


def work(spec: PromptSpec, items: list) -> Prepared:
    """Make one group of rows (in a worker process, or inline)."""
    made = maker(spec)
    return Prepared(made.make_all(items), unknown_roles(made))
