"""The tokenized-row contract: explicit Arrow/datasets features shared by tokenize,
merge and validate (datasets would infer int64 for unknown columns); how a dataset folder
of such rows sits on disk (shard names, listing, writing and read-only reading, type
comparison, save_to_disk metadata and its state hash, the load_from_disk check); and the
row rules validate checks row summaries with (as one polars pass and a pandera schema)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
from pathlib import Path
from typing import Callable, Iterator, Optional

import datasets
import pyarrow as pa

from stages.common import outputs
from stages.common.errors import StageError, arrow_input, json_file, open_regular, read_regular

FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "source": datasets.Value("string"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "num_tokens": datasets.Value("int32"),
        "num_loss_tokens": datasets.Value("int32"),
    }
)

ARROW_SCHEMA: pa.Schema = FEATURES.arrow_schema

# What made a dataset's tokens (tokenizer, chat template, tokenize policy, versions): the
# one thing "fingerprint" names here. Kept under this name: every dataset written so far
# carries it, and merge reads the base's. (A folder's state hash is `state_hash`, stored
# as state.json's `_fingerprint`, datasets' own key.)
FINGERPRINT_FILE = "fingerprint.json"

# ------------------------------------------------------------------- on disk
# A dataset folder is either a `save_to_disk` folder (state.json lists the shards in
# order) or a plain folder of `.arrow` shards (taken in natural name order). Shards are
# Arrow IPC *stream* files, which is what `datasets` writes and memory-maps.

STATE_FILE = "state.json"
INFO_FILE = "dataset_info.json"
_FILE_MAGIC = b"ARROW1"  # the IPC *file* (Feather v2) format, which datasets cannot load
# A stream ends with an end-of-stream marker (continuation + zero length), right after
# its last message. Without it a shard cut at a batch boundary reads as whole.
_END_MARKER = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def list_shards(folder: str | Path) -> list[Path]:
    """The shard files of a dataset folder, in dataset order (StageError if unusable)."""
    folder = Path(folder)
    if (folder / "dataset_dict.json").exists():
        raise StageError(
            f"{folder}: is a DatasetDict folder (dataset_dict.json); name one split's "
            f"folder instead, e.g. {folder}/train"
        )
    state_path = folder / STATE_FILE
    if state_path.exists():
        state = json_file(state_path)
        try:
            names = [entry["filename"] for entry in state["_data_files"]]
        except (KeyError, TypeError) as e:
            raise StageError(f"{state_path}: not a datasets state file ({e!r})") from None
        for name in names:
            if not _plain_file_name(name):  # never read a file outside the folder
                raise StageError(f"{state_path}: lists {str(name)[:100]!r}, which is not a file "
                                 "name in this folder")
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise StageError(f"{state_path}: lists {', '.join(map(str, twice))} more than once")
        if state.get("_indices_data_files"):
            raise StageError(f"{state_path}: has an indices mapping; save it flattened")
        shards = [folder / name for name in names]
        for path in shards:
            if not path.exists():
                raise StageError(f"{state_path}: lists {path.name}, which does not exist")
            _check_regular(path)
        return shards
    shards = sorted(folder.glob("*.arrow"), key=lambda p: natural_key(p.name))
    for path in shards:
        _check_regular(path)
    if not shards:
        others = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
        meta = {INFO_FILE, FINGERPRINT_FILE}
        if [name for name in others if name not in meta]:
            raise StageError(
                f"{folder}: no state.json and no .arrow shards (found {', '.join(others[:5])}); "
                "expected a datasets save_to_disk folder or a folder of .arrow shards"
            )
    return shards


def _check_regular(shard: Path) -> None:
    """StageError unless `shard` is a regular file (a FIFO would block every reader)."""
    if not shard.is_file():
        raise StageError(f"{shard}: not a regular file, so not a shard")


def _plain_file_name(name) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..")
            and not any(c in name for c in "/\\\0"))


def natural_key(name: str) -> list:
    """Sort key that puts shard-2 before shard-10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class ShardReader:
    """Record batches of one shard, read from its open file (errors.arrow_input), or,
    for a reader of a few columns (`check`), from a read-only memory map.

    A mapped file cut short under its reader (another process truncating it, a disk
    going away) kills the reader with SIGBUS on the next page it touches, a signal
    Python cannot turn into an error. Read into memory, a cut file is a short read:
    a StageError naming the shard. Each batch's memory goes with the batch, so readers
    that let batches go stay flat whatever the shard size. Only stages/view maps (a
    lookup by id touches the id pages alone: 41 MB of a 5.8 GB set, docs/stages.md);
    it writes nothing a cut shard could leave half-made.
    """

    def __init__(self, path: Path, source: pa.NativeFile,
                 check: Optional[tuple[str, ...]] = None):
        self.path = path
        self._check = check
        self._size = source.size()
        self._source = source
        try:
            self._reader = pa.ipc.open_stream(self._source)
            self.schema: pa.Schema = self._reader.schema
            self.schema.names  # field names that are not UTF-8 raise here, not later
        except (pa.ArrowInvalid, OSError, UnicodeDecodeError) as e:
            raise StageError(f"{path}: not a readable Arrow stream shard ({e})") from None

    def _cut(self) -> Optional[str]:
        """Why the file is no longer what was opened, if it was cut while being read."""
        size = self._source.size()
        if size < self._size:
            return f"{self.path}: cut short while being read ({self._size} bytes, now {size})"
        return None

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        """Every batch, checked; StageError at the end if the stream was cut short."""
        end = self._source.tell()  # where the last message read ends
        while True:
            try:
                batch = self._reader.read_next_batch()
                end = self._source.tell()
                # offsets and lengths are checked against the buffers before any reader
                # indexes with them: damaged bytes become an error, not a crash (SIGSEGV)
                if self._check is None:
                    batch.validate(full=True)
                else:  # only the columns this reader will touch
                    for name in self._check:
                        batch.column(name).validate(full=True)
            except StopIteration:
                self._source.seek(end)
                if self._source.read(9) != _END_MARKER:  # marker, then nothing
                    raise StageError(self._cut() or (
                        f"{self.path}: no end-of-stream marker after its last record batch: "
                        "the shard is truncated")) from None
                return
            except (pa.ArrowInvalid, OSError, UnicodeDecodeError) as e:
                raise StageError(self._cut() or f"{self.path}: damaged record batch ({e})") from None
            yield batch


