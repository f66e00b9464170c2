"""Adopt a training set written by another tool: its rows, converted once into the contract.

With `merge.adopt: true`, a `merge.base` this project did not write (a `datasets`
save_to_disk folder, .arrow files in either IPC format, or .parquet files) is written
into data/merged in the contract (dataset/schema.py), one shard per base file, in the
user's row order, a few record batches at a time: ids as int32, the mask (or `labels` with
-100) as int8 0/1, a content id (xxh3-128 of ids and mask, `-k` for the k-th repeat),
`source` from `merge.base_source`, the counts computed; other columns dropped and named.
A row that cannot be converted faithfully stops merge with one line naming the file and
row; the base is only read. Without `merge.adopt` such a base is refused with what
adopting it would write. The rules in full: docs/stages.md, "Bring your existing set".
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa

from stages.common import params
from stages.common.errors import StageError
from stages.dataset import arrays, baserows
from stages.common.reading import arrow_input, check_parquet_rows, open_regular, parquet
from stages.dataset import fingerprint
from stages.dataset.idhashes import IdHashes
from stages.process import cpus
from stages.dataset.schema import ARROW_SCHEMA
from stages.dataset.shards import (
    INFO_FILE,
    STATE_FILE,
    ShardFile,
    list_shards,
    natural_key,
    open_shard,
    shard_name,
)

log = logging.getLogger(__name__)

MASK_NAMES = ("loss_mask", "labels", "assistant_masks", "completion_mask")
BATCH_ROWS = 1000  # rows converted and written at once (datasets' writer batch size)
# threads converting batches, one per usable CPU up to this: each holds a batch or two
# (BATCH_ROWS rows) in memory while one thread does all the reading and writing (measured
# on 2 CPUs only)
MAX_CONVERTERS = 4
STREAM, FILE, PARQUET = "arrow stream", "arrow file", "parquet"
_ARROW_FILE_MAGIC, _PARQUET_MAGIC = b"ARROW1", b"PAR1"
# what a token takes in a Parquet column chunk before compression, at most: an int64 id
# (or label, or mask value) and its list's repetition and definition levels (a few bits)
PARQUET_TOKEN_BYTES = 9
# characters of merge.base_source: the rows' `source` labels the card's tables, validate's
# per-source figures and its plots; any folder name (255 bytes) fits
MAX_SOURCE_CHARS = 256


# ---------------------------------------------------------------------- the base


def base_files(folder: Path) -> list[Path]:
    """The data files of a base folder, in row order: a save_to_disk folder's shards, its
    .arrow files or its .parquet files (natural name order)."""
    parquet = sorted(folder.glob("*.parquet"), key=lambda p: natural_key(p.name))
    arrow = any((folder / name).exists() for name in (STATE_FILE, "dataset_dict.json")) or any(
        folder.glob("*.arrow"))
    if parquet and arrow:
        raise StageError(f"merge.base {folder}: holds both Arrow and .parquet files; "
                         "point merge.base at a folder of one set")
    if parquet:
        return parquet
    if arrow:
        return list_shards(folder)
    _check_empty(folder)
    return []


def _check_empty(folder: Path) -> None:
    """A folder without data files is an empty base if it holds nothing else either."""
    others = sorted(p.name for p in folder.iterdir()
                    if not p.name.startswith(".") and p.name not in (INFO_FILE, fingerprint.FILE))
    if not others:
        return
    nested = sorted({str(p.parent.relative_to(folder)) for p in folder.glob("*/*.parquet")})
    hint = f"; the .parquet files are in {nested[0]}: name that folder" if nested else ""
    raise StageError(
        f"merge.base {folder}: no state.json, .arrow or .parquet files (found "
        f"{', '.join(others[:5])}){hint}; expected a datasets save_to_disk folder or a folder "
        "of .arrow or .parquet files")


def file_format(path: Path) -> str:
    """STREAM, FILE or PARQUET, by the file's first bytes."""
    try:
        with open_regular(path) as f:  # a FIFO named like a data file: one line, no wait
            head = f.read(len(_ARROW_FILE_MAGIC))
    except OSError as e:
        raise StageError(f"{path}: cannot read ({e.strerror})") from None
    if head == _ARROW_FILE_MAGIC:
        return FILE
    if head[:len(_PARQUET_MAGIC)] == _PARQUET_MAGIC:
        return PARQUET
    return STREAM


