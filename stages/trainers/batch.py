"""One record batch of the merged set, checked, with the facts trainers decide rows by:
which tokens a trainer trains on in each row's first max_length, and per row how many."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa

from stages.common.errors import StageError
from stages.dataset import arrays


class Part:
    """One record batch of the merged set, checked, with what trainers decide rows by:
    its tokens as the trainer sees them, in each row's first max_length (all without a
    max_length). Each fact is worked out when a trainer's rule first asks for it."""

    def __init__(self, id: pa.Array, input_ids: pa.Array, loss_mask: pa.Array,
                 offsets: np.ndarray, ids: np.ndarray, mask: np.ndarray,
                 max_length: Optional[int]):
        self.id, self.input_ids, self.loss_mask = id, input_ids, loss_mask
        self.offsets = offsets  # row boundaries into ids/mask, from 0
        self.ids = ids  # int32 token ids of the batch's rows back to back (zero-copy)
        self.mask = mask  # int8, 0 and 1 only
        self.lengths = np.diff(offsets)
        self.max_length = max_length

    @functools.cached_property
    def trained(self) -> np.ndarray:
        """Per token: supervised, and in its row's first max_length."""
        trained = self.mask.view(np.bool_)
        if self.max_length is not None and (self.lengths > self.max_length).any():
            trained = trained.copy()
            for row in np.flatnonzero(self.lengths > self.max_length):
                trained[self.offsets[row] + self.max_length:self.offsets[row + 1]] = False
        return trained

    @functools.cached_property
    def trained_per_row(self) -> np.ndarray:
        """How many tokens of each row are trained."""
        rows, lengths = self._runs
        return np.bincount(rows, lengths, minlength=len(self.lengths)).astype(np.int64)

    @functools.cached_property
    def any_trained(self) -> np.ndarray:
        """Per row: at least one token trained."""
        if self.max_length is not None and (self.lengths > self.max_length).any():
            return self.trained_per_row > 0
        # no row cut: each row's largest mask value, in one vectorised pass
        starts = self.offsets[:-1]
        live = int(np.searchsorted(starts, len(self.mask)))  # rows after these are empty
        out = np.zeros(len(starts), bool)
        if live:
            out[:live] = np.maximum.reduceat(self.mask, starts[:live]) > 0
        return out & (self.lengths > 0)  # reduceat gives an empty row its next token

    @functools.cached_property
    def adjacent(self) -> np.ndarray:
        """Per row: two trained tokens next to each other."""
        rows, lengths = self._runs
        adjacent = np.zeros(len(self.lengths), bool)
        adjacent[rows[lengths >= 2]] = True
        return adjacent

    @functools.cached_property
    def _runs(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, length) of each run of trained tokens: supervised tokens in a row, cut at
        its max_length. Runs are few (a few per turn), so per-row facts cost a pass that
        finds where the mask changes, not one over every supervised token."""
        mask = self.mask.view(np.bool_)
        changes = np.flatnonzero(mask[1:] != mask[:-1]) + 1
        # both sorted: a stable sort merges them in one pass; a run never crosses a row
        cuts = np.sort(np.concatenate((changes, self.offsets)), kind="stable")
        starts, ends = cuts[:-1], cuts[1:]
        keep = starts < ends
        starts, ends = starts[keep], ends[keep]
        keep = mask[starts]
        starts, ends = starts[keep], ends[keep]
        rows = np.searchsorted(self.offsets, starts, side="right") - 1
        if self.max_length is not None:
            ends = np.minimum(ends, self.offsets[rows] + self.max_length)
        lengths = ends - starts
        keep = lengths > 0
        return rows[keep], lengths[keep]


def read_part(batch: pa.RecordBatch, path: Path, max_length: Optional[int]) -> Part:
    """The batch as a Part, or a StageError naming the shard and row it cannot export."""
    id_col, ids_col, mask_col = (batch.column(name) for name in ("id", "input_ids", "loss_mask"))
    if id_col.null_count:
        raise StageError(f"{path}: an id is null (run validate)")
    for name, col in (("input_ids", ids_col), ("loss_mask", mask_col)):
        if col.null_count:
            raise StageError(f"{path}: row {_row_id(id_col, _first(col.is_null()))}: "
                             f"{name} is null (run validate)")
    offsets, ids = _flat(ids_col, path, id_col, "input_ids")
    mask_offsets, mask = _flat(mask_col, path, id_col, "loss_mask")
    if not np.array_equal(offsets, mask_offsets):
        bad = _first(np.diff(offsets) != np.diff(mask_offsets))
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
    return Part(id_col, ids_col, mask_col, offsets, ids, mask, max_length)


def _first(flags) -> int:
    """The index of the first true flag (a numpy or an Arrow boolean vector)."""
    if isinstance(flags, pa.Array):
        flags = arrays.values(flags)
    return int(np.flatnonzero(flags)[0])


def _row_id(ids: pa.Array, row: int) -> str:
    return repr(ids[row].as_py())


def _flat(column: pa.Array, path: Path, id_col: pa.Array, name: str
          ) -> tuple[np.ndarray, np.ndarray]:
    """Row offsets (from 0) and the flattened values of a list column (zero-copy); a
    StageError naming the row that holds a null value (a token no trainer can read)."""
    offsets, values = arrays.flat(column)
    if values.null_count:
        at = _first(values.is_null())
        row = int(np.searchsorted(offsets, at, side="right")) - 1
        raise StageError(f"{path}: row {_row_id(id_col, row)}: {name} holds a null value "
                         "(run validate)")
    return offsets, arrays.values(values)
