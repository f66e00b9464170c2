"""validate's plots: a CSV per source and plot, an SVG per plot."""

from __future__ import annotations

import csv
import re

import numpy as np

from stages.dataset import charts, histograms
from stages.dataset.rowsummary import FRACTION_BINS, FRACTIONS, LENGTH_BINS, LENGTHS, ROWS


def stats(length_bin: int, fraction_bin: int) -> np.ndarray:
    out = np.zeros(3 + LENGTH_BINS + 1 + FRACTION_BINS, np.int64)
    out[LENGTHS][length_bin] = 2
    out[FRACTIONS][fraction_bin] = 2
    return out


def csv_of(folder, source: str) -> list[list[str]]:
    """The rows of the one CSV in `folder` that names `source`."""
    found = [rows for p in folder.iterdir()
             if (rows := list(csv.reader(p.open(encoding="utf-8"))))[1][2] == source]
    assert len(found) == 1
    return found[0]


def test_a_csv_per_source_and_plot_and_an_svg_per_plot(tmp_path):
    histograms.write_plots({"a/b": stats(0, 19), "a b": stats(3, 0), "alpha": stats(1, 1)},
                           8, tmp_path)
    lengths = charts.plots(tmp_path) / "token_length"
    names = sorted(p.name for p in lengths.iterdir())
    assert len(names) == 3 and "alpha.csv" in names  # a safe short name is kept as it is
    assert all(re.fullmatch(r"a_b-[0-9a-f]{12}\.csv", n) for n in names if n != "alpha.csv")
    rows = csv_of(lengths, "a b")
    assert rows[0] == ["tokens", "rows", "source"]
    assert rows[1] == ["8", "0", "a b"] and rows[4] == ["32", "2", "a b"]
    assert len(rows) == 1 + LENGTH_BINS  # no row over max_seq_len: no overflow bin
    fractions = charts.plots(tmp_path) / "supervised_fraction"
    assert csv_of(fractions, "a b")[1] == ["0.05", "2", "a b"]
    assert csv_of(fractions, "a/b")[-1] == ["1.0", "2", "a/b"]
    for name in charts.PICTURES:
        assert charts.picture(tmp_path, name).read_text().count("<svg") == 1


def test_a_long_source_name_makes_a_short_file_name_and_keeps_its_name_inside(tmp_path):
    long, longer = "x" * 300, "x" * 300 + "y"
    histograms.write_plots({long: stats(0, 0), longer: stats(1, 1)}, 8, tmp_path)
    lengths = charts.plots(tmp_path) / "token_length"
    names = [p.name for p in lengths.iterdir()]
    assert len(set(names)) == 2 and all(len(n) < 64 for n in names)
    cut = "x" * (histograms.NAME_CHARS - 1) + "\u2026"
    assert sorted(next(csv.reader(p.open(encoding="utf-8")))[0] for p in lengths.iterdir()
                  ) == ["tokens"] * 2
    assert [list(csv.reader(p.open(encoding="utf-8")))[1][2] for p in lengths.iterdir()
            ] == [cut, cut]  # both named, cut alike, yet two files
    svg = charts.picture(tmp_path, "token_length").read_text()
    assert svg.count(cut) == 2 and "x" * histograms.NAME_CHARS not in svg


def test_past_the_plotted_sources_the_smallest_are_summed_as_other(tmp_path):
    many = {f"src{i}": stats(0, 0) * (1 + (i == 7)) for i in range(500)}
    for s in many.values():
        s[ROWS] = s[LENGTHS].sum()
    histograms.write_plots(many, 8, tmp_path)
    lengths = charts.plots(tmp_path) / "token_length"
    files = list(lengths.iterdir())
    assert len(files) == histograms.PLOTTED_SOURCES + 1
    assert "src7.csv" in {p.name for p in files}  # the largest source is drawn
    other = csv_of(lengths, histograms.OTHER)
    drawn = histograms.PLOTTED_SOURCES - 1  # src7 and the first 19 others by name
    assert other[1][1] == str(2 * (500 - 1 - drawn))
    svg = charts.picture(tmp_path, "token_length").read_text()
    assert svg.count("<text") < 40 * (histograms.PLOTTED_SOURCES + 2)
