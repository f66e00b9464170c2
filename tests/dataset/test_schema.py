"""The row contract and the shard helpers merge and validate share."""

from __future__ import annotations

import json
import os

import datasets
import numpy as np
import pyarrow as pa
import pytest

from stages.common.errors import StageError
from stages.dataset.schema import (
    ARROW_SCHEMA,
    FEATURES,
    FINGERPRINT_FILE,
    NOT_NULL_CHECKS,
    ROW_CHECKS,
    ShardFile,
    castable,
    list_shards,
    loaded_rows_and_features,
    open_shard,
    row_rules,
    row_schema,
    rows_pass,
    schema_differences,
    shard_name,
    state_hash,
    write_metadata,
)


def test_contract_types_are_explicit():
    assert [(f.name, str(f.type)) for f in ARROW_SCHEMA] == [
        ("id", "string"), ("source", "string"), ("input_ids", "list<item: int32>"),
        ("loss_mask", "list<item: int8>"), ("num_tokens", "int32"),
        ("num_loss_tokens", "int32")]


def test_schema_differences_name_column_and_both_types():
    assert schema_differences(ARROW_SCHEMA) == []
    assert schema_differences(ARROW_SCHEMA.remove_metadata()) == []
    nested_name = pa.schema([pa.field("input_ids", pa.list_(pa.field("element", pa.int32())))
                             if f.name == "input_ids" else f for f in ARROW_SCHEMA])
    assert schema_differences(nested_name) == []  # datasets loads it the same way
    wide = pa.schema([pa.field(f.name, pa.large_list(pa.int32())) if f.name == "input_ids"
                      else f for f in ARROW_SCHEMA])
    assert schema_differences(wide) == [
        "column input_ids is large_list<item: int32>, expected list<item: int32>"]
    reordered = pa.schema(list(ARROW_SCHEMA)[::-1])
    assert schema_differences(reordered)[0].startswith("columns are in order")
    missing = pa.schema(list(ARROW_SCHEMA)[:-1])
    assert schema_differences(missing) == [
        "column num_loss_tokens is missing (expected int32)"]


@pytest.mark.parametrize("src, dst, ok", [
    (pa.int64(), pa.int32(), True),
    (pa.uint16(), pa.int8(), True),
    (pa.large_list(pa.int64()), pa.list_(pa.int32()), True),
    (pa.large_string(), pa.string(), True),
    (pa.float32(), pa.int32(), False),
    (pa.string(), pa.int32(), False),
    (pa.list_(pa.string()), pa.list_(pa.int32()), False),
])
def test_castable(src, dst, ok):
    assert castable(src, dst) is ok


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
    with open_shard(path, drop_behind=True) as reader:
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


def test_item_nullability_is_not_a_difference():
    strict = pa.schema([pa.field(f.name, pa.list_(pa.field("item", f.type.value_type, False)))
                        if pa.types.is_list(f.type) else f for f in ARROW_SCHEMA])
    assert schema_differences(strict) == []


def test_shard_file_writes_a_whole_stream_under_the_shared_name(tmp_path):
    assert shard_name(3, 12) == "data-00003-of-00012.arrow"
    path = tmp_path / shard_name(0, 1)
    with ShardFile(path) as shard:
        for batch in _table(5).to_batches(max_chunksize=2):
            shard.write(batch)
    with open_shard(path) as reader:  # the end-of-stream marker is there
        assert pa.Table.from_batches(list(reader)).equals(_table(5))
    (tmp_path / FINGERPRINT_FILE).write_text("{}")
    write_metadata(tmp_path, [path.name])
    assert loaded_rows_and_features(tmp_path) == (5, FEATURES)


def test_state_hash_follows_the_fingerprint_and_each_end_of_each_shard(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / FINGERPRINT_FILE).write_text('{"a": 1}')
    data = bytearray(rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes())
    (tmp_path / "s.arrow").write_bytes(data)
    first = state_hash(tmp_path, ["s.arrow"])
    assert state_hash(tmp_path, ["s.arrow"]) == first and len(first) == 16
    write_metadata(tmp_path, ["s.arrow"])
    assert json.loads((tmp_path / "state.json").read_text())["_fingerprint"] == first
    seen = {first}
    for at in (0, len(data) - 1):  # a byte of the head, a byte of the tail
        changed = bytearray(data)
        changed[at] ^= 1
        (tmp_path / "s.arrow").write_bytes(changed)
        seen.add(state_hash(tmp_path, ["s.arrow"]))
    (tmp_path / "s.arrow").write_bytes(data)
    (tmp_path / FINGERPRINT_FILE).write_text('{"a": 2}')
    seen.add(state_hash(tmp_path, ["s.arrow"]))
    assert len(seen) == 4


