"""Each row of a shard reduced to a columnar summary (stages/dataset/rowsummary.py)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from stages.dataset.rowsummary import (
    FRACTIONS,
    LENGTH_BINS,
    LENGTHS,
    ROWS,
    SUPERVISED,
    TOKENS,
    add_stats,
    bin_width,
    summarize,
    summarize_shard,
)
from stages.dataset.schema import ARROW_SCHEMA
from stages.dataset.shards import ShardFile

VOCAB = 1000


@pytest.mark.parametrize("values, longest, skip", [
    ([0, 1, 1, 1, 2, -1], 12, 7),  # bad values: the per-row count path
    ([0, 1, 1], 40, 7),  # only 0/1: read eight bytes at a time, from an odd offset
    ([0, 1], 40, 8),
])
def test_row_summary_matches_a_plain_python_count(values, longest, skip):
    """The columnar summary against a per-row Python loop, on random rows."""
    rng = np.random.default_rng(0)
    data = []
    for i in range(300):
        n = int(rng.integers(0, longest))
        data.append({"id": f"r{i}", "source": "s",
                     "input_ids": rng.integers(-3, VOCAB + 3, n).tolist(),
                     "loss_mask": rng.choice(values, n).tolist(),
                     "num_tokens": n, "num_loss_tokens": 0})
    batch = pa.Table.from_pylist(data, schema=ARROW_SCHEMA).slice(skip).combine_chunks()
    summary = summarize(batch.to_batches()[0], VOCAB, 0).to_pydict()
    for k, r in enumerate(data[skip:]):
        mask, best, run = r["loss_mask"], 0, 0
        for v in mask:
            run = run + 1 if v == 1 else 0
            best = max(best, run)
        assert summary["ids_out_of_range"][k] == sum(not 0 <= t < VOCAB for t in r["input_ids"])
        assert summary["mask_not_binary"][k] == sum(v not in (0, 1) for v in mask)
        assert summary["supervised"][k] == sum(v == 1 for v in mask)
        assert summary["longest_run"][k] == best


def test_a_shard_summary_counts_each_source_and_bins_it(tmp_path):
    rows = [{"id": f"r{i}", "source": "ab"[i % 2], "input_ids": list(range(n)),
             "loss_mask": [0] * (n - k) + [1] * k, "num_tokens": n, "num_loss_tokens": k}
            for i, (n, k) in enumerate([(10, 5), (3, 3), (70, 7), (129, 0), (64, 16)])]
    path = tmp_path / "data-00000-of-00001.arrow"
    with ShardFile(path) as shard:
        shard.write(pa.RecordBatch.from_pylist(rows, schema=ARROW_SCHEMA))
    width = bin_width(128)  # 2 tokens a bin
    got = summarize_shard(path, VOCAB, width)
    assert got.diffs == [] and got.rows == 5 and len(got.summaries) == 1
    assert got.summaries[0].column("row").to_pylist() == [0, 1, 2, 3, 4]
    for source, mine in (("a", rows[0::2]), ("b", rows[1::2])):
        stats = got.stats[source]
        assert stats[ROWS] == len(mine)
        assert stats[TOKENS] == sum(r["num_tokens"] for r in mine)
        assert stats[SUPERVISED] == sum(r["num_loss_tokens"] for r in mine)
        lengths = stats[LENGTHS]
        assert len(lengths) == LENGTH_BINS + 1 and lengths.sum() == len(mine)
        for r in mine:  # a row of n tokens is in bin n // width, the last one past 128
            assert lengths[min(r["num_tokens"] // width, LENGTH_BINS)] >= 1
        assert stats[FRACTIONS].sum() == len(mine)
    assert got.stats["b"][LENGTHS][LENGTH_BINS] == 1  # the 129-token row, past the limit
    total = {}
    add_stats(total, got.stats)
    add_stats(total, got.stats)
    assert (total["a"] == 2 * got.stats["a"]).all()
