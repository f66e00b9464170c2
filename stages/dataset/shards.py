"""A dataset folder on disk: its shards listed in order, read (read-only: every column,
or a few columns by their buffers, stages/dataset/ipcstream.py) and written (`ShardFile`
one stream, `ShardWriter` bounded shards under datasets' names), the save_to_disk
metadata that makes the folder load, and the load_from_disk check. The row contract the
shards hold is stages/dataset/schema.py."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, TypeVar

import pyarrow as pa

from stages.common import outputs
from stages.common.errors import StageError
from stages.common.reading import arrow_input, json_file, open_regular
from stages.dataset import fingerprint, ipcstream
from stages.dataset.schema import ARROW_SCHEMA, features_of, schema_differences
from stages.process import children

# A dataset folder is either a `save_to_disk` folder (state.json lists the shards in
# order) or a plain folder of `.arrow` shards (taken in natural name order). Shards are
# Arrow IPC *stream* files, which is what `datasets` writes and memory-maps.

STATE_FILE = "state.json"
INFO_FILE = "dataset_info.json"
_FILE_MAGIC = b"ARROW1"  # the IPC *file* (Feather v2) format, which datasets cannot load
# A stream ends with an end-of-stream marker (continuation + zero length), right after
# its last message. Without it a shard cut at a batch boundary reads as whole.
_END_MARKER = b"\xff\xff\xff\xff\x00\x00\x00\x00"
# what reading damaged bytes can raise, from pyarrow or the flatbuffer parsing
_UNREADABLE = (OSError, ipcstream.Damaged, *ipcstream.BAD_BYTES)
T = TypeVar("T")


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
        meta = {INFO_FILE, fingerprint.FILE}
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
    """Record batches of one shard, read from its open file (reading.arrow_input), each
    checked in full.

    Read, never memory-mapped: a mapped file cut short under its reader (another
    process truncating it, a disk going away) kills the reader with SIGBUS on the next
    page it touches, a signal Python cannot turn into an error. Read, a cut file is a
    short read: a StageError naming the shard. Each batch's memory goes with the batch,
    so readers that let batches go stay flat whatever the shard size.
    """

    def __init__(self, path: Path, source: pa.NativeFile):
        self.path = path
        self._size = source.size()  # as opened (an OSFile keeps that figure: _cut stats)
        self._source = source
        self._pending: Optional[concurrent.futures.Future] = None  # ahead()'s next read
        try:
            self._reader = pa.ipc.open_stream(self._source)
            self.schema: pa.Schema = self._reader.schema
            self.schema.names  # field names that are not UTF-8 raise here, not later
        except _UNREADABLE as e:
            raise StageError(f"{path}: not a readable Arrow stream shard ({e})") from None

    def _peek(self) -> None:
        """Look at the next message's head before pyarrow reads it: a compressed body
        would be decompressed whole (a few kB of zstd can hold gigabytes), and a damaged
        body length allocated whole. A cut head is left to pyarrow, which names it.

        The head is read twice, here and by pyarrow: read_next_batch decompresses as it
        reads and shows no head before, and reading the messages here instead
        (pa.ipc.MessageReader) would read each body by its stated length before it could
        be checked, and leave dictionary batches with no reader. It costs a seek and a
        small read a batch: measured 17 us a batch on 2-row batches, nothing seen on
        batches of 256 rows of 2,000 tokens (ipcstream.Stream reads each head once)."""
        here = self._source.tell()
        try:
            head = ipcstream.read_head(self._read_at, here, self._size)
        except ipcstream.Cut:
            return
        finally:
            self._source.seek(here)
        if ipcstream.compressed(head):
            raise ipcstream.Compressed()

    def _read_at(self, at: int, n: int) -> bytes:
        self._source.seek(at)
        data = self._source.read(n)
        if len(data) != n:
            raise ipcstream.Cut(f"{n} bytes at {at}, read {len(data)}")
        return data

    def _cut(self) -> Optional[str]:
        """Why the file is no longer what was opened, if it was cut while being read."""
        try:
            size = os.stat(self.path).st_size
        except OSError:  # gone from its folder: an open file is not cut by that
            return None
        if size < self._size:
            return f"{self.path}: cut short while being read ({self._size} bytes, now {size})"
        return None

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        """Every batch, checked; StageError at the end if the stream was cut short."""
        end = self._source.tell()  # where the last message read ends
        while True:
            try:
                self._peek()
                batch = self._reader.read_next_batch()
                end = self._source.tell()
                # offsets and lengths are checked against the buffers before any reader
                # indexes with them: damaged bytes become an error, not a crash (SIGSEGV)
                batch.validate(full=True)
            except StopIteration:
                self._source.seek(end)
                if self._source.read(9) != _END_MARKER:  # marker, then nothing
                    raise StageError(self._cut() or (
                        f"{self.path}: no end-of-stream marker after its last record batch: "
                        "the shard is truncated")) from None
                return
            except ipcstream.Compressed as e:
                raise StageError(f"{self.path}: {e}") from None
            except _UNREADABLE as e:
                raise StageError(self._cut() or f"{self.path}: damaged record batch ({e})") from None
            yield batch

    def ahead(self, work: Callable[[pa.RecordBatch], T]) -> Iterator[T]:
        """work(batch) for each batch of __iter__, the next batch read and worked on in a
        thread while the caller uses the one before: Arrow's reads and writes and numpy's
        passes release the GIL, so a stage that writes what it reads overlaps the two.
        One batch more is held."""
        batches = iter(self)
        done = object()

        def step():
            batch = next(batches, done)
            return done if batch is done else work(batch)

        with concurrent.futures.ThreadPoolExecutor(1, "shard-ahead") as pool:
            self._pending = pool.submit(step)
            while (item := self._pending.result()) is not done:
                self._pending = pool.submit(step)
                yield item

    def settle(self) -> None:
        """Wait for a read ahead() started (before the file it reads is closed)."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending])