@contextlib.contextmanager
def open_shard(path: str | Path, drop_behind: bool = False,
               check: Optional[tuple[str, ...]] = None) -> Iterator[ShardReader]:
    """Open a shard read-only (never for writing: it may be a link into the DVC cache).
    `check`: the only columns whose bytes are checked, read from a memory map (see
    ShardReader); default all, read. `drop_behind` changes nothing: a batch's memory
    goes with the batch whatever the caller asks."""
    path = Path(path)
    with contextlib.ExitStack() as stack:
        try:
            if check is None:
                source = stack.enter_context(arrow_input(path))
            else:
                source = _mapped(stack.enter_context(open_regular(path)))
            head = source.read(len(_FILE_MAGIC))
            source.seek(0)
        except OSError as e:
            raise StageError(f"{path}: cannot read ({e.strerror or e})") from None
        if head == _FILE_MAGIC:
            raise StageError(
                f"{path}: is an Arrow IPC file (Feather), not the IPC stream format "
                "datasets writes; re-save it with datasets' save_to_disk"
            )
        if not head:
            raise StageError(f"{path}: empty file, not an Arrow stream shard")
        yield ShardReader(path, source, check)  # what the caller raises is its own


def _mapped(f) -> pa.BufferReader:
    """The open file `f` mapped read-only for random access (no read-around of the
    columns a few-column reader skips)."""
    if os.fstat(f.fileno()).st_size == 0:  # nothing to map: told apart by the caller
        return pa.BufferReader(b"")
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapped.madvise(mmap.MADV_RANDOM)
    return pa.BufferReader(pa.py_buffer(mapped))


def read_schema(path: str | Path) -> pa.Schema:
    with open_shard(path) as reader:
        return reader.schema


def schema_differences(schema: pa.Schema, expected: pa.Schema = ARROW_SCHEMA) -> list[str]:
    """Human lines saying how `schema` differs from the contract (empty: identical).

    Types compare exactly (int32 vs int64, list vs large_list, string vs large_string
    differ); nullability, list item names and schema metadata do not matter to datasets
    and are not compared.
    """
    out = []
    got = {f.name: f.type for f in schema}
    want = {f.name: f.type for f in expected}
    for name in [n for n in want if n not in got]:
        out.append(f"column {name} is missing (expected {want[name]})")
    for name in [n for n in got if n not in want]:
        out.append(f"column {name} ({got[name]}) is not in the contract")
    for name in [n for n in want if n in got and _plain(got[n]) != _plain(want[n])]:
        out.append(f"column {name} is {got[name]}, expected {want[name]}")
    if not out and schema.names != expected.names:
        out.append(f"columns are in order {schema.names}, expected {expected.names}")
    return out


