"""rules: which rows each rule hits, and the tally of them over an export."""

from __future__ import annotations

from stages.trainers.rules import (
    LONGER_CUT,
    MAX_NAMED,
    Rule,
    Tally,
    no_two_adjacent,
    none_supervised,
    shorter_than_two,
)
from tests.helpers.trainerparts import part

DROP_NONE = Rule("no_supervised_token", "dropped", "none in the first {L}", none_supervised)
DROP_PAIR = Rule("no_pair", "dropped by DFlash", "no pair in the first {L}", no_two_adjacent)
ROWS = [("long", [1, 2, 3, 4], [0, 0, 1, 1]), ("lonely", [1, 2], [0, 1]),
        ("silent", [1, 2], [0, 0]), ("one", [7], [1])]


def test_each_rule_names_its_rows_and_a_row_counts_once_as_affected():
    tally = Tally((LONGER_CUT, DROP_NONE, DROP_PAIR), max_length=3, default_max_length=2)
    tally.add(part(ROWS, 3))
    section = tally.section()
    assert section["longer_than_max_length"]["ids"] == ["long"]
    assert section["longer_than_max_length"]["rule"] == (
        "longer than 3 tokens: the trainer keeps the first 3")
    assert section["no_supervised_token"]["ids"] == ["silent"]
    assert section["no_pair"]["ids"] == ["long", "lonely", "silent", "one"]
    assert (tally.rows, tally.tokens, tally.supervised, tally.longest) == (4, 9, 4, 4)
    assert tally.affected == 4 and tally.over_default == 1


def test_without_max_length_the_longest_row_is_the_limit():
    tally = Tally((LONGER_CUT,), None, 1024)
    tally.add(part(ROWS))
    assert tally.max_length_used() == 4 and tally.section()["longer_than_max_length"]["rows"] == 0


def test_refuse_names_each_left_out_row_under_its_first_rule_only():
    tally = Tally((LONGER_CUT, DROP_NONE, DROP_PAIR), 3, 2)
    refused = tally.refuse(part(ROWS, 3))
    assert refused.tolist() == [True, True, True, True]
    assert tally.left_out == {"no_supervised_token": ["silent"],
                              "no_pair": ["long", "lonely", "one"]}
    assert not LONGER_CUT.refused and DROP_PAIR.refused


def test_shorter_than_two():
    assert shorter_than_two(part(ROWS), 10).tolist() == [False, False, False, True]


def test_ids_named_are_bounded_and_counts_are_whole():
    tally = Tally((DROP_NONE,), None, 10)
    rows = [(f"r{k}", [0, 0], [0, 0]) for k in range(MAX_NAMED + 5)]
    tally.add(part(rows[:7]))
    tally.add(part(rows[7:]))
    assert tally.counts["no_supervised_token"] == MAX_NAMED + 5
    assert tally.named["no_supervised_token"] == [r[0] for r in rows[:MAX_NAMED]]
