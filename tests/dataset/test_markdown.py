"""Text the card did not write renders as that text and nothing more (stages/dataset/markdown.py),
checked with a CommonMark + GFM-tables renderer that passes raw HTML through."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st
from markdown_it import MarkdownIt

from stages.dataset import markdown

RENDER = MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"])
HOSTILE = ["x\n---\ny", "# title", "<script>alert(1)</script>", "<img src=x onerror=alert(1)>",
           "`code` ``x``", "[link](javascript:alert(1))", "![i](http://e/x.png)", "a | b",
           "*em* _em_ __b__", "~~gone~~", "&lt;&#60;", "\\", "\x1b[31mred\x1b[0m", "\u202egnp.exe",
           "line\r\nbreak\u2028sep\x85nel", "<!-- c -->", "<http://a.b>", "lone \ud800", ""]
texts = st.sampled_from(HOSTILE) | st.text(max_size=30) | st.lists(
    st.sampled_from(HOSTILE), max_size=4).map("".join)


def inline_tokens(md: str) -> list:
    """The inline tokens of `md` rendered as one paragraph (or one table cell)."""
    tokens = RENDER.parse(md)
    return [c for t in tokens if t.type == "inline" for c in t.children]


def shown(md: str) -> str:
    """What a reader sees of `md`: its text and code, markup gone."""
    return "".join(t.content for t in inline_tokens(md) if t.type in ("text", "code_inline"))


def written(value) -> str:
    """What the helpers promise to show for `value`."""
    line = " ".join(str(value).split())
    line = re.sub("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]",
                  lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256
                  else f"\\u{ord(m.group()):04x}", line)
    return line.encode("utf-8", "backslashreplace").decode("utf-8")


@settings(max_examples=150, deadline=None)
@given(texts)
def test_text_renders_as_itself_in_prose_and_in_a_table_cell(value):
    md = markdown.text(value)
    assert "\n" not in md and "\r" not in md
    para = "Model: " + md + " end"
    kinds = {t.type for t in inline_tokens(para)}
    assert kinds <= {"text", "softbreak"}, (value, kinds)
    assert shown(para) == f"Model: {written(value)} end"
    table = f"| a | b |\n|---|---|\n| {md} | z |\n"
    tokens = RENDER.parse(table)
    assert [t.type for t in tokens].count("td_open") == 2, (value, table)
    assert not any(t.type.startswith("html") for t in tokens)
    assert shown(table) == "ab" + written(value) + "z", (value, table)


@settings(max_examples=150, deadline=None)
@given(texts)
def test_code_renders_as_one_code_span_of_the_text(value):
    md = markdown.code(value)
    spans = [t for t in inline_tokens("x " + md + " y") if t.type == "code_inline"]
    assert len(spans) == 1 and spans[0].content == (written(value) or " "), (value, md)
    cell = markdown.code(value, cell=True)
    tokens = RENDER.parse(f"| a | b |\n|---|---|\n| {cell} | z |\n")
    assert [t.type for t in tokens].count("td_open") == 2, (value, cell)
    spans = [c for t in tokens if t.type == "inline" for c in t.children if c.type == "code_inline"]
    assert [s.content for s in spans] == [written(value) or " "], (value, cell)
