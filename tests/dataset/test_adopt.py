"""merge.adopt: bases written by other tools' code paths come in with their values intact.

Each base here is written the way another tool writes it (`datasets` save_to_disk and
to_parquet, polars, plain pyarrow), merged with `merge.adopt: true`, and checked row by
row against what the user wrote; the result then passes the real validate stage and is
linked byte for byte by the next merge.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import time
from pathlib import Path

import datasets
import numpy as np
import polars as pl
import pyarrow as pa
import pytest
import yaml

from stages import merge, validate
from stages.common import params
from stages.common.errors import StageError
from stages.dataset import adopt, baserows, idhashes
from tests.helpers import stagecli
from tests.helpers.repo import ROOT, git_commit, run
from tests.helpers.sets import rows as contract_rows
from tests.helpers.sets import save

PATHS = stagecli.paths("merge")
VALIDATE_PATHS = stagecli.paths("validate")
VOCAB = 1000
FP = {
    "tokenizer": {"name": "tok", "vocab_sha256": "a" * 64, "vocab_size": VOCAB,
                  "special_tokens": {}},
    "chat_template_sha256": "c" * 64,
    "policy": {"max_seq_len": 64, "min_loss_tokens": 1},
    "versions": {},
}


@pytest.fixture(autouse=True)
def repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save(tmp_path / "data/tokenized", contract_rows([f"n{i}" for i in range(5)], "new", tag=1),
         fingerprint=FP)
    return tmp_path


def user_rows(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(input_ids, mask) of `n` conversations: a prompt, then a supervised answer."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        # at least one prompt token: a row trained whole is refused (adopt_fully_supervised)
        prompt, answer = int(rng.integers(1, 20)), int(rng.integers(2, 30))
        out.append((rng.integers(0, VOCAB, prompt + answer).tolist(), [0] * prompt + [1] * answer))
    return out


def columns(user, mask_name: str = "loss_mask") -> dict:
    return {"input_ids": [ids for ids, _ in user], mask_name: [m for _, m in user],
            "conversation_id": [f"conv-{i}" for i in range(len(user))]}


# ------------------------------------------------------------ bases as other tools write them


def datasets_int64(folder: Path, user) -> Path:
    """The issue's own example: datasets infers int64 for loss_mask; three shards."""
    datasets.Dataset.from_dict(columns(user)).save_to_disk(str(folder), num_shards=3)
    return folder


def trl_labels(folder: Path, user) -> Path:
    """input_ids + attention_mask + labels with -100, as TRL and axolotl keep them."""
    data = {"input_ids": [ids for ids, _ in user],
            "attention_mask": [[1] * len(ids) for ids, _ in user],
            "labels": [[t if m else -100 for t, m in zip(ids, mask)] for ids, mask in user]}
    datasets.Dataset.from_dict(data).save_to_disk(str(folder), num_shards=2)
    return folder


def large_lists(folder: Path, user) -> Path:
    features = datasets.Features({"input_ids": datasets.LargeList(datasets.Value("int64")),
                                  "loss_mask": datasets.LargeList(datasets.Value("int64")),
                                  "conversation_id": datasets.Value("string")})
    datasets.Dataset.from_dict(columns(user), features=features).save_to_disk(str(folder))
    return folder


def uint8_completion_mask(folder: Path, user) -> Path:
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int64")),
                                  "completion_mask": datasets.List(datasets.Value("uint8")),
                                  "conversation_id": datasets.Value("string")})
    datasets.Dataset.from_dict(columns(user, "completion_mask"), features=features
                               ).save_to_disk(str(folder), num_shards=2)
    return folder


