"""A dataset folder's shards: listed, read, written (one stream, bounded shards), and
the metadata that makes the folder load."""

from __future__ import annotations

import json
import os

import datasets
import numpy as np
import pyarrow as pa
import pytest

from stages.common.errors import StageError
from stages.dataset import fingerprint
from stages.dataset.schema import ARROW_SCHEMA, FEATURES
from stages.dataset.shards import (
    ShardFile,
    ShardWriter,
    list_shards,
    loaded_rows_and_features,
    open_columns,
    open_shard,
    shard_name,
    write_metadata,
)
from tests.helpers.sets import damaged_tokens_shard


def test_shard_reader_reads_everything_and_keeps_batches_valid(tmp_path):
    path = tmp_path / "x.arrow"
    n = 5000
    table = pa.table({"id": [str(i) for i in range(n)], "source": ["s"] * n,
                      "input_ids": [list(range(i % 50)) for i in range(n)],
                      "loss_mask": [[1] * (i % 50) for i in range(n)],
                      "num_tokens": [i % 50 for i in range(n)],
                      "num_loss_tokens": [i % 50 for i in range(n)]}).cast(ARROW_SCHEMA)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, ARROW_SCHEMA) as w:
        w.write_table(table, max_chunksize=100)
    with open_shard(path) as reader:
        batches = list(reader)  # each batch its own memory, valid after the next is read
    assert pa.Table.from_batches(batches).equals(table)
    first = table.slice(0, 100).column("input_ids").combine_chunks()
    assert batches[0].column("input_ids").equals(first)


def test_list_shards_orders_and_refuses(tmp_path):
    for name in ("b-10.arrow", "b-9.arrow", "a.arrow"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in list_shards(tmp_path)] == ["a.arrow", "b-9.arrow", "b-10.arrow"]
    (tmp_path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "gone.arrow"}]}))
    with pytest.raises(StageError, match="lists gone.arrow, which does not exist"):
        list_shards(tmp_path)
    (tmp_path / "state.json").write_text("{")
    with pytest.raises(StageError, match="state.json: not valid JSON"):
        list_shards(tmp_path)


