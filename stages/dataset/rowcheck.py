"""validate's row checks: `Findings` (failures per check: a count and the first
examples), and `Scanner`, which takes each shard's row summaries (rowsummary.py) in dataset
order, checks them against the row rules (schema.py) in chunks of CHUNK_ROWS rows, adds
up the per-source statistics and confirms repeated ids (idhashes.py) on the id strings.
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import Future
from pathlib import Path
from typing import Optional

import numpy as np
import pandera.errors
import pandera.polars  # noqa: F401 - imported with the stage, not on the clock inside run()
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from stages.common import params
from stages.common.errors import StageError
from stages.dataset import arrays, rowsummary
from stages.dataset.idhashes import IdHashes
from stages.dataset.loader import TokenBudget
from stages.dataset.schema import NOT_NULL_CHECKS, row_rules, row_schema, rows_pass
from stages.dataset.shards import open_columns

log = logging.getLogger(__name__)

CHUNK_ROWS = 65536  # summary rows checked at once: bounds memory, amortises per-call costs
# characters of one example in reports/validate.json: an id or a message names a row in far
# fewer, and the report is a git-tracked metric that a 4 MB id would otherwise copy whole
MAX_EXAMPLE_CHARS = 500


class Findings:
    """Failures per check: a count and the first few examples."""

    def __init__(self, names: list[str], max_examples: int):
        self.max_examples = max_examples
        self.checks: dict[str, dict] = {}
        for name in names:
            self.expect(name)

    def expect(self, name: str) -> None:
        self.checks[name] = {"passed": True, "failures": 0, "examples": []}

    def add(self, name: str, count: int, examples: list[str]) -> None:
        check = self.checks[name]
        check["passed"] = False
        check["failures"] += count
        room = max(self.max_examples - len(check["examples"]), 0)
        check["examples"].extend(_example(str(e)) for e in examples[:room])

    def failed(self) -> list[str]:
        return [name for name, c in self.checks.items() if not c["passed"]]


def _example(text: str) -> str:
    """One line (library messages, load_from_disk's, span several) of at most
    MAX_EXAMPLE_CHARS characters, saying how long a longer one was."""
    line = re.sub(r"\s*\n\s*", " ", text[:MAX_EXAMPLE_CHARS + 1])
    if len(text) <= MAX_EXAMPLE_CHARS:
        return line
    return f"{line[:MAX_EXAMPLE_CHARS]}\u2026 ({len(text):,} characters)"


class Scanner:
    """Summarises rows batch by batch and checks the summaries chunk by chunk."""

    def __init__(self, cfg: params.Validate, vocab: int, findings: Findings, ids: IdHashes,
                 chunk_rows: Optional[int] = None, budget: Optional[TokenBudget] = None):
        self.vocab = vocab
        self.budget = budget  # fed every row's length, supervision and source in order
        self.chunk_rows = chunk_rows or CHUNK_ROWS
        self.findings = findings
        self.rules = row_rules(cfg.max_seq_len, cfg.min_loss_tokens)
        self.schema = row_schema(self.rules)
        self.width = rowsummary.bin_width(cfg.max_seq_len)
        self.rows = 0
        self.pending: list[pa.RecordBatch] = []
        self.pending_rows = 0
        self.ids = ids  # 64-bit id hashes and row numbers, dataset-wide
        self.shard_rows: list[int] = []
        self.stats: dict[str, np.ndarray] = {}  # per source: see rowsummary.source_stats

    def add(self, path: Path, future: Future) -> None:
        """Take one shard's summaries (in dataset order) and check them chunk by chunk."""
        try:
            shard = future.result()
        except StageError as e:
            self.findings.add("shards_readable", 1, [str(e)[:300]])
            self.shard_rows.append(0)
            return
        if shard.diffs:
            self.findings.add("features", len(shard.diffs),
                              [f"{path.name}: {d}" for d in shard.diffs])
        for summary in shard.summaries:
            if self.budget is not None:
                self.budget.add(arrays.values(pc.fill_null(summary.column("input_ids_len"), 0)),
                                arrays.values(pc.fill_null(summary.column("supervised"), 0)),
                                summary.column("source"))
            first = pc.add(summary.column("row"), self.rows)
            self.pending.append(summary.set_column(0, "row", first))
            self.pending_rows += summary.num_rows
            if self.pending_rows >= self.chunk_rows:
                self.flush()
        self.rows += shard.rows
        self.shard_rows.append(shard.rows)
        rowsummary.add_stats(self.stats, shard.stats)
        log.info("shard %d %s: %d rows, %d in all", len(self.shard_rows), path.name,
                 shard.rows, self.rows)

    def flush(self) -> None:
        if not self.pending:
            return
        frame = pl.from_arrow(pa.Table.from_batches(self.pending))
        self.pending, self.pending_rows = [], 0
        if not rows_pass(frame, self.rules):
            try:
                self.schema.validate(frame, lazy=True)
            except pandera.errors.SchemaErrors as e:
                self._record(frame, e.failure_cases)
        ids = frame.filter(pl.col("id").is_not_null())
        self.ids.add(ids.get_column("id").hash(seed=0).to_numpy(),
                     ids.get_column("row").to_numpy())

    def _record(self, frame, failures) -> None:
        names = pl.col("column").replace_strict(NOT_NULL_CHECKS, default=None)
        failures = failures.with_columns(
            name=pl.when(pl.col("check") == "not_nullable").then(names)
            .otherwise(pl.col("check"))
        )
        for (name,), group in failures.group_by(["name"], maintain_order=True):
            if name not in self.findings.checks:  # a schema-level error: our own bug
                raise StageError(f"validate: summary schema error: {group.row(0)}")
            index = group.get_column("index").unique(maintain_order=True)
            rows = frame[index.head(self.findings.max_examples).to_list()]
            examples = [
                i if i is not None and i.strip() else
                f"row {r} ({'null' if i is None else repr(i)} id)"
                for i, r in zip(rows.get_column("id"), rows.get_column("row"))
            ]
            self.findings.add(name, len(index), examples)

    def check_unique_ids(self, shards: list[Path]) -> None:
        """Hash-level duplicates (stages/dataset/idhashes.py), then confirmed on the id strings."""
        suspects = self.ids.repeated_rows()
        if not len(suspects):
            return
        ids = _ids_at(shards, self.shard_rows, suspects)
        counts = pc.value_counts(ids)
        repeated = counts.filter(pc.greater(counts.field("counts"), 1))
        if len(repeated):
            total = pc.sum(repeated.field("counts")).as_py()
            examples = repeated.field("values").slice(0, self.findings.max_examples)
            self.findings.add("id_unique", total, examples.to_pylist())


def _ids_at(shards: list[Path], shard_rows: list[int], rows: np.ndarray) -> pa.Array:
    """The ids at dataset-wide row numbers `rows` (sorted), reading only those shards."""
    starts = np.concatenate(([0], np.cumsum(shard_rows)))
    out = []
    for i, path in enumerate(shards):
        lo, hi = np.searchsorted(rows, [starts[i], starts[i + 1]])
        if lo == hi:
            continue
        with open_columns(path) as stream:
            ids = pa.chunked_array([pc.cast(b.column("id"), pa.large_string()) for b in stream],
                                   pa.large_string())
        out.append(ids.take(pa.array(rows[lo:hi] - starts[i])).combine_chunks())
    return pa.concat_arrays(out) if out else pa.array([], pa.large_string())
