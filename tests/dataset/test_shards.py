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
    assert loaded_rows_and_features(tmp_path) == (5, FEATURES)


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
