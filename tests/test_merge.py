"""merge: the base stays byte-identical, mismatches are refused, duplicates follow policy."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
from pathlib import Path

import datasets
import pyarrow as pa
import pytest

from stages import merge
from stages.common import params, reports
from stages.common.errors import StageError
from stages.dataset.schema import ARROW_SCHEMA, FEATURES
from tests.helpers import stagecli
from tests.helpers.sets import BASE_FP as FP, ids, rows, save

PATHS = stagecli.paths("merge")  # where dvc.yaml has the stage read and write

ROOT = Path(__file__).resolve().parents[1]
def write_stream(path: Path, data: dict, schema: pa.Schema = ARROW_SCHEMA) -> None:
    """One shard written with pyarrow alone, in whatever schema the test wants."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pydict(data, schema=schema)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        writer.write_table(table, max_chunksize=2)


def with_type(name: str, type_: pa.DataType) -> pa.Schema:
    return pa.schema([pa.field(f.name, type_) if f.name == name else f for f in ARROW_SCHEMA])


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


def cfg(**kw) -> params.Merge:
    return params.Merge(**{"base": "data/base", **kw})


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def standard(repo):
    """A 3-shard base of 30 rows and 8 new rows, 2 of them with base ids."""
    save(repo / "data/base", rows(ids("b", 30), "base"), shards=3)
    save(repo / "data/tokenized", rows(ids("b", 2, 28) + ids("n", 6), "new", tag=1), shards=2)
    return repo


def loaded() -> datasets.Dataset:
    return datasets.load_from_disk("data/merged")


def test_base_shards_are_linked_byte_identical_and_result_loads(standard):
    base = standard / "data/base"
    before = digests(base)
    inodes = {p.name: p.stat().st_ino for p in base.glob("*.arrow")}
    report = merge.run(cfg(), PATHS)

    assert digests(base) == before  # never modified
    merged = standard / "data/merged"
    after = digests(merged)
    for name in inodes:
        assert after[name] == before[name]
        assert (merged / name).stat().st_ino == inodes[name]  # a hardlink, not a copy
    ds = loaded()
    assert ds.features == FEATURES
    assert len(ds) == 30 + 6 == report["merged"]["rows"]
    assert ds["id"] == ids("b", 30) + ids("n", 6)  # base order, then the new rows
    assert report["base"] | {"path": None} == {
        "path": None, "present": True, "rows": 30, "tokens": 150, "loss_tokens": 90,
        "shards": 3, "bytes": sum(p.stat().st_size for p in base.glob("*.arrow"))}
    assert report["new"]["rows"] == 8 and report["merged"]["tokens"] == 36 * 5
    assert report["duplicates"] == {"policy": "keep-base", "ids": 2, "base_rows": 2,
                                    "new_rows": 2, "dropped_base_rows": 0,
                                    "dropped_new_rows": 2}
    assert report["shards"]["base_linked"] == 3
    assert json.loads((merged / "fingerprint.json").read_text()) == FP
    state = json.loads((merged / "state.json").read_text())
    names = [f["filename"] for f in state["_data_files"]]
    assert names[:3] == sorted(inodes) and all(n.startswith("data-0000") for n in names[3:])
    assert reports.read(Path("reports"), "merge") == {**report, "host": reports.host()}
    assert not [p for p in (standard / "data").iterdir() if p.name.startswith(".")]


def test_link_false_copies_and_read_only_base_is_fine(standard):
    base = standard / "data/base"
    for p in base.iterdir():  # as under DVC's hardlink cache: read-only files
        p.chmod(stat.S_IRUSR | stat.S_IRGRP)
    before = digests(base)
    merge.run(cfg(link=False), PATHS)
    merged = standard / "data/merged"
    for p in base.glob("*.arrow"):
        assert (merged / p.name).stat().st_ino != p.stat().st_ino
    shards = [k for k in before if k.endswith(".arrow")]
    assert [digests(merged)[k] for k in shards] == [before[k] for k in shards]
    assert digests(base) == before


