"""The text of each token and what part of a conversation it is in.

`TokenText(tok)` gives each token's piece of the decoded text (the characters it
completes: joined over a run they are exactly `tok.decode(run)`), tells control tokens
(the tokenizer's added tokens) from text that only spells one, and `kinds()` labels every
token of a ChatML row: control, a role header, system/user/tool text, and in an
assistant turn thinking (`<think>`...`</think>`), tool call (`<tool_call>`...) or answer.
`visible()` writes the characters that would act on a terminal or hide in a page
(controls, bidi and zero-width marks, and the escape's own opener) as ⟨U+XXXX⟩.
"""

from __future__ import annotations

import codecs
import functools
import re
from typing import Sequence

import numpy as np

UNKNOWN = "\ufffd"  # an id outside the vocabulary: shown, never decoded
OPEN = "\u27e8"  # ⟨ : opens an escape, so a literal one is escaped too
_HIDDEN = ("\u0000-\u0008\u000b-\u001f\u007f-\u009f\u061c\u200b\u200e\u200f"
           "\u2028-\u202e\u2060\u2066-\u2069\ufeff" + OPEN)
_HIDDEN_RE = re.compile(f"[{_HIDDEN}]")
_ESCAPE_RE = re.compile(OPEN + r"U\+([0-9A-F]{4,6})\u27e9")
KINDS = ("control", "role", "system", "user", "tool", "thinking", "answer", "tool_call",
         "text")


def visible(text: str) -> str:
    """`text` with controls (but tab and newline), bidi and zero-width marks as ⟨U+XXXX⟩."""
    return _HIDDEN_RE.sub(lambda m: f"{OPEN}U+{ord(m.group(0)):04X}\u27e9", text)


def unescape(text: str) -> str:
    """The inverse of `visible`."""
    return _ESCAPE_RE.sub(lambda m: chr(int(m.group(1), 16)), text)


class TokenText:
    """Per-token text for one tokenizer (a transformers fast tokenizer)."""

    def __init__(self, tok):
        self.tok = tok
        self.size = len(tok)
        added = {i: t.content for i, t in tok.added_tokens_decoder.items()}
        # the tokens a chat template writes as structure (ChatEncoder's rule)
        self.control = {i: c for i, c in added.items() if c and not c.isspace()}
        self.ids = {c: i for i, c in self.control.items()}
        self._added = added
        self._back = None  # byte-level BPE: the character -> byte map of its alphabet
        if type(tok.backend_tokenizer.decoder).__name__ == "ByteLevel":
            from stages.models.tokenizer import _byte_alphabet

            self._back = {c: b for b, c in _byte_alphabet().items()}

    def _token_bytes(self, ids: list[int]) -> list[bytes] | None:
        names = self.tok.convert_ids_to_tokens(ids)
        out = []
        for i, name in zip(ids, names):
            if i in self._added:
                out.append(self._added[i].encode("utf-8"))
                continue
            try:
                out.append(bytes(self._back[c] for c in name))
            except (KeyError, TypeError):
                return None
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """What the trainer's tokenizer decodes `ids` to (special tokens kept)."""
        return "".join(self.pieces(ids))

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """One string per token, joined exactly `decode(ids)`: each token carries the
        characters its bytes complete (a character split over tokens goes to its last)."""
        ids = [int(i) for i in np.asarray(ids).tolist()]
        if any(not 0 <= i < self.size for i in ids):
            out, run = [], []
            for i in ids + [-1]:
                if 0 <= i < self.size:
                    run.append(i)
                    continue
                out += self.pieces(run) if run else []
                run = []
                if i != -1:
                    out.append(UNKNOWN)
            return out
        raw = self._token_bytes(ids) if self._back is not None else None
        if raw is None:
            return self._pieces_by_prefix(ids)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        out = [decoder.decode(b) for b in raw]
        tail = decoder.decode(b"", final=True)
        if tail and out:
            out[-1] += tail
        return out

    def _pieces_by_prefix(self, ids: list[int]) -> list[str]:
        out, before = [], ""
        for k in range(len(ids)):
            text = self.tok.decode(ids[: k + 1], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
            common = len(before) if text.startswith(before) else 0
            out.append(text[common:])
            before = text
        return out

    def kinds(self, ids: Sequence[int], pieces: list[str]) -> list[str]:
        """Each token's kind (KINDS): ChatML turns read at their control tokens."""
        start, end = self.ids.get("<|im_start|>"), self.ids.get("<|im_end|>")
        think_open, think_close = self.ids.get("<think>"), self.ids.get("</think>")
        call_open, call_close = self.ids.get("<tool_call>"), self.ids.get("</tool_call>")
        out, role, header, inner = [], None, None, None
        for i, piece in zip(np.asarray(ids).tolist(), pieces):
            if i in self.control:
                out.append("control")
                if i == start:
                    role, header, inner = None, "", None
                elif i == end:
                    role, header, inner = None, None, None
                elif i == think_open:
                    inner = "thinking"
                elif i == call_open:
                    inner = "tool_call"
                elif i in (think_close, call_close):
                    inner = None
                continue
            if header is not None:  # the role name, up to its newline
                out.append("role")
                header += piece
                if "\n" in header:
                    role, header = header.strip(), None
                continue
            if role == "assistant" or (role is None and inner):
                out.append(inner or "answer")
            elif role in ("system", "user", "tool"):
                out.append(inner if inner == "tool_call" else role)
            else:
                out.append(inner or "text")
        return out


def runs(flags: np.ndarray) -> list[tuple[int, int, bool]]:
    """(start, end, flag) of each maximal run of equal flags."""
    flags = np.asarray(flags, bool)
    if not len(flags):
        return []
    cuts = np.flatnonzero(flags[1:] != flags[:-1]) + 1
    bounds = [0, *cuts.tolist(), len(flags)]
    return [(a, b, bool(flags[a])) for a, b in zip(bounds[:-1], bounds[1:])]


def text_for(fingerprint: dict, spec: str | None = None) -> TokenText:
    """TokenText for the tokenizer a set's fingerprint names (or `spec`); loaded once
    per process."""
    from stages.common.errors import StageError

    tok = fingerprint.get("tokenizer") if isinstance(fingerprint, dict) else None
    spec = spec or (tok.get("name") if isinstance(tok, dict) else None)
    if not isinstance(spec, str) or not spec:
        raise StageError("the set's fingerprint.json names no tokenizer; give --tokenizer")
    return _loaded(spec)


@functools.lru_cache(maxsize=2)
def _loaded(spec: str) -> TokenText:
    from stages.models.tokenizer import _load_hf, load_tokenizer

    if spec.startswith("bundled:"):
        return TokenText(load_tokenizer(spec))
    return TokenText(_load_hf(spec, trust_remote_code=False))  # no chat template needed
