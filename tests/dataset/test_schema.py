"""The row contract, how a schema differs from it, and validate's row rules."""

from __future__ import annotations

import pyarrow as pa
import pytest

from stages.dataset.schema import (
    ARROW_SCHEMA,
    NOT_NULL_CHECKS,
    ROW_CHECKS,
    castable,
    features_of,
    row_rules,
    row_schema,
    rows_pass,
    schema_differences,
)
from stages.trainers import axolotl, trl


@pytest.mark.parametrize("schema", [ARROW_SCHEMA, trl.SCHEMA, axolotl.SCHEMA],
                         ids=["contract", "trl", "axolotl"])
def test_each_schema_written_is_datasets_own_metadata_and_all(schema):
    """hf_schema builds what datasets would (no stage imports datasets to write shards):
    the same fields and the same `huggingface` metadata, byte for byte, and the features
    read back are the features meant."""
    import datasets

    own = datasets.Features.from_arrow_schema(schema.remove_metadata())
    assert own.arrow_schema == schema
    assert own.arrow_schema.metadata == schema.metadata
    assert own.to_dict() == features_of(schema)
    assert datasets.Features.from_arrow_schema(schema) == own


def test_a_stage_that_only_writes_shards_never_imports_datasets():
    import subprocess
    import sys

    code = ("import sys; import stages.export, stages.tokenize, stages.show; "
            "print('datasets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


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

def test_item_nullability_is_not_a_difference():
    strict = pa.schema([pa.field(f.name, pa.list_(pa.field("item", f.type.value_type, False)))
                        if pa.types.is_list(f.type) else f for f in ARROW_SCHEMA])
    assert schema_differences(strict) == []



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
