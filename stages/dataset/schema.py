"""The tokenized-row contract: explicit Arrow/datasets features shared by tokenize,
merge and validate (datasets would infer int64 for unknown columns) and how a schema
differs from it; and the row rules validate checks row summaries with (as one polars
pass and a pandera schema). Where such rows sit on disk: stages/dataset/shards.py."""

from __future__ import annotations

import json
from typing import Callable

import pyarrow as pa

# datasets' name for each Arrow type a row holds (its `Value` dtypes)
_DTYPES = {pa.string(): "string", pa.int8(): "int8", pa.int32(): "int32", pa.int64(): "int64"}


def _feature(type_: pa.DataType) -> dict:
    """How datasets describes an Arrow type of a row (as `Features.to_dict` writes it)."""
    if pa.types.is_list(type_):
        return {"feature": _feature(type_.value_type), "_type": "List"}
    return {"dtype": _DTYPES[type_], "_type": "Value"}


def hf_schema(fields: list[tuple[str, pa.DataType]]) -> pa.Schema:
    """An Arrow schema as datasets writes one: the fields, and in its `huggingface`
    metadata the features datasets reads them back as. Built here, not by datasets,
    whose import costs a stage that only writes shards half a second at every start
    (tests/dataset/test_schema.py holds it equal to datasets' own)."""
    features = {name: _feature(type_) for name, type_ in fields}
    return pa.schema([pa.field(name, type_) for name, type_ in fields],
                     metadata={"huggingface": json.dumps({"info": {"features": features}})})


def features_of(schema: pa.Schema) -> dict:
    """The features (as dataset_info.json holds them) of a schema made by hf_schema."""
    return json.loads(schema.metadata[b"huggingface"])["info"]["features"]


ARROW_SCHEMA: pa.Schema = hf_schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
    ("num_loss_tokens", pa.int32()),
])


def __getattr__(name: str):
    """FEATURES: the contract as datasets' own Features, for comparing with what
    datasets loads; datasets is imported by the code that asks, not by every stage."""
    if name == "FEATURES":
        import datasets

        features = datasets.Features.from_dict(features_of(ARROW_SCHEMA))
        globals()["FEATURES"] = features  # built once: later lookups find it as a global
        return features
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def schema_differences(schema: pa.Schema, expected: pa.Schema = ARROW_SCHEMA) -> list[str]:
    """Human lines saying how `schema` differs from the contract (empty: identical).

    Types compare exactly (int32 vs int64, list vs large_list, string vs large_string
    differ); nullability, list item names and schema metadata do not matter to datasets
    and are not compared.
    """
    out = []
    got = {f.name: f.type for f in schema}
    want = {f.name: f.type for f in expected}
    for name in [n for n in want if n not in got]:
        out.append(f"column {name} is missing (expected {want[name]})")
    for name in [n for n in got if n not in want]:
        out.append(f"column {name} ({got[name]}) is not in the contract")
    for name in [n for n in want if n in got and _plain(got[n]) != _plain(want[n])]:
        out.append(f"column {name} is {got[name]}, expected {want[name]}")
    if not out and schema.names != expected.names:
        out.append(f"columns are in order {schema.names}, expected {expected.names}")
    return out


def _plain(type_: pa.DataType) -> pa.DataType:
    """The type with list items nullable and named alike, as datasets reads them."""
    if pa.types.is_list(type_):
        return pa.list_(_plain(type_.value_type))
    if pa.types.is_large_list(type_):
        return pa.large_list(_plain(type_.value_type))
    return type_