def bool_assistant_masks_stream(folder: Path, user) -> Path:
    """pyarrow alone, IPC stream format, a bool mask named as TRL names it."""
    folder.mkdir(parents=True)
    data = columns(user, "assistant_masks")
    data["assistant_masks"] = [[bool(v) for v in m] for m in data["assistant_masks"]]
    schema = pa.schema([("input_ids", pa.list_(pa.int64())),
                        ("assistant_masks", pa.list_(pa.bool_())),
                        ("conversation_id", pa.string())])
    half = len(user) // 2
    for k, part in enumerate((slice(0, half), slice(half, None))):
        table = pa.Table.from_pydict({key: v[part] for key, v in data.items()}, schema=schema)
        with pa.OSFile(str(folder / f"part-{k}.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, schema) as writer:
            writer.write_table(table, max_chunksize=7)
    return folder


def polars_ipc_file(folder: Path, user) -> Path:
    """polars' write_ipc: the Arrow IPC *file* format, large_list columns."""
    folder.mkdir(parents=True)
    half = len(user) // 2
    for k, part in enumerate((user[:half], user[half:])):
        pl.DataFrame(columns(part)).write_ipc(folder / f"chunk-{k}.arrow")
    return folder


def hub_parquet(folder: Path, user) -> Path:
    """A Hub snapshot: README.md beside data/train-0000N-of-00002.parquet."""
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# my set\n")
    half = len(user) // 2
    for k, part in enumerate((user[:half], user[half:])):
        datasets.Dataset.from_dict(columns(part)).to_parquet(
            str(folder / f"data/train-{k:05d}-of-00002.parquet"))
    return folder / "data"


WRITERS = [datasets_int64, trl_labels, large_lists, uint8_completion_mask,
           bool_assistant_masks_stream, polars_ipc_file, hub_parquet]


def cfg(base, **kw) -> params.Merge:
    return params.Merge(base=str(base), adopt=True, **kw)


def digests(folder: Path) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every file under `folder`."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                         p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def read_only(folder: Path) -> None:
    for p in [*folder.rglob("*"), folder]:
        p.chmod(stat.S_IRUSR | stat.S_IXUSR if p.is_dir() else stat.S_IRUSR)


def validate_passes() -> dict:
    off = params.TrainCheck(enabled=False)
    report = validate.run(params.Validate(train_check=off), VALIDATE_PATHS)
    assert report["passed"]
    return report


def next_tokenized(repo: Path, prefix: str) -> None:
    """data/tokenized replaced by other new rows (a later generation)."""
    os.rename(repo / "data/tokenized", repo / f"data/tokenized-{prefix}-old")
    save(repo / "data/tokenized", contract_rows([f"{prefix}{i}" for i in range(3)], "new", tag=2),
         fingerprint=FP)


# ---------------------------------------------------------------------------- adopting


@pytest.mark.parametrize("writer", WRITERS, ids=lambda w: w.__name__)
def test_a_base_from_another_tool_is_adopted_with_its_values(repo, writer):
    user = user_rows(40)
    base = writer(repo / "legacy", user)
    read_only(repo / "legacy")
    before = digests(repo / "legacy")
    report = merge.run(cfg(base), PATHS)
    assert digests(repo / "legacy") == before  # the base is only read

    ds = datasets.load_from_disk("data/merged")
    assert len(ds) == 45 and report["merged"]["rows"] == 45
    assert ds["input_ids"][:40] == [ids for ids, _ in user]
    assert ds["loss_mask"][:40] == [mask for _, mask in user]
    assert ds["num_loss_tokens"][:40] == [sum(m) for _, m in user]
    assert ds["source"][:40] == [base.name] * 40
    assert len(set(ds["id"])) == 45
    adopted = report["adopted"]
    assert adopted["rows"] == 40 and adopted["tokens"] == sum(len(ids) for ids, _ in user)
    assert report["shards"]["base_adopted"] == len(adopted["files"])
    assert report["bytes_written"] >= adopted["bytes"]
    extra = {"conversation_id"} if writer is not trl_labels else {"attention_mask"}
    assert set(adopted["dropped_columns"]) == extra
    validate_passes()
    card = (repo / "data/merged/README.md").read_text()
    assert "## Adopted base" in card and f"`{base}`" in card
    history = json.loads((repo / "data/merged/lineage.json").read_text())["history"]
    assert [v["version"] for v in history] == [0, 1] and history[0]["adopted"]["path"] == str(base)

    # the same base adopted again: the same ids, the same bytes (DVC stores them once)
    first_ids = ds["id"]
    os.rename(repo / "data/merged", repo / "data/v1")
    merge.run(cfg(base), PATHS)
    assert datasets.load_from_disk("data/merged")["id"] == first_ids
    shards = [p.name for p in (repo / "data/v1").glob("*.arrow")]
    assert [digests(repo / "data/merged")[n][0] for n in shards] == [
        digests(repo / "data/v1")[n][0] for n in shards]
    (repo / "data/merged").rename(repo / "data/again")

    # merging onto the adopted version links its shards, nothing is converted again
    next_tokenized(repo, "m")
    v1 = {p.name: p for p in (repo / "data/v1").glob("*.arrow")}
    report = merge.run(cfg("data/v1"), PATHS)
    assert report["adopted"] is None and report["shards"]["base_linked"] == len(v1)
    for name, path in v1.items():
        assert (repo / "data/merged" / name).stat().st_ino == path.stat().st_ino
    assert datasets.load_from_disk("data/merged")["id"][:45] == first_ids
    lineage = json.loads((repo / "data/merged/lineage.json").read_text())
    assert [v["version"] for v in lineage["history"]] == [0, 1, 2]
    assert "## Adopted base" in (repo / "data/merged/README.md").read_text()
    validate_passes()


def test_repeated_rows_get_unique_ids_stable_across_runs(repo, monkeypatch):
    monkeypatch.setattr(idhashes, "SPILL_ROWS", 8)  # the dataset-wide check on disk
    user = user_rows(30)
    twice = user[:10] + user[:10] + user[10:] + [user[3]]  # row 3 three times in all
    datasets.Dataset.from_dict(columns(twice)).save_to_disk("legacy", num_shards=4)
    report = merge.run(cfg("legacy"), PATHS)
    ids = datasets.load_from_disk("data/merged")["id"][:len(twice)]
    assert len(set(ids)) == len(ids)
    assert ids[10:20] == [f"{rid}-1" for rid in ids[:10]]
    assert ids[-1] == f"{ids[3]}-2" and report["adopted"]["repeated_rows"] == 11
    os.rename("data/merged", "data/first")
    merge.run(cfg("legacy"), PATHS)
    assert datasets.load_from_disk("data/merged")["id"][:len(twice)] == ids
    validate_passes()


def test_ids_are_the_content_whatever_the_integer_types(repo):
    user = user_rows(6)
    datasets_int64(repo / "a", user)
    uint8_completion_mask(repo / "b", user)
    merge.run(cfg("a"), PATHS)
    first = datasets.load_from_disk("data/merged")["id"][:6]
    merge.run(cfg("b"), PATHS)
    assert datasets.load_from_disk("data/merged")["id"][:6] == first


def test_values_checked_and_narrowed_a_chunk_at_a_time(repo, monkeypatch):
    monkeypatch.setattr(baserows, "CHUNK", 7)
    user = user_rows(20)
    datasets_int64(repo / "legacy", user)
    merge.run(cfg("legacy"), PATHS)
    ds = datasets.load_from_disk("data/merged")
    assert ds["input_ids"][:20] == [ids for ids, _ in user]
    assert ds["loss_mask"][:20] == [mask for _, mask in user]

    user[15][0][-1] = VOCAB + 5  # far past the first chunk of its batch
    datasets.Dataset.from_dict(columns(user)).save_to_disk("broken")
    with pytest.raises(StageError) as e:
        merge.run(cfg("broken"), PATHS)
    last = len(user[15][0]) - 1
    assert str(e.value) == (f"merge.adopt: broken/data-00000-of-00001.arrow, row 15: "
                            f"input_ids[{last}] is {VOCAB + 5}, outside the vocabulary "
                            f"[0, {VOCAB}) of the new rows")


def test_batches_converted_side_by_side_keep_their_order_and_the_first_error(repo,
                                                                             monkeypatch):
    """Parts of a file are converted by several threads at once: the shard holds them in
    the file's order, the first row trained whole is the one counted first, and of two
    bad rows the earlier is named even when a later part fails first."""
    monkeypatch.setattr(adopt, "BATCH_ROWS", 3)
    monkeypatch.setattr(adopt, "MAX_CONVERTERS", 4)
    monkeypatch.setattr(adopt.cpus, "usable", lambda: 4)
    user = user_rows(40)
    data = columns(user)
    for r in (8, 31):
        data["loss_mask"][r] = [1] * len(data["input_ids"][r])
    datasets.Dataset.from_dict(data).save_to_disk("legacy")
    report = merge.run(cfg("legacy", adopt_fully_supervised="keep"), PATHS)
    ds = datasets.load_from_disk("data/merged")
    assert ds["input_ids"][:40] == data["input_ids"]
    assert ds["loss_mask"][:40] == data["loss_mask"]
    assert report["adopted"]["fully_supervised_rows"] == 2

    check = baserows.inside

    def inside(values, limit):  # the earlier bad part is the slower to fail
        if VOCAB + 1 in values:
            time.sleep(0.3)
        return check(values, limit)

    monkeypatch.setattr(baserows, "inside", inside)
    data["input_ids"][10][0] = VOCAB + 1  # parts of 3 rows: the 4th part
    data["input_ids"][13][0] = VOCAB + 2  # the 5th, converted beside it
    datasets.Dataset.from_dict(data).save_to_disk("broken")
    with pytest.raises(StageError, match=r"broken/data-00000-of-00001.arrow, row 10: "
                                         rf"input_ids\[0\] is {VOCAB + 1}"):
        merge.run(cfg("broken", adopt_fully_supervised="keep"), PATHS)


def test_named_columns_and_source(repo):
    user = user_rows(5)
    data = {"tokens": [ids for ids, _ in user],
            "targets": [[t if m else -100 for t, m in zip(ids, mask)] for ids, mask in user]}
    datasets.Dataset.from_dict(data).save_to_disk("legacy")
    columns_ = params.BaseColumns(input_ids="tokens", mask="targets", mask_kind="labels")
    report = merge.run(cfg("legacy", base_columns=columns_, base_source="sft-v3"), PATHS)
    ds = datasets.load_from_disk("data/merged")
    assert ds["loss_mask"][:5] == [m for _, m in user] and set(ds["source"][:5]) == {"sft-v3"}
    assert report["adopted"]["mapping"]["loss_mask"].startswith("targets (")


def test_a_new_row_with_an_adopted_id_follows_on_duplicate(repo):
    user = user_rows(6)
    datasets_int64(repo / "legacy", user)
    merge.run(cfg("legacy"), PATHS)
    taken = datasets.load_from_disk("data/merged")["id"][:3]  # shards of 2 rows each
    os.rename(repo / "data/tokenized", repo / "data/old")
    save(repo / "data/tokenized", contract_rows(taken + ["n9"], "new", tag=1), fingerprint=FP)
    report = merge.run(cfg("legacy", on_duplicate="keep-new"), PATHS)
    assert report["duplicates"]["dropped_base_rows"] == 3
    assert report["shards"] | {k: 0 for k in ("new_linked", "new_copied", "new_filtered")} == {
        "base_linked": 0, "base_copied": 0, "base_cast": 0, "base_adopted": 1,
        "base_filtered": 1, "base_emptied": 1, "new_linked": 0, "new_copied": 0,
        "new_filtered": 0}
    ds = datasets.load_from_disk("data/merged")
    assert len(ds) == 3 + 4 and [ds["id"].count(rid) for rid in taken] == [1, 1, 1]
    assert sorted(p.name for p in (repo / "data/merged").glob("*.arrow")) == [
        "data-00001-of-00003.arrow", "data-00002-of-00003.arrow", "data-00003-of-00003.arrow"]
    assert not [p for p in (repo / "data/merged").iterdir() if p.name.startswith(".")]
    validate_passes()


def test_a_base_in_this_projects_layout_is_not_converted(repo):
    save(repo / "data/base", contract_rows(["b0", "b1"], "base"), fingerprint=FP)
    report = merge.run(cfg("data/base"), PATHS)
    assert report["adopted"] is None and report["shards"]["base_linked"] == 1


# ------------------------------------------------------------------------ refusals


def test_without_adopt_the_refusal_says_what_was_found_and_what_adopting_writes(repo):
    user = user_rows(3000, seed=1)
    datasets_int64(repo / "legacy_base", user)
    (repo / "params.yaml").write_text(yaml.safe_dump({"merge": {"base": "legacy_base"}}))
    line, _ = stagecli.fail("merge", repo)
    assert line.startswith("error: merge.base legacy_base is not in this project's layout: "
                           "legacy_base/data-00000-of-00003.arrow (arrow stream) has ")
    assert "loss_mask list<item: int64>, conversation_id string" in line
    assert "set merge.adopt: true to convert it once into data/merged (3,000 rows" in line
    assert not (repo / "data/merged").exists()
    number, unit = re.search(r"about ([0-9.]+) (kB|MB) written\)$", line).groups()
    estimate = float(number) * {"kB": 1e3, "MB": 1e6}[unit]

    report = merge.run(cfg("legacy_base"), PATHS)
    assert abs(estimate - report["adopted"]["bytes"]) < 0.02 * report["adopted"]["bytes"]


@pytest.mark.parametrize("data, says", [
    ({"input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [1, 1, 1]]},
     r"legacy/data-00000-of-00001.arrow, row 1: loss_mask has 3 values, input_ids 2"),
    ({"input_ids": [[1, 2, 3], [4, 5, VOCAB]], "loss_mask": [[0, 1, 1], [0, 1, 1]]},
     rf"row 1: input_ids\[2\] is {VOCAB}, outside the vocabulary \[0, {VOCAB}\)"),
    ({"input_ids": [[1, -2, 3]], "loss_mask": [[0, 1, 1]]},
     r"row 0: input_ids\[1\] is -2, outside the vocabulary"),
    ({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 2, 1]]},
     r"row 0: loss_mask\[1\] is 2, not 0 or 1"),
    ({"input_ids": [[1, 2, 3], [7, 8, 9]], "labels": [[-100, 2, 3], [-100, 9, -100]]},
     r"row 1: labels\[1\] is 9 but input_ids\[1\] is 8: labels must be -100 or the token id "
     r"at the same position \(shifted labels are not adopted\)"),
    ({"input_ids": [[1, 2], None], "loss_mask": [[0, 1], [1]]}, r"row 1: input_ids is null"),
    ({"input_ids": [[1, 2]], "loss_mask": [[0, None]]}, r"row 0: loss_mask\[1\] is null"),
    ({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 1]], "attention_mask": [[1, 1, 0]]},
     r"row 0: attention_mask\[2\] is 0: the row is padded"),
    ({"input_ids": [[1, 2]], "attention_mask": [[1, 1]]},
     r"merge.adopt: legacy/data-00000-of-00001.arrow has input_ids list<item: int32>, "
     r"attention_mask list<item: int8>; no mask column: expected one of loss_mask, labels, "
     r"assistant_masks, completion_mask, or name it in merge.base_columns.mask"),
    ({"input_ids": [[1, 2]], "loss_mask": [[0, 1]], "labels": [[-100, 2]]},
     r"several mask columns \(loss_mask, labels\): name one in merge.base_columns.mask"),
    ({"input_ids": [["a", "b"]], "loss_mask": [[0, 1]]},
     r"column input_ids is list<item: string>; token ids must be a list or large_list of "
     r"integers"),
    ({"ids": [[1, 2]], "loss_mask": [[0, 1]]}, r"no token id column 'input_ids'"),
    # rows validate would refuse (issue 32): named by file and row, never by content hash
    ({"input_ids": [[1, 2, 3], [4]], "loss_mask": [[0, 1, 1], [1]]},
     r"legacy/data-00000-of-00001.arrow, row 1: one token, which validate refuses"),
    ({"input_ids": [[1, 2, 3], []], "loss_mask": [[0, 1, 1], []]}, r"row 1: an empty row"),
    ({"input_ids": [[1, 2, 3], [4, 5, 6]], "loss_mask": [[0, 1, 1], [0, 0, 0]]},
     r"row 1: no supervised token.*merge.adopt_drop_invalid: true"),
    ({"input_ids": [[1, 2, 3], [4, 5, 6]], "loss_mask": [[0, 1, 1], [1, 0, 1]]},
     r"row 1: no two consecutive supervised tokens"),
    # a row that trains its prompt is judged on its own, not by the whole base
    ({"input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[1, 1, 1], [1, 1]]},
     r"legacy/data-00000-of-00001.arrow, row 0: loss_mask trains all 3 of its tokens, the "
     r"prompt included"),
    ({"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8, 9]], "labels": [[-100, 2, 3], [4, 5, 6, 7],
                                                                 [-100, 9]]},
     r"row 1: labels trains all 4 of its tokens.*merge.adopt_fully_supervised: drop or keep"),
])
def test_a_broken_base_stops_in_one_line_naming_file_and_row(repo, data, says):
    datasets.Dataset.from_dict(data).save_to_disk("legacy")
    (repo / "params.yaml").write_text(yaml.safe_dump({"merge": {"base": "legacy",
                                                                "adopt": True}}))
    line, _ = stagecli.fail("merge", repo)
    assert line.startswith("error: merge.adopt: ")
    assert re.search(says, line), line
    assert not (repo / "data/merged").exists()
    assert sorted(p.name for p in (repo / "data").iterdir()) == ["tokenized"]


