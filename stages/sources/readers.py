"""Prompt sources read as rows, streamed: a `Reader` yields `(position, item)` in groups
of a few hundred and never holds a whole source in memory; `locate` says where a source's
rows are.

Formats: JSON lines (optionally .gz/.bz2/.xz; lines come unparsed, for `parse_line`, so
parsing can happen in worker processes), JSON array files (element by element), Parquet
(record batches), Arrow IPC files and `save_to_disk` folders (memory-mapped batches),
folders of those, and Hugging Face dataset ids (`datasets` streaming when online; the
local cache when HF_HUB_OFFLINE is set).
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import json
import lzma
import os
import re
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import orjson

from stages.common.errors import StageError, json_type

from stages.common.reading import (
    arrow_input,
    check_parquet_rows,
    json_file,
    open_regular,
    parquet,
)
from stages.common.params import Prepare, Source

_JSON_EXT = (".jsonl", ".ndjson", ".json")
_COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_BATCH = 512  # rows per group a reader yields
_LINES_BYTES = 1 << 19  # bytes of JSON lines per group


class BadRow:
    """A row that is not a JSON object: `reason` is malformed_json or not_an_object."""

    __slots__ = ("reason", "message")

    def __init__(self, reason: str, message: str):
        self.reason = reason
        self.message = message

    def __reduce__(self):
        return (BadRow, (self.reason, self.message))


def parse_line(line: bytes):
    """One JSON line: a dict, a BadRow, or None for a blank line."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        # what orjson refuses: blank lines, a BOM, NaN or huge numbers, or real errors
        if line[:3] == b"\xef\xbb\xbf":
            line = line[3:]
        if not line.strip():
            return None
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:
            return BadRow("malformed_json", f"malformed JSON ({_first_line(e)})")
    if type(obj) is not dict:
        return BadRow("not_an_object", f"expected a JSON object, got {json_type(obj)}")
    return obj



def _kind(path: Path) -> Optional[str]:
    name = path.name.lower()
    for ext in _COMPRESSED:
        if name.endswith(ext):
            name = name[: -len(ext)]
    if name.endswith(_JSON_EXT):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    return None


