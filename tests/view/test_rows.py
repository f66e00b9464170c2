"""Rows found by id through the id column only, by number, source, sample and length, in
the row contract and in each trainer's export."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from stages.common.errors import StageError
from stages.view.rows import Dataset
from tests.helpers.sets import write_set


@pytest.fixture
def rowset(tmp_path):
    rng = np.random.default_rng(2)
    rows = {}
    for k in range(30):
        n = int(rng.integers(3, 60))
        rows[f"r{k}"] = (rng.integers(0, 1000, n).tolist(), rng.integers(0, 2, n).tolist())
    write_set(tmp_path / "set", rows)
    return tmp_path / "set", rows


def test_by_id_number_and_lengths(rowset):
    folder, rows = rowset
    data = Dataset(folder)
    got = data.by_ids(["r7", "r2"])
    assert [r.id for r in got] == ["r7", "r2"] and [r.number for r in got] == [7, 2]
    assert got[0].input_ids.tolist() == rows["r7"][0]
    assert got[0].supervised.tolist() == [bool(m) for m in rows["r7"][1]]
    assert data.by_numbers([29])[0].id == "r29"
    lengths = {k: len(v[0]) for k, v in rows.items()}
    longest = data.chosen(longest=1)[0]
    assert len(longest.input_ids) == max(lengths.values())
    assert data.chosen(sample=4, seed=3)[0].id == data.chosen(sample=4, seed=3)[0].id
    with pytest.raises(StageError, match="no row with id 'zz'"):
        data.by_ids(["zz"])
    with pytest.raises(StageError, match="no row number 30"):
        data.by_numbers([30])


def test_a_lookup_by_id_does_not_read_the_token_columns(rowset):
    """The scan behind a lookup asks for the id column alone (what it then reads from
    disk at scale: bench/bench_show.py)."""
    folder, rows = rowset
    data = Dataset(folder)
    seen = []
    original = data.scan

    def spy(columns):
        seen.append(columns)
        return original(columns)

    data.scan = spy
    data.by_ids(["r3"])
    assert seen == [("id",)]


@pytest.mark.slow  # three real exports in processes of their own
def test_exports_are_read_as_their_trainer_reads_them(rowset, tmp_path):
    import subprocess
    import sys

    from tests.helpers.repo import ROOT, env

    folder, rows = rowset
    for trainer in ("trl", "axolotl", "specforge"):
        out = tmp_path / trainer
        subprocess.run([sys.executable, "-m", "stages.export", "--for", trainer, "--merged",
                        str(folder), "--out", str(out)], cwd=ROOT, env=env(), check=True,
                       capture_output=True)
        data = Dataset(out)
        assert data.kind == trainer
        row = data.by_numbers([5])[0]
        assert row.input_ids.tolist() == rows["r5"][0]
        assert row.supervised.tolist() == [bool(m) for m in rows["r5"][1]]
        if trainer != "axolotl":
            assert data.by_ids(["r5"])[0].number == 5
        assert json.loads((out / "export.json").read_text())["for"] == trainer


def test_a_lookup_checks_the_row_it_returns_and_no_other(tmp_path):
    from stages.dataset.shards import write_metadata
    from tests.helpers.sets import damaged_tokens_shard

    folder = tmp_path / "set"
    folder.mkdir()
    damaged_tokens_shard(folder / "data-00000-of-00001.arrow")
    write_metadata(folder, ["data-00000-of-00001.arrow"])
    data = Dataset(folder)
    assert data.by_ids(["a"])[0].input_ids.tolist() == [7, 8]
    with pytest.raises(StageError, match="damaged record batch"):
        data.by_ids(["b"])


def _contract_shard(path, input_ids, loss_mask, table_change=None):
    from stages.dataset.schema import ARROW_SCHEMA
    from stages.dataset.shards import ShardFile

    n = len(input_ids)
    table = pa.table({"id": [f"r{k}" for k in range(n)], "source": ["s"] * n,
                      "input_ids": input_ids, "loss_mask": loss_mask,
                      "num_tokens": [len(i) for i in input_ids],
                      "num_loss_tokens": [1] * n}).cast(ARROW_SCHEMA)
    table = table_change(table) if table_change else table
    with ShardFile(path, table.schema) as f:
        for batch in table.to_batches():
            f.write(batch)


@pytest.mark.parametrize("column", ["input_ids", "loss_mask"])
def test_a_null_value_in_a_row_is_named_not_shown_as_an_id(tmp_path, column):
    from stages.dataset.shards import write_metadata

    ids, mask = [[5, 6], [9, 10, 11, 12]], [[0, 1], [0, 1, 1, 1]]
    (ids if column == "input_ids" else mask)[1][2] = None
    folder = tmp_path / "set"
    folder.mkdir()
    _contract_shard(folder / "data-00000-of-00001.arrow", ids, mask)
    write_metadata(folder, ["data-00000-of-00001.arrow"])
    data = Dataset(folder)
    assert data.by_numbers([0])[0].input_ids.tolist() == [5, 6]
    with pytest.raises(StageError, match=rf"data-00000-of-00001.arrow: row 1 \('r1'\): "
                                         rf"{column} holds a null value"):
        data.by_numbers([1])


@pytest.mark.parametrize("change, message", [
    (lambda t: t.drop_columns(["input_ids"]), "column input_ids is missing"),
    (lambda t: t.rename_columns(["id", "source", "input]ids", *t.column_names[3:]]),
     "column input_ids is missing"),
    (lambda t: t.set_column(3, "loss_mask", t.column(3).cast(pa.list_(pa.int64()))),
     "column loss_mask is list<item: int64>, expected list<item: int8>"),
])
def test_a_later_shard_without_the_columns_is_named(tmp_path, change, message):
    from stages.dataset.shards import write_metadata

    folder = tmp_path / "set"
    folder.mkdir()
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    _contract_shard(folder / names[0], [[1, 2]], [[0, 1]])
    _contract_shard(folder / names[1], [[3, 4]], [[0, 1]], change)
    write_metadata(folder, names, state="test")
    data = Dataset(folder)
    for choose in (lambda: data.by_numbers([1]), lambda: data.chosen(longest=2),
                   lambda: data.by_ids(["missing"])):
        with pytest.raises(StageError, match=rf"{names[1]}: {message}"):
            choose()