def test_without_adopt_a_base_without_a_mask_is_refused_with_the_accepted_names(repo):
    datasets.Dataset.from_dict({"input_ids": [[1, 2]], "text": ["hi"]}).save_to_disk("legacy")
    with pytest.raises(StageError) as e:
        merge.run(params.Merge(base="legacy"), PATHS)
    assert str(e.value) == (
        "merge.base legacy is not in this project's layout: legacy/data-00000-of-00001.arrow "
        "(arrow stream) has input_ids list<item: int32>, text string; merge.adopt cannot "
        "convert it either: no mask column: expected one of loss_mask, labels, "
        "assistant_masks, completion_mask, or name it in merge.base_columns.mask")


def test_a_later_file_in_another_layout_is_named(repo):
    (repo / "legacy").mkdir()
    datasets.Dataset.from_dict(columns(user_rows(3))).to_parquet(str(repo / "legacy/a.parquet"))
    datasets.Dataset.from_dict({"input_ids": [[1, 2]]}).to_parquet(str(repo / "legacy/b.parquet"))
    with pytest.raises(StageError) as e:
        merge.run(params.Merge(base="legacy"), PATHS)
    assert str(e.value).endswith("merge.adopt cannot convert it either: legacy/b.parquet: no "
                                 "mask column: expected one of loss_mask, labels, "
                                 "assistant_masks, completion_mask, or name it in "
                                 "merge.base_columns.mask")
    with pytest.raises(StageError, match=r"^merge.adopt: legacy/b.parquet has input_ids "):
        merge.run(cfg("legacy"), PATHS)
    assert not (repo / "data/merged").exists()