def read_schema(path: Path, fmt: str) -> pa.Schema:
    try:
        if fmt == PARQUET:
            with parquet(path) as f:
                return f.schema_arrow
        if fmt == FILE:
            with arrow_input(path) as source:
                return pa.ipc.open_file(source).schema
    except (pa.ArrowInvalid, OSError) as e:
        raise StageError(f"{path}: not a readable {fmt} file ({e})") from None
    with open_shard(path) as reader:
        return reader.schema


@contextlib.contextmanager
def batches(path: Path, fmt: str, columns: list[str],
            row_tokens: int) -> Iterator[Iterator[pa.RecordBatch]]:
    """The record batches of one base file, only `columns`, read with memory flat in the
    file's size; a damaged file, or a Parquet row group whose rows average more than
    `row_tokens` tokens (merge.adopt_max_row_tokens), is a StageError naming it."""
    if fmt == STREAM:
        with open_shard(path) as reader:
            yield (batch.select(columns) for batch in reader)
        return
    yield _checked(path, fmt, _parquet_batches(path, columns, row_tokens) if fmt == PARQUET
                   else _file_batches(path, columns))


def _checked(path: Path, fmt: str, stream: Iterator[pa.RecordBatch]):
    try:
        for batch in stream:
            batch.validate(full=True)  # damaged offsets become an error, not a crash
            yield batch
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
        raise StageError(f"{path}: not a readable {fmt} file ({e})") from None


def _parquet_batches(path: Path, columns: list[str], row_tokens: int
                     ) -> Iterator[pa.RecordBatch]:
    with parquet(path) as f:  # decoded a row group at a time
        row_bytes = row_tokens * PARQUET_TOKEN_BYTES
        check_parquet_rows(path, f.metadata, columns, row_bytes,
                           f"merge.adopt_max_row_tokens ({row_tokens} tokens: {row_bytes} bytes)")
        yield from f.iter_batches(batch_size=BATCH_ROWS, columns=columns)


def _file_batches(path: Path, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """An IPC file's batches, each read into memory (reading.arrow_input)."""
    with arrow_input(path) as source:
        reader = pa.ipc.open_file(source)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i).select(columns)


# -------------------------------------------------------------------- the layout


@dataclasses.dataclass
class Layout:
    """Which base columns become the contract's, and how."""

    input_ids: str
    mask: str
    kind: str  # "mask" or "labels"
    padding: Optional[str] = None  # an attention_mask to hold to all ones

    def read(self) -> list[str]:
        return [self.input_ids, self.mask] + ([self.padding] if self.padding else [])

    def mapping(self, schema: pa.Schema, source: str) -> dict[str, str]:
        """For the report and the card: where each contract column comes from."""
        how = ("-100 -> 0, the token id -> 1" if self.kind == "labels" else
               "values kept, stored as int8")
        return {
            "id": "content id: xxh3-128 of input_ids and loss_mask; the k-th repeat gets -k",
            "source": f"{source!r} (merge.base_source)",
            "input_ids": f"{self.input_ids} ({schema.field(self.input_ids).type}), "
                         "values kept, stored as int32",
            "loss_mask": f"{self.mask} ({schema.field(self.mask).type}, {self.kind}), {how}",
            "num_tokens": "counted",
            "num_loss_tokens": "counted",
        }


class LayoutError(StageError):
    """A base file whose columns merge.adopt cannot map; `reason` says why."""

    def __init__(self, path: Path, schema: pa.Schema, reason: str):
        super().__init__(f"merge.adopt: {path} has {_shape_text(schema)}; {reason}")
        self.path, self.reason = path, reason


