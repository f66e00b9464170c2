"""Each row of a tokenized shard reduced to a summary with columnar operations on the
flattened Arrow lists, no Python loop per row or token: lengths, token ids outside the
vocabulary, mask values outside {0, 1}, supervised tokens, the longest supervised run
and the stored counters; and per source, rows, tokens and histograms.

  shard = summarize_shard(path, vocab, bin_width(max_seq_len))   # a ShardSummary
  shard.summaries: record batches of SUMMARY_TYPES, checked by validate against
  stages/dataset/schema.py's row rules; shard.stats: per source, see source_stats
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stages.common.errors import StageError
from stages.dataset import arrays
from stages.dataset.schema import schema_differences
from stages.dataset.shards import open_shard

LENGTH_BINS = 64
FRACTION_BINS = 20

# what summarising a readable shard of the wrong types raises
_SUMMARY_ERRORS = (StageError, pa.ArrowException, KeyError, ValueError, TypeError)


class ShardSummary(NamedTuple):
    """One shard, summarised."""

    diffs: list[str]  # how its schema differs from the contract's
    summaries: list[pa.RecordBatch]  # one summary row per row, numbered from 0 in the shard
    rows: int
    stats: dict[str, np.ndarray]  # per source: see source_stats()


def summarize_shard(path: Path, vocab: int, width: int) -> ShardSummary:
    """Summarise one shard (thread-safe: validate runs several at once). A shard whose
    columns cannot be summarised (a list of floats, say) is only counted: its schema
    differences say what is wrong with it. StageError if it cannot be read."""
    summaries, rows, failure = [], 0, None
    with open_shard(path) as reader:
        diffs = schema_differences(reader.schema)
        for batch in reader:
            if failure is None:
                try:
                    summaries.append(summarize(batch, vocab, rows))
                except _SUMMARY_ERRORS as e:
                    failure = e
            rows += batch.num_rows
    summary = None
    if summaries and failure is None:
        # one batch per shard: few large batches are cheap to convert and count, many
        # small not; the casts to one schema for all shards are done here, once, too
        summary = pa.concat_batches(summaries)
        try:
            summary = pa.RecordBatch.from_arrays(
                [pc.cast(c, SUMMARY_TYPES[name])
                 for c, name in zip(summary.columns, summary.schema.names)],
                names=summary.schema.names,
            )
        except _SUMMARY_ERRORS as e:
            failure = e
    if failure is not None:
        if not diffs:
            raise StageError(f"{path}: cannot summarise its rows ({failure})")
        return ShardSummary(diffs + [f"its rows were not checked ({failure})"], [], rows, {})
    if summary is None:
        return ShardSummary(diffs, [], rows, {})
    return ShardSummary(diffs, [summary], rows, source_stats(summary, width))


def bin_width(max_seq_len: int) -> int:
    """Tokens per bin of the token-length histogram."""
    return max(1, -(-max_seq_len // LENGTH_BINS))


# Where each figure is in a source's stats vector
ROWS, TOKENS, SUPERVISED = 0, 1, 2
LENGTHS = slice(3, 3 + LENGTH_BINS + 1)  # rows per token-length bin, one more past the last
FRACTIONS = slice(3 + LENGTH_BINS + 1, None)  # rows per supervised-fraction bin


def source_stats(summary: pa.RecordBatch, width: int) -> dict[str, np.ndarray]:
    """Per source, one int64 vector of figures: ROWS, TOKENS and SUPERVISED tokens, the
    token-length histogram (LENGTHS: bins of `width`), the supervised-fraction one
    (FRACTIONS)."""
    lengths = arrays.values(pc.fill_null(summary.column("input_ids_len"), 0))
    supervised = arrays.values(pc.fill_null(summary.column("supervised"), 0))
    encoded = pc.dictionary_encode(pc.fill_null(summary.column("source"), "(null)"))
    codes = arrays.values(encoded.indices)
    names = encoded.dictionary.to_pylist()
    k, lb, fb = len(names), LENGTH_BINS + 1, FRACTION_BINS
    length_bin = np.minimum(lengths // width, LENGTH_BINS)
    fraction_bin = np.minimum(supervised * fb // np.maximum(lengths, 1), fb - 1)
    out = np.empty((k, 3 + lb + fb), np.int64)
    out[:, ROWS] = np.bincount(codes, minlength=k)
    out[:, TOKENS] = np.bincount(codes, weights=lengths, minlength=k)
    out[:, SUPERVISED] = np.bincount(codes, weights=supervised, minlength=k)
    out[:, LENGTHS] = np.bincount(codes * lb + length_bin, minlength=k * lb).reshape(k, lb)
    out[:, FRACTIONS] = np.bincount(codes * fb + fraction_bin, minlength=k * fb).reshape(k, fb)
    return {name: out[i] for i, name in enumerate(names)}


def add_stats(into: dict[str, np.ndarray], stats: dict[str, np.ndarray]) -> None:
    """Add per-source `stats` (as source_stats gives them) into `into`."""
    for name, vector in stats.items():
        if name in into:
            into[name] = into[name] + vector
        else:
            into[name] = vector.copy()


SUMMARY_TYPES = {
    name: pa.large_string() if name in ("id", "source") else pa.int64()
    for name in ["row", "id", "source", "input_ids_len", "loss_mask_len", "ids_out_of_range",
                 "mask_not_binary", "supervised", "longest_run", "num_tokens",
                 "num_loss_tokens"]
}


def summarize(batch: pa.RecordBatch, vocab: int, first_row: int) -> pa.RecordBatch:
    """One summary row per row of `batch`, from the flattened lists (no per-row loop).

    id, source and the stored counters keep the shard's own types (summarize_shard casts
    them to SUMMARY_TYPES): a compute call costs about as much as the numpy work on a
    1000-row batch, so per-batch calls are kept few.
    """
    n = batch.num_rows
    ids_col = batch.column("input_ids")
    mask_col = batch.column("loss_mask")
    id_off, id_vals = _flat(ids_col)
    mask_off, mask_vals = _flat(mask_col)

    out_of_range = _count_from(id_vals, id_off, vocab)  # negatives too: compared unsigned
    not_binary, ones = _binary(mask_vals, mask_off)
    supervised, longest = _runs(ones, mask_off, n)

    id_nulls, mask_nulls = _null_mask(ids_col), _null_mask(mask_col)

    def ints(values: np.ndarray, nulls: Optional[np.ndarray]) -> pa.Array:
        return pa.array(values, pa.int64(), mask=nulls)

    def kept(name: str) -> pa.Array:
        # a copy: a read batch's columns are slices of one body, every token included,
        # which a column kept until the shard is summarised would keep alive (peak RSS
        # a shard per thread, and fresh pages to fault in for each)
        return pa.concat_arrays([batch.column(name)])

    return pa.RecordBatch.from_arrays(
        [
            pa.array(np.arange(first_row, first_row + n, dtype=np.int64)),
            kept("id"),
            kept("source"),
            ints(np.diff(id_off), id_nulls),
            ints(np.diff(mask_off), mask_nulls),
            ints(out_of_range, id_nulls),
            ints(not_binary, mask_nulls),
            ints(supervised, mask_nulls),
            ints(longest, mask_nulls),
            kept("num_tokens"),
            kept("num_loss_tokens"),
        ],
        names=list(SUMMARY_TYPES),
    )


def _flat(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Row offsets (from 0) and the flattened values of a list column; null items -> -1."""
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        raise StageError(f"column is {column.type}, not a list")
    if not pa.types.is_integer(column.type.value_type):
        raise StageError(f"column holds {column.type.value_type}, not integers")
    offsets, values = arrays.flat(column)
    if values.null_count:
        values = pc.fill_null(values, -1)
    return offsets, arrays.values(values)