def test_the_source_is_the_folder_a_link_names(repo):
    datasets_int64(repo / "sets/sft-v3", user_rows(3))
    (repo / "data/base").symlink_to(repo / "sets/sft-v3")
    report = merge.run(cfg("data/base"), PATHS)
    assert report["adopted"]["source"] == "sft-v3"
    assert set(datasets.load_from_disk("data/merged")["source"][:3]) == {"sft-v3"}


def test_unreadable_and_odd_folders_are_named(repo):
    write = datasets_int64(repo / "cut", user_rows(20))
    shard = write / "data-00001-of-00003.arrow"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(StageError, match="cut/data-00001-of-00003.arrow"):
        merge.run(cfg("cut"), PATHS)

    (repo / "bad").mkdir()
    (repo / "bad/x.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(StageError, match=r"bad/x.parquet: not a readable parquet file"):
        merge.run(cfg("bad"), PATHS)

    hub_parquet(repo / "snapshot", user_rows(4))
    with pytest.raises(StageError, match=r"the .parquet files are in data: name that folder"):
        merge.run(cfg("snapshot"), PATHS)

    datasets_int64(repo / "mixed", user_rows(4))
    datasets.Dataset.from_dict(columns(user_rows(2))).to_parquet(str(repo / "mixed/x.parquet"))
    with pytest.raises(StageError, match="holds both Arrow and .parquet files"):
        merge.run(cfg("mixed"), PATHS)
    assert not (repo / "data/merged").exists()


def test_the_vocabulary_comes_from_the_new_rows(repo):
    fp = json.loads(json.dumps(FP))
    del fp["tokenizer"]["vocab_size"]
    (repo / "data/tokenized/fingerprint.json").write_text(json.dumps(fp))
    datasets_int64(repo / "legacy", user_rows(3))
    with pytest.raises(StageError, match="fingerprint.json: no tokenizer.vocab_size"):
        merge.run(cfg("legacy"), PATHS)


# ------------------------------------------------------------------------- dvc repro


@pytest.mark.slow
def test_dvc_repro_adopts_once_then_links(tmp_path):
    """The merge stage as dvc.yaml declares it, in a throwaway git + DVC repo."""
    repo = tmp_path / "r"
    (repo / "reports").mkdir(parents=True)
    for name in ("stages", "pyproject.toml"):
        src = ROOT / name
        if src.is_dir():
            subprocess.run(["cp", "-r", str(src), str(repo / name)], check=True)
        else:
            (repo / name).write_bytes(src.read_bytes())
    pipeline = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    stage = pipeline["stages"]["merge"]
    stage["deps"] = [d for d in stage["deps"] if not str(d).startswith("reports/")]
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"merge": stage}}))
    (repo / "params.yaml").write_text(yaml.safe_dump(
        {"merge": {"base": "data/base", "adopt": True}}))
    user = user_rows(50)
    datasets_int64(repo / "data/base", user)
    save(repo / "data/tokenized", contract_rows(["n0", "n1"], "new", tag=1), fingerprint=FP)
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"],
                ["dvc", "config", "cache.type", "hardlink,symlink"]):
        run(cmd, repo)
    git_commit(repo, "adopt")
    run(["dvc", "repro"], repo)
    ds = datasets.load_from_disk(str(repo / "data/merged"))
    assert ds["input_ids"][:50] == [ids for ids, _ in user]
    assert "up to date" in run(["dvc", "repro"], repo) + run(["dvc", "status"], repo)
    merged = json.loads((repo / "reports/merge.json").read_text())
    assert merged["shards"]["base_adopted"] == 3
    shown = json.loads(run(["dvc", "metrics", "show", "--json"], repo))
    assert shown[""]["data"]["reports/merge.json"]["data"]["adopted"]["rows"] == 50


