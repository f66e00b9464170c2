"""The same row in two versions: differences flags exactly the tokens that changed, and
`python -m stages.show --rev` reads the older version through DVC (no checkout) and marks
them on the page."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from stages.view.versions import differences
from tests.repo import git_commit, link_caches, run


def test_differences_flag_replaced_inserted_and_resupervised_tokens():
    old = np.array([1, 2, 3, 4, 5, 6, 7, 8])
    new = np.array([1, 2, 30, 31, 4, 5, 6, 8, 9])
    old_sup = np.array([0, 0, 0, 1, 1, 1, 1, 1], bool)
    new_sup = np.array([0, 0, 1, 1, 1, 0, 1, 1, 1], bool)
    a, b = differences(old, old_sup, new, new_sup)
    assert np.flatnonzero(a).tolist() == [2, 4, 6]  # 3 replaced, 5 resupervised, 7 gone
    assert np.flatnonzero(b).tolist() == [2, 3, 5, 8]


def test_identical_rows_differ_nowhere():
    ids = np.arange(50)
    sup = ids % 3 == 0
    a, b = differences(ids, sup, ids, sup)
    assert not a.any() and not b.any()


def write_set(folder: Path, rows: dict[str, tuple[list[int], list[int]]]) -> None:
    from stages.dataset.schema import ARROW_SCHEMA
    from stages.dataset.shards import ShardFile, shard_name, write_metadata

    folder.mkdir(parents=True, exist_ok=True)
    ids = list(rows)
    tokens = [rows[i][0] for i in ids]
    masks = [rows[i][1] for i in ids]
    with ShardFile(folder / shard_name(0, 1)) as shard:
        shard.write(pa.RecordBatch.from_arrays(
            [pa.array(ids), pa.array(["s"] * len(ids)), pa.array(tokens, pa.list_(pa.int32())),
             pa.array(masks, pa.list_(pa.int8())), pa.array([len(t) for t in tokens], pa.int32()),
             pa.array([sum(m) for m in masks], pa.int32())], schema=ARROW_SCHEMA))
    (folder / "fingerprint.json").write_text(json.dumps({"tokenizer": {"name": "bundled:qwen3.6"}}))
    write_metadata(folder, [shard_name(0, 1)])


@pytest.mark.slow
def test_rev_reads_the_committed_version_through_dvc_and_marks_what_changed(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    run(["git", "init", "-q"], repo)
    run([sys.executable, "-m", "dvc", "init", "-q"], repo)
    link_caches(repo)
    (repo / ".gitignore").write_text(".cache\n")
    rng = np.random.default_rng(0)
    base = rng.integers(0, 200000, 40).tolist()
    mask = [0] * 15 + [1] * 25
    write_set(repo / "set", {"a": (base, mask), "b": (base[:10], [0] * 5 + [1] * 5)})
    run([sys.executable, "-m", "dvc", "add", "-q", "set"], repo)
    git_commit(repo, "v1")
    changed = list(base)
    changed[20:23] = [7, 8, 9]  # three tokens replaced
    changed.insert(30, 11)  # one inserted
    new_mask = mask[:30] + [1] + mask[30:]
    new_mask[5] = 1  # one token's supervision changed
    shutil.rmtree(repo / "set")
    write_set(repo / "set", {"a": (changed, new_mask), "b": (base[:10], [0] * 5 + [1] * 5)})
    run([sys.executable, "-m", "dvc", "add", "-q", "set"], repo)
    page = tmp_path / "diff.html"
    out = run([sys.executable, "-m", "stages.show", "set", "--rev", "HEAD", "--id", "a",
               "--html", str(page)], repo, timeout=600)
    assert "wrote" in out
    text = page.read_text(encoding="utf-8")
    old, new = text.split('data-row-id="a"')[1:3]

    def differs(part: str) -> list[int]:
        return [int(p) for p in re.findall(
            r'data-pos="(\d+)" data-supervised="\d" data-differs="1"', part)]

    assert differs(old) == [5, 20, 21, 22]
    assert differs(new) == [5, 20, 21, 22, 30]
    # the workspace is the new version (41 tokens), the revision the old one (40)
    plain = run([sys.executable, "-m", "stages.show", "set", "--id", "a", "--rev", "HEAD",
                 "--color", "never"], repo, timeout=600)
    assert "differs from HEAD: 5 of 41 tokens here, 4 of 40 there" in plain
    assert "differing positions: 5, 20-22, 30" in plain