def layout(path: Path, schema: pa.Schema, columns: params.BaseColumns) -> Layout:
    """The layout of a base file with `schema`, from merge.base_columns or the names;
    LayoutError naming the file and what is missing or mistyped."""
    names = schema.names
    _check_unique(path, schema)
    ids = columns.input_ids or "input_ids"
    if ids not in names:
        raise LayoutError(path, schema, f"no token id column {ids!r} (name it in "
                                        "merge.base_columns.input_ids)")
    if columns.mask:
        if columns.mask not in names:
            raise LayoutError(path, schema, f"no mask column {columns.mask!r} "
                                            "(merge.base_columns.mask)")
        mask = columns.mask
    else:
        present = [name for name in MASK_NAMES if name in names]
        if not present:
            raise LayoutError(path, schema, f"no mask column: expected one of "
                              f"{', '.join(MASK_NAMES)}, or name it in merge.base_columns.mask")
        if len(present) > 1:
            raise LayoutError(path, schema, f"several mask columns ({', '.join(present)}): "
                                            "name one in merge.base_columns.mask")
        mask = present[0]
    if mask == ids:
        raise LayoutError(path, schema, f"merge.base_columns names {ids!r} as both the token "
                                        "ids and the mask: one column cannot be both")
    if mask == "attention_mask" and "labels" in names:
        raise LayoutError(path, schema, "the mask is attention_mask, which marks padding, not "
                                        "what is trained, and the base has labels: name labels "
                                        "in merge.base_columns.mask")
    kind = columns.mask_kind or ("labels" if mask == "labels" else "mask")
    _check_type(path, schema, ids, "token ids", booleans=False)
    _check_type(path, schema, mask, f"a {kind} column", booleans=kind == "mask")
    padding = "attention_mask" if "attention_mask" in names and _int_list(
        schema.field("attention_mask").type, booleans=True) else None
    return Layout(ids, mask, kind, None if padding in (ids, mask) else padding)


def _check_unique(path: Path, schema: pa.Schema) -> None:
    """A name given to two columns: which of them a role means would be a guess."""
    seen = set()
    for name in schema.names:
        if name in seen:
            raise LayoutError(path, schema, f"the column name {name!r} appears more than once; "
                                            "each column must have a name of its own")
        seen.add(name)


def _int_list(type_: pa.DataType, booleans: bool) -> bool:
    if not (pa.types.is_list(type_) or pa.types.is_large_list(type_)):
        return False
    item = type_.value_type
    return pa.types.is_integer(item) or (booleans and pa.types.is_boolean(item))


def _check_type(path: Path, schema: pa.Schema, name: str, what: str, booleans: bool) -> None:
    type_ = schema.field(name).type
    if not _int_list(type_, booleans):
        items = "integers or booleans" if booleans else "integers"
        raise LayoutError(path, schema, f"column {name} is {type_}; {what} must be a list or "
                                        f"large_list of {items}")


def _shape_text(schema: pa.Schema, limit: int = 8) -> str:
    parts = [f"{f.name} {f.type}" for f in schema]
    more = f" and {len(parts) - limit} more columns" if len(parts) > limit else ""
    return ", ".join(parts[:limit]) + more


# ----------------------------------------------------------------------- the plan


@dataclasses.dataclass
class Plan:
    base: Path
    files: list[Path]
    formats: list[str]
    layout: Layout
    schema: pa.Schema  # the first file's
    source: str
    drop_invalid: bool = False  # merge.adopt_drop_invalid
    fully_supervised: str = "error"  # merge.adopt_fully_supervised: error, drop or keep
    row_tokens: int = 1 << 20  # merge.adopt_max_row_tokens


def plan(cfg: params.Merge, base: Path, files: list[Path], out: Path) -> Optional[Plan]:
    """How to adopt the base; None when it is in this project's layout already (then
    merge links its shards as they are). Without merge.adopt a base in another layout
    is refused: one line saying what was found and what adopting it would write."""
    if cfg.adopt and not files:  # an unmounted or unpulled folder: not a first version
        raise StageError(f"merge.base {base}: holds no data files (.arrow, .parquet or a "
                         "save_to_disk folder's shards), and merge.adopt is true: there is no "
                         "base to adopt (fix the path, or set merge.adopt: false for a first "
                         "version)")
    formats = [file_format(path) for path in files]
    foreign = next(((path, fmt) for path, fmt in zip(files, formats) if not _ours(path, fmt)),
                   None)
    if foreign is None:
        if cfg.adopt and files:
            log.info("merge.adopt: %s is in this project's layout already: nothing to convert",
                     base)
        return None
    path, fmt = foreign
    schema = read_schema(path, fmt)
    source = cfg.base_source or base.resolve().name or str(base)
    if not cfg.adopt:
        raise _refusal(base, files, formats, path, fmt, schema, cfg.base_columns, source, out)
    _check_source(source, cfg.base_source is None)
    return Plan(base, files, formats, layout(path, schema, cfg.base_columns), schema, source,
                cfg.adopt_drop_invalid, cfg.adopt_fully_supervised, cfg.adopt_max_row_tokens)


