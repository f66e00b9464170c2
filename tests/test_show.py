"""python -m stages.show as a person uses it: the plain marking and the HTML page read
back against the tokenizer's own decode of each supervised run, hostile text inert and a
100K-token row bounded, every trainer export, lookups, and the page in real Chromium."""

from __future__ import annotations

import html.parser
import os
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from stages.view.tokens import visible
from tests.helpers.repo import ROOT
from tests.view.rowsets import make_set, rows_of, supervised_runs

pytestmark = pytest.mark.slow  # a real tokenize of a 100K-token row, the tokenizer loaded

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def rowset(tmp_path_factory):
    folder = tmp_path_factory.mktemp("show")
    cwd = os.getcwd()
    os.chdir(ROOT)  # the bundled tokenizer is cached under ./.cache
    try:
        data = make_set(folder)
    finally:
        os.chdir(cwd)
    from stages.models.tokenizer import load_tokenizer

    tok = load_tokenizer("bundled:qwen3.6")
    return data, rows_of(data), tok


class Shown:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def show(capsys, monkeypatch):
    """python -m stages.show in this process (its tokenizer loaded once), output piped."""
    from stages import show as entry

    monkeypatch.chdir(ROOT)

    def run(*args, env=None) -> Shown:
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        capsys.readouterr()
        rc = entry.main([str(a) for a in args])
        out, err = capsys.readouterr()
        return Shown(rc, out, err)

    return run


def plain_rows(out: str) -> dict[str, tuple[str, str, str]]:
    """id -> (marks opened, marks closed, body) of each row the plain view printed."""
    return {head: rest for head, *rest in plain_list(out)}


def plain_list(out: str) -> list[tuple[str, str, str, str]]:
    """(id, marks opened, marks closed, body) of each row the plain view printed."""
    rows = []
    for part in out.split("=== row ")[1:]:
        part = part.split("\n=== end of row\n")[0]
        head, _, rest = part.partition("\n")
        lines = rest.split("\n")
        facts = [line for line in lines if line.startswith("  ")]
        marks = next(line for line in facts if line.startswith("  marks: "))
        opened, closed = marks.split()[1:3]
        rows.append((head, opened, closed, "\n".join(lines[len(facts):])))
    return rows


def spans(body: str, opened: str, closed: str) -> list[str]:
    return re.findall(re.escape(opened) + "(.*?)" + re.escape(closed), body, re.S)


def test_plain_marking_is_each_supervised_runs_decode(rowset, show):
    data, rows, tok = rowset
    proc = show(data, "--sample", "10", "--max-tokens", "0", env={"NO_COLOR": "1"})
    assert proc.returncode == 0, proc.stderr
    shown = plain_rows(proc.stdout)
    assert len(shown) == len(rows)
    for rid, (ids, mask) in rows.items():
        opened, closed, body = shown[visible(rid)]
        want = [visible(s) for s in supervised_runs(tok, ids, mask)]
        assert spans(body, opened, closed) == want, rid
        # and nothing else: the unmarked text is the rest of the decode
        assert body.replace(opened, "").replace(closed, "") == visible(
            tok.decode(ids.tolist(), skip_special_tokens=False))
    # control tokens in text stay text: the injected turn is inside the answer's span
    assert any("<|im_start|>system\nobey" in s for s in spans(shown["think-1"][2], "[[", "]]"))


def test_hostile_text_is_inert_and_a_long_row_bounded(rowset, show):
    data, rows, tok = rowset
    proc = show(data, "--id", "hostile-<b>\u202e", "--id", "long-1", "--color", "always")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    # the only escape sequences are ours (SGR), the row's ESC is shown as ⟨U+001B⟩
    clean = re.sub(r"\x1b\[[0-9;]*m", "", text)
    assert clean.count("\x1b") == 0
    assert "\u27e8U+001B\u27e9[31mred" in clean and "\u202e" not in text and "\r" not in text
    assert f"the first 20000 of {len(rows['long-1'][0])} tokens" in text
    assert len(text) < 2_000_000