@pytest.mark.parametrize("data, base_columns, says", [
    ({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 1]]},
     {"input_ids": "input_ids", "mask": "input_ids"},
     r"names 'input_ids' as both the token ids and the mask"),
    ({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 1]], "labels": [[-100, 2, 3]]},
     {"mask": "attention_mask"}, r"the mask is attention_mask, which marks padding"),
])
def test_a_column_mapping_that_would_train_every_token_is_refused(repo, data, base_columns,
                                                                   says):
    datasets.Dataset.from_dict(data).save_to_disk("legacy")
    (repo / "params.yaml").write_text(yaml.safe_dump({"merge": {
        "base": "legacy", "adopt": True, "base_columns": base_columns}}))
    line, _ = stagecli.fail("merge", repo)
    assert re.search(says, line) and "legacy/data-00000-of-00001.arrow" in line, line
    assert not (repo / "data/merged").exists()


def test_rows_validate_would_refuse_are_dropped_and_counted_when_asked(repo):
    user = user_rows(6)
    data = columns(user)
    data["input_ids"][2], data["loss_mask"][2] = [5], [1]
    data["input_ids"][4], data["loss_mask"][4] = [5, 6, 7], [0, 0, 0]
    datasets.Dataset.from_dict(data).save_to_disk("legacy")
    report = merge.run(cfg("legacy", adopt_drop_invalid=True), PATHS)
    assert report["adopted"]["invalid_rows_dropped"] == 2
    assert report["adopted"]["rows"] == 4 and report["base"]["rows"] == 4
    merged = datasets.load_from_disk("data/merged")
    assert len(merged) == 4 + 5
    validate_passes()