def _check_source(source: str, from_folder: bool) -> None:
    """Refuse a `source` validate would refuse (blank) or too long to label anything."""
    what = (f"merge.base_source is null and the base folder's name {source[:40]!r}"
            if from_folder else f"merge.base_source {source[:40]!r}")
    if not source.strip():
        raise StageError(f"{what} is blank; validate refuses rows without a source "
                         "(source_not_empty): set merge.base_source to a name")
    if len(source) > MAX_SOURCE_CHARS:
        raise StageError(f"{what}... is {len(source):,} characters long, over "
                         f"{MAX_SOURCE_CHARS}: set merge.base_source to a shorter name")


def _ours(path: Path, fmt: str) -> bool:
    """Whether a base file is laid out as this project writes: a stream of the contract's
    columns (in whatever types: allow_cast's business, not adopt's)."""
    return fmt == STREAM and sorted(read_schema(path, fmt).names) == sorted(ARROW_SCHEMA.names)


def _refusal(base: Path, files: list[Path], formats: list[str], path: Path, fmt: str,
             schema: pa.Schema, columns: params.BaseColumns, source: str, out: Path) -> StageError:
    found = f"merge.base {base} is not in this project's layout: {path} ({fmt}) has " \
            f"{_shape_text(schema)}"
    try:
        ids = [layout(file, read_schema(file, file_fmt), columns).input_ids
               for file, file_fmt in zip(files, formats)]
    except LayoutError as e:
        where = "" if e.path == path else f"{e.path}: "
        return StageError(f"{found}; merge.adopt cannot convert it either: {where}{e.reason}")
    rows = tokens = 0
    for file, file_fmt, column in zip(files, formats, ids):
        r, t = _count(file, file_fmt, column)
        rows, tokens = rows + r, tokens + t
    return StageError(
        f"{found}; set merge.adopt: true to convert it once into {out} ({rows:,} rows, "
        f"{tokens:,} tokens: about {_size(estimated_bytes(len(files), rows, tokens, source))} "
        "written)")


def _count(path: Path, fmt: str, ids: str) -> tuple[int, int]:
    """(rows, tokens) of one base file from offsets or Parquet metadata, not the values."""
    if fmt == PARQUET:
        with parquet(path) as f:
            meta = f.metadata
        leaf = next(i for i in range(meta.num_columns)
                    if meta.schema.column(i).path.startswith(f"{ids}."))
        tokens = sum(meta.row_group(g).column(leaf).num_values for g in range(meta.num_row_groups))
        return meta.num_rows, tokens  # counts an empty list as one value: an estimate
    rows = tokens = 0
    with batches(path, fmt, [ids], params.INT32) as stream:  # not Parquet: no footer to check
        for batch in stream:
            offsets = batch.column(0).offsets
            rows += batch.num_rows
            tokens += offsets[-1].as_py() - offsets[0].as_py()
    return rows, tokens


# What a contract shard takes on disk: per token an int32 id and an int8 mask value; per
# row a 32-character id, its source and six offsets or counters; per record batch and per
# file the IPC framing (measured on shards adopt writes: ~1.5 kB and ~1 kB)
TOKEN_BYTES = 4 + 1
ROW_BYTES = 32 + 4 * 6
BATCH_BYTES, FILE_BYTES = 1500, 1000


def estimated_bytes(files: int, rows: int, tokens: int, source: str) -> int:
    """About the bytes adopting `rows` rows of `tokens` tokens from `files` files writes."""
    batches = rows // BATCH_ROWS + files
    return (tokens * TOKEN_BYTES + rows * (ROW_BYTES + len(source.encode()))
            + batches * BATCH_BYTES + files * FILE_BYTES)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


# ---------------------------------------------------------------------- converting


@dataclasses.dataclass
class Adopted:
    """What adopting wrote: the shards (in order) and the facts for report and card."""

    shards: list[Path]
    report: dict
    policy: dict  # the longest row and the fewest supervised tokens, as tokenize's policy


class _Totals:
    def __init__(self):
        self.rows = self.tokens = self.loss_tokens = self.longest = 0
        self.fewest: Optional[int] = None

    def add(self, lengths: np.ndarray, supervised: np.ndarray) -> None:
        if not len(lengths):
            return
        self.rows += len(lengths)
        self.tokens += int(lengths.sum())
        self.loss_tokens += int(supervised.sum())
        self.longest = max(self.longest, int(lengths.max()))
        low = int(supervised.min())
        self.fewest = low if self.fewest is None else min(self.fewest, low)