def _offline() -> bool:
    return any(
        os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


class Reader:
    """Rows of one source, in order: iterate for `(position, item)` pairs.

    `item` is a row (dict), a parsed JSON value, or the raw bytes of a JSON line, which
    `parse_line` turns into a row. `position` is a 1-based line for JSON and a 0-based
    row index otherwise;
    `where(position)` names it for messages. `check(fields, where)` is called with a
    file's column names whenever a file with a schema (Parquet, Arrow, a Hub dataset
    with features) is opened, so a misnamed field fails before any row is read.
    """

    def __init__(self, src: Source, columns: list[str], check: Callable[[list[str], str], None],
                 max_record_bytes: int = Prepare.max_record_bytes):
        self.src = src
        self.max_record_bytes = max_record_bytes
        self.columns = columns
        self.check = check
        self.current = src.path
        self.unit = "line"
        self.hub_id, self.parts = locate(src)
        self.hub = self.hub_id is not None

    def where(self, pos: int) -> str:
        if self.unit == "line":
            return f"{self.current}:{pos}"
        return f"{self.current}: row {pos}"

    # -- iterating ----------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        for positions, items in self.batches():
            yield from zip(positions, items)

    def batches(self) -> Iterator[tuple[Sequence[int], list]]:
        """(positions, items) in groups of a few hundred rows, in order; `current` and
        `unit` describe the file the group comes from."""
        if self.hub:
            self.current, self.unit = _hub_label(self.src, self.hub_id), "row"
            yield from _grouped(_hub_rows(self.src, self.hub_id, self.current, self.columns,
                                          self.check))
            return
        for path in self.parts:
            self.current = str(path)
            kind = _kind(path)
            self.unit = "line" if kind == "json" else "row"
            if kind == "json":
                yield from _json_batches(path, self.max_record_bytes)
            elif kind == "parquet":
                yield from _parquet_batches(path, self.columns, self.check, self.max_record_bytes)
            else:
                yield from _arrow_batches(path, self.columns, self.check)


def _hub_label(src: Source, hub_id: str) -> str:
    """How messages name a Hub source: id[subset][split]@revision."""
    label = hub_id + "".join(f"[{x}]" for x in (src.subset, src.split) if x)
    return label + (f"@{src.revision}" if src.revision else "")


def _hub_rows(src: Source, hub_id: str, label: str, columns: list[str],
              check: Callable[[list[str], str], None]) -> Iterator[tuple[int, Any]]:
    """(row index, row) of a Hugging Face dataset: streamed from the Hub, or read from the
    local cache when offline."""
    import datasets

    ds = _hub_dataset(src, hub_id, label)
    features = getattr(ds, "features", None)
    if features:
        names = list(features)
        check(names, label)
        ds = ds.select_columns([c for c in columns if c in names])
    n = 0
    if isinstance(ds, datasets.Dataset):  # memory-mapped cache: read in Arrow batches
        for table in ds.with_format("arrow").iter(batch_size=_BATCH):
            for row in _rows(table, label, n):
                yield n, row
                n += 1
        return
    for row in _guarded(ds, f"source {src.name}: reading {label} failed"):
        yield n, row
        n += 1


def _hub_dataset(src: Source, hub_id: str, label: str):
    """The source's split of a Hub dataset (the only one, or train, when `split` is unset)."""
    offline = _offline()
    try:
        import datasets

        ds = datasets.load_dataset(
            hub_id, src.subset, split=src.split, revision=src.revision, streaming=not offline,
        )
        if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
            names = list(ds)
            pick = "train" if "train" in ds else (names[0] if len(names) == 1 else None)
            if pick is None:
                raise StageError(
                    f"source {src.name}: {hub_id} has splits {', '.join(names)}; set split"
                )
            ds = ds[pick]
    except StageError:
        raise
    except Exception as e:
        how = "from the local cache (HF_HUB_OFFLINE is set)" if offline else "from the Hub"
        raise StageError(
            f"source {src.name}: cannot load Hugging Face dataset {label} {how}: {_first_line(e)}"
        ) from None
    return ds


# -- locating a source's files ---------------------------------------------------


def locate(src: Source) -> tuple[Optional[str], list[Path]]:
    """Where a source's rows are: (a Hugging Face dataset id, []) or (None, its files in
    read order)."""
    raw = src.path
    for prefix in ("hf://datasets/", "hf:"):
        if raw.startswith(prefix):
            return raw[len(prefix):], []
    path = Path(raw)  # a leading ~ is expanded by params.build
    if path.is_symlink() and not path.exists():
        raise StageError(f"source {src.name}: path {raw!r} is a link that leads nowhere "
                         "(a missing target or a loop of links)")
    if not path.exists():
        if _HUB_ID.match(raw) and _kind(path) is None:
            return raw, []
        raise StageError(f"source {src.name}: path {raw!r} not found")
    if src.revision:
        raise StageError(
            f"source {src.name}: revision applies to Hugging Face datasets, not to the local path {raw}"
        )
    if path.is_file():
        if src.subset or src.split:
            which = "subset" if src.subset else "split"
            raise StageError(
                f"source {src.name}: {which} applies to folders and Hugging Face datasets, "
                f"not to the single file {raw}"
            )
        if _kind(path) is None:
            raise StageError(
                f"source {src.name}: cannot tell the format of {raw} "
                "(expected .jsonl, .json, .parquet or .arrow, optionally .gz/.bz2/.xz)"
            )
        return None, [path]
    if not path.is_dir():
        raise StageError(f"source {src.name}: path {raw!r} is neither a file nor a folder")
    return None, _folder_files(src, path)

def _folder_files(src: Source, path: Path) -> list[Path]:
    if src.subset:
        sub = path / src.subset
        if not sub.is_dir():
            raise StageError(f"source {src.name}: subset folder {sub} not found")
        path = sub
    if (path / "dataset_dict.json").is_file():
        where = path / "dataset_dict.json"
        splits = json_file(where).get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise StageError(f"{where}: 'splits' must be a list of names")
        split = src.split or ("train" if "train" in splits else None)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split is None:
            raise StageError(
                f"source {src.name}: {path} has splits {', '.join(splits)}; set split"
            )
        if split not in splits:
            raise StageError(
                f"source {src.name}: split {split!r} not in {path} (splits: {', '.join(splits)})"
            )
        return _saved(path / split)
    if (path / "state.json").is_file():
        if src.split:
            raise StageError(
                f"source {src.name}: {path} holds one dataset (no splits); remove split"
            )
        return _saved(path)
    files = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p) is not None)
    files = [p for p in files if not any(part.startswith(".") for part in p.relative_to(path).parts)]
    if src.split:
        files = [p for p in files if _in_split(p.relative_to(path), src.split)]
    if not files:
        what = f" for split {src.split!r}" if src.split else ""
        raise StageError(
            f"source {src.name}: no .jsonl/.json/.parquet/.arrow files{what} under {path}"
        )
    return files

