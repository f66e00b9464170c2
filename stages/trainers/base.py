"""What every trainer format says: its name, its max length (the default, and where a user
sets it), the rules by which it cuts or drops rows, its writer, and the settings to give it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pyarrow as pa

from stages.trainers.batch import Part
from stages.trainers.rules import Rule
from stages.trainers.vocab import VocabCounts
from stages.trainers.writers import ArrowFolder, Writer


class Trainer:
    """A trainer format: subclasses set the class attributes and write the two methods."""

    name: str
    default_max_length: int  # the trainer's own default
    max_length_key: str  # where its max length is set
    rules: tuple[Rule, ...]

    def writer(self, folder: Path, vocab: Optional[VocabCounts]) -> Writer:
        """The writer of this format's files into `folder`."""
        raise NotImplementedError

    def settings(self, out: Path, report: dict) -> list[str]:
        """What to set in the trainer, from the export's report."""
        raise NotImplementedError


class ArrowTrainer(Trainer):
    """A format written as a save_to_disk folder: its `schema` (schema.hf_schema: with
    the features datasets reads it by) and the `columns` of a part."""

    schema: pa.Schema

    @staticmethod
    def columns(part: Part) -> list[pa.Array]:
        """The arrays of `schema`, in order, for one part of the merged set."""
        raise NotImplementedError

    def writer(self, folder: Path, vocab: Optional[VocabCounts]) -> ArrowFolder:
        return ArrowFolder(folder, self.schema, self.columns)


def length_note(report: dict, verb: str) -> str:
    """Why max_length is what it is, and what the trainer's default would do."""
    longer = report["trainer_will"]["longer_than_max_length"]["rows"]
    default = report["trainer_default_max_length"]
    given = (f"{verb}s {longer} rows longer" if longer else f"{verb}s none") + \
        f" (longest row {report['longest_row']})"
    return f"{given}; the default {default['value']} would {verb} {default['rows_longer']}"