@contextlib.contextmanager
def open_shard(path: str | Path, columns: Iterable[str] = ()) -> Iterator[ShardReader]:
    """Open a shard read-only (never for writing: it may be a link into the DVC cache),
    every column of every batch read and checked; StageError unless it holds `columns`
    as the contract types them (see require_columns)."""
    path = Path(path)
    with arrow_input(path) as source:
        _check_head(path, source)
        reader = ShardReader(path, source)
        require_columns(path, reader.schema, columns)
        try:
            yield reader  # what the caller raises is its own
        finally:
            reader.settle()


@contextlib.contextmanager
def open_columns(path: str | Path, columns: Iterable[str] = ()) -> Iterator[ipcstream.Stream]:
    """Open a shard read-only for a reader of a few columns: each batch's columns are
    read when asked for, only their own buffers, each checked in full (the lookup of a
    row by id, merge's scan of a base: the token buffers stay unread); StageError unless
    it holds `columns` as the contract types them (see require_columns)."""
    path = Path(path)
    with open_regular(path) as f:
        _check_head(path, pa.PythonFile(f, mode="r"))
        stream = ipcstream.Stream(path, f.fileno())
        require_columns(path, stream.schema, columns)
        yield stream


def require_columns(path: Path, schema: pa.Schema, columns: Iterable[str]) -> None:
    """StageError naming the shard unless `schema` holds each of `columns` once, of the
    contract's type. Readers that index these columns ask this of every shard, before
    any column is read: a shard's schema is its own (a damaged byte can rename a column
    or change its width), not the first shard's. validate asks nothing: it reports
    schema differences as findings."""
    columns = list(columns)
    twice = sorted({n for n in schema.names if n in columns and schema.names.count(n) > 1})
    if twice:
        raise StageError(f"{path}: has column {twice[0]} more than once")
    got = {f.name: f for f in schema}
    mine = pa.schema([got[n] for n in columns if n in got])
    diffs = schema_differences(mine, pa.schema([ARROW_SCHEMA.field(n) for n in columns]))
    if diffs:
        raise StageError(f"{path}: {'; '.join(diffs)} (not a shard of the row contract)")


def _check_head(path: Path, source) -> None:
    """StageError for an empty file or an IPC file (not stream); `source` left at 0."""
    try:
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


def read_schema(path: str | Path) -> pa.Schema:
    with open_shard(path) as reader:
        return reader.schema


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