def _saved(path: Path) -> list[Path]:
    from stages.dataset.shards import list_shards

    return list_shards(path)


# -- one reader per file format (JSON lines/arrays: _json_batches below) -----------


def _parquet_batches(path: Path, columns: list[str], check: Callable[[list[str], str], None],
                     max_record_bytes: int) -> Iterator[tuple[Sequence[int], list]]:
    """(row indexes, rows) of a Parquet file, `columns` only."""
    with contextlib.ExitStack() as stack:
        try:
            pf = stack.enter_context(parquet(path))
        except StageError:
            raise
        except Exception as e:
            raise StageError(f"{path}: cannot read Parquet ({_first_line(e)})") from None
        names = pf.schema_arrow.names
        check(names, str(path))
        cols = [c for c in columns if c in names]
        check_parquet_rows(path, pf.metadata, cols, max_record_bytes,
                           f"prepare.max_record_bytes ({max_record_bytes} bytes)")
        n = 0
        for batch in _guarded(pf.iter_batches(batch_size=_BATCH, columns=cols),
                              f"{path}: cannot read Parquet"):
            yield range(n, n + batch.num_rows), _rows(batch, path, n)
            n += batch.num_rows

def _arrow_batches(path: Path, columns: list[str], check: Callable[[list[str], str], None]
                   ) -> Iterator[tuple[Sequence[int], list]]:
    """(row indexes, rows) of an Arrow file (stream or file format), `columns` only."""
    import pyarrow as pa

    with arrow_input(path) as source:  # read, not mapped: a cut file is an error, not SIGBUS
        try:
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:
                opened = pa.ipc.open_file(source)
                reader = (opened.get_batch(i) for i in range(opened.num_record_batches))
        except Exception as e:
            raise StageError(f"{path}: cannot read Arrow ({_first_line(e)})") from None
        n = 0
        for batch in _guarded(reader, f"{path}: cannot read Arrow"):
            names = batch.schema.names
            if n == 0:
                check(names, str(path))
            yield range(n, n + batch.num_rows), \
                _rows(batch.select([c for c in columns if c in names]), path, n)
            n += batch.num_rows


def _rows(batch, where, first: int) -> list:
    """An Arrow batch (or table) as Python rows, checked in full first: offsets past
    their data or strings that are not UTF-8 (a damaged file) would crash the conversion
    or end it in a traceback; here they are one line naming the file and rows."""
    import pyarrow as pa

    last = first + batch.num_rows - 1
    try:
        batch.validate(full=True)
        return batch.to_pylist()
    except (pa.ArrowException, UnicodeDecodeError, ValueError) as e:
        raise StageError(f"{where}: rows {first}-{last}: damaged Arrow data "
                         f"({_first_line(e)})") from None


