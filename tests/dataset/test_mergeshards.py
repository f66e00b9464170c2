"""A merge's shards: scanned, duplicates settled by policy, placed or rewritten."""

from __future__ import annotations

import pyarrow as pa
import pytest

from stages.common.errors import StageError
from stages.dataset import mergeshards
from stages.dataset.schema import ARROW_SCHEMA
from stages.dataset.shards import ShardFile, open_shard


def shard(path, ids: list[str]):
    n = len(ids)
    batch = pa.RecordBatch.from_pydict(
        {"id": ids, "source": ["s"] * n, "input_ids": [[1, 2, 3]] * n,
         "loss_mask": [[0, 1, 1]] * n, "num_tokens": [3] * n, "num_loss_tokens": [2] * n},
        schema=ARROW_SCHEMA)
    with ShardFile(path) as f:
        f.write(batch)
    return mergeshards.Shard(path)


def ids_in(path) -> list[str]:
    with open_shard(path) as reader:
        return [i for b in reader for i in b.column("id").to_pylist()]


@pytest.mark.parametrize("policy, base_ids, new_ids", [
    ("keep-base", ["a", "b", "c"], ["d"]),
    ("keep-new", ["a", "c"], ["b", "d"]),
])
def test_duplicates_are_dropped_from_one_side_and_the_rest_placed(tmp_path, policy,
                                                                  base_ids, new_ids):
    base = [shard(tmp_path / "base.arrow", ["a", "b", "c"])]
    new = [shard(tmp_path / "new.arrow", ["b", "d"])]
    unique = mergeshards.scan_new(new, tmp_path)
    dup = mergeshards.scan_base(base, unique)
    counts = mergeshards.apply_duplicates(policy, dup, base, new, tmp_path)
    assert counts["ids"] == 1 and counts["policy"] == policy
    out = tmp_path / "out"
    out.mkdir()
    placed = mergeshards.place_all(out, base, new, link=True)
    written = [name for name, _, _ in placed if name is not None]
    assert ids_in(out / written[0]) == base_ids and ids_in(out / written[1]) == new_ids
    assert mergeshards.totals([s for _, _, s in placed])["rows"] == 4


def test_error_policy_and_repeated_new_ids_are_refused(tmp_path):
    base = [shard(tmp_path / "base.arrow", ["a"])]
    new = [shard(tmp_path / "new.arrow", ["a"])]
    dup = mergeshards.scan_base(base, mergeshards.scan_new(new, tmp_path))
    with pytest.raises(StageError, match="1 ids are in both"):
        mergeshards.apply_duplicates("error", dup, base, new, tmp_path)
    with pytest.raises(StageError, match="occur more than once"):
        mergeshards.scan_new([shard(tmp_path / "twice.arrow", ["x", "x"])], tmp_path)


def test_a_base_of_wider_types_is_cast_only_when_allowed(tmp_path):
    wide = pa.schema([pa.field(f.name, pa.int64()) if f.name == "num_tokens" else f
                      for f in ARROW_SCHEMA])
    path = tmp_path / "wide.arrow"
    batch = pa.RecordBatch.from_pydict(
        {"id": ["a"], "source": ["s"], "input_ids": [[1]], "loss_mask": [[1]],
         "num_tokens": [1], "num_loss_tokens": [1]}, schema=wide)
    with ShardFile(path, wide) as f:
        f.write(batch)
    with pytest.raises(StageError, match="merge.allow_cast"):
        mergeshards.check_base_schema(path, False, tmp_path)
    assert mergeshards.check_base_schema(path, True, tmp_path) is True
