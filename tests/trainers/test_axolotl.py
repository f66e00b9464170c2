"""axolotl: exactly input_ids, attention_mask and labels, and the rows axolotl drops."""

from __future__ import annotations

from pathlib import Path

from stages.trainers.axolotl import SCHEMA, Axolotl
from stages.trainers.batch import read_part
from tests.helpers.trainerparts import part, record_batch

IGNORE = -100


def test_labels_are_the_supervised_ids_and_minus_100_elsewhere():
    p = part([("a", [11, 12, 13], [0, 1, 1]), ("b", [], []), ("c", [14, 15], [1, 0])])
    ids, attention, labels = (c.to_pylist() for c in Axolotl.columns(p))
    assert ids == [[11, 12, 13], [], [14, 15]]
    assert attention == [[1, 1, 1], [], [1, 1]]
    assert labels == [[IGNORE, 12, 13], [], [14, IGNORE]]
    assert SCHEMA.names == ["input_ids", "attention_mask", "labels"]


def test_a_part_sliced_from_a_batch_keeps_its_rows():
    batch = record_batch([("a", [1, 2], [1, 1]), ("b", [3, 4, 5], [0, 0, 1])]).slice(1)
    ids, attention, labels = (c.to_pylist() for c in Axolotl.columns(read_part(batch, Path("s"),
                                                                               None)))
    assert ids == [[3, 4, 5]] and attention == [[1, 1, 1]] and labels == [[IGNORE, IGNORE, 5]]


def test_the_rows_axolotl_drops():
    rules = {r.key: r for r in Axolotl.rules}
    p = part([("long", [1, 2, 3], [0, 1, 1]), ("one", [1], [1]), ("silent", [1, 2], [0, 0])])
    assert rules["longer_than_max_length"].rows(p, 2).tolist() == [True, False, False]
    assert rules["shorter_than_min_sample_len"].rows(p, 2).tolist() == [False, True, False]
    assert rules["no_supervised_token"].rows(p, 2).tolist() == [False, False, True]
    assert all(r.refused for r in Axolotl.rules)
