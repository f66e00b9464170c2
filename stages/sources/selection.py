"""Which prompts of the mix stay: `dedup_key(messages, tools, mode)` finds repeats, and a
source's `limit` is a `LimitSampler` that keeps the rows whose sample hashes are lowest,
in source order (`add` each line, then `emit` to the output).
"""

from __future__ import annotations

import heapq
import shutil
import unicodedata
from pathlib import Path

import orjson
import xxhash

from stages.chat import conversation

_SEQ_BITS = 40  # sample entries pack (hash << 40 | candidate number) into one int
_SEQ_MASK = (1 << _SEQ_BITS) - 1

# Dedup text: a role marker and the text of each message, tool calls and tools as sorted
# JSON; Unicode NFC and every whitespace character removed. So "2+2" and "2 + 2", or a
# prompt re-wrapped or with a trailing newline, are duplicates. For ASCII text that is
# one bytes.translate; only other text goes through NFC and str.split.
_MARK = {role: f"\0{role}\0" for role in conversation.ROLES}
_ASCII_WS = bytes(c for c in range(128) if chr(c).isspace())


def dedup_key(messages: list[dict], tools, mode: str = "prompt") -> int:
    """64-bit key of a prompt, equal for prompts equal after normalization."""
    parts = []
    for m in messages:
        if mode == "user" and m["role"] != "user":
            continue
        parts.append(_MARK[m["role"]])
        parts.append(m["content"])
        if mode != "user" and "tool_calls" in m:
            parts.append("\0calls\0")
            parts.append(orjson.dumps(m["tool_calls"], option=orjson.OPT_SORT_KEYS).decode())
    if tools and mode != "user":
        parts.append("\0tools\0")
        parts.append(orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode())
    text = "".join(parts)
    if text.isascii():
        data = text.encode().translate(None, _ASCII_WS)
    else:
        data = "".join(unicodedata.normalize("NFC", text).split()).encode("utf-8", "surrogatepass")
    return xxhash.xxh3_64_intdigest(data)


class LimitSampler:
    """A source's `limit`: the rows with the smallest sample hashes, kept in source order.

    Rows go to a spool file while a max-heap holds the best `limit` entries; `emit` then
    copies the chosen lines out, so memory holds `limit` integers, never the rows."""

    def __init__(self, path: Path, limit: int):
        self.path, self.limit = path, limit
        self.spool = open(path, "w+b", buffering=1 << 20)
        self.heap: list[int] = []  # (hash << _SEQ_BITS | row number), negated
        self.n = 0

    def add(self, line: bytes, sample: int) -> None:
        self.spool.write(line)
        entry = -((sample << _SEQ_BITS) | self.n)
        if len(self.heap) < self.limit:
            heapq.heappush(self.heap, entry)
        elif self.limit and entry > self.heap[0]:
            heapq.heapreplace(self.heap, entry)
        self.n += 1

    def emit(self, out) -> int:
        """Copy the sampled lines to `out`, in their original order; returns how many."""
        try:
            return self._copy(out)
        finally:
            self.spool.close()
            self.path.unlink()

    def _copy(self, out) -> int:
        spool = self.spool
        spool.flush()
        spool.seek(0)
        if len(self.heap) >= self.n:
            shutil.copyfileobj(spool, out, 1 << 20)
            return self.n
        chosen = sorted((-entry) & _SEQ_MASK for entry in self.heap)
        if not chosen:
            return 0
        want = iter(chosen)
        nxt = next(want)
        for seq, line in enumerate(spool):
            if seq == nxt:
                out.write(line)
                nxt = next(want, -1)
                if nxt < 0:
                    break
        return len(chosen)
