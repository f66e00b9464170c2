"""validate's plots: a CSV per source and plot, an SVG per plot."""

from __future__ import annotations

import csv

import numpy as np

from stages.dataset import charts, histograms
from stages.dataset.rowsummary import FRACTION_BINS, FRACTIONS, LENGTH_BINS, LENGTHS


def stats(length_bin: int, fraction_bin: int) -> np.ndarray:
    out = np.zeros(3 + LENGTH_BINS + 1 + FRACTION_BINS, np.int64)
    out[LENGTHS][length_bin] = 2
    out[FRACTIONS][fraction_bin] = 2
    return out


def test_a_csv_per_source_and_plot_and_an_svg_per_plot(tmp_path):
    histograms.write_plots({"a/b": stats(0, 19), "a b": stats(3, 0)}, 8, tmp_path)
    lengths = charts.plots(tmp_path) / "token_length"
    assert sorted(p.name for p in lengths.iterdir()) == ["a_b-2.csv", "a_b.csv"]
    rows = list(csv.reader((lengths / "a_b.csv").open()))
    assert rows[0] == ["tokens", "rows"] and rows[1] == ["8", "0"] and rows[4] == ["32", "2"]
    assert len(rows) == 1 + LENGTH_BINS  # no row over max_seq_len: no overflow bin
    fractions = charts.plots(tmp_path) / "supervised_fraction"
    assert list(csv.reader((fractions / "a_b.csv").open()))[1] == ["0.05", "2"]
    assert list(csv.reader((fractions / "a_b-2.csv").open()))[-1] == ["1.0", "2"]
    for name in charts.PICTURES:
        assert charts.picture(tmp_path, name).read_text().count("<svg") == 1