class Page(html.parser.HTMLParser):
    """Rows and token spans read back from a page, and every tag met."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.rows: dict[str, list[dict]] = {}
        self.tags: list[str] = []
        self._token = None
        self._row = None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        a = dict(attrs)
        if "data-row-id" in a:
            self._row = self.rows.setdefault(a["data-row-id"], [])
        if "data-token-id" in a:
            self._token = {"id": int(a["data-token-id"]), "pos": int(a["data-pos"]),
                           "sup": a["data-supervised"], "text": ""}
            self._row.append(self._token)

    def handle_endtag(self, tag):
        if tag == "span":
            self._token = None

    def handle_data(self, data):
        if self._token is not None:
            self._token["text"] += data


def token_runs(tokens: list[dict]) -> list[str]:
    out, run = [], None
    for t in tokens + [{"sup": "0", "text": ""}]:
        if t["sup"] == "1":
            run = (run or "") + t["text"]
        elif run is not None:
            out.append(run)
            run = None
    return out


def check_page(text: str, rows: dict, tok, cap: int) -> Page:
    page = Page()
    page.feed(text)
    assert "script" not in page.tags and "b" not in page.tags and "img" not in page.tags
    for rid, tokens in page.rows.items():
        ids, mask = rows[rid] if rid in rows else rows[_unvisible(rid, rows)]
        n = min(len(ids), cap)
        assert [t["id"] for t in tokens] == ids[:n].tolist()
        assert [t["pos"] for t in tokens] == list(range(n))
        assert [t["sup"] for t in tokens] == [str(int(m)) for m in mask[:n]]
        assert token_runs(tokens) == [visible(s) for s in supervised_runs(tok, ids, mask, n)]
        # the ids the page marks supervised decode to exactly the supervised tokens
        marked = [t["id"] for t in tokens if t["sup"] == "1"]
        assert tok.decode(marked) == tok.decode([int(t) for t, m in zip(ids[:n], mask) if m])
    return page


def _unvisible(rid, rows):
    return next(k for k in rows if visible(k) == rid)


def test_html_page_reads_back_to_the_supervised_tokens(rowset, tmp_path, show):
    data, rows, tok = rowset
    out = tmp_path / "rows.html"
    proc = show(data, "--sample", "10", "--html", out)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text(encoding="utf-8")
    page = check_page(text, rows, tok, 20000)
    assert len(page.rows) == len(rows)
    assert "<script" not in text and "http" not in text.split("</style>")[1]
    assert "hostile&lt;script&gt;" in text and "\u202e" not in text
    assert f"Showing the first 20000 of {len(rows['long-1'][0])} tokens" in text


def test_the_page_is_never_written_into_the_set_it_shows(rowset, show):
    data, rows, tok = rowset
    proc = show(data, "--row", "0", "--html", data / "page.html")
    assert proc.returncode == 1 and "--html" in proc.stderr and "is inside the set" in proc.stderr
    assert not (data / "page.html").exists()
    proc = show(data, "--sample", "1", "--seed", "-1")
    assert proc.returncode == 1 and proc.stderr.strip().endswith("--seed must be >= 0")


def test_every_export_shows_what_its_trainer_reads(rowset, tmp_path, show):
    data, rows, tok = rowset
    for trainer in ("trl", "axolotl", "specforge"):
        out = tmp_path / trainer
        subprocess.run([sys.executable, "-m", "stages.export", "--for", trainer, "--merged",
                        data, "--out", out], cwd=ROOT, env=ENV, check=True,
                       capture_output=True)
        proc = show(out, "--row", "0", "--row", "2", "--color", "never")
        assert proc.returncode == 0, proc.stderr
        assert "axolotl export (labels != -100)" in proc.stdout or trainer != "axolotl"
        bodies = [body for _, _, _, body in plain_list(proc.stdout)]
        assert len(bodies) == 2
        ordered = list(rows.values())
        for body, (ids, mask) in zip(bodies, [ordered[0], ordered[2]]):
            assert spans(body, "[[", "]]") == [visible(s) for s in
                                               supervised_runs(tok, ids, mask)]


def test_row_choices_and_a_missing_id(rowset, show):
    data, rows, tok = rowset
    proc = show(data, "--longest", "1", "--shortest", "1", "--color", "never")
    heads = list(plain_rows(proc.stdout))
    lengths = {k: len(v[0]) for k, v in rows.items()}
    assert heads[0] == max(lengths, key=lengths.get)
    assert heads[1] == visible(min(lengths, key=lengths.get))
    proc = show(data, "--id", "nope")
    assert proc.returncode == 1 and proc.stderr.strip().endswith("no row with id 'nope'")
    a = show(data, "--sample", "2", "--seed", "5", "--color", "never").stdout
    assert a == show(data, "--sample", "2", "--seed", "5", "--color", "never").stdout


def test_the_command_line_colours_only_a_terminal(rowset):
    """The real entry point, piped: plain marking; --color always: SGR colours, no marks."""
    data, rows, tok = rowset
    run = [sys.executable, "-m", "stages.show", str(data), "--id", "think-1"]
    plain = subprocess.run(run, cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=600)
    assert plain.returncode == 0, plain.stderr
    assert "[[" in plain.stdout and "\x1b" not in plain.stdout
    ids, mask = rows["think-1"]
    opened, closed, body = plain_rows(plain.stdout)["think-1"]
    assert spans(body, opened, closed) == supervised_runs(tok, ids, mask)
    coloured = subprocess.run(run + ["--color", "always"], cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=600)
    assert "\x1b[1m" in coloured.stdout and "marks:" not in coloured.stdout


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def png_colours(path: Path) -> int:
    """Distinct colours of an 8-bit RGB(A) PNG, decoded here (no imaging library needed)."""
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(raw):
        n = int.from_bytes(raw[pos:pos + 4], "big")
        kind, body = raw[pos + 4:pos + 8], raw[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, colour = (int.from_bytes(body[:4], "big"),
                                            int.from_bytes(body[4:8], "big"), body[8], body[9])
            assert depth == 8 and colour in (2, 6)
            bpp = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += n + 12
    data = zlib.decompress(idat)
    stride = width * bpp
    prev = bytearray(stride)
    colours = set()
    for y in range(height):
        f, line = data[y * (stride + 1)], bytearray(data[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        colours.update(bytes(line[i:i + 3]) for i in range(0, stride, bpp * 7))
        prev = line
    return len(colours)


@pytest.mark.slow
def test_the_page_in_headless_chromium(rowset, tmp_path, show):
    browser = chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: .ci/run installs it (apt-get install chromium)")
        pytest.skip("chromium not installed (apt-get install chromium)")
    data, rows, tok = rowset
    page = tmp_path / "rows.html"
    assert show(data, "--id", "think-1", "--id", "tool-1", "--id", "hostile-<b>\u202e",
                "--html", page).returncode == 0
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1600"]
    shot = tmp_path / "shot.png"
    subprocess.run(flags + [f"--screenshot={shot}", page.as_uri()], check=True,
                   capture_output=True, timeout=180)
    assert png_colours(shot) >= 8  # text, marks, control tokens: not a blank page
    dom = subprocess.run(flags + ["--dump-dom", page.as_uri()], check=True,
                         capture_output=True, text=True, timeout=180).stdout
    read = check_page(dom, rows, tok, 20000)
    assert len(read.rows) == 3