def test_write_metadata_makes_a_loadable_folder(tmp_path):
    table = pa.Table.from_pydict(
        {"id": ["a"], "source": ["s"], "input_ids": [[1, 2]], "loss_mask": [[0, 1]],
         "num_tokens": [2], "num_loss_tokens": [1]}, schema=ARROW_SCHEMA)
    with pa.OSFile(str(tmp_path / "z.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, ARROW_SCHEMA) as w:
        w.write_table(table)
    write_metadata(tmp_path, ["z.arrow"], "abc")
    ds = datasets.load_from_disk(str(tmp_path))
    assert ds.features == FEATURES and ds[0]["input_ids"] == [1, 2]


def _stream(path, table, chunk=2):
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=chunk)


def _table(n=6):
    return pa.Table.from_pydict(
        {"id": [f"r{i}" for i in range(n)], "source": ["s"] * n,
         "input_ids": [[1, 2, 3]] * n, "loss_mask": [[0, 1, 1]] * n,
         "num_tokens": [3] * n, "num_loss_tokens": [2] * n}, schema=ARROW_SCHEMA)


def test_a_shard_cut_at_a_batch_boundary_is_refused(tmp_path):
    first = tmp_path / "first.arrow"
    _stream(first, _table(2))
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(first.read_bytes()[:-8])  # a stream cut right after a batch
    assert pa.ipc.open_stream(cut.read_bytes()).read_all().num_rows == 2  # pyarrow takes it
    with pytest.raises(StageError, match="cut.arrow: no end-of-stream marker"):
        with open_shard(cut) as reader:
            list(reader)
    with open_shard(first) as reader:
        assert sum(b.num_rows for b in reader) == 2


def test_damaged_offsets_are_an_error_not_a_crash(tmp_path):
    path = tmp_path / "bad.arrow"
    _stream(path, _table(), chunk=6)
    data = path.read_bytes()
    offsets = np.arange(0, 21, 3, dtype="<i4").tobytes()  # input_ids' (and loss_mask's)
    at = data.index(offsets)
    damaged = np.frombuffer(offsets, "<i4").copy()
    damaged[-1] = 1 << 30  # far past the values: reading it unchecked would crash
    path.write_bytes(data[:at] + damaged.tobytes() + data[at + len(offsets):])
    with pytest.raises(StageError, match="bad.arrow: damaged record batch"):
        with open_shard(path) as reader:
            list(reader)


def test_state_json_listing_a_shard_twice_is_refused(tmp_path):
    _stream(tmp_path / "a.arrow", _table())
    (tmp_path / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": "a.arrow"}, {"filename": "a.arrow"}]}))
    with pytest.raises(StageError, match="lists a.arrow more than once"):
        list_shards(tmp_path)




def test_shard_file_writes_a_whole_stream_under_the_shared_name(tmp_path):
    assert shard_name(3, 12) == "data-00003-of-00012.arrow"
    path = tmp_path / shard_name(0, 1)
    with ShardFile(path) as shard:
        for batch in _table(5).to_batches(max_chunksize=2):
            shard.write(batch)
    with open_shard(path) as reader:  # the end-of-stream marker is there
        assert pa.Table.from_batches(list(reader)).equals(_table(5))
    (tmp_path / fingerprint.FILE).write_text("{}")
    write_metadata(tmp_path, [path.name])
    assert loaded_rows_and_features(tmp_path) == (5, FEATURES.to_dict())


def test_a_reader_of_a_few_columns_reads_and_checks_only_those(tmp_path):
    path = damaged_tokens_shard(tmp_path / "data-00000-of-00001.arrow")
    with open_columns(path) as stream:
        (batch,) = list(stream)
        assert batch.column("id").to_pylist() == ["a", "b"]
        with pytest.raises(StageError, match="damaged record batch .*input_ids"):
            batch.lengths("input_ids")
    with pytest.raises(StageError, match="damaged record batch"):
        with open_shard(path) as reader:
            list(reader)


def _rows(path) -> int:
    with open_shard(path) as reader:
        return sum(b.num_rows for b in reader)


def test_shard_writer_bounds_rows_and_bytes_and_names_the_shards(tmp_path):
    by_rows = ShardWriter(tmp_path, max_rows=3, max_bytes=1 << 20)
    for batch in _table(7).to_batches(max_chunksize=2):
        by_rows.write(batch)
    names = by_rows.close()
    assert names == [shard_name(i, 3) for i in range(3)]
    assert [_rows(tmp_path / n) for n in names] == [3, 3, 1]
    one_each = ShardWriter(tmp_path / "bytes", max_rows=100, max_bytes=1)
    (tmp_path / "bytes").mkdir()
    one_each.write(_table(4).to_batches()[0])
    assert len(one_each.close()) == 4  # a shard takes one row over the byte bound
    empty = ShardWriter(tmp_path / "empty", max_rows=3, max_bytes=1 << 20)
    (tmp_path / "empty").mkdir()
    assert empty.close() == [shard_name(0, 1)]  # no rows: one empty shard, still loads


def test_a_shard_cut_while_read_is_a_stage_error_naming_it(tmp_path):
    """Read, not mapped: a shard truncated between two batches is a short read, one
    StageError naming it (mapped, the next batch's pages would be a SIGBUS)."""
    path = tmp_path / "x.arrow"
    n = 4000
    table = pa.table({"id": [str(i) for i in range(n)], "source": ["s"] * n,
                      "input_ids": [list(range(50)) for _ in range(n)],
                      "loss_mask": [[1] * 50 for _ in range(n)],
                      "num_tokens": [50] * n, "num_loss_tokens": [50] * n}).cast(ARROW_SCHEMA)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, ARROW_SCHEMA) as w:
        w.write_table(table, max_chunksize=100)
    size = path.stat().st_size
    with open_shard(path) as reader:
        batches = iter(reader)
        first = next(batches)
        os.truncate(path, size // 2 + 7)
        with pytest.raises(StageError, match=rf"^{path}: cut short while being read "
                                             rf"\({size} bytes, now {size // 2 + 7}\)$"):
            for _ in batches:
                pass
    assert first.column("id")[0].as_py() == "0"  # what was read stays readable


def _read_every_way(path) -> str:
    """What each shard reader makes of `path`: "read", or the StageError's line (any
    other exception fails the caller's test)."""
    try:
        with open_shard(path, ARROW_SCHEMA.names) as reader:
            list(reader)
        with open_columns(path, ARROW_SCHEMA.names) as stream:
            for batch in stream:
                batch.lengths("input_ids")
                batch.column("id")
                batch.read(checked=False)
    except StageError as e:
        return str(e)
    return "read"


def test_every_one_byte_change_is_one_line_naming_the_shard(tmp_path):
    good = tmp_path / "good.arrow"
    _stream(good, _table(2), chunk=2)
    data = good.read_bytes()
    bad = tmp_path / "bad.arrow"
    seen = set()
    for at in range(len(data)):
        # between them, 0xff and a flipped bit reach a negative length, a renamed
        # column, an int wider than 64 bits, a header type of none, a huge body
        for value in {0xFF, data[at] ^ 0x40} - {data[at]}:
            bad.write_bytes(data[:at] + bytes([value]) + data[at + 1:])
            outcome = _read_every_way(bad)
            assert outcome == "read" or (outcome.startswith(f"{bad}: ")
                                         and "\n" not in outcome), (at, value, outcome)
            seen.add(outcome.split(" (")[0])
    assert len(seen) > 4, seen


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_a_compressed_shard_is_refused_before_it_is_decompressed(tmp_path, compression):
    path = tmp_path / "bomb.arrow"
    n = 4 << 20  # 16 MB of zero token ids in a few kB
    table = pa.table({"id": ["x"], "source": ["s"],
                      "input_ids": pa.ListArray.from_arrays([0, n], pa.array(np.zeros(n, np.int32))),
                      "loss_mask": pa.ListArray.from_arrays([0, n], pa.array(np.ones(n, np.int8))),
                      "num_tokens": [n], "num_loss_tokens": [n]}).cast(ARROW_SCHEMA)
    with pa.ipc.new_stream(str(path), ARROW_SCHEMA,
                           options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
        w.write_table(table)
    assert path.stat().st_size < n // 40
    pool = pa.default_memory_pool()
    for opening in (open_shard, open_columns):
        before = pool.max_memory()
        with pytest.raises(StageError, match=rf"^{path}: its record batches are compressed"):
            with opening(path) as batches:
                [b if opening is open_shard else b.column("id") for b in batches]
        assert pool.max_memory() - before < n  # nothing decompressed


@pytest.mark.parametrize("change, message", [
    (lambda t: t.rename_columns(["id", "source", "input]ids", *t.column_names[3:]]),
     "column input_ids is missing"),
    (lambda t: t.set_column(2, "input_ids", t.column(2).cast(pa.list_(pa.int64()))),
     "column input_ids is list<item: int64>, expected list<item: int32>"),
    (lambda t: t.append_column("id", t.column(0)), "has column id more than once"),
])
def test_a_reader_of_the_contracts_columns_refuses_a_shard_without_them(tmp_path, change,
                                                                          message):
    path = tmp_path / "other.arrow"
    _stream(path, change(_table()))
    for opening in (open_shard, open_columns):
        with pytest.raises(StageError, match=rf"^{path}: .*{message}"):
            with opening(path, ("id", "input_ids")):
                pass
        with opening(path):  # validate reads it, to report how it differs
            pass
