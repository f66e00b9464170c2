"""The trainers an export is written for: one module per trainer format (its columns, the
rows it cuts or drops, its writer) beside the parts they share. TRAINERS maps `--for` to
each."""

from stages.trainers.axolotl import Axolotl
from stages.trainers.base import Trainer
from stages.trainers.specforge import SpecForge
from stages.trainers.trl import Trl

REPORT = "export.json"  # in an export's folder, beside what the trainer reads
TRAINERS: dict[str, Trainer] = {t.name: t for t in (Trl(), SpecForge(), Axolotl())}