def _guarded(iterable, what: str) -> Iterator:
    """Items of `iterable`; an error while producing one becomes a one-line StageError."""
    it = iter(iterable)
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except StageError:
            raise
        except Exception as e:
            raise StageError(f"{what} ({_first_line(e)})") from None
        yield item


def _in_split(rel: Path, split: str) -> bool:
    """HF repo file naming: `train/...`, `train-00000-of-00001.parquet`, `train.jsonl`."""
    if split in rel.parts[:-1]:
        return True
    name = rel.name
    return name.startswith(split + "-") or name.startswith(split + ".") or name.startswith(split + "_")


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


@contextlib.contextmanager
def _open_binary(path: Path) -> Iterator:
    """The file's bytes, decompressed by its suffix; a FIFO named like a source is one
    line, never a wait (reading.open_regular)."""
    with open_regular(path, buffering=1 << 20) as f:
        opener = _COMPRESSED.get(path.suffix.lower())
        if opener is None:
            yield f
        else:
            with opener(f, "rb") as decompressed:  # closes it, never the file under it
                yield decompressed


# what reading a damaged file raises: truncated .gz/.bz2/.xz (EOFError), bad .xz data
# (LZMAError), bad deflate data (zlib.error), a file that is not gzip or bz2 (OSError)
_READ_ERRORS = (EOFError, lzma.LZMAError, zlib.error, OSError)


def _read_error(path: Path, line: int, e: BaseException) -> StageError:
    why = "the compressed data ends early; is the file truncated?" if isinstance(e, EOFError) \
        else _first_line(e)
    return StageError(f"{path}:{line}: cannot read ({why})")


def _too_long(path: Path, line: int, max_bytes: int, what: str = "line") -> StageError:
    return StageError(f"{path}:{line}: a {what} longer than prepare.max_record_bytes "
                      f"({max_bytes} bytes); raise it if such records are real")


def _json_batches(path: Path, max_bytes: int) -> Iterator[tuple[Sequence[int], list]]:
    """A JSON lines file, its lines unparsed (parse_line parses them, possibly in a
    worker process); or a JSON array file, when its first character is `[`."""
    with _open_binary(path) as f:
        try:
            head = f.peek(64) if hasattr(f, "peek") else b""
        except _READ_ERRORS as e:
            raise _read_error(path, 1, e) from None
        if head[:3] == b"\xef\xbb\xbf":
            head = head[3:]
        if head.lstrip()[:1] == b"[":
            yield from _grouped(_json_array(path, f, max_bytes))
            return
        yield from _json_lines(path, f, max_bytes)


def _json_lines(path: Path, f, max_bytes: int) -> Iterator[tuple[Sequence[int], list]]:
    """Lines (without their newline) in groups of about _LINES_BYTES. A line is never
    held past `max_bytes`, so one endless line (a decompression bomb) stops early."""
    n = 1  # the line number of the first line not yet yielded
    partial: list[bytes] = []  # pieces of line n, read so far
    size = 0
    while True:
        block = _read_block(f, path, n)
        if not block:
            break
        if b"\n" not in block:
            size += len(block)
            if size > max_bytes:
                raise _too_long(path, n, max_bytes)
            partial.append(block)
            continue
        lines = block.split(b"\n")
        if partial:
            if size + len(lines[0]) > max_bytes:
                raise _too_long(path, n, max_bytes)
            partial.append(lines[0])
            lines[0] = b"".join(partial)
        last = lines.pop()
        partial, size = ([last], len(last)) if last else ([], 0)
        if len(block) > max_bytes:  # only then can a whole line in it be too long
            for i, line in enumerate(lines):
                if len(line) > max_bytes:
                    raise _too_long(path, n + i, max_bytes)
        if size > max_bytes:
            raise _too_long(path, n + len(lines), max_bytes)
        yield range(n, n + len(lines)), lines
        n += len(lines)
    if partial:
        yield range(n, n + 1), [b"".join(partial)]