def fully_supervised_base(n: int, trained_whole: list[int]) -> dict:
    """`n` chat rows (a prompt, then a supervised answer), those in `trained_whole` with a
    mask of all ones: what a base joined from two sets, one with a wrong mask, holds."""
    data = columns(user_rows(n))
    for r in trained_whole:
        data["loss_mask"][r] = [1] * len(data["input_ids"][r])
    return data


@pytest.mark.parametrize("rule, kept", [("drop", 4), ("keep", 6)])
def test_rows_that_train_every_token_are_counted_per_file_and_dropped_or_kept(repo, caplog,
                                                                           rule, kept):
    datasets.Dataset.from_dict(fully_supervised_base(6, [1, 4])).save_to_disk("legacy")
    with caplog.at_level("WARNING"):
        report = merge.run(cfg("legacy", adopt_fully_supervised=rule), PATHS)
    adopted = report["adopted"]
    assert (adopted["fully_supervised_rows"], adopted["fully_supervised"]) == (2, rule)
    assert adopted["files"][0]["fully_supervised_rows"] == 2
    assert adopted["invalid_rows_dropped"] == 0 and adopted["rows"] == kept
    assert len(datasets.load_from_disk("data/merged")) == kept + 5
    (line,) = [r.getMessage() for r in caplog.records if "train every token" in r.getMessage()]
    assert "legacy/data-00000-of-00001.arrow: 2 rows train every token" in line
    assert "(the first: row 1)" in line and f"merge.adopt_fully_supervised: {rule}" in line
    assert "Rows training every token, the prompt included: 2" in (
        repo / "data/merged/README.md").read_text()


