"""batch: a record batch checked, with what trainers train on in each row's first max_length."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from stages.common.errors import StageError
from stages.dataset.schema import ARROW_SCHEMA
from stages.trainers.batch import read_part
from tests.helpers.trainerparts import part, record_batch

ROWS = [("a", [5, 6, 7, 8], [0, 1, 1, 0]), ("b", [9, 9], [1, 0]), ("c", [1, 2, 3], [0, 0, 0]),
        ("d", [4, 5, 6, 7, 8], [1, 0, 1, 0, 1])]


def test_trained_tokens_per_row_and_adjacent_pairs():
    p = part(ROWS)
    assert p.lengths.tolist() == [4, 2, 3, 5]
    assert p.trained.tolist() == [bool(v) for _, _, m in ROWS for v in m]
    assert p.trained_per_row.tolist() == [2, 1, 0, 3]
    assert p.any_trained.tolist() == [True, True, False, True]
    assert p.adjacent.tolist() == [True, False, False, False]


def test_max_length_cuts_what_is_trained_not_what_is_read():
    p = part(ROWS, max_length=2)
    assert p.ids.tolist() == [t for _, ids, _ in ROWS for t in ids]  # every token kept
    assert p.trained_per_row.tolist() == [1, 1, 0, 1]
    assert p.adjacent.tolist() == [False, False, False, False]


def test_a_pair_across_two_rows_is_not_adjacent():
    p = part([("x", [1, 2], [0, 1]), ("y", [3, 4], [1, 0])])
    assert p.adjacent.tolist() == [False, False]


def test_a_slice_of_a_batch_reads_from_its_own_offset():
    p = read_part(record_batch(ROWS).slice(1, 2), Path("s"), None)
    assert p.offsets.tolist() == [0, 2, 5] and p.ids.tolist() == [9, 9, 1, 2, 3]


@pytest.mark.parametrize("rows, message", [
    ([("a", [1, 2], [0, 2])], "row 'a' holds a loss_mask value other than 0 and 1"),
    ([("a", [1], [1]), ("b", [1, -3], [0, 1])], "row 'b' holds a negative token id"),
    ([("a", [1], [1]), ("b", [1, 2], [1])], "row 'b': input_ids and loss_mask lengths differ"),
])
def test_a_row_it_cannot_export_is_named(rows, message):
    with pytest.raises(StageError, match=message):
        part(rows)


def test_a_null_list_is_named():
    batch = record_batch([("a", [1], [1]), ("b", [2], [1])])
    masks = pa.array([[1], None], ARROW_SCHEMA.field("loss_mask").type)
    batch = batch.set_column(3, "loss_mask", masks)
    with pytest.raises(StageError, match="row 'b': loss_mask is null"):
        read_part(batch, Path("s"), None)


@pytest.mark.parametrize("column", [2, 3])
def test_a_null_value_inside_a_list_is_named(column):
    batch = record_batch([("a", [1, 2], [0, 1]), ("b", [3, 4, 5, 6], [0, 1, 1, 1])])
    name = ARROW_SCHEMA.names[column]
    values = [[1, 2], [3, 4, None, 6]] if name == "input_ids" else [[0, 1], [0, 1, None, 1]]
    batch = batch.set_column(column, name, pa.array(values, ARROW_SCHEMA.field(name).type))
    with pytest.raises(StageError, match=rf"^s: row 'b': {name} holds a null value"):
        read_part(batch, Path("s"), None)
    with pytest.raises(StageError, match=rf"^s: row 'b': {name} holds a null value"):
        read_part(batch.slice(1), Path("s"), None)


def test_ids_and_mask_are_the_shard_bytes_not_copies():
    batch = record_batch(ROWS)
    p = read_part(batch, Path("s"), None)
    assert np.shares_memory(p.ids, np.frombuffer(batch.column("input_ids").values.buffers()[1],
                                                 np.int32))


@pytest.mark.parametrize("seed", range(5))
def test_per_row_facts_equal_a_row_by_row_count(seed):
    """Random masks (empty rows, runs across row boundaries, every max_length): the
    per-row facts equal counting each row's first max_length token by token."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(60):
        n = int(rng.integers(0, 12))
        mask = (rng.random(n) < rng.random()).astype(int).tolist()
        rows.append((f"r{k}", [1] * n, mask))
    rows = [("first", [], [])] + rows + [("last", [1], [1]), ("e1", [], []), ("e2", [], [])]
    for max_length in (None, 1, 2, 3, 7):
        p = part(rows, max_length)
        cut = [m[:max_length] for _, _, m in rows]
        assert p.trained_per_row.tolist() == [sum(m) for m in cut]
        assert p.any_trained.tolist() == [any(m) for m in cut]
        assert p.adjacent.tolist() == [any(a and b for a, b in zip(m, m[1:])) for m in cut]
        assert p.trained.tolist() == [bool(v) for m, (_, _, full) in zip(cut, rows)
                                      for v in m + [0] * (len(full) - len(m))]