def write_metadata(folder: str | Path, shard_names: list[str],
                   state: Optional[str] = None,
                   schema: pa.Schema = ARROW_SCHEMA) -> None:
    """Write the state.json and dataset_info.json that make `folder` a save_to_disk folder
    of rows of `schema` (the contract's unless an export says otherwise; made by
    schema.hf_schema, which holds the features datasets reads it by).

    `state` is the state hash (dataset/fingerprint.py); by default the folder's, which
    then must already hold its shards (and its fingerprint.json, where it has one).
    """
    folder = Path(folder)
    doc = {
        "_data_files": [{"filename": name} for name in shard_names],
        fingerprint.STATE_KEY: state if state is not None else fingerprint.state_hash(
            folder, shard_names),
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    info = {"citation": "", "description": "", "features": features_of(schema),
            "homepage": "", "license": ""}
    for name, obj in ((STATE_FILE, doc), (INFO_FILE, info)):
        (folder / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def loaded_rows_and_features(folder: str | Path) -> tuple[int, dict]:
    """(rows, features as dataset_info.json holds them) of `folder` opened with
    `datasets.load_from_disk`, as training opens it (Opening, waited for); StageError
    saying what stops that."""
    return Opening(folder).result()


class Opening:
    """`datasets.load_from_disk(folder)` in a worker process of its own, forked at once
    (before the caller starts any thread), for (rows, features as a dict: datasets is
    imported there, or inherited from a stage that imported it at start).

    datasets memory-maps every shard: one cut short under the map (another process
    truncating it) kills the process reading it with SIGBUS, which Python cannot turn
    into an error; in a worker it is a StageError. The dataset itself is dropped at
    once: opening maps a page or more of every record batch, memory that grows with it.
    """

    def __init__(self, folder: str | Path):
        self._workers = children.Workers("fork", 1)
        self._job = self._workers.submit(_opened, str(folder))

    def result(self) -> tuple[int, dict]:
        try:
            got = self._workers.result(self._job, "datasets")
        finally:
            self._workers.close()
        if isinstance(got, str):
            raise StageError(got)
        return got


def _opened(folder: str):
    import datasets

    try:
        loaded = datasets.load_from_disk(folder)
    except Exception as e:  # noqa: BLE001 - whatever stops training from opening it
        return f"{type(e).__name__}: {e}"
    return len(loaded), loaded.features.to_dict()


class ShardWriter:
    """Arrow stream shards of at most `max_rows` rows and about `max_bytes` bytes."""

    def __init__(self, folder: Path, max_rows: int, max_bytes: int):
        self.folder = folder
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.paths: list[Path] = []
        self._shard: Optional[ShardFile] = None
        self._rows = 0
        self._bytes = 0

    def _open(self) -> None:
        path = self.folder / f".shard-{len(self.paths):05d}.arrow"
        self.paths.append(path)
        self._shard = ShardFile(path)
        self._rows = self._bytes = 0

    def _close_current(self) -> None:
        if self._shard is not None:
            self._shard.close()
            self._shard = None

    def write(self, batch: pa.RecordBatch) -> None:
        while batch.num_rows:
            if self._shard is None:
                self._open()
            per_row = max(1, batch.nbytes // batch.num_rows)
            fit = (self.max_bytes - self._bytes) // per_row
            # an empty shard takes at least one row, whatever its size
            take = min(self.max_rows - self._rows, batch.num_rows, max(fit, 0 if self._rows else 1))
            if take <= 0:
                self._close_current()
                continue
            part = batch.slice(0, take)
            self._shard.write(part)
            self._rows += take
            self._bytes += part.nbytes
            batch = batch.slice(take)
            if self._rows >= self.max_rows or self._bytes >= self.max_bytes:
                self._close_current()

    def close(self) -> list[str]:
        """Finish the last shard and give the shards their final names."""
        if not self.paths:  # no rows: one empty shard, so the folder still loads
            self._open()
        self._close_current()
        n = len(self.paths)
        names = []
        for i, path in enumerate(self.paths):
            name = shard_name(i, n)
            os.replace(path, self.folder / name)
            names.append(name)
        return names
