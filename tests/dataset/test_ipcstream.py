"""An IPC stream read by its layout: each column from its own buffers equals pyarrow's
read of the whole batch, the other buffers stay unread, and damaged or cut bytes are a
StageError naming the file, never a crash."""

from __future__ import annotations

import os
import random

import numpy as np
import pyarrow as pa
import pytest

from stages.common.errors import StageError
from stages.dataset.ipcstream import Stream


def _every_type(n: int = 3000) -> pa.Table:
    return pa.table({
        "id": pa.array([f"r{i}" if i % 7 else None for i in range(n)]),
        "tokens": pa.array([list(range(i % 40)) for i in range(n)], pa.list_(pa.int32())),
        "big": pa.array([[i] * (i % 3) for i in range(n)], pa.large_list(pa.int64())),
        "count": pa.array(range(n), pa.int64()),
        "nested": pa.array([{"a": i, "b": [str(i)] if i % 5 else None} for i in range(n)]),
        "flag": pa.array([i % 2 == 0 for i in range(n)]),
        "text": pa.array([str(i) * 3 for i in range(n)], pa.large_string()),
        "nothing": pa.nulls(n),
    })


def _write(path, table, **options) -> None:
    with pa.ipc.new_stream(path, table.schema,
                           options=pa.ipc.IpcWriteOptions(**options)) as w:
        w.write_table(table, max_chunksize=700)


def _whole(path) -> list[pa.RecordBatch]:
    with pa.OSFile(str(path)) as f:
        return list(pa.ipc.open_stream(f))


def test_each_column_from_its_buffers_is_pyarrows_column(tmp_path):
    path = tmp_path / "s.arrow"
    table = _every_type()
    _write(path, table)
    with open(path, "rb") as f:
        stream = Stream(path, f.fileno())
        assert stream.schema == table.schema
        batches = list(stream)
        expected = _whole(path)
        assert [b.num_rows for b in batches] == [b.num_rows for b in expected] != []
        for got, want in zip(batches, expected):
            for name in table.column_names:
                assert got.column(name).equals(want.column(name)), name
            for name in ("tokens", "big"):
                assert got.lengths(name).tolist() == \
                    np.diff(want.column(name).offsets.to_numpy()).tolist()
            assert got.read().equals(want)


def test_a_few_columns_read_only_their_own_bytes(tmp_path):
    path = tmp_path / "s.arrow"
    n = 2000
    _write(path, pa.table({"id": [f"row-{i}" for i in range(n)],
                           "tokens": pa.array([list(range(500))] * n, pa.list_(pa.int32()))}))
    read = []
    with open(path, "rb") as f:
        stream = Stream(path, f.fileno())
        pread = stream.pread
        stream.pread = lambda at, k: read.append(k) or pread(at, k)
        rows = sum(len(b.column("id")) + 0 * b.lengths("tokens").sum() for b in stream)
    assert rows == n
    # ids (~20 KB) and the token offsets (~8 KB) of a 4 MB file, and the metadata
    assert sum(read) < path.stat().st_size / 50, (sum(read), path.stat().st_size)


def _error_or_rows(path) -> str:
    with open(path, "rb") as f:
        try:
            stream = Stream(path, f.fileno())
            for batch in stream:
                for name in stream.schema.names:
                    batch.column(name)
                batch.lengths("tokens")
        except StageError as e:
            return str(e)
    return "read"


def test_damaged_bytes_are_a_stage_error_naming_the_file_never_a_crash(tmp_path):
    good = tmp_path / "good.arrow"
    _write(good, _every_type(300))
    data = good.read_bytes()
    rng = random.Random(5)
    bad = tmp_path / "bad.arrow"
    seen = set()
    for _ in range(300):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(damaged))
            damaged[at] = rng.randrange(256)
        bad.write_bytes(bytes(damaged))
        outcome = _error_or_rows(bad)  # any other exception fails the test
        assert outcome == "read" or outcome.startswith(f"{bad}: "), outcome
        seen.add(outcome.split(" (")[0])
    assert len(seen) > 2  # the damage reached more than one check


