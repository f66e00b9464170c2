"""validate's row checks: findings per check, and shards scanned against the row rules."""

from __future__ import annotations

from concurrent.futures import Future

import pyarrow as pa

from stages.common.params import Validate
from stages.dataset import rowcheck, rowsummary
from stages.dataset.idhashes import IdHashes
from stages.dataset.schema import ARROW_SCHEMA, ROW_CHECKS
from stages.dataset.shards import ShardFile


def test_findings_keep_a_count_and_the_first_examples_on_one_line():
    findings = rowcheck.Findings(["a", "b"], max_examples=2)
    findings.add("a", 3, ["one\n  two", "x", "y"])
    findings.add("a", 1, ["z"])
    assert findings.checks["a"] == {"passed": False, "failures": 4, "examples": ["one two", "x"]}
    assert findings.failed() == ["a"]


def test_an_example_is_cut_to_a_bounded_length_saying_how_long_it_was():
    findings = rowcheck.Findings(["id_unique"], max_examples=10)
    findings.add("id_unique", 20, ["x" * (4 << 20)] * 10)
    examples = findings.checks["id_unique"]["examples"]
    assert len(examples) == 10
    assert all(e == "x" * rowcheck.MAX_EXAMPLE_CHARS + "\u2026 (4,194,304 characters)"
               for e in examples)


def summarized(path, vocab, width) -> Future:
    done = Future()
    done.set_result(rowsummary.summarize_shard(path, vocab, width))
    return done


def test_a_scan_finds_long_rows_and_repeated_ids(tmp_path):
    cfg = Validate(vocab_size=100, max_seq_len=4, min_loss_tokens=1)
    rows = {"id": ["a", "b", "a"], "source": ["s"] * 3,
            "input_ids": [[1, 2], [1, 2, 3, 4, 5], [3, 4]],
            "loss_mask": [[0, 1], [0, 1, 1, 1, 1], [0, 1]],
            "num_tokens": [2, 5, 2], "num_loss_tokens": [1, 4, 1]}
    path = tmp_path / "data-00000-of-00001.arrow"
    with ShardFile(path) as f:
        f.write(pa.RecordBatch.from_pydict(rows, schema=ARROW_SCHEMA))
    findings = rowcheck.Findings(["shards_readable", "features", "id_unique"] + ROW_CHECKS, 3)
    with IdHashes() as ids:
        scan = rowcheck.Scanner(cfg, 100, findings, ids, chunk_rows=2)
        scan.add(path, summarized(path, 100, scan.width))
        scan.flush()
        scan.check_unique_ids([path])
    assert scan.rows == 3
    failed = findings.failed()
    assert "id_unique" in failed and findings.checks["id_unique"]["examples"] == ["a"]
    assert "max_seq_len" in failed and findings.checks["max_seq_len"]["examples"] == ["b"]
    assert findings.checks["max_seq_len"]["failures"] == 1
