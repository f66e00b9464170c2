"""One record batch of the merged set, checked, with the facts trainers decide rows by:
which tokens a trainer trains on in each row's first max_length, and per row how many."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import pyarrow as pa

from stages.common.errors import StageError


class Part(NamedTuple):
    """One record batch of the merged set, checked, with what trainers decide rows by:
    its tokens as the trainer sees them, in each row's first max_length (all without a
    max_length)."""

    id: pa.Array
    input_ids: pa.Array
    loss_mask: pa.Array
    offsets: np.ndarray  # row boundaries into ids/mask, from 0
    ids: np.ndarray  # int32 token ids of the batch's rows back to back (zero-copy)
    mask: np.ndarray  # int8
    lengths: np.ndarray
    trained: np.ndarray  # per token: supervised, and in its row's first max_length
    trained_per_row: np.ndarray
    adjacent: np.ndarray  # per row: two trained tokens next to each other


def read_part(batch: pa.RecordBatch, path: Path, max_length: Optional[int]) -> Part:
    """The batch as a Part, or a StageError naming the shard and row it cannot export."""
    id_col, ids_col, mask_col = (batch.column(name) for name in ("id", "input_ids", "loss_mask"))
    if id_col.null_count:
        raise StageError(f"{path}: an id is null (run validate)")
    for name, col in (("input_ids", ids_col), ("loss_mask", mask_col)):
        if col.null_count:
            raise StageError(f"{path}: row {_row_id(id_col, _first(col.is_null()))}: "
                             f"{name} is null (run validate)")
    offsets, ids = _flat(ids_col)
    mask_offsets, mask = _flat(mask_col)
    lengths = np.diff(offsets)
    if not np.array_equal(offsets, mask_offsets):
        bad = _first(lengths != np.diff(mask_offsets))
        raise StageError(f"{path}: row {_row_id(id_col, bad)}: "
                         "input_ids and loss_mask lengths differ (run validate)")
    # one pass per check; which row is bad is looked up only when one is
    as_bytes = mask.view(np.uint8)  # -1 reads as 255
    for what, wrong, bad in (
            ("a loss_mask value other than 0 and 1", lambda: as_bytes.max() > 1,
             lambda: as_bytes > 1),
            ("a negative token id", lambda: ids.min() < 0, lambda: ids < 0)):
        if len(ids) and wrong():
            row = int(np.searchsorted(offsets, _first(bad()), side="right")) - 1
            raise StageError(f"{path}: row {_row_id(id_col, row)} holds {what} (run validate)")
    trained = mask.view(np.bool_)  # 0 and 1 only, checked above
    if max_length is not None and (lengths > max_length).any():
        trained = trained.copy()
        for row in np.flatnonzero(lengths > max_length):
            trained[offsets[row] + max_length:offsets[row + 1]] = False
    pairs = np.zeros(len(ids), bool)  # pairs[i]: tokens i and i + 1 trained, in one row
    if len(ids) > 1:
        np.logical_and(trained[:-1], trained[1:], out=pairs[:-1])
        pairs[offsets[1:-1] - 1] = False  # across a row boundary (pairs[-1] stays False)
    return Part(
        id_col, ids_col, mask_col, offsets, ids, mask, lengths, trained,
        _per_row(trained, offsets), _per_row(pairs, offsets) > 0,
    )


def _per_row(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """How many flags are set in each row."""
    at = np.flatnonzero(flags)  # sorted: each row's flags lie between two of its offsets
    return np.searchsorted(at, offsets[1:]) - np.searchsorted(at, offsets[:-1])


def _first(flags) -> int:
    """The index of the first true flag."""
    return int(np.flatnonzero(np.asarray(flags))[0])


def _row_id(ids: pa.Array, row: int) -> str:
    return repr(ids[row].as_py())


def _flat(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Row offsets (from 0) and the flattened values of a list column (zero-copy)."""
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values.slice(offsets[0], offsets[-1] - offsets[0]).to_numpy()
    return offsets - offsets[0], values