def _null_mask(column: pa.Array) -> Optional[np.ndarray]:
    if not column.null_count:
        return None
    return arrays.values(pc.is_null(column))


def _count_from(values: np.ndarray, offsets: np.ndarray, limit: int) -> np.ndarray:
    """Per-row count of values outside [0, limit).

    Viewed as unsigned, a negative value is huge, so one max() pass clears clean data;
    only a batch holding a bad value pays for the per-row counts.
    """
    n = len(offsets) - 1
    unsigned = values.view(np.dtype(f"u{values.itemsize}"))
    if len(values) == 0 or unsigned.max() < limit:
        return np.zeros(n, np.int64)
    cumulative = np.concatenate(([0], np.cumsum(unsigned >= limit, dtype=np.int64)))
    return cumulative[offsets[1:]] - cumulative[offsets[:-1]]


def _binary(values: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row count of mask values outside {0, 1}, and the mask as 0/1 bytes.

    The contract's int8 mask is read as 64-bit words: one OR over them shows that no
    byte holds more than its low bit, so clean data costs one pass over an eighth of the
    elements and is used as is. Anything else pays for the per-row counts.
    """
    if values.itemsize == 1:
        data = values.view(np.uint8)
        words, tail = _words(data)
        high = np.bitwise_or.reduce(words) if len(words) else np.uint64(0)
        if not high & ~_LOW_BITS and not (tail > 1).any():
            return np.zeros(len(offsets) - 1, np.int64), data
    return _count_from(values, offsets, 2), (values == 1).view(np.uint8)


_LOW_BITS = np.uint64(0x0101010101010101)  # a word of eight 1 bytes


def _words(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A uint8 array as whole uint64 words (native order: byte k stays byte k), and the
    bytes left over."""
    whole = len(data) // 8 * 8
    return data[:whole].view(np.uint64), data[whole:]


def _changes(ones: np.ndarray) -> np.ndarray:
    """Sorted positions p (0 < p < len) where the 0/1 bytes differ from the byte before.

    Eight bytes are compared in one step, as a 64-bit word against the word one byte
    further on; the XOR of the few words that differ then has a 1 byte exactly where a
    change is. (A compare byte by byte, then np.flatnonzero over its result, or any
    per-position fancy indexing, costs several times more.)
    """
    size = len(ones)
    whole = max(size - 1, 0) // 8
    here = ones[: whole * 8].view(np.uint64)
    ahead = ones[1 : whole * 8 + 1].view(np.uint64)
    hits = np.flatnonzero(here != ahead)
    flips = np.flatnonzero((here[hits] ^ ahead[hits]).view(np.uint8))
    inside = hits[flips >> 3] * 8 + (flips & 7) + 1
    tail = whole * 8 + np.flatnonzero(ones[whole * 8 + 1 :] != ones[whole * 8 : -1]) + 1
    return np.concatenate((inside, tail))


def _runs(ones: np.ndarray, offsets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row: number of supervised tokens and the longest run of consecutive ones.

    Runs come from the positions where the 0/1 mask changes (see _changes); their
    number is small next to the token count.
    """
    size = len(ones)
    change = _changes(ones)
    rising = ones[change] == 1
    starts, ends = change[rising], change[~rising]
    if size and ones[0] == 1:
        starts = np.concatenate(([0], starts))
    if size and ones[-1] == 1:
        ends = np.concatenate((ends, [size]))
    # a run that continues across a row boundary is two runs: split it there
    inner = offsets[1:-1]
    inner = inner[(inner > 0) & (inner < size)]
    split = inner[(ones[inner - 1] == 1) & (ones[inner] == 1)]
    if len(split):
        starts = np.sort(np.concatenate((starts, split)))
        ends = np.sort(np.concatenate((ends, split)))
    lengths = ends - starts
    row = np.searchsorted(offsets, starts, side="right") - 1
    supervised = np.bincount(row, weights=lengths, minlength=n).astype(np.int64)[:n]
    longest = np.zeros(n, np.int64)
    np.maximum.at(longest, row, lengths)
    return supervised, longest
