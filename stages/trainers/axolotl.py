"""axolotl's format for pre-tokenized data: a save_to_disk folder of exactly `input_ids`,
`attention_mask` and `labels` (-100 where the loss mask is 0), the rows it drops named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from stages.dataset import arrays
from stages.dataset.loader import IGNORE
from stages.dataset.schema import hf_schema
from stages.trainers.base import ArrowTrainer, length_note
from stages.trainers.batch import Part
from stages.trainers.rules import Rule, longer, none_supervised, shorter_than_two

# int64 labels: PyTorch's cross-entropy refuses int32 targets, and a trainer that formats
# the dataset as torch tensors hands the column's own type to the loss
SCHEMA = hf_schema([
    ("input_ids", pa.list_(pa.int32())),
    ("attention_mask", pa.list_(pa.int8())),
    ("labels", pa.list_(pa.int64())),
])


class Axolotl(ArrowTrainer):
    schema = SCHEMA
    name = "axolotl"
    default_max_length = 512
    max_length_key = "sequence_len"
    rules = (
        Rule("longer_than_max_length", "dropped",
             "longer than {L} tokens: dropped (excess_length_strategy drop, the default; "
             "truncate keeps the first {L})", longer),
        Rule("shorter_than_min_sample_len", "dropped", "fewer than 2 tokens (min_sample_len)",
             shorter_than_two),
        Rule("no_supervised_token", "dropped",
             "no supervised token in the first {L}: all labels -100 (axolotl 0.19 drops "
             "these in preprocessing with sample_packing on)", none_supervised),
    )

    @staticmethod
    def columns(part: Part) -> list[pa.Array]:
        """input_ids as they are, attention_mask all ones, labels the ids or IGNORE."""
        offsets = arrays.array(part.offsets.astype(np.int32))
        # one pass straight to int64 (a bool view of the 0/1 mask, no comparison array)
        labels = np.where(part.mask.view(np.bool_), part.ids, np.int64(IGNORE))
        return [part.input_ids,
                pa.ListArray.from_arrays(offsets, arrays.array(np.ones(len(part.ids), np.int8))),
                pa.ListArray.from_arrays(offsets, arrays.array(labels))]

    def settings(self, out: Path, report: dict) -> list[str]:
        return [
            "axolotl config keys:",
            f"  datasets: [{{path: {out}, type: }}]  # empty type: already tokenized",
            f"  sequence_len: {report['max_length']}  # {length_note(report, 'drop')}",
        ]
