"""A row's header facts: how it was made, read from the fingerprint, the lineage and its
own tokens."""

from __future__ import annotations

import numpy as np

from stages.view.marked import mark
from stages.view.rows import Row
from tests.helpers.sets import SetFacts as Set


def row(text, ids, mask, rid="c1#2", number=9):
    return Row(number, rid, "src", np.asarray(ids), np.asarray(mask, bool), "s.arrow")


def test_the_header_says_how_the_row_was_made(text):
    end = text.ids["<|im_end|>"]
    ids = [text.ids["<|im_start|>"], 9707, 1000, end]
    fp = {"tokenizer": {"name": "bundled:qwen3.6"}, "chat_template_sha256": "ab" * 32,
          "policy": {"ids": "engine", "multi_turn": "all", "enable_thinking": True,
                     "max_seq_len": 4, "on_too_long": "truncate"}}
    lineage = {"version": 3, "base": {"rows": 10}, "duplicates": {"dropped_base_rows": 2}}
    m = mark(row(text, ids, [0, 1, 1, 1]), text, Set(fp, lineage), 0)
    made = m.facts["made"]
    assert "ids engine" in made and "multi_turn all" in made
    assert "earlier turn 2 of conversation c1" in made
    assert "answer closed by <|im_end|>" in made and "cut to max_seq_len 4" in made
    assert "new in version 3" in made  # row 9: after the 8 base rows kept
    assert m.facts["tokens"] == 4 and m.facts["supervised"] == 3
    base_row = mark(row(text, ids[:3], [0, 1, 1], number=1), text, Set(fp, lineage), 0)
    assert "answer cut" in base_row.facts["made"]
    assert "from the base (before version 3)" in base_row.facts["made"]
    assert "ids engine" not in base_row.facts["made"]  # the base had its own policy


def test_a_cap_shows_the_first_tokens(text):
    ids = np.arange(100, 200)
    m = mark(row(text, ids, np.ones(100)), text, Set(), 30)
    assert m.shown == 30 and len(m.pieces) == 30 and m.facts["tokens"] == 100


def test_a_lineage_with_numbers_that_are_no_counts_says_nothing_of_versions(text):
    ids = [text.ids["<|im_start|>"], 9707]
    for lineage in ({"version": float("inf"), "base": {"rows": 1},
                     "duplicates": {"dropped_base_rows": 0}},
                    {"version": 2, "base": {"rows": float("nan")},
                     "duplicates": {"dropped_base_rows": 0}}):
        made = mark(row(text, ids, [0, 1]), text, Set({}, lineage), 0).facts["made"]
        assert "version" not in made