def _summary(n=4, **columns):
    import polars as pl

    base = {"id": [f"r{i}" for i in range(n)], "source": ["s"] * n,
            "input_ids_len": [5] * n, "loss_mask_len": [5] * n, "ids_out_of_range": [0] * n,
            "mask_not_binary": [0] * n, "supervised": [3] * n, "longest_run": [3] * n,
            "num_tokens": [5] * n, "num_loss_tokens": [3] * n}
    base.update(columns)
    return pl.DataFrame(base, schema={k: pl.String if k in ("id", "source") else pl.Int64
                                      for k in base})


@pytest.mark.parametrize("column,values", [
    (None, None),
    ("id", [" ", "a", "b", "c"]), ("id", [None, "a", "b", "c"]),
    ("source", ["", "s", "s", "s"]), ("input_ids_len", [5, 5, 9, 5]),
    ("loss_mask_len", [5, 4, 5, 5]), ("loss_mask_len", [5, None, 5, 5]),
    ("ids_out_of_range", [0, 1, 0, 0]), ("ids_out_of_range", [0, None, 0, 0]),
    ("mask_not_binary", [0, 0, 2, 0]), ("supervised", [3, 0, 3, 3]),
    ("longest_run", [3, 1, 3, 3]), ("num_tokens", [5, 5, 5, 6]),
    ("num_loss_tokens", [3, 3, 2, 3]), ("num_loss_tokens", [None, 3, 3, 3]),
])
def test_the_quick_pass_test_says_yes_only_where_pandera_finds_nothing(column, values):
    import pandera.errors

    rules = row_rules(max_seq_len=8, min_loss_tokens=1)
    assert {name for checks in rules.values() for name, _ in checks} | set(
        NOT_NULL_CHECKS.values()) == set(ROW_CHECKS)
    frame = _summary(**({column: values} if column else {}))
    try:
        row_schema(rules).validate(frame, lazy=True)
        clean = True
    except pandera.errors.SchemaErrors:
        clean = False
    if rows_pass(frame, rules):
        assert clean
    assert rows_pass(frame, rules) == (column is None)  # a null goes the long way too


def _damaged_tokens_shard(path):
    """A shard of rows a (2 tokens) and b (3), whose input_ids offsets say b ends at
    token 99 of 5 (its id column sound)."""
    import numpy as np
    import pyarrow as pa

    from stages.dataset.schema import ARROW_SCHEMA, ShardFile

    batch = pa.RecordBatch.from_arrays(
        [pa.array(["a", "b"]), pa.array(["s", "s"]),
         pa.array([[7, 8], [9, 10, 11]], pa.list_(pa.int32())),
         pa.array([[0, 1], [0, 1, 1]], pa.list_(pa.int8())), pa.array([2, 3], pa.int32()),
         pa.array([1, 2], pa.int32())], schema=ARROW_SCHEMA)
    with ShardFile(path) as shard:
        shard.write(batch)
    raw = path.read_bytes()
    good = np.array([0, 2, 5], np.int32).tobytes()
    assert raw.count(good) == 2  # input_ids' offsets, then loss_mask's
    path.write_bytes(raw.replace(good, np.array([0, 2, 99], np.int32).tobytes(), 1))
    return path


def test_a_reader_checks_only_the_columns_it_is_given(tmp_path):
    from stages.common.errors import StageError
    from stages.dataset.schema import open_shard

    path = _damaged_tokens_shard(tmp_path / "data-00000-of-00001.arrow")
    with open_shard(path, check=("id",)) as reader:
        assert [b.column("id").to_pylist() for b in reader] == [["a", "b"]]
    with pytest.raises(StageError, match="damaged record batch"):
        with open_shard(path) as reader:
            list(reader)


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
