"""Rows as one self-contained HTML page: no script, no network (a Content-Security-Policy
forbids both), the same marking as the terminal, a legend, and each token's id and
position on hover.

Each row is a `<section data-row-id>`; each token a `<span data-token-id data-pos
data-supervised="1|0">` whose text is the token's piece of the decode (tokens.visible
escapes aside), so a test or a person can read the page back. Everything from the data
is HTML-escaped; bidi and zero-width marks are shown as ⟨U+XXXX⟩ and each token is its
own bidi isolate; a row longer than the cap shows its first tokens and says so.

    html_text = page(title, [marked, ...], note)
"""

from __future__ import annotations

import html
from typing import Optional

from stages.view.marked import Marked
from stages.view.tokens import visible

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5em;color:#1b1b1b;background:#fff}
h1{font-size:1.3em}section{border:1px solid #ccc;border-radius:6px;margin:1em 0;padding:.6em 1em}
dl{display:grid;grid-template-columns:max-content auto;gap:.1em 1em;margin:.3em 0 .8em}
dt{font-weight:600}dd{margin:0;overflow-wrap:anywhere}
.text{font:13px/1.5 ui-monospace,monospace;white-space:pre-wrap;overflow-wrap:anywhere}
.t{unicode-bidi:isolate;position:relative}.t0{color:#777}
.t[data-pos]:hover{outline:1px solid #333}
.t[data-pos]:hover::after{content:"pos " attr(data-pos) " \b7  id " attr(data-token-id);
position:absolute;left:0;top:1.6em;z-index:9;background:#222;color:#fff;font-size:11px;
padding:1px 4px;border-radius:3px;white-space:nowrap;pointer-events:none}
.t1{background:#d8f5d0;color:#0b3d02}.t1.thinking{background:#eadcf8;color:#3b1060}
.t1.tool_call{background:#d2eef7;color:#063b4c}
.ctl{outline:1px solid #b58900;background:#fff3c4;color:#6b5200;font-weight:600}
.t1.ctl{background:#ffe08a}.role{color:#2451a6}
.diff{box-shadow:inset 0 -3px 0 #d62828}.note{color:#a33;font-style:italic}
.legend span{margin-right:1em;padding:0 .3em}.side{display:grid;grid-template-columns:1fr 1fr;gap:1em}
"""
LEGEND = ('<p class="legend"><strong>Legend:</strong> <span class="t t1 answer">supervised answer</span>'
          '<span class="t t1 thinking">supervised thinking</span>'
          '<span class="t t1 tool_call">supervised tool call</span>'
          '<span class="t t0">not supervised</span><span class="t ctl">control token</span>'
          '<span class="t diff">differs from the other version</span> '
          'Hover a token for its position and id (CSS only: no script). Characters that hide or reorder text '
          'are written \u27e8U+XXXX\u27e9.</p>')


def esc(text: str) -> str:
    return html.escape(visible(str(text)), quote=True)


def row_section(m: Marked, label: Optional[str] = None) -> str:
    facts = dict(m.facts)
    rid = facts.get("id", "")
    out = [f'<section class="row" data-row-id="{esc(rid)}" data-row-number="{m.row.number}">']
    out.append(f"<h2>{esc(label or 'row')} {esc(rid)}</h2><dl>")
    out += [f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in facts.items() if k != "id"]
    out.append("</dl>")
    if m.shown < len(m.row.input_ids):
        out.append(f'<p class="note">Showing the first {m.shown} of {len(m.row.input_ids)} '
                   f"tokens; {len(m.row.input_ids) - m.shown} more are not shown "
                   "(--max-tokens).</p>")
    out.append('<div class="text">')
    for k, (i, piece) in enumerate(zip(m.ids.tolist(), m.pieces)):
        sup = int(bool(m.supervised[k]))
        kind = m.kinds[k]
        classes = f"t t{sup} {kind}" + (" ctl" if m.control[k] else "")
        differs = m.differs is not None and bool(m.differs[k])
        if differs:
            classes += " diff"
        extra = ' data-differs="1"' if differs else ""
        out.append(f'<span class="{classes}" data-token-id="{i}" data-pos="{k}" '
                   f'data-supervised="{sup}"{extra}>{esc(piece)}</span>')
    out.append("</div></section>")
    return "".join(out)


def page(title: str, rows: list[Marked], note: str = "",
         pairs: Optional[list[tuple[Marked, Marked, str, str]]] = None) -> str:
    """The whole page: `rows` one under another; `pairs` (old, new, old label, new label)
    side by side."""
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
           f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>",
           f"<h1>{esc(title)}</h1>", LEGEND]
    if note:
        out.append(f"<p>{esc(note)}</p>")
    for m in rows:
        out.append(row_section(m))
    for old, new, a, b in pairs or []:
        out.append('<div class="side">' + row_section(old, a) + row_section(new, b) + "</div>")
    out.append("</body></html>\n")
    return "\n".join(out)


def write_samples(folder, target, sample: int = 2, longest: int = 1, seed: int = 0,
                  max_tokens: int = 1024) -> int:
    """validate's page: `sample` seeded rows and the longest of every source of the set at
    `folder`, written atomically to `target`; the number of rows on it."""
    from stages.common import outputs
    from stages.view.marked import mark
    from stages.view.rows import Dataset
    from stages.view.tokens import text_for

    data = Dataset(folder)
    rows = data.per_source(sample, seed, longest)
    text = text_for(data.fingerprint)
    marked = [mark(r, text, data, max_tokens) for r in rows]
    note = (f"{sample} rows drawn with seed {seed} and the {longest} longest of every "
            f"source; at most {max_tokens} tokens a row. More: python -m stages.show --help")
    with outputs.atomic_file(target) as f:
        f.write(page(f"Sample rows of {folder}", marked, note))
    return len(marked)
