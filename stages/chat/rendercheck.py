"""Serve-render check: each training row's prompt against the tokens the engine served.

tokenize renders a row and compares its prompt (through the generation prompt) with the
engine's prompt ids, id for id, else with `usage.prompt_tokens`; and the supervised
tokens of its final answer with the engine's completion: their count within a slack of
max(COMPLETION_SLACK_TOKENS, COMPLETION_SLACK_FRACTION x count), and id for id where the
ids are known (`ids_differ`). Rows whose text spells a control token are compared as
the engine encoded them. Each mismatching prompt gets a likely cause (the other
`enable_thinking`, another chat template, another tokenizer), and the first examples
show the first differing token. What the report holds and when the stage fails:
docs/stages.md, tokenize, "Serve-render check".
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from stages.chat.encoder import ChatEncoder, RenderedRow
from stages.serving.engineids import Served

COMPLETION_SLACK_TOKENS = 4
COMPLETION_SLACK_FRACTION = 0.02
EXAMPLES = 5
NO_IDS = "the completion row carries no engine token ids"
CAUSES = {
    "enable_thinking": "enable_thinking differs between generate and tokenize "
                       "(set tokenize.enable_thinking to generate's)",
    "chat_template": "a different chat template than the engine's (tokenize.chat_template "
                     "or the tokenizer's own template does not render what was served)",
    "tokenizer": "another tokenizer than the engine's, or a template differing in a few "
                 "characters (same token count, other ids)",
}


COUNTS = ("checked", "checked_by_ids", "checked_by_count", "unchecked", "unusable_ids",
          "mismatches")
COMPLETION_COUNTS = ("checked", "differ", "beyond_slack", "abs_diff_sum", "ids_checked",
                     "ids_differ")


def new_stats() -> dict:
    return {**dict.fromkeys(COUNTS, 0), "by_count_why": {}, "causes": {}, "examples": [],
            "completion": {**dict.fromkeys(COMPLETION_COUNTS, 0), "max_abs_diff": 0},
            "answers": {"text_differs": 0, "control_as_text": 0, "examples": []}}


def answer_differs(stats: dict, kind: str, rid: str, where: str) -> None:
    """Count a row whose engine answer ids are not its recorded answer (servedrows)."""
    a = stats["answers"]
    a["text_differs" if kind == "text" else "control_as_text"] += 1
    if len(a["examples"]) < EXAMPLES:
        a["examples"].append({"row": rid, "where": where, "kind": kind})


def merge(into: dict, part: dict) -> None:
    """Add a chunk's stats to the totals (chunks arrive in input order)."""
    for key in COUNTS:
        into[key] += part[key]
    for name in ("causes", "by_count_why"):
        for key, n in part[name].items():
            into[name][key] = into[name].get(key, 0) + n
    into["examples"].extend(part["examples"][: EXAMPLES - len(into["examples"])])
    c, p = into["completion"], part["completion"]
    for key in COMPLETION_COUNTS:
        c[key] += p[key]
    c["max_abs_diff"] = max(c["max_abs_diff"], p["max_abs_diff"])
    a, b = into["answers"], part["answers"]
    for key in ("text_differs", "control_as_text"):
        a[key] += b[key]
    a["examples"].extend(b["examples"][: EXAMPLES - len(a["examples"])])


def summary(stats: dict) -> dict:
    """The report's form of the totals."""
    c = dict(stats["completion"])
    n = c.pop("abs_diff_sum")
    c["mean_abs_diff"] = round(n / c["checked"], 3) if c["checked"] else 0
    c["slack"] = (f"max({COMPLETION_SLACK_TOKENS}, "
                  f"{COMPLETION_SLACK_FRACTION:g} x the engine's count)")
    return {**stats, "completion": c}


def slack(n: int) -> int:
    return max(COMPLETION_SLACK_TOKENS, math.ceil(COMPLETION_SLACK_FRACTION * n))