def test_a_base_whose_every_row_trains_every_token_is_refused_unless_kept(repo):
    datasets.Dataset.from_dict(fully_supervised_base(3, [0, 1, 2])).save_to_disk("legacy")
    with pytest.raises(StageError, match=r"legacy: loss_mask marks every token of every row"):
        merge.run(cfg("legacy", adopt_fully_supervised="drop"), PATHS)
    assert merge.run(cfg("legacy", adopt_fully_supervised="keep"),
                     PATHS)["adopted"]["fully_supervised_rows"] == 3


def test_a_base_whose_every_trainable_row_trains_every_token_is_refused_under_drop(repo):
    """Rows validate would refuse, dropped by merge.adopt_drop_invalid, do not hide that
    every other row trains every token: dropping those too would adopt an empty base."""
    data = fully_supervised_base(3, [0, 1, 2])
    data["input_ids"].append([5, 6])
    data["loss_mask"].append([0, 0])
    data["conversation_id"].append("no-supervised-token")
    datasets.Dataset.from_dict(data).save_to_disk("legacy")
    with pytest.raises(StageError, match=r"legacy: loss_mask marks every token of every row"):
        merge.run(cfg("legacy", adopt_fully_supervised="drop", adopt_drop_invalid=True), PATHS)
    assert not (repo / "data/merged").exists()


def test_a_base_whose_every_row_validate_would_refuse_is_no_empty_version(repo):
    """merge.adopt_drop_invalid dropping every row of the base (a mask column that is not
    one) would make version 1 of the new rows alone: refused naming the base."""
    data = columns(user_rows(3))
    data["loss_mask"] = [[0] * len(ids) for ids in data["input_ids"]]
    datasets.Dataset.from_dict(data).save_to_disk("legacy")
    with pytest.raises(StageError, match=r"legacy: all 3 of its rows are rows validate would "
                                         r"refuse .*merge.base_columns"):
        merge.run(cfg("legacy", adopt_drop_invalid=True), PATHS)
    assert not (repo / "data/merged").exists()


