"""The terminal view: [[...]] marks hold exactly each supervised run's decode, growing
when the text holds them; colour only when asked; nothing the row holds reaches the
terminal as a control sequence."""

from __future__ import annotations

import re

import numpy as np

from stages.view import terminal
from stages.view.marked import mark
from stages.view.rows import Row
from tests.helpers.sets import SetFacts as Set


def marked(text, s: str, supervised_from: int):
    ids = text.tok.encode(s, add_special_tokens=False)
    mask = [k >= supervised_from for k in range(len(ids))]
    return mark(Row(0, "r", "s", np.asarray(ids), np.asarray(mask), "x"), text, Set(), 0), ids


def test_plain_marks_hold_the_decode(text):
    m, ids = marked(text, "question? answer with <|im_end|> in it", 2)
    out = terminal.render(m, colour=False)
    assert out.startswith("=== row r\n") and out.endswith("\n=== end of row\n\n")
    body = out.split("  marks: [[ ]]\n")[1].split("\n=== end of row")[0]
    assert re.findall(r"\[\[(.*?)\]\]", body, re.S) == [text.tok.decode(ids[2:])]


def test_marks_grow_when_the_text_holds_them(text):
    m, ids = marked(text, "a [[b]] c ]] d", 0)
    assert terminal.marks(m) == ("[[[", "]]]")
    assert "marks: [[[ ]]]" in terminal.render(m, colour=False)


def test_colour_and_hostile_text(text):
    m, _ = marked(text, "x\x1b[2Jy\u202ez", 1)
    out = terminal.render(m, colour=True)
    assert "[[" not in out and "\x1b[1m" in out
    assert "\x1b[2J" not in out and "\u202e" not in out
    assert "\u27e8U+001B\u27e9" in re.sub(r"\x1b\[[0-9;]*m", "", out)


def test_tokens_view_lists_every_token(text):
    m, ids = marked(text, "one two three", 1)
    lines = terminal.render(m, colour=False, tokens=True).splitlines()
    rows = [line for line in lines if re.match(r"\s+\d+\s+\d+ ", line)]
    assert [int(line.split()[1]) for line in rows] == ids
    assert [line.split()[2] == "*" for line in rows] == [k >= 1 for k in range(len(ids))]
