"""The page: self-contained (no script, nothing fetched), every token a span with its id,
position and supervision, the row's text escaped and bounded."""

from __future__ import annotations

import html.parser
import os
import re

import numpy as np

from stages.view import page
from stages.view.marked import mark
from stages.view.rows import Row
from tests.helpers.sets import SetFacts as Set


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


def test_validates_samples_page_has_seeded_rows_and_the_longest_of_every_source(tmp_path):
    import pyarrow as pa

    from stages.dataset.shards import ShardFile, list_shards, open_shard
    from tests.helpers.repo import ROOT
    from tests.helpers.sets import write_set

    rng = np.random.default_rng(4)
    rows = {f"{src}{k}": (rng.integers(0, 1000, int(rng.integers(3, 2000))).tolist(), None)
            for src in ("a", "b") for k in range(6)}
    rows = {k: (v, [1] * len(v)) for k, (v, _) in rows.items()}
    write_set(tmp_path / "set", rows)
    # write_set gives every row source "s": rewrite with the id's letter as its source
    path = list_shards(tmp_path / "set")[0]
    with open_shard(path) as reader:
        batch = next(iter(reader))
    sources = pa.array([i[0] for i in batch.column("id").to_pylist()])
    path.unlink()
    with ShardFile(path) as shard:
        shard.write(batch.set_column(1, "source", sources))
    target = tmp_path / "reports" / "samples.html"
    cwd = os.getcwd()
    os.chdir(ROOT)  # the bundled tokenizer is cached under ./.cache
    try:
        n = page.write_samples(tmp_path / "set", target)
    finally:
        os.chdir(cwd)
    text = target.read_text(encoding="utf-8")
    shown = re.findall(r'data-row-id="([^"]+)"', text)
    assert n == len(shown) == len(set(shown))
    for src in "ab":  # 2 drawn + the longest (which may be one of them), per source
        longest = max((k for k in rows if k[0] == src), key=lambda k: len(rows[k][0]))
        assert longest in shown and sum(k[0] == src for k in shown) in (2, 3)
    assert max(len(re.findall(r"data-token-id=", part))
               for part in text.split("<section")[1:]) <= 1024