def test_a_stream_cut_at_or_before_its_end_is_named_so(tmp_path):
    path = tmp_path / "s.arrow"
    _write(path, _every_type(1500))
    data = path.read_bytes()
    path.write_bytes(data[:-8])  # cut at a batch boundary: pyarrow would take it whole
    assert "no end-of-stream marker" in _error_or_rows(path)
    path.write_bytes(data + b"\0" * 8)
    assert "end-of-stream marker" in _error_or_rows(path)
    path.write_bytes(b"not arrow at all, but long enough")
    assert _error_or_rows(path).startswith(f"{path}: not a readable Arrow stream shard")
    path.write_bytes(data)
    with open(path, "rb") as f:
        stream = Stream(path, f.fileno())
        batches = iter(stream)
        next(batches).column("id")
        os.truncate(path, len(data) // 2)
        with pytest.raises(StageError, match=rf"cut short while being read \({len(data)} "
                                             rf"bytes, now {len(data) // 2}\)"):
            for batch in batches:
                batch.column("tokens")


def test_an_empty_batch_has_no_rows_and_no_lengths(tmp_path):
    path = tmp_path / "s.arrow"
    table = _every_type(0)
    with pa.ipc.new_stream(path, table.schema) as w:
        w.write_batch(pa.RecordBatch.from_pylist([], schema=table.schema))
    with open(path, "rb") as f:
        (batch,) = list(Stream(path, f.fileno()))
        assert batch.num_rows == 0 and batch.lengths("tokens").tolist() == []
        assert batch.column("id").to_pylist() == []


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_a_compressed_body_is_refused_unread(tmp_path, compression):
    path = tmp_path / "s.arrow"
    _write(path, _every_type(), compression=compression)
    with open(path, "rb") as f:
        stream = Stream(path, f.fileno())
        read = []
        pread = stream.pread
        stream.pread = lambda at, k: read.append(k) or pread(at, k)
        with pytest.raises(StageError, match=rf"^{path}: its record batches are compressed"):
            list(stream)
    assert sum(read) < 1000  # the first message's head, not its body


def test_every_one_byte_change_is_a_stage_error_naming_the_file(tmp_path):
    good = tmp_path / "good.arrow"
    _write(good, pa.table({"id": ["a", "bc"], "tokens": pa.array([[1], [2, 3]], pa.list_(pa.int32()))}))
    data = good.read_bytes()
    bad = tmp_path / "bad.arrow"
    for at in range(len(data)):
        for value in {0xFF, 0x00, data[at] ^ 0x40} - {data[at]}:
            bad.write_bytes(data[:at] + bytes([value]) + data[at + 1:])
            with open(bad, "rb") as f:
                try:  # any other exception fails the test
                    for batch in Stream(bad, f.fileno()):
                        batch.read(checked=False)
                        batch.lengths("tokens")
                        batch.column("id")
                except StageError as e:
                    assert str(e).startswith(f"{bad}: "), (at, value, e)


def test_a_column_the_shard_lacks_is_named(tmp_path):
    path = tmp_path / "s.arrow"
    _write(path, pa.table({"id": ["a"], "count": [1]}))
    with open(path, "rb") as f:
        (batch,) = Stream(path, f.fileno())
        with pytest.raises(StageError, match=rf"^{path}: has no column tokens"):
            batch.column("tokens")
        with pytest.raises(StageError, match=rf"^{path}: has no column tokens"):
            batch.lengths("tokens")
        with pytest.raises(StageError, match=rf"^{path}: column count is int64, not a list"):
            batch.lengths("count")


def test_a_column_given_twice_is_named_so_not_missing(tmp_path):
    path = tmp_path / "s.arrow"
    _write(path, pa.Table.from_arrays([pa.array([1]), pa.array([2]), pa.array(["a"])],
                                      names=["count", "count", "id"]))
    with open(path, "rb") as f:
        (batch,) = Stream(path, f.fileno())
        with pytest.raises(StageError, match=rf"^{path}: has column count 2 times \("):
            batch.column("count")
        assert batch.column("id").to_pylist() == ["a"]