class ServeCheck:
    """Checks the rows of one chunk; `stats` holds the outcome. `why_without`: why rows
    of this run may carry no engine ids (generate's generation.json), for the report."""

    def __init__(self, encoder: ChatEncoder, why_without: str = NO_IDS):
        self.encoder = encoder
        self.why_without = why_without
        self.stats = new_stats()

    def row(self, row: dict, served: Served, plan: RenderedRow, ids: np.ndarray,
            mask: np.ndarray, prompt_len: int, where: str, rid: str) -> None:
        st = self.stats
        if served.unusable:
            st["unusable_ids"] += 1
        if not served.n_prompt:
            st["unchecked"] += 1
            return
        st["checked"] += 1
        if served.by_ids:
            st["checked_by_ids"] += 1
        else:
            st["checked_by_count"] += 1
            why = f"unusable engine ids: {served.unusable}" if served.unusable \
                else self.why_without
            st["by_count_why"][why] = st["by_count_why"].get(why, 0) + 1
        ours = ids[:prompt_len]
        history = row["messages"][: plan.n_messages - 1]
        if plan.lookalikes:  # as the engine encoded it: spellings read as control tokens
            ours = self._ids(history, row.get("tools"), engine_style=True)
        if not served.prompt_agrees(ours):
            self._mismatch(row, served, history, ours, where, rid, plan.lookalikes)
        if served.n_completion:
            self._completion(ids[prompt_len:][mask[prompt_len:] == 1], served)

    def _ids(self, history, tools, encoder: Optional[ChatEncoder] = None,
             engine_style: bool = False) -> Optional[np.ndarray]:
        try:
            return (encoder or self.encoder).prompt_ids(history, tools, engine_style=engine_style)
        except Exception:  # a render the other setting refuses is simply not the cause
            return None

    def _completion(self, supervised: np.ndarray, served: Served) -> None:
        c = self.stats["completion"]
        engine = served.n_completion
        d = abs(len(supervised) - engine)
        c["checked"] += 1
        c["differ"] += d > 0
        c["beyond_slack"] += d > slack(engine)
        c["abs_diff_sum"] += d
        c["max_abs_diff"] = max(c["max_abs_diff"], d)
        if served.completion_ids is not None:
            c["ids_checked"] += 1
            c["ids_differ"] += not np.array_equal(supervised, served.completion_ids)

    def _mismatch(self, row, served: Served, history, ours, where, rid, engine_style) -> None:
        st = self.stats
        st["mismatches"] += 1
        other = _flipped(self.encoder)
        alt = None if other is None else self._ids(history, row.get("tools"), other,
                                                   engine_style)
        n_prompt = served.n_prompt
        if alt is not None and served.prompt_agrees(alt):
            cause = "enable_thinking"
        elif served.by_ids and ours is not None and len(ours) == n_prompt:
            cause = "tokenizer"
        else:
            cause = "chat_template"
        st["causes"][cause] = st["causes"].get(cause, 0) + 1
        if len(st["examples"]) >= EXAMPLES:
            return
        tok = self.encoder.tok
        n_ours = 0 if ours is None else len(ours)
        example: dict[str, Any] = {"row": rid, "where": where, "cause": cause,
                                   "prompt_tokens": n_ours, "engine_prompt_tokens": n_prompt}
        if ours is not None:
            example["ours_end"] = tok.decode(ours[-16:].tolist())
        engine = served.prompt_ids
        if engine is None and cause == "enable_thinking":
            engine = alt  # the engine's prompt is known: the other setting renders it
        if engine is not None and ours is not None:
            i = _first_difference(ours, engine)
            example["first_difference"] = i
            example["ours_at"] = tok.decode(ours[max(0, i - 8):i + 8].tolist())
            example["engine_at"] = tok.decode(engine[max(0, i - 8):i + 8].tolist())
        else:  # only a digest or a count of the engine's ids is kept
            example["first_difference"] = None
        st["examples"].append(example)


_FLIPPED: dict[int, Optional[ChatEncoder]] = {}


def _flipped(encoder: ChatEncoder) -> Optional[ChatEncoder]:
    """The same encoder with the other enable_thinking (built once per process)."""
    key = id(encoder)
    if key not in _FLIPPED:
        try:
            _FLIPPED[key] = ChatEncoder(encoder.tok, enable_thinking=not encoder.enable_thinking,
                                        name=encoder.name, chat_template=encoder.template)
        except Exception:  # a template that cannot render the other way: not the cause
            _FLIPPED[key] = None
    return _FLIPPED[key]


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def failure(stats: dict, allowed: int) -> Optional[str]:
    """The stage's one-line error when mismatches exceed `allowed`, else None."""
    n = stats["mismatches"]
    if n <= allowed:
        return None
    cause = max(stats["causes"], key=stats["causes"].get)
    first = stats["examples"][0] if stats["examples"] else {}
    return (
        f"serve-render check: {n} of {stats['checked']} checked rows render a prompt the "
        f"engine did not serve (tokenize.max_render_mismatch: {allowed}); likely cause: "
        f"{CAUSES[cause]}; first: row {first.get('row')!r} at {first.get('where')} "
        f"({first.get('prompt_tokens')} prompt tokens here, "
        f"{first.get('engine_prompt_tokens')} served); examples in reports/tokenize.json"
    )


def answer_failure(stats: dict, allowed: int) -> Optional[str]:
    """The stage's one-line error when more engine answers than `allowed` decode to other
    text than the recorded answer (tokenize.ids: engine), else None."""
    a = stats["answers"]
    if a["text_differs"] <= allowed:
        return None
    first = next(e for e in a["examples"] if e["kind"] == "text")
    return (f"engine ids: {a['text_differs']} rows' generated ids decode to other text than "
            f"the recorded answer (tokenize.max_answer_mismatch: {allowed}); first: row "
            f"{first['row']!r} at {first['where']} (a router mixing up replies?)")
