"""validate's plots written: for token_length and supervised_fraction, one CSV per
source under reports/plots/ (declared as DVC plots) and one SVG beside them that stacks
all rows and then each source (drawn by stages/dataset/charts.py)."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np

from stages.common import outputs
from stages.dataset import charts
from stages.dataset.rowsummary import FRACTION_BINS, FRACTIONS, LENGTH_BINS, LENGTHS


def write_plots(stats: dict[str, np.ndarray], width: int, reports: Path) -> None:
    """One CSV per source and plot, under reports/plots/ (declared as DVC plots), and
    one SVG per plot beside them, all rows then each source (stages/dataset/charts.py).

    token_length: rows per bin of `width` = max_seq_len / 64 tokens, x = the bin's upper
    edge (one more bin past max_seq_len when any row is longer); supervised_fraction: rows
    per 0.05 of supervised tokens / tokens, x = the bin's upper edge.
    """
    names = _file_names(sorted(stats))
    lengths = [(b + 1) * width for b in range(LENGTH_BINS + 1)]
    fractions = [round((b + 1) / FRACTION_BINS, 4) for b in range(FRACTION_BINS)]
    for folder, column, edges, part in (
        ("token_length", "tokens", lengths, LENGTHS),
        ("supervised_fraction", "supervised_fraction", fractions, FRACTIONS),
    ):
        _write_svg(reports, folder, [0] + edges,
                   {s: stats[s][part].tolist() for s in sorted(stats)})
        with outputs.atomic_dir(charts.plots(reports) / folder) as tmp:
            for source, file in names.items():
                counts = stats[source][part].tolist()
                if folder == "token_length" and counts[-1] == 0:
                    counts = counts[:-1]  # nobody over max_seq_len: no overflow bin
                with (tmp / file).open("w", newline="", encoding="utf-8") as f:
                    w = csv.writer(f, lineterminator="\n")
                    w.writerow([column, "rows"])
                    w.writerows(zip(edges, counts))


def _write_svg(reports: Path, name: str, edges: list, counts: dict[str, list[int]]) -> None:
    """reports/plots/NAME.svg: a panel for all rows, then one per source."""
    overall = [sum(column) for column in zip(*counts.values())]
    if name == "token_length":  # up to the longest rows, not max_seq_len: readable bars
        keep = max([8] + [b + 1 for b, n in enumerate(overall) if n])
        overall, edges = overall[:keep], edges[: keep + 1]
        counts = {s: c[:keep] for s, c in counts.items()}
    panels = [("all sources", overall)] + list(counts.items())
    title, x_label = charts.PICTURES[name]
    with outputs.atomic_file(charts.picture(reports, name)) as f:
        f.write(charts.histogram_svg(title, x_label, edges, panels))


def _file_names(sources: list[str]) -> dict[str, str]:
    out, taken = {}, set()
    for source in sources:
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", source).strip("._") or "source"
        name, k = f"{stem}.csv", 1
        while name in taken:
            k += 1
            name = f"{stem}-{k}.csv"
        taken.add(name)
        out[source] = name
    return out