def convert(p: Plan, folder: Path, vocab: int) -> Adopted:
    """Write the base's rows into `folder` as contract shards (data-NNNNN-of-MMMMM.arrow)."""
    totals, files, dropped = _Totals(), [], set()
    shards = [folder / shard_name(i, len(p.files)) for i in range(len(p.files))]
    with IdHashes() as hashes:
        for path, fmt, dst in zip(p.files, p.formats, shards):
            schema = read_schema(path, fmt)
            file_layout = layout(path, schema, params.BaseColumns(p.layout.input_ids, p.layout.mask,
                                                             p.layout.kind))
            dropped.update(n for n in schema.names if n not in (file_layout.input_ids,
                                                                file_layout.mask))
            got = _convert_file(path, fmt, dst, file_layout, vocab, p, hashes, totals)
            files.append({"file": path.name, "shard": dst.name, "rows": got.written,
                          "invalid_rows_dropped": got.invalid,
                          "fully_supervised_rows": got.fully})
            log.info("adopted %s (%s): %d rows -> %s", path, fmt, got.written, dst.name)
            got.tell(path, p.fully_supervised)
        repeated = _number_repeats(shards, [f["rows"] for f in files], hashes.repeated_rows())
    fully = sum(f["fully_supervised_rows"] for f in files)
    # the rows validate would accept (those merge.adopt_drop_invalid dropped are none)
    trainable = sum(f["rows"] for f in files) + (fully if p.fully_supervised == "drop" else 0)
    if fully and fully == trainable and p.fully_supervised != "keep":
        # dropping them all would leave no base: the column is not a mask of what to train
        raise StageError(f"merge.adopt: {p.base}: {p.layout.mask} marks every token of every "
                         "row as trained, prompts included: not a mask of what to train "
                         "(name the right column in merge.base_columns.mask)")
    invalid = sum(f["invalid_rows_dropped"] for f in files)
    if invalid and not trainable:  # an empty version 1 would stand for the base
        raise StageError(f"merge.adopt: {p.base}: all {invalid} of its rows are rows validate "
                         f"would refuse (empty, no two consecutive supervised tokens in "
                         f"{p.layout.mask}): merge.adopt_drop_invalid would drop the whole base "
                         "(name the right columns in merge.base_columns)")
    if dropped:
        log.warning("merge.adopt: columns dropped from %s: %s", p.base, ", ".join(sorted(dropped)))
    report = {
        "path": str(p.base),
        "folder": real_folder(p.base),
        "formats": sorted(set(p.formats)),
        "columns": {f.name: str(f.type) for f in p.schema},
        "mapping": p.layout.mapping(p.schema, p.source),
        "dropped_columns": sorted(dropped),
        "source": p.source,
        "rows": totals.rows,
        "tokens": totals.tokens,
        "loss_tokens": totals.loss_tokens,
        "repeated_rows": repeated,
        "invalid_rows_dropped": sum(f["invalid_rows_dropped"] for f in files),
        # rows whose mask trains every token, the prompt included: kept or dropped as
        # merge.adopt_fully_supervised says
        "fully_supervised_rows": fully,
        "fully_supervised": p.fully_supervised,
        "bytes": sum(path.stat().st_size for path in shards),
        "files": files,
    }
    policy = {"max_seq_len": totals.longest, "min_loss_tokens": totals.fewest}
    return Adopted(shards, report, policy)