@pytest.mark.parametrize(
    "column, type_, words",
    [
        ("num_tokens", pa.int64(), ["num_tokens", "int64", "int32"]),
        ("input_ids", pa.large_list(pa.int32()), ["input_ids", "large_list", "list<item: int32>"]),
        ("loss_mask", pa.list_(pa.int32()), ["loss_mask", "int32", "int8"]),
        ("id", pa.large_string(), ["id", "large_string", "string"]),
    ],
)
def test_mismatched_base_types_are_refused_naming_column_and_types(repo, column, type_, words):
    write_stream(repo / "data/base/part-0.arrow", rows(ids("b", 4)), with_type(column, type_))
    save(repo / "data/tokenized", rows(ids("n", 3)))
    with pytest.raises(StageError) as e:
        merge.run(cfg(), PATHS)
    message = str(e.value)
    assert "\n" not in message and "part-0.arrow" in message and "allow_cast" in message
    for word in words:
        assert word in message
    assert not (repo / "data/merged").exists()


def test_allow_cast_writes_a_converted_copy_and_keeps_the_base(repo):
    schema = pa.schema([
        pa.field("id", pa.large_string()), pa.field("source", pa.string()),
        pa.field("input_ids", pa.large_list(pa.int64())), pa.field("loss_mask", pa.list_(pa.int64())),
        pa.field("num_tokens", pa.int64()), pa.field("num_loss_tokens", pa.int64()),
    ])
    write_stream(repo / "data/base/a-0.arrow", rows(ids("b", 4)), schema)
    write_stream(repo / "data/base/a-1.arrow", rows(ids("b", 4, 4)))  # already the contract
    save(repo / "data/tokenized", rows(ids("n", 3)))
    before = digests(repo / "data/base")
    report = merge.run(cfg(allow_cast=True), PATHS)
    assert digests(repo / "data/base") == before
    after = digests(repo / "data/merged")
    assert after["a-0.arrow"] != before["a-0.arrow"]  # converted: cannot stay identical
    assert after["a-1.arrow"] == before["a-1.arrow"]
    assert report["shards"]["base_cast"] == 1 and report["shards"]["base_linked"] == 1
    ds = loaded()
    assert ds.features == FEATURES and len(ds) == 11
    assert ds[0]["input_ids"] == [0, 11, 12, 13, 14]


def test_allow_cast_refuses_values_that_do_not_fit_and_other_types(repo):
    data = rows(ids("b", 2))
    data["num_tokens"] = [5, 3_000_000_000]
    write_stream(repo / "data/base/a.arrow", data, with_type("num_tokens", pa.int64()))
    save(repo / "data/tokenized", rows(ids("n", 2)))
    with pytest.raises(StageError, match="num_tokens cannot become int32"):
        merge.run(cfg(allow_cast=True), PATHS)
    assert not (repo / "data/merged").exists()

    data = rows(ids("b", 2))
    data["num_tokens"] = ["5", "5"]
    write_stream(repo / "data/base/a.arrow", data, with_type("num_tokens", pa.string()))
    with pytest.raises(StageError, match="num_tokens is string.*not castable"):
        merge.run(cfg(allow_cast=True), PATHS)

    extra = pa.schema(list(ARROW_SCHEMA) + [pa.field("attention_mask", pa.list_(pa.int8()))])
    data = rows(ids("b", 2)) | {"attention_mask": [[1], [1]]}
    write_stream(repo / "data/base/a.arrow", data, extra)
    with pytest.raises(StageError, match="not in this project's layout: .*attention_mask "
                                         "list<item: int8>; set merge.adopt: true"):
        merge.run(cfg(allow_cast=True), PATHS)


@pytest.mark.parametrize(
    "change, where",
    [
        (lambda fp: fp["tokenizer"].update(vocab_sha256="b" * 64), "tokenizer.vocab_sha256"),
        (lambda fp: fp["tokenizer"]["special_tokens"].update({"<|im_end|>": 8}),
         "tokenizer.special_tokens.<|im_end|>"),
        (lambda fp: fp.update(chat_template_sha256="d" * 64), "chat_template_sha256"),
    ],
)
def test_fingerprint_mismatch_is_refused(repo, change, where):
    other = json.loads(json.dumps(FP))
    change(other)
    save(repo / "data/base", rows(ids("b", 3)), fingerprint=other)
    save(repo / "data/tokenized", rows(ids("n", 3)))
    with pytest.raises(StageError) as e:
        merge.run(cfg(), PATHS)
    assert f"fingerprint mismatch: {where}" in str(e.value)
    assert "data/base/fingerprint.json" in str(e.value)


