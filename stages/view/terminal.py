"""A row as text for a terminal: supervised tokens marked, control tokens shown as what
they are, thinking / answer / tool call told apart.

In colour (a TTY without NO_COLOR): supervised text is bold and coloured by kind,
unsupervised text dim, control tokens in reverse video. Plain (NO_COLOR, or piped):
every supervised span is written between `[[` and `]]` (more brackets when the row's
text itself holds `[[` or `]]`; the header's `marks` says which), and the text between
them is exactly the span's decode, but for ⟨U+XXXX⟩ escapes (tokens.visible).
`tokens=True` lists one token a line: position, id, supervised, kind, text. A row is
`=== row ID`, its header lines (indented), the body, and a line `=== end of row`.
"""

from __future__ import annotations

from stages.view.marked import Marked
from stages.view.tokens import visible

RESET, BOLD, DIM, REVERSE = "\x1b[0m", "\x1b[1m", "\x1b[2m", "\x1b[7m"
COLOURS = {"thinking": "\x1b[35m", "answer": "\x1b[32m", "tool_call": "\x1b[36m",
           "control": "\x1b[33m", "role": "\x1b[34m"}
DIFF = "\x1b[41m"
LEGEND_PLAIN = ("plain marking: [[...]] = supervised span (exactly its decode; characters "
                "that act on a terminal written \u27e8U+XXXX\u27e9)")
LEGEND_COLOUR = ("colour: bold = supervised (green answer, magenta thinking, cyan tool "
                 "call), dim = not supervised, reverse = control token, red = differs")


def marks(m: Marked) -> tuple[str, str]:
    """The brackets for a row: `[[`/`]]`, with one more while the text holds either."""
    text = "".join(m.pieces)
    k = 2
    while "[" * k in text or "]" * k in text:
        k += 1
    return "[" * k, "]" * k


def header(m: Marked, colour: bool, tokens: bool = False) -> list[str]:
    facts = dict(m.facts)
    lines = []
    first = f"=== row {visible(str(facts.pop('id')))}"
    lines.append(f"{BOLD}{first}{RESET}" if colour else first)
    for key, value in facts.items():
        lines.append(f"  {key}: {visible(str(value))}")
    if not colour and not tokens:
        opened, closed = marks(m)
        lines.append(f"  marks: {opened} {closed}")
    if m.shown < len(m.row.input_ids):
        lines.append(f"  shown: the first {m.shown} of {len(m.row.input_ids)} tokens "
                     f"({len(m.row.input_ids) - m.shown} not shown: --max-tokens)")
    return lines


def body(m: Marked, colour: bool) -> str:
    """The row's text with its supervised spans marked."""
    if not colour:
        opened, closed = marks(m)
        out = []
        for a, b, sup in m.spans():
            text = visible("".join(m.pieces[a:b]))
            out.append(f"{opened}{text}{closed}" if sup else text)
        return "".join(out)
    out = []
    for k, piece in enumerate(m.pieces):
        style = ""
        if m.differs is not None and m.differs[k]:
            style += DIFF
        if m.control[k]:
            style += REVERSE + COLOURS["control"]
        elif m.supervised[k]:
            style += BOLD + COLOURS.get(m.kinds[k], "")
        else:
            style += DIM + COLOURS.get(m.kinds[k], "") if m.kinds[k] == "role" else DIM
        if m.supervised[k] and m.control[k]:
            style += BOLD
        # colour restarts on every line: a pager or a copy of one line keeps it
        text = visible(piece).replace("\n", f"{RESET}\n{style}")
        out.append(f"{style}{text}{RESET}")
    return "".join(out)


def token_lines(m: Marked) -> list[str]:
    """One token a line: position, id, * when supervised, kind, its text (repr-like)."""
    lines = [f"{'pos':>7} {'id':>8} s {'kind':<9} text"]
    for k, (i, piece) in enumerate(zip(m.ids.tolist(), m.pieces)):
        flag = "*" if m.supervised[k] else " "
        kind = m.kinds[k] + ("!" if m.differs is not None and m.differs[k] else "")
        lines.append(f"{k:>7} {i:>8} {flag} {kind:<9} {visible(repr(piece))}")
    return lines


END = "=== end of row"


def render(m: Marked, colour: bool, tokens: bool = False) -> str:
    """Header lines, the body, then END on a line of its own."""
    parts = header(m, colour, tokens)
    parts += token_lines(m) if tokens else [body(m, colour)]
    return "\n".join(parts) + f"\n{END}\n\n"
