"""Text the pipeline did not write, made inert in a markdown page (the lineage card).

A served model id, a source name, a path or a base's history entry can hold anything: a
line break followed by `---` or `#` (a new heading or a thematic break), backticks, `|`
(a new table cell), `<script>` or `<img onerror=...>` (raw HTML, which a card's renderer
may pass through), link and emphasis syntax, or terminal control sequences (a card is
also read with `cat`). Each helper gives one line that renders as exactly the text given:
`text` for prose and table cells, `code` for a code span.
"""

from __future__ import annotations

import re
from typing import Any

# what CommonMark/GFM can read as markup inside a line: backslash escapes, code spans,
# emphasis, links and images, raw HTML and entities, table cells, strikethrough; `_`
# between two letters or digits (snake_case) cannot delimit emphasis and stays as it is
_ACTIVE = re.compile(r"([\\`*\[\]<>&|~]|(?<![^\W_])_|_(?![^\W_]))")
# C0 and C1 controls (whitespace among them is folded first) and the bidirectional
# overrides that make a terminal or a browser show text in another order
_HIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def text(value: Any) -> str:
    """`value` as one line of markdown that renders as its text, nothing more."""
    return _ACTIVE.sub(r"\\\1", _one_line(value))


def code(value: Any, cell: bool = False) -> str:
    """`value` as a code span (`cell`: inside a table row, where `|` must be escaped)."""
    line = _one_line(value)
    longest = max((len(run) for run in re.findall(r"`+", line)), default=0)
    fence = "`" * (longest + 1)
    if not line:
        line = " "  # an empty span is no span
    elif line.startswith("`") or line.endswith("`"):
        line = f" {line} "  # the renderer strips one space from each end
    if cell:
        line = line.replace("|", "\\|")
    return f"{fence}{line}{fence}"


def _one_line(value: Any) -> str:
    """`value` as text on one line: whitespace runs (line breaks included) become one
    space, controls their \\x escape, text UTF-8 cannot hold its backslash escape."""
    line = " ".join(str(value).split())
    line = _HIDDEN.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256
                       else f"\\u{ord(m.group()):04x}", line)
    return line.encode("utf-8", "backslashreplace").decode("utf-8")
