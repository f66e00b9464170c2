"""SpecForge's format (0.2.0, DFlash and EAGLE-3): one `train.jsonl` of `input_ids`,
`loss_mask` and `id` records (`data.prompts_path`), and with a draft vocabulary EAGLE-3's
`vocab_mapping.pt`; DFlash's and EAGLE-3's row rules."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import orjson

from stages.trainers.base import Trainer, length_note
from stages.trainers.batch import Part
from stages.trainers.rules import LONGER_CUT, Rule, no_two_adjacent, none_supervised
from stages.trainers.vocab import VOCAB_MAPPING, VocabCounts
from stages.trainers.writers import Writer

JSONL = "train.jsonl"
RECORD_KEYS = ["input_ids", "loss_mask", "id"]


class JsonLines(Writer):
    """SpecForge's prompts file, and with a draft vocabulary its EAGLE-3 mapping."""

    def __init__(self, folder: Path, vocab: Optional[VocabCounts]):
        self.folder = folder
        self.vocab = vocab
        self._file = open(folder / JSONL, "wb")

    def write(self, part: Part) -> None:
        ids, mask, offsets = part.ids, part.mask, part.offsets
        lines = []
        for k, row_id in enumerate(part.id.to_pylist()):
            lo, hi = offsets[k], offsets[k + 1]
            lines.append(orjson.dumps({"input_ids": ids[lo:hi], "loss_mask": mask[lo:hi],
                                       "id": row_id}, option=orjson.OPT_SERIALIZE_NUMPY))
        lines.append(b"")
        self._file.write(b"\n".join(lines))
        if self.vocab is not None:
            self.vocab.add(part)

    def finish(self) -> dict:
        self._file.close()
        out = {"files": [JSONL], "record_keys": list(RECORD_KEYS)}
        if self.vocab is not None:
            out["vocab_mapping"] = self.vocab.save(self.folder / VOCAB_MAPPING)
            out["files"].append(VOCAB_MAPPING)
        return out


class SpecForge(Trainer):
    name = "specforge"
    default_max_length = 2048
    max_length_key = "data.max_length"
    rules = (
        LONGER_CUT,
        Rule("eagle3_no_supervised_token", "dropped by EAGLE-3",
             "no supervised token in the first {L} (EAGLE-3 needs 1)", none_supervised),
        Rule("dflash_no_two_adjacent_supervised", "dropped by DFlash",
             "no two adjacent supervised tokens in the first {L}", no_two_adjacent),
    )

    def writer(self, folder: Path, vocab: Optional[VocabCounts]) -> JsonLines:
        return JsonLines(folder, vocab)

    def settings(self, out: Path, report: dict) -> list[str]:
        lines = [
            "SpecForge config keys (0.2.0):",
            f"  data.prompts_path: {out / JSONL}  # one JSONL file: a folder is not read",
            f"  data.max_length: {report['max_length']}  # {length_note(report, 'cut')}",
        ]
        mapping = report.get("vocab_mapping")
        if mapping:
            lines.append(f"  model.vocab_mapping_path: {out / VOCAB_MAPPING}  # EAGLE-3, a "
                         f"draft config with draft_vocab_size {mapping['draft_vocab_size']} "
                         f"and vocab_size {mapping['target_vocab_size']}")
        else:
            lines.append("  model.vocab_mapping_path: for EAGLE-3 with a smaller draft "
                         "vocabulary, export again with --draft-vocab-size and "
                         "--target-vocab-size")
        return lines
