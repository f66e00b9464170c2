"""A row made ready to show: each token's text, kind, supervision and control flag, the
cap on tokens shown, and the header facts (id, source, tokens, supervised tokens, and how
the row was made, read from the set's fingerprint.json and lineage.json and from the
row's own tokens).

    marked = mark(row, text, dataset, max_tokens)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from stages.view.rows import Dataset, Row
from stages.view.tokens import TokenText, runs


@dataclasses.dataclass
class Marked:
    row: Row
    pieces: list[str]  # the shown tokens' text (the first `shown` tokens)
    kinds: list[str]
    control: np.ndarray  # bool per shown token
    supervised: np.ndarray  # bool per shown token
    shown: int
    facts: dict  # header: name -> value, in order
    differs: Optional[np.ndarray] = None  # bool per shown token (two-version view)

    @property
    def ids(self) -> np.ndarray:
        return self.row.input_ids[: self.shown]

    def spans(self) -> list[tuple[int, int, bool]]:
        """(start, end, supervised) runs of the shown tokens."""
        return runs(self.supervised)


def mark(row: Row, text: TokenText, dataset: Dataset, max_tokens: int) -> Marked:
    shown = len(row.input_ids) if not max_tokens else min(len(row.input_ids), max_tokens)
    ids = row.input_ids[:shown]
    # decoded run by run: a marked span's text is exactly the decode of its tokens, even
    # where a character's bytes straddle the edge of supervision
    pieces = [p for a, b, _ in runs(row.supervised[:shown]) for p in text.pieces(ids[a:b])]
    kinds = text.kinds(ids, pieces)
    control = np.fromiter((int(i) in text.control for i in ids.tolist()), bool, len(ids))
    return Marked(row, pieces, kinds, control, row.supervised[:shown], shown,
                  facts(row, text, dataset))


def facts(row: Row, text: TokenText, dataset: Dataset) -> dict:
    """What the header says about a row."""
    out = {"id": row.id if row.id is not None else "(no id column)",
           "row": f"{row.number} ({row.shard})"}
    if row.source is not None:
        out["source"] = row.source
    out["tokens"] = len(row.input_ids)
    out["supervised"] = int(row.supervised.sum())
    out["made"] = "; ".join(_made(row, text, dataset))
    out["read as"] = dataset.describe()
    if row.notes:
        out["warning"] = "; ".join(row.notes)
    return out


def _made(row: Row, text: TokenText, dataset: Dataset) -> list[str]:
    fp = dataset.fingerprint if isinstance(dataset.fingerprint, dict) else {}
    policy = fp.get("policy") if isinstance(fp.get("policy"), dict) else {}
    tok = fp.get("tokenizer") if isinstance(fp.get("tokenizer"), dict) else {}
    out = []
    version = _version(row, dataset.lineage)
    if policy and not (version or "").startswith("from the base"):  # the base had its own
        out.append(f"ids {policy.get('ids', 'render')} (tokenize.ids), multi_turn "
                   f"{policy.get('multi_turn')}, thinking {policy.get('enable_thinking')}")
    if tok.get("name"):
        sha = fp.get("chat_template_sha256")
        out.append(f"tokenizer {tok['name']}" + (f", template {str(sha)[:12]}" if sha else ""))
    if row.id and "#" in row.id:
        conv, turn = row.id.rsplit("#", 1)
        out.append(f"earlier turn {turn} of conversation {conv}")
    out.append(_ending(row, text))
    limit = policy.get("max_seq_len")
    if isinstance(limit, int) and len(row.input_ids) == limit and \
            policy.get("on_too_long") == "truncate":
        out.append(f"cut to max_seq_len {limit}")
    if version:
        out.append(version)
    return out


def _ending(row: Row, text: TokenText) -> str:
    """Whether the last supervised span ends at an end-of-turn control token: a row whose
    answer was cut (max_tokens, max_seq_len) ends without one."""
    where = np.flatnonzero(row.supervised)
    if not len(where):
        return "no supervised token"
    last = int(row.input_ids[where[-1]])
    if last in text.control:
        return f"answer closed by {text.control[last]}"
    return "answer cut: its last supervised token is not an end-of-turn token"


def _version(row: Row, lineage: dict) -> Optional[str]:
    try:
        version = int(lineage["version"])
        kept = int(lineage["base"]["rows"]) - int(lineage["duplicates"]["dropped_base_rows"])
    except (KeyError, TypeError, ValueError, OverflowError):  # a hand-edited Infinity too
        return None
    if row.number < kept:
        return f"from the base (before version {version})"
    return f"new in version {version}"
