"""The one reader of what a stage reads but does not control: a file only when it is a
regular file (a FIFO or a device named like a shard or a metadata file would block its
reader or never end), only up to a size; JSON only to MAX_FILE_DEPTH levels of nesting (a
deeper value parses, then makes every recursive walk of it -- redaction, comparison,
encoding -- raise RecursionError far from where it was read); Arrow and Parquet files
read, never memory-mapped (a mapped file cut short under its reader is a SIGBUS). Each
refusal is a StageError naming the file; `writable` says whether a JSON value read can be
written back as UTF-8.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from stages.common.errors import StageError, json_type

# levels of nesting a value may have (params, a row's tools and tool calls): params need 5,
# real tool schemas a few; chat templates recurse per level
MAX_DEPTH = 64
# a JSON document: such a value inside its file's own few levels (a row around its tools,
# a reply around its tool calls), so the value's check names what is too deep; far below
# Python's recursion limit
MAX_FILE_DEPTH = MAX_DEPTH + 36
# a metadata file (state.json, fingerprint.json, a report, lineage.json, dvc.lock) is
# kilobytes to a few MB; past this it is not one
MAX_METADATA_BYTES = 64 << 20


def json_object(text: bytes | str, where: str) -> dict:
    """`text` parsed as a JSON object, or a StageError naming `where` (file:line)."""
    try:
        doc = parse_json(text)
    except ValueError as e:
        raise StageError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise StageError(f"{where}: expected a JSON object, got {json_type(doc)}")
    return doc


def parse_json(text: bytes | str, levels: int = MAX_FILE_DEPTH) -> Any:
    """`text` parsed as JSON nested at most `levels` levels, else ValueError. A file that
    wraps a document read with the default (a cache record around a reply) allows as many
    more levels as it adds."""
    try:
        doc = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    # a value cannot nest deeper than it has brackets: most text needs no walk at all
    brackets = text.count(b"[" if isinstance(text, bytes) else "[") + \
        text.count(b"{" if isinstance(text, bytes) else "{")
    if brackets > levels and deeper_than(doc, levels):
        raise ValueError("nested too deeply")
    return doc


def deeper_than(value: Any, levels: int) -> bool:
    """Whether the JSON value nests more than `levels` lists and objects (no recursion)."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        if depth == levels:
            return True
        stack.extend((child, depth + 1) for child in node if isinstance(child, (dict, list)))
    return False


def json_file(path: str | Path, limit: int = MAX_METADATA_BYTES) -> dict:
    """The JSON object in the regular file `path` of at most `limit` bytes, else a
    StageError naming it (FileNotFoundError when it does not exist)."""
    return json_object(read_regular(path, limit), str(path))


def read_regular(path: str | Path, limit: int = MAX_METADATA_BYTES) -> bytes:
    """The bytes of the regular file `path` if it holds at most `limit`, else StageError
    (FileNotFoundError when it does not exist: the caller knows what that means)."""
    try:
        with open_regular(path) as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise StageError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(data) > limit:
        raise StageError(f"{path}: larger than {limit} bytes; not a file this stage reads whole")
    return data


def absent(path: str | Path, hint: str) -> str:
    """Why `path`, which a stage expected to find, is not there, as an error line: a link
    to nowhere or a loop of links is not "not found", and `hint` (what makes it) would
    mislead."""
    if os.path.islink(path):
        return f"{path}: a link that leads nowhere (a missing target or a loop of links)"
    return f"{path}: not found ({hint})"


