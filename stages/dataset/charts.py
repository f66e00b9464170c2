"""Histograms as self-contained SVG: no script, no font or stylesheet to fetch, so they
open in any browser, image viewer or Git host, offline. (`dvc plots show` writes HTML
that loads vega from a CDN: blank on an air-gapped host.)

validate writes one per plot (PICTURES) under plots(reports), and a page of sample rows
(samples(reports), stages/view/page.py); the dataset card links them.
One chart stacks panels that share the x axis: all rows first, then one per source.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

PICTURES = {  # name: (title, x label)
    "token_length": ("Token length per row", "tokens per row"),
    "supervised_fraction": ("Supervised fraction per row", "supervised tokens / tokens"),
}

SAMPLES = "samples.html"

WIDTH = 720
PANEL = 120  # plot height of one panel
LEFT, RIGHT, TOP, GAP = 64, 16, 40, 46
BAR = "#4c78a8"
ALL = "#e45756"


def histogram_svg(title: str, x_label: str, edges: list[float],
                  panels: list[tuple[str, list[int]]]) -> str:
    """An SVG of one bar chart per (name, counts) panel; `edges`: len(counts) + 1 bin edges."""
    height = TOP + len(panels) * (PANEL + GAP) + 10
    inner = WIDTH - LEFT - RIGHT
    bins = len(edges) - 1
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="15" '
        f'font-weight="bold">{escape(title)}</text>',
    ]
    step = max(1, bins // 8)
    for p, (name, counts) in enumerate(panels):
        top = TOP + p * (PANEL + GAP) + 14
        base = top + PANEL
        peak = max(counts) if counts else 0
        out.append(f'<text x="{LEFT}" y="{top - 4}" font-weight="bold">{escape(name)} '
                   f'({sum(counts):,} rows)</text>')
        out.append(f'<line x1="{LEFT}" y1="{base}" x2="{LEFT + inner}" y2="{base}" '
                   'stroke="#333"/>')
        out.append(f'<line x1="{LEFT}" y1="{top}" x2="{LEFT}" y2="{base}" stroke="#333"/>')
        for value, y in ((0, base), (peak, top)):
            out.append(f'<text x="{LEFT - 6}" y="{y + 4}" text-anchor="end">{value:,}</text>')
        color = ALL if p == 0 else BAR
        width = inner / bins
        for b, count in enumerate(counts):
            if count:
                h = max(1.0, PANEL * count / peak)
                out.append(f'<rect x="{LEFT + b * width + 0.5:.1f}" y="{base - h:.1f}" '
                           f'width="{max(width - 1, 0.5):.1f}" height="{h:.1f}" fill="{color}">'
                           f'<title>{_edge(edges[b])}-{_edge(edges[b + 1])}: {count:,}</title>'
                           '</rect>')
        for b in range(0, bins + 1, step):
            x = LEFT + b * width
            out.append(f'<line x1="{x:.1f}" y1="{base}" x2="{x:.1f}" y2="{base + 4}" '
                       'stroke="#333"/>')
            out.append(f'<text x="{x:.1f}" y="{base + 16}" text-anchor="middle">'
                       f'{_edge(edges[b])}</text>')
        out.append(f'<text x="{LEFT + inner / 2}" y="{base + 32}" text-anchor="middle" '
                   f'fill="#555">{escape(x_label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def plots(reports: Path) -> Path:
    """validate's plots, in the stage reports folder: CSV folders for DVC, the SVGs beside."""
    return Path(reports) / "plots"


def picture(reports: Path, name: str) -> Path:
    """Where validate writes the SVG of plot `name` (a key of PICTURES)."""
    return plots(reports) / f"{name}.svg"


def _edge(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:g}"


def samples(reports: Path) -> Path:
    """validate's page of sample rows, supervised tokens marked."""
    return Path(reports) / SAMPLES
