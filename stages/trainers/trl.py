"""TRL's format (SFTTrainer, TRL 1.16): a save_to_disk folder of `id`, `input_ids` and
`assistant_masks`, which SFTTrainer builds its labels from (it ignores a `loss_mask`)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from stages.dataset.schema import ARROW_SCHEMA as ROW, hf_schema
from stages.trainers.base import ArrowTrainer, length_note
from stages.trainers.batch import Part
from stages.trainers.rules import LONGER_CUT, Rule, none_supervised

# the merged set's own columns and types, loss_mask under the name SFTTrainer reads
SCHEMA = hf_schema([("id", ROW.field("id").type), ("input_ids", ROW.field("input_ids").type),
                    ("assistant_masks", ROW.field("loss_mask").type)])


class Trl(ArrowTrainer):
    schema = SCHEMA
    name = "trl"
    default_max_length = 1024
    max_length_key = "SFTConfig.max_length"
    rules = (
        LONGER_CUT,
        Rule("no_supervised_token", "dropped",
             "no supervised token in the first {L}: SFTTrainer drops a row whose labels "
             "are all -100 after its cut (when packing is off)", none_supervised),
    )

    @staticmethod
    def columns(part: Part) -> list[pa.Array]:
        """The merged set's own columns: loss_mask is written as assistant_masks."""
        return [part.id, part.input_ids, part.loss_mask]

    def settings(self, out: Path, report: dict) -> list[str]:
        return [
            "SFTConfig settings that matter (TRL 1.16):",
            f"  max_length={report['max_length']}  # {length_note(report, 'cut')}",
            "  assistant_only_loss=False  # the default: the labels come from assistant_masks "
            "(True is for conversational text and raises here)",
            "  dataset_kwargs=None  # keep dataset preparation: it builds the labels from "
            "assistant_masks (skip_prepare_dataset=True refuses mask columns without labels)",
            "  packing=True  # optional: rows packed without padding (bfd; TRL runs it with "
            "flash-attention); off, each batch is padded",
            f"train_dataset = datasets.load_from_disk({str(out)!r})  "
            "# its map() cache files are written into that folder",
        ]