def existing_folder(path: str | Path, hint: str) -> Path:
    """`path` if it is a folder (a link to one included), else StageError saying what it
    is instead (`absent` when nothing is there)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise StageError(absent(path, hint)) from None
    except OSError as e:  # a loop of links, a component that is a file
        raise StageError(f"{path}: cannot be reached ({e.strerror})") from None
    if not stat.S_ISDIR(mode):
        kind = ("a file" if stat.S_ISREG(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device or a socket")
        raise StageError(f"{path}: is {kind}, not a dataset folder")
    return Path(path)


def regular(path: str | Path) -> Path:
    """`path` if it is a regular file (a link to one included), checked by os.stat before
    a library that opens it by name (Parquet, a memory map) would wait on a FIFO; else
    StageError naming it (FileNotFoundError, IsADirectoryError as they are)."""
    _check_mode(path, os.stat(path).st_mode)
    return Path(path)


def _check_mode(path: str | Path, mode: int) -> None:
    """Nothing, for a regular file; IsADirectoryError for a folder; else StageError."""
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device or a socket"
        raise StageError(f"{path}: not a regular file ({kind})")


def open_regular(path: str | Path, buffering: int = -1) -> BinaryIO:
    """`path` opened for reading if it is a regular file (a link to one included), else
    StageError (IsADirectoryError for a folder); opening never waits, as opening a FIFO
    would until a writer came."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _check_mode(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return open(fd, "rb", buffering=buffering)


@contextlib.contextmanager
def arrow_input(path: str | Path) -> Iterator:
    """`path` (a regular file) as a pyarrow input file, read, never memory-mapped: a
    mapped file cut short under its reader (another process truncating it) kills the
    process with SIGBUS on the next page touched, which Python cannot turn into an
    error; read, a cut file is a short read the caller reports naming it."""
    import pyarrow as pa

    with open_regular(path) as f:
        same = f"/proc/self/fd/{f.fileno()}"  # Linux: the file just checked, opened again
        if os.path.exists(same):  # Arrow's own reads: a third faster than through Python's
            with pa.OSFile(same) as source:
                yield source
        else:
            yield pa.PythonFile(f, mode="r")


@contextlib.contextmanager
def parquet(path: str | Path) -> Iterator:
    """`path` (a regular file) opened as a pyarrow ParquetFile, read through open_regular;
    a footer naming a column in bytes that are not UTF-8 is a StageError."""
    import pyarrow.parquet as pq

    with arrow_input(path) as source:
        try:
            opened = pq.ParquetFile(source)
        except UnicodeDecodeError:  # pyarrow decodes the footer's names as it opens
            raise StageError(f"{path}: a column name in the Parquet footer is not UTF-8 "
                             "text; not a Parquet file this stage reads") from None
        with opened as f:
            yield f


# the fewest bytes a value of a Parquet physical type takes once decoded into Arrow (a
# string at least its offset): from these and a column chunk's value count, the footer
# bounds what a run-length encoded page expands to, which its own sizes do not
_DECODED_BYTES = {"BOOLEAN": 1, "INT32": 4, "INT64": 8, "INT96": 12, "FLOAT": 4, "DOUBLE": 8,
                  "BYTE_ARRAY": 4, "FIXED_LEN_BYTE_ARRAY": 1}


def check_parquet_rows(path: str | Path, meta, columns: list[str], row_bytes: int,
                       limit: str) -> None:
    """Refuse, from the footer alone, a column of `columns` whose rows average more than
    `row_bytes` once decoded (a one-row Parquet bomb): a page is decoded whole, so such a
    file would fill memory while being read. `limit` names where row_bytes comes from."""
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            name = chunk.path_in_schema.split(".")[0]
            size = max(chunk.total_uncompressed_size,
                       chunk.num_values * _DECODED_BYTES.get(chunk.physical_type, 1))
            if name in columns and size > row_bytes * max(group.num_rows, 1):
                raise StageError(f"{path}: row group {g}: column {name} holds {size} bytes "
                                 f"for {group.num_rows} rows, over {limit} a row")


def writable(value: Any) -> bool:
    """Every string in a JSON value encodes as UTF-8."""
    if isinstance(value, str):
        if value.isascii():
            return True
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(writable(k) and writable(v) for k, v in value.items())
    if isinstance(value, list):
        return all(writable(v) for v in value)
    return True
