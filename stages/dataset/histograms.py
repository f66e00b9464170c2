"""validate's plots written: for token_length and supervised_fraction, one CSV per
source under reports/plots/ (declared as DVC plots) and one SVG beside them that stacks
all rows and then each source (drawn by stages/dataset/charts.py); past PLOTTED_SOURCES
sources, the smallest are summed into one "other sources" plot."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np
import xxhash

from stages.common import outputs
from stages.dataset import charts
from stages.dataset.rowsummary import FRACTION_BINS, FRACTIONS, LENGTH_BINS, LENGTHS, ROWS

# sources drawn one by one, those with the most rows: a set of thousands of sources would
# otherwise write thousands of CSVs and tens of MB of SVG into the git-tracked reports
PLOTTED_SOURCES = 20
OTHER = "other sources"
# characters of a source name in a file name and inside a file: a name can be as long as
# the data makes it, a file name at most 255 bytes, and the hash in the file name tells
# two names apart that share their first characters
STEM_CHARS, NAME_CHARS = 40, 256


def write_plots(stats: dict[str, np.ndarray], width: int, reports: Path) -> None:
    """One CSV per source and plot, under reports/plots/ (declared as DVC plots), and
    one SVG per plot beside them, all rows then each source (stages/dataset/charts.py).

    token_length: rows per bin of `width` = max_seq_len / 64 tokens, x = the bin's upper
    edge (one more bin past max_seq_len when any row is longer); supervised_fraction: rows
    per 0.05 of supervised tokens / tokens, x = the bin's upper edge.
    """
    stats = _plotted(stats)
    names = _file_names(sorted(stats))
    lengths = [(b + 1) * width for b in range(LENGTH_BINS + 1)]
    fractions = [round((b + 1) / FRACTION_BINS, 4) for b in range(FRACTION_BINS)]
    for folder, column, edges, part in (
        ("token_length", "tokens", lengths, LENGTHS),
        ("supervised_fraction", "supervised_fraction", fractions, FRACTIONS),
    ):
        _write_svg(reports, folder, [0] + edges,
                   [(label(s), stats[s][part].tolist()) for s in sorted(stats)])
        with outputs.atomic_dir(charts.plots(reports) / folder) as tmp:
            for source, file in names.items():
                counts = stats[source][part].tolist()
                if folder == "token_length" and counts[-1] == 0:
                    counts = counts[:-1]  # nobody over max_seq_len: no overflow bin
                with (tmp / file).open("w", newline="", encoding="utf-8") as f:
                    w = csv.writer(f, lineterminator="\n")
                    w.writerow([column, "rows", "source"])
                    w.writerows((edge, n, label(source)) for edge, n in zip(edges, counts))


def _write_svg(reports: Path, name: str, edges: list, counts: list[tuple[str, list[int]]]
               ) -> None:
    """reports/plots/NAME.svg: a panel for all rows, then one per (source, counts)."""
    overall = [sum(column) for column in zip(*(c for _, c in counts))]
    if name == "token_length":  # up to the longest rows, not max_seq_len: readable bars
        keep = max([8] + [b + 1 for b, n in enumerate(overall) if n])
        overall, edges = overall[:keep], edges[: keep + 1]
        counts = [(s, c[:keep]) for s, c in counts]
    panels = [("all sources", overall)] + counts
    title, x_label = charts.PICTURES[name]
    with outputs.atomic_file(charts.picture(reports, name)) as f:
        f.write(charts.histogram_svg(title, x_label, edges, panels))


def _plotted(stats: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The PLOTTED_SOURCES sources with the most rows as they are, the rest summed as
    OTHER (a source of that name included, so no two plots carry one name)."""
    ranked = sorted(stats, key=lambda s: (-int(stats[s][ROWS]), s))
    if len(ranked) <= PLOTTED_SOURCES and OTHER not in stats:
        return stats
    kept = [s for s in ranked if s != OTHER][:PLOTTED_SOURCES]
    rest = [stats[s] for s in stats if s not in kept]
    return {**{s: stats[s] for s in kept}, **({OTHER: np.sum(rest, axis=0)} if rest else {})}


def label(source: str) -> str:
    """A source's name as a plot shows it: whole up to NAME_CHARS characters."""
    return source if len(source) <= NAME_CHARS else source[:NAME_CHARS - 1] + "…"


def _file_names(sources: list[str]) -> dict[str, str]:
    """A CSV file name per source: a short name made of safe characters as it is; any
    other, its first letters made safe and a hash of the whole name, so that names cut
    or changed to the same letters stay apart and a rerun writes the same files."""
    out, taken = {}, set()
    for source in sources:
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", source[:STEM_CHARS]).strip("._") or "source"
        if stem != source:
            digest = xxhash.xxh3_64_hexdigest(source.encode("utf-8", "surrogatepass"))
            stem = f"{stem}-{digest[:12]}"
        name, k = f"{stem}.csv", 1
        while name in taken:  # a safe name that happens to look like a hashed one
            k += 1
            name = f"{stem}-{k}.csv"
        taken.add(name)
        out[source] = name
    return out