def test_fingerprint_policy_and_versions_may_differ(repo):
    other = json.loads(json.dumps(FP)) | {"policy": {"multi_turn": "all"}, "versions": {}}
    save(repo / "data/base", rows(ids("b", 3)), fingerprint=other)
    save(repo / "data/tokenized", rows(ids("n", 3)))
    assert merge.run(cfg(), PATHS)["merged"]["rows"] == 6


def test_keep_new_rewrites_only_the_base_shards_holding_duplicates(standard):
    before = digests(standard / "data/base")
    report = merge.run(cfg(on_duplicate="keep-new"), PATHS)
    after = digests(standard / "data/merged")
    names = sorted(n for n in before if n.endswith(".arrow"))
    assert [after[n] == before[n] for n in names] == [True, True, False]  # b28, b29: last
    assert digests(standard / "data/base") == before
    ds = loaded()
    assert len(ds) == 28 + 8
    assert ds["id"] == ids("b", 28) + ids("b", 2, 28) + ids("n", 6)
    by_id = {r["id"]: r for r in ds}
    assert by_id["b28"]["input_ids"][0] == 1  # the new version
    assert report["duplicates"]["dropped_base_rows"] == 2
    assert report["duplicates"]["dropped_new_rows"] == 0
    assert report["shards"]["base_filtered"] == 1 and report["shards"]["base_linked"] == 2


def test_keep_new_that_empties_a_base_shard_counts_it(repo):
    save(repo / "data/base", rows(ids("b", 6), "base"), shards=3)  # b0 b1 | b2 b3 | b4 b5
    save(repo / "data/tokenized", rows(["b2", "b3", "n0"], "new", tag=1))
    report = merge.run(cfg(on_duplicate="keep-new"), PATHS)
    assert report["shards"]["base_emptied"] == 1 and report["shards"]["base_linked"] == 2
    assert report["merged"]["rows"] == len(loaded()) == 4 + 3
    assert sorted(loaded()["id"]) == sorted(["b0", "b1", "b4", "b5", "b2", "b3", "n0"])
    on_disk = sorted(p.name for p in Path("data/merged").glob("*.arrow"))
    assert len(on_disk) == 3 and "data-00001-of-00003.arrow" not in on_disk  # the emptied


def test_keep_base_keeps_the_base_version(standard):
    merge.run(cfg(), PATHS)
    by_id = {r["id"]: r for r in loaded()}
    assert by_id["b28"]["input_ids"][0] == 0 and by_id["b28"]["source"] == "base"


def test_duplicates_error_policy_names_them(standard):
    with pytest.raises(StageError, match=r"2 ids are in both.*'b28'.*on_duplicate is 'error'"):
        merge.run(cfg(on_duplicate="error"), PATHS)
    assert not (standard / "data/merged").exists()


def test_duplicate_ids_inside_new_are_refused(repo):
    save(repo / "data/tokenized", rows(["x", "y", "x"]))
    with pytest.raises(StageError, match="1 ids occur more than once, e.g. 'x'"):
        merge.run(cfg(base=None), PATHS)


