"""baserows: the per-row rules of adopting, against plain Python row by row (the
conversion of whole bases, as other tools write them: test_adopt.py)."""

from __future__ import annotations

import numpy as np
import pytest

from stages.dataset import baserows


def test_row_sums_count_empty_rows_as_zero():
    loss = np.array([1, 0, 1, 1, 1], np.int8)
    offsets = np.array([0, 0, 2, 2, 5, 5], np.int32)
    assert baserows.row_sums(loss, offsets).tolist() == [0, 1, 0, 3, 0]


def test_per_row_rules_match_a_row_by_row_count_with_empty_rows_anywhere():
    """row_sums and trainable_rows (reduceat over the non-empty rows) against plain Python on
    random masks whose rows are empty, 1 token or long, first, inside and last."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        lengths = rng.choice([0, 0, 1, 2, 3, 50], size=int(rng.integers(1, 12)))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        loss = (rng.random(int(offsets[-1])) < rng.random()).astype(np.int8)
        rows = [loss[a:b].tolist() for a, b in zip(offsets, offsets[1:])]
        assert baserows.row_sums(loss, offsets).tolist() == [sum(r) for r in rows]
        pairs = [any(x and y for x, y in zip(r, r[1:])) for r in rows]
        assert baserows.trainable_rows(loss, offsets.astype(np.int64)).tolist() == pairs


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "uint64"])
def test_inside_holds_values_to_zero_and_the_limit(dtype):
    info = np.iinfo(dtype)
    for limit in (2, 100, 1000, 2**31 - 1):
        for value in (0, 1, limit - 1, limit, -1, info.min, info.max):
            if info.min <= value <= info.max:
                values = np.array([0, value, 0], dtype)
                assert baserows.inside(values, limit) is (0 <= value < limit), (value, limit)