def _plain(type_: pa.DataType) -> pa.DataType:
    """The type with list items nullable and named alike, as datasets reads them."""
    if pa.types.is_list(type_):
        return pa.list_(_plain(type_.value_type))
    if pa.types.is_large_list(type_):
        return pa.large_list(_plain(type_.value_type))
    return type_


def castable(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether `src` can become `dst` without reinterpreting values (ranges checked later)."""
    if src == dst:
        return True
    if pa.types.is_integer(src) and pa.types.is_integer(dst):
        return True
    strings = (pa.types.is_string, pa.types.is_large_string)
    if any(f(src) for f in strings) and any(f(dst) for f in strings):
        return True
    lists = (pa.types.is_list, pa.types.is_large_list)
    if any(f(src) for f in lists) and any(f(dst) for f in lists):
        return castable(src.value_type, dst.value_type)
    return False


def shard_name(index: int, total: int) -> str:
    """The file name of shard `index` of `total`, as datasets' save_to_disk names them."""
    return f"data-{index:05d}-of-{total:05d}.arrow"


class ShardFile:
    """One shard being written: an Arrow IPC stream of the contract's schema (or of
    `schema`: an export's columns).

    Closing it writes the end-of-stream marker that tells a whole shard from a cut one.
    """

    def __init__(self, path: str | Path, schema: pa.Schema = ARROW_SCHEMA):
        self.path = Path(path)
        self._sink = pa.OSFile(str(self.path), "wb")
        with self._written():
            self._writer = pa.ipc.new_stream(self._sink, schema)

    @contextlib.contextmanager
    def _written(self) -> Iterator[None]:
        """A write error as this output's (outputs.NoRoom when for want of room): an
        OSError would read, to a reader's `except OSError`, as its input failing."""
        try:
            yield
        except OSError as e:
            if outputs.no_room(e):
                raise outputs.NoRoom(f"{self.path}: {e}") from None
            raise StageError(f"{self.path}: cannot write ({e})") from None

    def write(self, batch: pa.RecordBatch) -> None:
        with self._written():
            self._writer.write_batch(batch)

    def close(self) -> None:
        with self._written():
            try:
                self._writer.close()
            finally:
                self._sink.close()

    def __enter__(self) -> "ShardFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def state_hash(folder: str | Path, shard_names: list[str]) -> str:
    """state.json's `_fingerprint` (datasets' name) for a folder: cheap, and the same
    whenever the output is: a hash of fingerprint.json (where the folder has one), then
    each shard's name, size, first and last 64 KiB."""
    folder = Path(folder)
    fingerprint = folder / FINGERPRINT_FILE
    h = hashlib.sha256(read_regular(fingerprint) if fingerprint.exists() else b"")
    for name in shard_names:
        with open_regular(folder / name) as f:
            size = os.fstat(f.fileno()).st_size
            h.update(f"{name}\0{size}\0".encode())
            h.update(f.read(1 << 16))
            if size > 1 << 16:
                f.seek(max(1 << 16, size - (1 << 16)))
                h.update(f.read())
    return h.hexdigest()[:16]


def write_metadata(folder: str | Path, shard_names: list[str],
                   state: Optional[str] = None,
                   features: datasets.Features = FEATURES) -> None:
    """Write the state.json and dataset_info.json that make `folder` a save_to_disk folder
    of rows with `features` (the contract's unless an export says otherwise).

    `state` is state.json's `_fingerprint`; by default state_hash() of the folder, which
    then must already hold its shards (and its fingerprint.json, where it has one).
    """
    folder = Path(folder)
    doc = {
        "_data_files": [{"filename": name} for name in shard_names],
        "_fingerprint": state if state is not None else state_hash(folder, shard_names),
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    info = {"citation": "", "description": "", "features": features.to_dict(),
            "homepage": "", "license": ""}
    for name, obj in ((STATE_FILE, doc), (INFO_FILE, info)):
        (folder / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def loaded_rows_and_features(folder: str | Path) -> tuple[int, datasets.Features]:
    """(rows, features) of `folder` opened with `datasets.load_from_disk`, as training
    opens it; raises whatever stops that.

    The dataset itself is dropped at once: opening it maps a page or more of every record
    batch, memory that grows with the dataset, so it is held only for the moment it takes.
    """
    loaded = datasets.load_from_disk(str(folder))
    return len(loaded), loaded.features


# ------------------------------------------------------------------- pandera
# validate reduces every row to a summary (lengths, counts; computed columnar per shard)
# and checks the summary frame against these rules. Row-level check names below are the
# names used in reports/validate.json.

NOT_NULL_CHECKS = {
    "id": "id_not_null",
    "source": "source_not_null",
    "input_ids_len": "input_ids_not_null",
    "loss_mask_len": "loss_mask_not_null",
    "num_tokens": "num_tokens_not_null",
    "num_loss_tokens": "num_loss_tokens_not_null",
}
ROW_CHECKS = [
    *NOT_NULL_CHECKS.values(),
    "id_not_empty",
    "source_not_empty",
    "lengths_equal",
    "mask_binary",
    "token_id_range",
    "max_seq_len",
    "min_loss_tokens",
    "supervised_run",
    "num_tokens_matches",
    "num_loss_tokens_matches",
]


def row_rules(max_seq_len: int, min_loss_tokens: int) -> dict[str, list[tuple[str, Callable]]]:
    """Per column of validate's per-row summary frame: its (check name, rule) pairs, a rule
    being a polars expression over the column that is true where the row passes.

    Summary columns: id, source; input_ids_len, loss_mask_len (null when the list is
    null); ids_out_of_range (token ids outside [0, vocab)), mask_not_binary (mask values
    outside {0, 1}); supervised (mask == 1 count), longest_run (longest run of
    consecutive supervised tokens); num_tokens, num_loss_tokens (the stored counters).
    Columns named in NOT_NULL_CHECKS must not be null; in the others null passes.
    """
    import polars as pl

    def not_blank(c):
        return c.str.strip_chars().str.len_bytes() > 0

    return {
        "id": [("id_not_empty", not_blank)],
        "source": [("source_not_empty", not_blank)],
        "input_ids_len": [("max_seq_len", lambda c: c <= max_seq_len)],
        "loss_mask_len": [("lengths_equal", lambda c: c == pl.col("input_ids_len"))],
        "ids_out_of_range": [("token_id_range", lambda c: c == 0)],
        "mask_not_binary": [("mask_binary", lambda c: c == 0)],
        "supervised": [("min_loss_tokens", lambda c: c >= min_loss_tokens)],
        "longest_run": [("supervised_run", lambda c: c >= 2)],
        "num_tokens": [("num_tokens_matches", lambda c: c == pl.col("input_ids_len"))],
        "num_loss_tokens": [("num_loss_tokens_matches", lambda c: c == pl.col("supervised"))],
    }


def row_schema(rules: dict[str, list[tuple[str, Callable]]]):
    """The pandera (polars) schema of the summary frame: says which rows fail which rule."""
    import pandera.polars as pa_pl
    import polars as pl

    def check(name: str, expr):
        return pa_pl.Check(lambda data: data.lazyframe.select(expr(pl.col(data.key))), name=name)

    return pa_pl.DataFrameSchema(
        {
            column: pa_pl.Column(
                pl.String if column in ("id", "source") else pl.Int64,
                [check(name, expr) for name, expr in checks],
                nullable=column not in NOT_NULL_CHECKS,
            )
            for column, checks in rules.items()
        },
        strict=False,  # the bookkeeping column `row` rides along unchecked
    )


def rows_pass(frame, rules: dict[str, list[tuple[str, Callable]]]) -> bool:
    """Whether every row passes every rule, with no null anywhere: one polars pass.

    The pandera schema costs ten times more per call; it is asked only when this says
    no, to name the failing rows (a null, allowed or not, also goes the long way).
    """
    import polars as pl

    tests = [pl.col(column).is_not_null().all().alias(column) for column in rules]
    tests += [expr(pl.col(column)).all().alias(name)
              for column, checks in rules.items() for name, expr in checks]
    return all(frame.select(tests).row(0))
