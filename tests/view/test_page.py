"""The page: self-contained (no script, nothing fetched), every token a span with its id,
position and supervision, the row's text escaped and bounded."""

from __future__ import annotations

import html.parser

import numpy as np

from stages.view import page
from stages.view.marked import mark
from stages.view.rows import Row
from tests.view.test_marked import Set


class Tags(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.tokens = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        a = dict(attrs)
        if "data-token-id" in a:
            self.tokens.append((int(a["data-token-id"]), int(a["data-pos"]),
                                a["data-supervised"]))


def test_a_hostile_row_is_inert_and_read_back(text):
    s = '<script>alert(1)</script><img src="http://x/y"> \u202eabc\u200b'
    ids = text.tok.encode(s, add_special_tokens=False)
    mask = np.arange(len(ids)) % 2 == 0
    m = mark(Row(0, 'id"><script>', "src<b>", np.asarray(ids), mask, "x"), text, Set(), 0)
    out = page.page("t<script>", [m])
    tags = Tags()
    tags.feed(out)
    assert "script" not in tags.tags and "img" not in tags.tags and "b" not in tags.tags
    assert tags.tokens == [(i, k, str(int(s))) for k, (i, s) in enumerate(zip(ids, mask))]
    assert "default-src 'none'" in out and "\u202e" not in out and "\u200b" not in out
    assert 'data-row-id="id&quot;&gt;&lt;script&gt;"' in out


def test_a_long_row_is_capped_with_a_note(text):
    ids = np.full(5000, 1000)
    m = mark(Row(0, "long", "s", ids, np.ones(5000, bool), "x"), text, Set(), 100)
    out = page.page("t", [m])
    assert out.count("data-token-id=") == 100
    assert "Showing the first 100 of 5000 tokens" in out
