"""trl: TRL's columns, its drop rule and the settings it is given."""

from __future__ import annotations

from stages.trainers.trl import SCHEMA, Trl
from tests.helpers.trainerparts import part


def test_the_merged_columns_as_trl_names_them():
    p = part([("a", [1, 2, 3], [0, 1, 1])])
    columns = Trl.columns(p)
    assert [c.to_pylist() for c in columns] == [["a"], [[1, 2, 3]], [[0, 1, 1]]]
    assert SCHEMA.names == ["id", "input_ids", "assistant_masks"]


def test_a_row_with_nothing_trained_in_its_first_max_length_is_dropped():
    drop = {r.key: r for r in Trl.rules}["no_supervised_token"]
    assert drop.refused
    assert drop.rows(part([("a", [1, 2, 3], [0, 0, 1]), ("b", [1, 2], [0, 1])], 2), 2).tolist() \
        == [True, False]
