"""Arrow arrays as numpy arrays and back, through the arrays' own buffers.

pyarrow's `to_numpy` (and `np.asarray` of an array, which calls it) and `pa.array` of a
numpy array pass through its pandas bridge, which imports pandas the first time in a
process: about 0.25 s, most of a small export's run, and paid again by every tokenize
worker (forked from a process that had not imported it). Every `to_numpy` in stages/ and
every conversion on export's and tokenize's paths go through here instead
(tests/dataset/test_arrays.py keeps them so); other stages still call `pa.array` in places.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

_NUMPY = {pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32,
          pa.int64(): np.int64, pa.uint8(): np.uint8, pa.uint16(): np.uint16,
          pa.uint32(): np.uint32, pa.uint64(): np.uint64, pa.float32(): np.float32,
          pa.float64(): np.float64}


def values(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The values of a primitive or boolean array without nulls: a read-only view of its
    buffer (a copy for booleans, which Arrow packs as bits, and for several chunks)."""
    if isinstance(array, pa.ChunkedArray):
        chunks = [values(chunk) for chunk in array.chunks]
        if len(chunks) == 1:
            return chunks[0]
        return np.concatenate(chunks) if chunks else _empty(array.type)
    if array.null_count:
        raise ValueError(f"{array.type} array holds {array.null_count} nulls")
    if pa.types.is_boolean(array.type):
        return _bits(array)
    if array.type not in _NUMPY:
        raise TypeError(f"{array.type}: not a numeric type")
    dtype = np.dtype(_NUMPY[array.type])
    if not len(array):
        return np.empty(0, dtype)
    return np.frombuffer(array.buffers()[1], dtype, count=len(array),
                         offset=array.offset * dtype.itemsize)


def array(values: np.ndarray) -> pa.Array:
    """A numpy vector of one of the numeric types above as an Arrow array without nulls
    (zero-copy: the array keeps the vector alive)."""
    values = np.ascontiguousarray(values)
    if values.dtype == np.bool_:
        bits = np.packbits(values, bitorder="little")
        return pa.Array.from_buffers(pa.bool_(), len(values), [None, pa.py_buffer(bits)])
    type_ = pa.from_numpy_dtype(values.dtype)
    if type_ not in _NUMPY:
        raise TypeError(f"{values.dtype}: not a numeric type")
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(values)])


def strings(texts: list[str]) -> pa.Array:
    """Python strings as an Arrow string array without nulls (UnicodeEncodeError on a lone
    surrogate, as pa.array raises)."""
    data = [t.encode("utf-8") for t in texts]
    ends = np.zeros(len(data) + 1, np.int64)
    np.cumsum([len(d) for d in data], out=ends[1:])
    if ends[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"{ends[-1]} bytes of text: more than a string array holds")
    return pa.Array.from_buffers(pa.string(), len(data), [
        None, pa.py_buffer(ends.astype(np.int32)), pa.py_buffer(b"".join(data))])


def offsets(column: pa.Array) -> np.ndarray:
    """A list array's row offsets into its values (a view; they need not start at 0)."""
    return values(column.offsets)


def flat(column: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """A list array's row offsets from 0 (int64) and the values its rows hold: an Arrow
    slice, whose nulls each caller reports in its own words."""
    at = offsets(column).astype(np.int64)
    if not len(at):  # an empty array may come without its single 0 offset
        at = np.zeros(1, np.int64)
    return at - at[0], column.values.slice(at[0], at[-1] - at[0])


def _bits(array: pa.Array) -> np.ndarray:
    if not len(array):
        return np.empty(0, bool)
    first, last = array.offset, array.offset + len(array)
    packed = np.frombuffer(array.buffers()[1], np.uint8, count=(last + 7) // 8)
    return np.unpackbits(packed, count=last, bitorder="little")[first:].view(bool)


def _empty(type_: pa.DataType) -> np.ndarray:
    return np.empty(0, bool if pa.types.is_boolean(type_) else _NUMPY[type_])
