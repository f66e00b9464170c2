"""An Arrow IPC stream read message by message from its layout, so that a reader of a
few columns reads only their buffers (`pread` at their offsets) and skips the rest of
each record batch unread: merge's scan of a base set reads its ids and token counts,
a few percent of its bytes, and never maps the file (a mapped file cut short under its
reader is a SIGBUS; a short read here is an error naming the file).

The layout (Arrow's columnar format, IPC section): each message is a continuation
marker (0xFFFFFFFF, absent in pre-1.0 streams), its metadata's length, a Message
flatbuffer, then its body. A RecordBatch message lists a node (length, null count) per
field and a buffer (offset, length into the body) per buffer of each field, both in
depth-first field order. Types whose buffers this module does not lay out (dictionary,
union, view and run-end types) are read whole, by pyarrow. A compressed body is refused:
this pipeline writes none, and a few kB of zstd can hold gigabytes.
"""

from __future__ import annotations

import functools
import os
import struct
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Optional

import numpy as np
import pyarrow as pa

from stages.common.errors import StageError
from stages.dataset import arrays

CONTINUATION = 0xFFFFFFFF
_SCHEMA, _DICTIONARY, _RECORD_BATCH = 1, 2, 3  # Message.header_type
END = -1  # the end-of-stream marker's kind: no header type, 0 included, can be it
# what pyarrow and the flatbuffer parsing raise on bytes that do not hold what they say
BAD_BYTES = (pa.ArrowException, SystemError, ValueError, TypeError, KeyError,
             OverflowError, IndexError, struct.error)


class Damaged(Exception):
    """The bytes do not hold the stream layout."""


class Cut(Exception):
    """A read came back short: the file ends before its layout says it does."""


class Compressed(Exception):
    """A record batch whose body is compressed."""

    def __str__(self) -> str:
        return ("its record batches are compressed (zstd or lz4), which this pipeline never "
                "writes and does not decompress: re-save it uncompressed")