def real_folder(base: Path) -> str:
    """Where the base really is, links followed: relative to the working directory (the
    repository) when inside it, so the card and report of a clone elsewhere are the same
    bytes; else absolute, the user's own place for it."""
    real = base.resolve()
    try:
        return str(real.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(real)


@dataclasses.dataclass
class _FileCounts:
    """What converting one base file did, for the report and its log lines."""

    written: int = 0
    invalid: int = 0  # rows validate would refuse, dropped (merge.adopt_drop_invalid)
    fully: int = 0  # rows that train every token (merge.adopt_fully_supervised)
    first_fully: Optional[int] = None  # the file's row number of the first of them

    def tell(self, path: Path, rule: str) -> None:
        if self.invalid:
            log.warning("merge.adopt: %s: %d rows validate would refuse dropped "
                        "(merge.adopt_drop_invalid)", path, self.invalid)
        if self.fully:
            log.warning("merge.adopt: %s: %d rows train every token, the prompt included "
                        "(the first: row %d): %s (merge.adopt_fully_supervised: %s)", path,
                        self.fully, self.first_fully, "dropped" if rule == "drop" else "kept",
                        rule)


def _convert_file(path: Path, fmt: str, dst: Path, lay: Layout, vocab: int, p: Plan,
                  hashes: IdHashes, totals: _Totals) -> _FileCounts:
    """Convert one base file into the shard `dst`, counting what it dropped or flagged.
    Batches are read and written here, in order, and converted between by a few threads
    (numpy's passes and xxhash release the GIL); results are taken in order, so an error
    names the file's first bad row."""
    converters = min(cpus.usable(), MAX_CONVERTERS)
    got = _FileCounts()
    row = 0
    pending: collections.deque = collections.deque()

    def take() -> None:
        out, digests, fully, first_row = pending.popleft().result()
        if fully.any():
            got.fully += int(np.count_nonzero(fully))
            if got.first_fully is None:
                got.first_fully = first_row + int(np.flatnonzero(fully)[0])
        first = totals.rows  # dataset-wide number of the batch's first row
        writer.write(out)
        lengths = arrays.values(out.column("num_tokens"))
        totals.add(lengths, arrays.values(out.column("num_loss_tokens")))
        hashes.add(digests, np.arange(first, first + len(lengths)))
        got.written += out.num_rows

    def convert_part(part: pa.RecordBatch, first_row: int):
        return (*baserows.contract_rows(part, lay, vocab, p.source,
                                        baserows.Where(path, first_row), p.drop_invalid,
                                        p.fully_supervised), first_row)

    with batches(path, fmt, lay.read(), p.row_tokens) as stream, ShardFile(dst) as writer, \
            concurrent.futures.ThreadPoolExecutor(converters, "adopt") as pool:
        try:
            for batch in stream:
                for start in range(0, batch.num_rows, BATCH_ROWS):
                    part = batch.slice(start, BATCH_ROWS)
                    pending.append(pool.submit(convert_part, part, row))
                    row += part.num_rows
                    if len(pending) > converters:
                        take()
            while pending:
                take()
        finally:
            for future in pending:
                future.cancel()
    got.invalid = row - got.written - (got.fully if p.fully_supervised == "drop" else 0)
    return got


def _number_repeats(shards: list[Path], rows: list[int], suspects: np.ndarray) -> int:
    """Give the k-th repeat of a row's content the id `ID-k` (k = 1, 2, ...), rewriting
    only the shards that hold one; returns the number of rows renamed. `suspects`: the
    dataset-wide rows whose 64-bit hash repeats (sorted), confirmed here on the ids."""
    if not len(suspects):
        return 0
    seen: dict[str, int] = {}
    renamed = first = 0
    for shard, count in zip(shards, rows):
        last = first + count
        local = suspects[(suspects >= first) & (suspects < last)] - first
        first = last
        if not len(local):
            continue
        with open_shard(shard) as reader:
            ids = pa.chunked_array([batch.column("id") for batch in reader], pa.string())
        names = {}
        for r, rid in zip(local.tolist(), ids.take(pa.array(local)).to_pylist()):
            k = seen.get(rid, 0)
            seen[rid] = k + 1
            if k:
                names[r] = f"{rid}-{k}"
        if names:
            _rename_rows(shard, names)
            renamed += len(names)
    if renamed:
        log.info("merge.adopt: %d rows repeat an earlier row's content: ids numbered -1, -2, ...",
                 renamed)
    return renamed


def _rename_rows(shard: Path, names: dict[int, str]) -> None:
    tmp = shard.with_name(f".{shard.name}.renamed")
    row = 0
    with open_shard(shard) as reader, ShardFile(tmp) as writer:
        for batch in reader:
            hits = [r for r in range(row, row + batch.num_rows) if r in names]
            if hits:
                ids = batch.column("id").to_pylist()
                for r in hits:
                    ids[r - row] = names[r]
                batch = pa.RecordBatch.from_arrays([pa.array(ids, pa.string()),
                                                    *batch.columns[1:]], schema=ARROW_SCHEMA)
            writer.write(batch)
            row += batch.num_rows
    os.replace(tmp, shard)
