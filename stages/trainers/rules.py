"""The rules by which a trainer cuts or drops a row, each named as export.json names it,
and the tally of the rows each rule hits over an export."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from stages.dataset import arrays
from stages.trainers.batch import Part

MAX_NAMED = 20  # ids named per kind of row a trainer does not take whole (counts are whole)


@dataclass(frozen=True)
class Rule:
    """A kind of row the trainer does not take whole, and what it does with it."""

    key: str
    action: str
    rule: str  # how the trainer decides, {L} standing for max_length
    rows: Callable[[Part, int], np.ndarray]  # per row of a part: affected (max_length)

    @property
    def refused(self) -> bool:
        """The trainer drops the row (rather than cutting it)."""
        return self.action.startswith("dropped")


def longer(part: Part, max_length: int) -> np.ndarray:
    return part.lengths > max_length


def none_supervised(part: Part, max_length: int) -> np.ndarray:
    return ~part.any_trained


def no_two_adjacent(part: Part, max_length: int) -> np.ndarray:
    return ~part.adjacent


def shorter_than_two(part: Part, max_length: int) -> np.ndarray:
    return part.lengths < 2


LONGER_CUT = Rule("longer_than_max_length", "cut",
                  "longer than {L} tokens: the trainer keeps the first {L}", longer)


class Tally:
    """Rows, tokens and the rows each Rule names, over the parts of an export."""

    def __init__(self, rules: tuple[Rule, ...], max_length: Optional[int],
                 default_max_length: int):
        self.rules = rules
        self.max_length = max_length
        self.default_max_length = default_max_length
        self.rows = self.tokens = self.supervised = self.longest = 0
        self.over_default = 0
        self.affected = 0  # rows named by at least one rule
        self.named: dict[str, list[str]] = {r.key: [] for r in rules}
        self.counts: dict[str, int] = {r.key: 0 for r in rules}
        self.left_out: dict[str, list[str]] = {}  # --drop-refused: every id, by first rule

    def _limit(self) -> int:
        # no cut: every row fits max_length, which is then the longest row
        return self.max_length if self.max_length is not None else np.iinfo(np.int64).max

    def refuse(self, part: Part) -> np.ndarray:
        """Per row of `part`: one the trainer drops; each such id is named in left_out."""
        refused = np.zeros(len(part.lengths), bool)
        for rule in (r for r in self.rules if r.refused):
            hit = rule.rows(part, self._limit()) & ~refused
            if hit.any():
                self.left_out.setdefault(rule.key, []).extend(
                    part.id.take(arrays.array(np.flatnonzero(hit))).to_pylist())
            refused |= hit
        return refused

    def add(self, part: Part) -> None:
        self.rows += len(part.lengths)
        self.tokens += len(part.ids)
        self.supervised += int(np.count_nonzero(part.mask))  # 0 and 1 only
        self.longest = max(self.longest, int(part.lengths.max(initial=0)))
        self.over_default += int(np.count_nonzero(part.lengths > self.default_max_length))
        limit = self._limit()
        any_rule = np.zeros(len(part.lengths), bool)
        for rule in self.rules:
            hit = rule.rows(part, limit)
            any_rule |= hit
            self.counts[rule.key] += int(np.count_nonzero(hit))
            room = MAX_NAMED - len(self.named[rule.key])
            if room > 0 and hit.any():
                first = arrays.array(np.flatnonzero(hit)[:room])
                self.named[rule.key] += part.id.take(first).to_pylist()
        self.affected += int(np.count_nonzero(any_rule))

    def max_length_used(self) -> int:
        return self.max_length if self.max_length is not None else self.longest

    def section(self) -> dict:
        length = self.max_length_used()
        return {
            rule.key: {"action": rule.action, "rule": rule.rule.format(L=length),
                       "rows": self.counts[rule.key], "ids": self.named[rule.key]}
            for rule in self.rules
        }