def _read_block(f, path: Path, line: int) -> bytes:
    """About _LINES_BYTES from `f`, read in the pieces the decompressor gives, so that an
    error names the line it was reading (`line` is the first line of the block)."""
    pieces: list[bytes] = []
    size = 0
    try:
        while size < _LINES_BYTES:
            piece = f.read1(_LINES_BYTES - size)
            if not piece:
                break
            pieces.append(piece)
            size += len(piece)
    except _READ_ERRORS as e:
        raise _read_error(path, line + sum(p.count(b"\n") for p in pieces), e) from None
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _grouped(pairs: Iterator[tuple[int, Any]]) -> Iterator[tuple[list, list]]:
    positions: list[int] = []
    items: list = []
    for pos, item in pairs:
        positions.append(pos)
        items.append(item)
        if len(items) >= _BATCH:
            yield positions, items
            positions, items = [], []
    if items:
        yield positions, items


def _json_array(path: Path, raw, max_bytes: int) -> Iterator[tuple[int, Any]]:
    """Elements of a top-level JSON array, decoded one at a time from 1 MiB chunks.
    Hand-written rather than ijson (not one of our declared dependencies): the per-record byte cap is
    enforced before an element is decoded, and errors name the file and line."""
    text = io.TextIOWrapper(raw, encoding="utf-8-sig", errors="strict")
    decode = json.JSONDecoder().raw_decode
    buf, pos, line, eof = "", 0, 1, False  # `line` is the line number of buf[pos]
    chunk = 1 << 20

    def more() -> bool:
        nonlocal buf, pos, eof
        try:
            data = text.read(chunk)
        except UnicodeDecodeError as e:
            raise StageError(f"{path}:{line}: not UTF-8 ({_first_line(e)})") from None
        except _READ_ERRORS as e:
            raise _read_error(path, line, e) from None
        if not data:
            eof = True
            return False
        buf = buf[pos:] + data
        pos = 0
        return True

    def skip_ws() -> None:
        nonlocal pos, line
        while True:
            n = len(buf)
            while pos < n and buf[pos] in " \t\r\n":
                if buf[pos] == "\n":
                    line += 1
                pos += 1
            if pos < n or not more():
                return

    def fail(msg: str, at: int):
        err_line = line + buf.count("\n", pos, at)
        raise StageError(
            f"{path}:{err_line}: malformed JSON ({msg}); a JSON array cannot be resumed "
            "after an error, so on_bad_row: skip does not apply"
        )

    skip_ws()
    if buf[pos : pos + 1] != "[":
        fail("expected '['", pos)
    pos += 1
    skip_ws()
    if buf[pos : pos + 1] == "]":
        return
    while True:
        skip_ws()
        while True:
            try:
                obj, end = decode(buf, pos)
            except json.JSONDecodeError as e:
                if not eof:
                    if len(buf) - pos > max_bytes:
                        raise _too_long(path, line, max_bytes, "JSON array element")
                    # a large element: grow reads so re-decoding stays linear
                    chunk = min(2 * chunk, max(1 << 20, max_bytes))
                    if more():
                        continue  # the element runs past the buffer
                fail(e.msg, e.pos)
            except RecursionError:
                fail("nested too deeply", pos)
            if end == len(buf) and not eof and more():
                continue  # a number may continue in the next chunk
            break
        if end - pos > max_bytes:  # read whole in one chunk: still refused
            raise _too_long(path, line, max_bytes, "JSON array element")
        yield line, obj
        line += buf.count("\n", pos, end)
        pos = end
        skip_ws()
        c = buf[pos : pos + 1]
        if c == ",":
            pos += 1
            chunk = 1 << 20
            continue
        if c == "]":
            pos += 1
            skip_ws()
            if pos < len(buf):
                fail("data after the closing ']' (JSON lines whose rows are arrays?)", pos)
            return
        fail("expected ',' or ']' after an element" if c else "unexpected end of file", pos)
