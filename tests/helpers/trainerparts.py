"""Record batches of the merged set's contract built from rows, for the trainer tests."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pyarrow as pa

from stages.dataset.schema import ARROW_SCHEMA
from stages.trainers.batch import Part, read_part


def record_batch(rows: list[tuple[str, list[int], list[int]]]) -> pa.RecordBatch:
    """(id, input_ids, loss_mask) rows as a record batch of the merged set's schema."""
    return pa.RecordBatch.from_pylist(
        [{"id": rid, "source": "s", "input_ids": ids, "loss_mask": mask,
          "num_tokens": len(ids), "num_loss_tokens": sum(mask)} for rid, ids, mask in rows],
        schema=ARROW_SCHEMA)


def part(rows, max_length: Optional[int] = None) -> Part:
    return read_part(record_batch(rows), Path("shard.arrow"), max_length)