def test_the_base_folder_is_recorded_without_the_host_s_path(repo, tmp_path_factory):
    """The report and the card say where the base really is (links followed), relative to
    the repository when inside it: a clone elsewhere writes the same bytes."""
    datasets.Dataset.from_dict(columns(user_rows(3))).save_to_disk("legacy")
    (repo / "data/base").symlink_to(repo / "legacy")
    assert merge.run(cfg("data/base"), PATHS)["adopted"]["folder"] == "legacy"
    outside = tmp_path_factory.mktemp("elsewhere") / "set"
    datasets.Dataset.from_dict(columns(user_rows(3))).save_to_disk(str(outside))
    assert merge.run(cfg(outside), PATHS)["adopted"]["folder"] == str(outside.resolve())


# ------------------------------------------------------------ what adopting refuses up front


def test_a_parquet_bomb_is_refused_from_its_footer_before_it_is_decoded(repo):
    """One row of 2M zero ids: a few kB on disk, gigabytes once read and converted."""
    (repo / "bomb").mkdir()
    n = 2 << 20
    mask = np.ones(n, np.int8)
    mask[0] = 0
    table = pa.table({"input_ids": pa.LargeListArray.from_arrays([0, n], np.zeros(n, np.int64)),
                      "loss_mask": pa.LargeListArray.from_arrays([0, n], mask)})
    pa.parquet.write_table(table, repo / "bomb/a.parquet", compression="zstd")
    assert (repo / "bomb/a.parquet").stat().st_size < 16_000
    with pytest.raises(StageError, match=r"^bomb/a.parquet: row group 0: column input_ids holds "
                                         rf"{8 * n} bytes for 1 rows, over "
                                         r"merge.adopt_max_row_tokens \(1048576 tokens"):
        merge.run(cfg("bomb"), PATHS)
    assert not (repo / "data/merged").exists()


def test_an_ordinary_parquet_set_stays_under_the_row_bound(repo):
    hub_parquet(repo / "snap", user_rows(10))
    report = merge.run(cfg("snap/data", adopt_max_row_tokens=29 + 20), PATHS)
    assert report["adopted"]["rows"] == 10


def duplicate_names(folder: Path, fmt: str, names: list[str]) -> Path:
    folder.mkdir()
    ids, mask = pa.array([[1, 2, 3, 4]]), pa.array([[0, 0, 1, 1]])
    table = pa.table([ids, mask, mask], names=names)
    if fmt == "parquet":
        pa.parquet.write_table(table, folder / "a.parquet")
    else:
        with pa.OSFile(str(folder / "a.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    return folder


@pytest.mark.parametrize("adopting", [True, False])
@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_a_column_named_twice_is_refused_naming_the_file(repo, fmt, adopting):
    duplicate_names(repo / "dup", fmt, ["input_ids", "loss_mask", "loss_mask"])
    with pytest.raises(StageError, match=rf"dup/a.{fmt} .*has .*the column name 'loss_mask' "
                                         "appears more than once"):
        merge.run(params.Merge(base="dup", adopt=adopting), PATHS)


@pytest.mark.parametrize("adopting", [True, False])
def test_a_parquet_column_name_that_is_not_utf8_is_one_line(repo, adopting):
    import io
    import pyarrow.parquet as pq

    (repo / "odd").mkdir()
    sink = io.BytesIO()
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 1]],
                             "conversation_id": ["c0"]}), sink, store_schema=False)
    raw = sink.getvalue().replace(b"conversation_id", b"conversation_\xff\xfe")
    (repo / "odd/a.parquet").write_bytes(raw)
    with pytest.raises(StageError, match=r"^odd/a.parquet: a column name in the Parquet footer "
                                         "is not UTF-8"):
        merge.run(params.Merge(base="odd", adopt=adopting), PATHS)


@pytest.mark.parametrize("files", [{}, {"dataset_info.json": "{}"}])
def test_an_adopted_base_without_data_files_is_no_first_version(repo, files):
    (repo / "mount").mkdir()
    for name, text in files.items():
        (repo / "mount" / name).write_text(text)
    with pytest.raises(StageError, match=r"^merge.base mount: holds no data files .* "
                                         "merge.adopt is true"):
        merge.run(cfg("mount"), PATHS)
    assert not (repo / "data/merged").exists()


@pytest.mark.parametrize("source, says", [
    (" ", r"^merge.base_source ' ' is blank; validate refuses"),
    ("s" * 257, r"^merge.base_source 's{40}'\.\.\. is 257 characters long, over 256"),
])  # fmt: skip
def test_a_base_source_validate_would_refuse_or_too_long_is_refused(repo, source, says):
    datasets_int64(repo / "sft", user_rows(3))
    with pytest.raises(StageError, match=says):
        merge.run(cfg("sft", base_source=source), PATHS)
    assert not (repo / "data/merged").exists()
    assert merge.run(cfg("sft", base_source="s" * 256), PATHS)["adopted"]["rows"] == 3