@pytest.mark.parametrize("base", [None, "data/absent", "data/empty"])
def test_no_base_gives_a_first_version(repo, base):
    (repo / "data/empty").mkdir(parents=True)
    save(repo / "data/tokenized", rows(ids("n", 5)), shards=2)
    report = merge.run(cfg(base=base), PATHS)
    assert len(loaded()) == 5 and report["base"]["rows"] == 0
    assert report["shards"]["new_linked"] == 2
    assert sorted(p.name for p in (repo / "data/merged").glob("*.arrow")) == [
        "data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]


def test_a_base_link_to_nowhere_is_refused_not_taken_for_no_base(repo):
    save(repo / "data/tokenized", rows(ids("n", 2)))
    os.symlink(repo / "mnt/unmounted/train", repo / "data/base")
    with pytest.raises(StageError, match="data/base: links to .*unmounted/train, which does"):
        merge.run(cfg(base="data/base"), PATHS)
    assert not (repo / "data/merged").exists()


def test_an_unreadable_base_fingerprint_is_one_error(standard):
    (standard / "data/base/fingerprint.json").unlink()
    (standard / "data/base/fingerprint.json").mkdir()
    with pytest.raises(StageError, match="data/base/fingerprint.json: cannot read"):
        merge.run(cfg(), PATHS)


def test_a_fingerprint_holding_a_lone_surrogate_is_one_error(repo):
    """It would be carried into the merged fingerprint and the card, which cannot hold it."""
    save(repo / "data/base", rows(ids("b", 3)))
    save(repo / "data/tokenized", rows(ids("n", 3)))
    path = repo / "data/tokenized/fingerprint.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"versions": {"x": "\ud800"}}))
    with pytest.raises(StageError, match="^data/tokenized/fingerprint.json: holds a lone surrogate"):
        merge.run(cfg(), PATHS)
    assert not (repo / "data/merged").exists()


def test_both_empty_is_refused(repo):
    save(repo / "data/tokenized", rows([]))
    with pytest.raises(StageError, match="no rows to write"):
        merge.run(cfg(base=None), PATHS)


def test_base_as_a_folder_of_raw_arrow_shards_in_natural_order(repo):
    for k in (10, 2, 1):
        write_stream(repo / f"data/raw/shard-{k}.arrow", rows(ids(f"k{k}-", 2)))
    save(repo / "data/tokenized", rows(ids("n", 2)))
    merge.run(cfg(base="data/raw"), PATHS)
    assert loaded()["id"] == ids("k1-", 2) + ids("k2-", 2) + ids("k10-", 2) + ids("n", 2)


def test_merged_output_is_a_valid_base_for_the_next_version(standard):
    merge.run(cfg(), PATHS)
    os.rename("data/merged", "data/v1")
    save(standard / "data/tokenized2", rows(ids("m", 3)))
    os.rename("data/tokenized", "data/tokenized1")
    os.rename("data/tokenized2", "data/tokenized")
    report = merge.run(cfg(base="data/v1"), PATHS)
    assert len(loaded()) == 36 + 3 == report["merged"]["rows"]
    assert len(set(p.name for p in Path("data/merged").glob("*.arrow"))) == 6


def test_unusable_bases_are_refused_clearly(repo):
    save(repo / "data/tokenized", rows(ids("n", 2)))
    table = pa.Table.from_pydict(rows(ids("b", 2)), schema=ARROW_SCHEMA)
    (repo / "data/feather").mkdir()
    with pa.OSFile(str(repo / "data/feather/x.arrow"), "wb") as sink:
        with pa.ipc.new_file(sink, ARROW_SCHEMA) as writer:
            writer.write_table(table)
    with pytest.raises(StageError, match=r"data/feather/x.arrow \(arrow file\) has .*"
                                         "set merge.adopt: true"):
        merge.run(cfg(base="data/feather"), PATHS)

    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows(["a"]), features=FEATURES)}
                         ).save_to_disk(str(repo / "data/dd"))
    with pytest.raises(StageError, match="DatasetDict folder"):
        merge.run(cfg(base="data/dd"), PATHS)

    (repo / "data/parquet").mkdir()
    (repo / "data/parquet/x.parquet").write_bytes(b"PAR1")
    with pytest.raises(StageError, match="x.parquet: not a readable parquet file"):
        merge.run(cfg(base="data/parquet"), PATHS)
    (repo / "data/parquet/x.parquet").unlink()
    (repo / "data/parquet/notes.txt").write_text("")
    with pytest.raises(StageError, match="no state.json, .arrow or .parquet files"):
        merge.run(cfg(base="data/parquet"), PATHS)

    (repo / "data/trunc").mkdir()
    write_stream(repo / "data/trunc/x.arrow", rows(ids("b", 6)))
    data = (repo / "data/trunc/x.arrow").read_bytes()
    (repo / "data/trunc/x.arrow").write_bytes(data[: len(data) // 2])
    with pytest.raises(StageError, match="x.arrow"):
        merge.run(cfg(base="data/trunc"), PATHS)

    with pytest.raises(StageError, match="must not be data/tokenized"):
        merge.run(cfg(base="data/tokenized"), PATHS)


@pytest.mark.parametrize("name", ["../tokenized/data-00000-of-00001.arrow", "/etc/hostname",
                                  "sub/x.arrow", "..", "", 5, {"a": 1}])
def test_a_state_json_entry_outside_the_base_folder_is_refused(repo, name):
    save(repo / "data/tokenized", rows(ids("n", 2)))
    save(repo / "data/base", rows(ids("b", 2)))
    state_path = repo / "data/base/state.json"
    state = json.loads(state_path.read_text())
    state["_data_files"].append({"filename": name})
    state_path.write_text(json.dumps(state))
    with pytest.raises(StageError) as e:
        merge.run(cfg(), PATHS)
    assert str(e.value) == (f"data/base/state.json: lists {str(name)[:100]!r}, which is not a "
                            "file name in this folder")
    assert not (repo / "data/merged").exists()


def test_cli_refuses_a_state_json_escape_in_one_line(repo):
    save(repo / "data/tokenized", rows(ids("n", 2)))
    save(repo / "data/base", rows(ids("b", 2)))
    state_path = repo / "data/base/state.json"
    state = json.loads(state_path.read_text())
    state["_data_files"] = [{"filename": str(repo / "data/tokenized/data-00000-of-00001.arrow")}]
    state_path.write_text(json.dumps(state))
    (repo / "params.yaml").write_text("merge:\n  base: data/base\n")
    line, _ = stagecli.fail("merge", repo)
    assert line.startswith("error: data/base/state.json: lists '/") and "not a file name" in line
    assert not (repo / "data/merged").exists()


def test_new_rows_must_match_the_contract(repo):
    write_stream(repo / "data/tokenized/data-0.arrow", rows(ids("n", 2)),
                 with_type("loss_mask", pa.list_(pa.int64())))
    (repo / "data/tokenized/fingerprint.json").write_text(json.dumps(FP))
    with pytest.raises(StageError, match="loss_mask is list<item: int64>, expected.*int8"):
        merge.run(cfg(base=None), PATHS)


def test_a_failed_merge_leaves_the_previous_output(standard):
    merge.run(cfg(), PATHS)
    before = digests(standard / "data/merged")
    fp = json.loads(json.dumps(FP))
    fp["tokenizer"]["name"] = "other"
    (standard / "data/tokenized/fingerprint.json").write_text(json.dumps(fp))
    with pytest.raises(StageError):
        merge.run(cfg(), PATHS)
    assert digests(standard / "data/merged") == before
    assert sorted(p.name for p in (standard / "data").iterdir()) == ["base", "merged",
                                                                       "tokenized"]


def test_cli_prints_one_line_and_exits_1(repo):
    save(repo / "data/base", rows(ids("b", 2)), fingerprint=FP | {"chat_template_sha256": "x"})
    save(repo / "data/tokenized", rows(ids("n", 2)))
    (repo / "params.yaml").write_text("merge:\n  base: data/base\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    proc = subprocess.run(stagecli.command("merge"), cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: fingerprint mismatch: chat_template_sha256")


def test_symlinked_base_shards_are_linked_to_their_targets(repo):
    """DVC's symlink cache: base shards are symlinks into the cache."""
    save(repo / "cache", rows(ids("b", 4)), shards=2)
    (repo / "data/base").mkdir(parents=True)
    for p in (repo / "cache").iterdir():
        (repo / "data/base" / p.name).symlink_to(p)
    save(repo / "data/tokenized", rows(ids("n", 2)))
    merge.run(cfg(), PATHS)
    for p in (repo / "cache").glob("*.arrow"):
        merged = repo / "data/merged" / p.name
        assert not merged.is_symlink() and merged.stat().st_ino == p.stat().st_ino
    assert len(loaded()) == 6


def test_falls_back_to_copying_when_hardlinks_fail(standard, monkeypatch):
    def no_link(src, dst, **kw):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(merge.os, "link", no_link)
    before = digests(standard / "data/base")
    report = merge.run(cfg(), PATHS)
    assert report["shards"]["base_copied"] == 3 and report["shards"]["new_copied"] == 1
    after = digests(standard / "data/merged")
    assert all(after[k] == v for k, v in before.items() if k.endswith(".arrow"))
