"""Dataset-wide id uniqueness in memory that does not grow with the dataset.

validate reduces every id to a 64-bit hash and its dataset-wide row number (16 bytes a
row). Up to `spill_rows` of those pairs stay in memory; past that they are written to a
temporary file, ordered by the hash's top 8 bits (its bucket), with each bucket's offset
kept. At the end, runs of consecutive buckets holding about `group_rows` pairs in all are
read back from every file and checked, one group at a time, by a numpy sort: equal ids
have equal hashes, hence the same bucket, so no repeat spans two groups. Rows whose hash
repeats are only suspects: the caller confirms them on the id strings, since two
different ids may share a hash.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

BUCKETS = 256
SHIFT = np.uint64(64 - 8)  # the top 8 bits pick one of the 256 buckets
SPILL_ROWS = 1 << 16  # 1 MB of pairs in memory at most
GROUP_ROWS = 1 << 16  # pairs sorted at once: bounds the sort's memory, amortises its cost


class IdHashes:
    """Collects (id hash, row) pairs; says which rows' hashes occur more than once."""

    def __init__(self, spill_rows: Optional[int] = None, group_rows: Optional[int] = None):
        self.spill_rows = spill_rows or SPILL_ROWS
        self.group_rows = group_rows or GROUP_ROWS
        self._hashes: list[np.ndarray] = []
        self._rows: list[np.ndarray] = []
        self._held = 0
        self._folder: Optional[tempfile.TemporaryDirectory] = None
        self._spills: list[tuple[Path, np.ndarray]] = []  # file, offset of each bucket

    def __enter__(self) -> "IdHashes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
            self._spills = []

    @property
    def spilled(self) -> bool:
        return self._folder is not None

    def add(self, hashes: np.ndarray, rows: np.ndarray) -> None:
        self._hashes.append(hashes.astype(np.uint64, copy=False))
        self._rows.append(rows.astype(np.int64, copy=False))
        self._held += len(hashes)
        if self._held > self.spill_rows:
            self._spill()

    def repeated_rows(self) -> np.ndarray:
        """Sorted row numbers whose id hash occurs more than once in the dataset."""
        suspects = [_repeated(hashes, rows) for hashes, rows in self._groups()]
        suspects = [s for s in suspects if len(s)]
        return np.sort(np.concatenate(suspects)) if suspects else np.zeros(0, np.int64)

    def _take(self) -> tuple[np.ndarray, np.ndarray]:
        hashes = np.concatenate(self._hashes) if self._hashes else np.zeros(0, np.uint64)
        rows = np.concatenate(self._rows) if self._rows else np.zeros(0, np.int64)
        self._hashes, self._rows, self._held = [], [], 0
        return hashes, rows

    def _spill(self) -> None:
        if self._folder is None:
            self._folder = tempfile.TemporaryDirectory(prefix="validate-ids-")
        hashes, rows = self._take()
        bucket = (hashes >> SHIFT).astype(np.uint8)
        order = np.argsort(bucket, kind="stable")  # a radix sort on one-byte keys
        counts = np.bincount(bucket, minlength=BUCKETS)
        path = Path(self._folder.name) / f"{len(self._spills):06d}.pairs"
        with path.open("wb") as f:  # all hashes, then all rows (np.take: no fancy indexing)
            np.take(hashes, order).tofile(f)
            np.take(rows, order).tofile(f)
        self._spills.append((path, np.concatenate(([0], np.cumsum(counts)))))

    def _groups(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(hashes, rows) in groups that never split one hash value between two groups."""
        if not self.spilled:
            yield self._take()  # at most spill_rows pairs
            return
        if self._held:
            self._spill()
        sizes = sum(np.diff(starts) for _, starts in self._spills)
        first = 0
        while first < BUCKETS:
            last = first + 1
            held = sizes[first]
            while last < BUCKETS and held + sizes[last] <= self.group_rows:
                held += sizes[last]
                last += 1
            hashes, rows = [], []
            for path, starts in self._spills:
                lo, total = int(starts[first]), int(starts[-1])
                count = int(starts[last]) - lo
                hashes.append(np.fromfile(path, np.uint64, count, offset=8 * lo))
                rows.append(np.fromfile(path, np.int64, count, offset=8 * (total + lo)))
            yield np.concatenate(hashes), np.concatenate(rows)
            first = last


def _repeated(hashes: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The rows whose hash occurs more than once in `hashes`.

    A plain numpy sort (no hash table, no frame) says whether any hash repeats; only a
    group that has repeats pays for the argsort that finds their rows.
    """
    if len(hashes) < 2:
        return rows[:0]
    ordered = np.sort(hashes)
    if not (ordered[1:] == ordered[:-1]).any():
        return rows[:0]
    order = np.argsort(hashes)
    ordered = hashes[order]
    same = ordered[1:] == ordered[:-1]
    repeated = np.zeros(len(hashes), bool)
    repeated[1:] |= same
    repeated[:-1] |= same
    return rows[order[repeated]]