def castable(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether `src` can become `dst` without reinterpreting values (ranges checked later)."""
    if src == dst:
        return True
    if pa.types.is_integer(src) and pa.types.is_integer(dst):
        return True
    strings = (pa.types.is_string, pa.types.is_large_string)
    if any(f(src) for f in strings) and any(f(dst) for f in strings):
        return True
    lists = (pa.types.is_list, pa.types.is_large_list)
    if any(f(src) for f in lists) and any(f(dst) for f in lists):
        return castable(src.value_type, dst.value_type)
    return False


# ------------------------------------------------------------------- pandera
# validate reduces every row to a summary (lengths, counts; computed columnar per shard)
# and checks the summary frame against these rules. Row-level check names below are the
# names used in reports/validate.json.

NOT_NULL_CHECKS = {
    "id": "id_not_null",
    "source": "source_not_null",
    "input_ids_len": "input_ids_not_null",
    "loss_mask_len": "loss_mask_not_null",
    "num_tokens": "num_tokens_not_null",
    "num_loss_tokens": "num_loss_tokens_not_null",
}
ROW_CHECKS = [
    *NOT_NULL_CHECKS.values(),
    "id_not_empty",
    "source_not_empty",
    "lengths_equal",
    "mask_binary",
    "token_id_range",
    "max_seq_len",
    "min_loss_tokens",
    "supervised_run",
    "num_tokens_matches",
    "num_loss_tokens_matches",
]


def row_rules(max_seq_len: int, min_loss_tokens: int) -> dict[str, list[tuple[str, Callable]]]:
    """Per column of validate's per-row summary frame: its (check name, rule) pairs, a rule
    being a polars expression over the column that is true where the row passes.

    Summary columns: id, source; input_ids_len, loss_mask_len (null when the list is
    null); ids_out_of_range (token ids outside [0, vocab)), mask_not_binary (mask values
    outside {0, 1}); supervised (mask == 1 count), longest_run (longest run of
    consecutive supervised tokens); num_tokens, num_loss_tokens (the stored counters).
    Columns named in NOT_NULL_CHECKS must not be null; in the others null passes.
    """
    import polars as pl

    def not_blank(c):
        return c.str.strip_chars().str.len_bytes() > 0

    return {
        "id": [("id_not_empty", not_blank)],
        "source": [("source_not_empty", not_blank)],
        "input_ids_len": [("max_seq_len", lambda c: c <= max_seq_len)],
        "loss_mask_len": [("lengths_equal", lambda c: c == pl.col("input_ids_len"))],
        "ids_out_of_range": [("token_id_range", lambda c: c == 0)],
        "mask_not_binary": [("mask_binary", lambda c: c == 0)],
        "supervised": [("min_loss_tokens", lambda c: c >= min_loss_tokens)],
        "longest_run": [("supervised_run", lambda c: c >= 2)],
        "num_tokens": [("num_tokens_matches", lambda c: c == pl.col("input_ids_len"))],
        "num_loss_tokens": [("num_loss_tokens_matches", lambda c: c == pl.col("supervised"))],
    }


def row_schema(rules: dict[str, list[tuple[str, Callable]]]):
    """The pandera (polars) schema of the summary frame: says which rows fail which rule."""
    import pandera.polars as pa_pl
    import polars as pl

    def check(name: str, expr):
        return pa_pl.Check(lambda data: data.lazyframe.select(expr(pl.col(data.key))), name=name)

    return pa_pl.DataFrameSchema(
        {
            column: pa_pl.Column(
                pl.String if column in ("id", "source") else pl.Int64,
                [check(name, expr) for name, expr in checks],
                nullable=column not in NOT_NULL_CHECKS,
            )
            for column, checks in rules.items()
        },
        strict=False,  # the bookkeeping column `row` rides along unchecked
    )


def rows_pass(frame, rules: dict[str, list[tuple[str, Callable]]]) -> bool:
    """Whether every row passes every rule, with no null anywhere: one polars pass.

    The pandera schema costs ten times more per call; it is asked only when this says
    no, to name the failing rows (a null, allowed or not, also goes the long way).
    """
    import polars as pl

    tests = [pl.col(column).is_not_null().all().alias(column) for column in rules]
    tests += [expr(pl.col(column)).all().alias(name)
              for column, checks in rules.items() for name, expr in checks]
    return all(frame.select(tests).row(0))