def _named(method):
    """`method` of a Stream or a Batch raising StageError naming the file: cut short
    while being read when it is smaller than when it was opened, else truncated or
    damaged."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        stream = self if isinstance(self, Stream) else self._stream
        try:
            return method(self, *args, **kwargs)
        except (Cut, Damaged, Compressed, *BAD_BYTES) as e:
            now = os.fstat(stream.fd).st_size
            if now < stream.size:
                why = f"cut short while being read ({stream.size} bytes, now {now})"
            elif isinstance(e, Compressed):
                why = str(e)
            elif not hasattr(stream, "schema"):
                why = f"not a readable Arrow stream shard ({e})"
            elif isinstance(e, Cut):
                why = "no end-of-stream marker after its last record batch: the shard is truncated"
            else:
                why = f"damaged record batch ({e})"
            raise StageError(f"{stream.path}: {why}") from None
    return wrapped


class _Table:
    """A flatbuffer table at `pos` of `buf` (fields by their index in the schema)."""

    def __init__(self, buf: bytes, pos: int):
        self.buf, self.pos = buf, pos
        self.vtable = pos - _unpack("<i", buf, pos)
        self.vsize = _unpack("<H", buf, self.vtable)

    def _at(self, i: int) -> Optional[int]:
        slot = 4 + 2 * i
        if slot + 2 > self.vsize:
            return None
        off = _unpack("<H", self.buf, self.vtable + slot)
        return self.pos + off if off else None

    def scalar(self, i: int, fmt: str, default: int = 0) -> int:
        at = self._at(i)
        return default if at is None else _unpack(fmt, self.buf, at)

    def table(self, i: int) -> Optional["_Table"]:
        at = self._at(i)
        return None if at is None else _Table(self.buf, at + _unpack("<I", self.buf, at))

    def pairs(self, i: int) -> np.ndarray:
        """A vector of 16-byte structs of two int64 (FieldNode, Buffer) as an (n, 2) array."""
        at = self._at(i)
        if at is None:
            return np.zeros((0, 2), np.int64)
        start = at + _unpack("<I", self.buf, at)
        n = _unpack("<I", self.buf, start)
        end = start + 4 + 16 * n
        if end > len(self.buf):
            raise Damaged("a vector runs past its message's metadata")
        return np.frombuffer(self.buf, "<i8", 2 * n, start + 4).reshape(n, 2)


def _unpack(fmt: str, buf: bytes, at: int) -> int:
    try:
        return struct.unpack_from(fmt, buf, at)[0]
    except struct.error:
        raise Damaged("an offset runs past its message's metadata") from None


def _layout(type_: pa.DataType) -> Optional[tuple[int, list[pa.DataType]]]:
    """(buffers of the field itself, its children's types), None for a type not laid
    out here."""
    t = pa.types
    if t.is_null(type_):
        return 0, []
    if t.is_boolean(type_) or t.is_integer(type_) or t.is_floating(type_) or \
            t.is_temporal(type_) or t.is_decimal(type_) or t.is_fixed_size_binary(type_):
        return 2, []
    if t.is_string(type_) or t.is_binary(type_) or t.is_large_string(type_) or \
            t.is_large_binary(type_):
        return 3, []
    if t.is_list(type_) or t.is_large_list(type_) or t.is_map(type_):
        return 2, [type_.value_field.type if not t.is_map(type_) else
                   pa.struct([type_.key_field, type_.item_field])]
    if t.is_fixed_size_list(type_):
        return 1, [type_.value_type]
    if t.is_struct(type_):
        return 1, [type_.field(k).type for k in range(type_.num_fields)]
    return None


def _count(type_: pa.DataType) -> Optional[tuple[int, int]]:
    """(nodes, buffers) a field of `type_` takes, its children's included."""
    laid = _layout(type_)
    if laid is None:
        return None
    nodes, buffers = 1, laid[0]
    for child in laid[1]:
        sub = _count(child)
        if sub is None:
            return None
        nodes, buffers = nodes + sub[0], buffers + sub[1]
    return nodes, buffers


class Batch:
    """One record batch of the stream, its body unread until a column is asked for."""

    def __init__(self, stream: "Stream", meta: _Table, body: int, body_len: int,
                 message: int, num_rows: int):
        self._stream, self._body, self._body_len = stream, body, body_len
        self._message = message
        self.num_rows = num_rows
        self._nodes, self._buffers = meta.pairs(1), meta.pairs(2)
        # every column's, read or not: merge links a base shard it scanned a few columns
        # of, and a negative length is what makes pyarrow's len() a SystemError later
        if (self._nodes < 0).any() or (self._nodes[:, 1] > self._nodes[:, 0]).any():
            raise Damaged("a field node with a negative length or more nulls than values")
        if (self._buffers < 0).any() or (self._buffers.sum(axis=1) > body_len).any():
            raise Damaged("a buffer lies outside its record batch's body")

    @_named
    def read(self, checked: bool = True) -> pa.RecordBatch:
        """The whole batch, every column, read by pyarrow and checked in full; with
        `checked` false, unchecked: for a caller that checks each value it touches (one
        row of a batch whose other rows may be damaged)."""
        raw = self._stream.pread(self._message, self._body + self._body_len - self._message)
        try:
            message = pa.ipc.read_message(pa.py_buffer(raw))
            batch = pa.ipc.read_record_batch(message, self._stream.schema)
            if checked:
                batch.validate(full=True)
        except (OSError, *BAD_BYTES) as e:
            raise Damaged(str(e)) from None
        return batch

    @_named
    def column(self, name: str) -> pa.Array:
        """Column `name`, only its own buffers read, checked in full."""
        type_ = self._stream.field(name).type
        place = self._stream.places.get(name)
        if place is None:
            return self.read().column(name)
        array = self._array(type_, place[0], place[1])[0]
        if len(array) != self.num_rows:
            raise Damaged(f"column {name!r} holds {len(array)} rows in a batch of {self.num_rows}")
        try:
            array.validate(full=True)
        except BAD_BYTES as e:
            raise Damaged(str(e)) from None
        return array

    @_named
    def lengths(self, name: str) -> np.ndarray:
        """The lengths of list column `name`'s rows from its offsets alone (its values
        unread), checked against the values' count."""
        type_ = self._stream.field(name).type
        if not (pa.types.is_list(type_) or pa.types.is_large_list(type_)):
            raise StageError(f"{self._stream.path}: column {name} is {type_}, not a list")
        place = self._stream.places.get(name)
        if place is None:
            return np.diff(arrays.offsets(self.read().column(name)))
        node, buf = place
        rows, values = self._node(node)[0], self._node(node + 1)[0]
        if rows != self.num_rows:
            raise Damaged(f"column {name!r} holds {rows} rows in a batch of {self.num_rows}")
        if not rows:  # an empty list column may have no offsets at all
            return np.zeros(0, np.int64)
        width = "<i8" if pa.types.is_large_list(type_) else "<i4"
        raw = self._buffer(buf + 1)
        if len(raw) < (rows + 1) * np.dtype(width).itemsize:
            raise Damaged(f"column {name!r}: its offsets buffer is short")
        offsets = np.frombuffer(raw, width, rows + 1).astype(np.int64)
        lengths = np.diff(offsets)
        if offsets[0] < 0 or offsets[-1] > values or (lengths < 0).any():
            raise Damaged(f"column {name!r}: offsets outside its {values} values")
        return lengths

    def _node(self, i: int) -> tuple[int, int]:
        if i >= len(self._nodes):
            raise Damaged("fewer field nodes than the schema's fields")
        length, nulls = self._nodes[i]
        return int(length), int(nulls)

    def _buffer(self, i: int) -> bytes:
        if i >= len(self._buffers):
            raise Damaged("fewer buffers than the schema's fields")
        offset, length = (int(v) for v in self._buffers[i])
        if offset < 0 or length < 0 or offset + length > self._body_len:
            raise Damaged(f"buffer {i} lies outside its record batch's body")
        return self._stream.pread(self._body + offset, length) if length else b""

    def _array(self, type_: pa.DataType, node: int, buf: int) -> tuple[pa.Array, int, int]:
        """The array of a field of `type_` whose node and first buffer are `node` and
        `buf`; with the node and buffer after it."""
        length, nulls = self._node(node)
        own, child_types = _layout(type_)
        raw = [self._buffer(buf + k) for k in range(own)]
        # no nulls: the validity buffer may be absent (length 0); a null column has none
        buffers = [pa.py_buffer(raw[0]) if own and nulls else None]
        buffers += [pa.py_buffer(b) for b in raw[1:]]
        node, buf = node + 1, buf + own
        children = []
        for child in child_types:
            array, node, buf = self._array(child, node, buf)
            children.append(array)
        try:
            array = pa.Array.from_buffers(type_, length, buffers, nulls, children=children or None)
        except BAD_BYTES as e:
            raise Damaged(str(e)) from None
        return array, node, buf


class Stream:
    """The record batches of the IPC stream in `path`, open as the regular file `fd`,
    each a Batch; every error a StageError naming the file."""

    @_named
    def __init__(self, path: Path, fd: int):
        self.path, self.fd, self.size = path, fd, os.fstat(fd).st_size
        if hasattr(os, "posix_fadvise"):  # no read-around: it would pull in the columns skipped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.end: Optional[int] = None  # where the end-of-stream marker ends, once read
        self._pos = 0
        kind, _, body, body_len = self._message()
        if kind != _SCHEMA:
            raise Damaged("the stream does not start with a schema message")
        try:
            self.schema: pa.Schema = pa.ipc.read_schema(pa.py_buffer(self.pread(0, body)))
            self.schema.names  # field names that are not UTF-8 raise here, not later
        except (OSError, *BAD_BYTES) as e:
            raise Damaged(str(e)) from None
        self._pos = body + body_len
        # (first node, first buffer) of each top-level column, while every column
        # before it is one this module lays out
        self.places: dict[str, tuple[int, int]] = {}
        node = buf = 0
        for field in self.schema:
            counted = _count(field.type)
            if counted is None:
                break
            self.places[field.name] = (node, buf)
            node, buf = node + counted[0], buf + counted[1]

    def field(self, name: str) -> pa.Field:
        """The column `name`; StageError naming the file when it has none, or two."""
        # get_field_index gives -1 for a name given twice as for one that is absent
        twice = self.schema.names.count(name)
        if twice > 1:
            raise StageError(f"{self.path}: has column {name} {twice} times (a column "
                             "read by name must be there once)")
        index = self.schema.get_field_index(name)
        if index < 0:
            raise StageError(f"{self.path}: has no column {name} (columns: "
                             f"{', '.join(self.schema.names)[:300]})")
        return self.schema.field(index)

    def pread(self, at: int, n: int) -> bytes:
        data = os.pread(self.fd, n, at)
        if len(data) != n:
            raise Cut(f"{n} bytes at {at}, read {len(data)}")
        return data

    def _message(self) -> Head:
        head = read_head(self.pread, self._pos, self.size)
        if head.kind == END:
            self.end = head.body
        return head

    def __iter__(self) -> Iterator[Batch]:
        while True:
            batch = self._next()
            if batch is None:
                return
            yield batch

    @_named
    def _next(self) -> Optional[Batch]:
        """The next record batch, its body unread; None at the end of the stream."""
        start = self._pos
        kind, header, body, body_len = self._message()
        self._pos = body + body_len
        if kind == END:
            if self.end - start != 8 or self.end != os.fstat(self.fd).st_size:
                raise Damaged("its end-of-stream marker is not the 8 bytes that end the file")
            return None
        if kind == _DICTIONARY:
            raise Damaged("dictionary batches are not part of a shard's columns")
        if kind != _RECORD_BATCH or header is None:
            raise Damaged(f"message type {kind} where a record batch belongs")
        rows = header.scalar(0, "<q")
        if rows < 0:
            raise Damaged(f"a record batch of {rows} rows")
        if compressed(Head(kind, header, body, body_len)):
            raise Compressed()
        return Batch(self, header, body, body_len, start, rows)


class Head(NamedTuple):
    """A message's kind (Message.header_type, or END), header table, body start (after
    the end-of-stream marker: where it ends) and body length."""
    kind: int
    header: Optional[_Table]
    body: int
    body_len: int


def read_head(pread: Callable[[int, int], bytes], start: int, size: int) -> Head:
    """The head of the message at `start` of a stream of `size` bytes, read with
    `pread(at, n)` (its body unread); Damaged when the bytes do not hold one, Cut when
    the file ends inside it."""
    (word,) = struct.unpack("<I", pread(start, 4))
    at = start + 4
    if word == CONTINUATION:
        (word,) = struct.unpack("<I", pread(at, 4))
        at += 4
    if word == 0:
        return Head(END, None, at, 0)
    if word > size:
        raise Damaged(f"a message claims {word} bytes of metadata")
    meta = pread(at, word)
    message = _Table(meta, _unpack("<I", meta, 0))
    kind = message.scalar(1, "<B")
    body_len = message.scalar(3, "<q")
    body = at + word
    # checked before anything allocates a body: a damaged length would be a huge malloc
    if body_len < 0 or body + body_len > size:
        raise Damaged(f"a message's body ({body_len} bytes) runs past the file's end")
    return Head(kind, message.table(2), body, body_len)


def compressed(head: Head) -> bool:
    """Whether the message's body is compressed: its RecordBatch (a DictionaryBatch's
    own) has a BodyCompression."""
    header = head.header
    if head.kind == _DICTIONARY and header is not None:
        header = header.table(1)
    return head.kind in (_RECORD_BATCH, _DICTIONARY) and header is not None and \
        header.table(3) is not None
