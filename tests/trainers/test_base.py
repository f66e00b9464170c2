"""base: what every trainer format says, and the length note its settings carry."""

from __future__ import annotations

import pytest

from stages.trainers import TRAINERS
from stages.trainers.base import Trainer, length_note
from stages.trainers.rules import LONGER_CUT


def report(longer: int, longest: int, default: int, over_default: int) -> dict:
    return {"trainer_will": {"longer_than_max_length": {"rows": longer}},
            "longest_row": longest,
            "trainer_default_max_length": {"value": default, "rows_longer": over_default}}


def test_the_length_note_says_what_max_length_and_the_default_do():
    assert length_note(report(0, 494, 1024, 0), "cut") == (
        "cuts none (longest row 494); the default 1024 would cut 0")
    assert length_note(report(3, 900, 512, 7), "drop") == (
        "drops 3 rows longer (longest row 900); the default 512 would drop 7")


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_every_format_says_all_a_trainer_format_says(name):
    trainer = TRAINERS[name]
    assert isinstance(trainer, Trainer) and trainer.name == name
    assert trainer.default_max_length > 0 and trainer.max_length_key
    keys = [rule.key for rule in trainer.rules]
    assert len(set(keys)) == len(keys) and "longer_than_max_length" in keys
    assert type(trainer).writer is not Trainer.writer
    assert type(trainer).settings is not Trainer.settings


def test_only_axolotl_drops_the_rows_longer_than_max_length():
    assert [n for n, t in sorted(TRAINERS.items()) if LONGER_CUT not in t.rules] == ["axolotl"]
