"""Failures in a row that stop a run (stages/serving/failurestreaks.py): permanent
failures held until the first success, bad bodies counted until one good reply."""

from __future__ import annotations

import pytest

from stages.common.errors import StageError
from stages.serving.client import Failure
from stages.serving.failurestreaks import BREAKER, BadBodyBreaker, HeldFailures


def failure(kind: str = "http_400", status=400) -> Failure:
    return Failure(kind, status, "unknown param top_q", 1, True)


def test_held_failures_are_handed_back_once_at_the_first_success():
    gate = HeldFailures()
    for key in range(3):
        gate.hold(key, {"k": key}, failure())
    assert not gate.open
    assert gate.success() == [(0, {"k": 0}), (1, {"k": 1}), (2, {"k": 2})]
    assert gate.open and gate.success() == [] and gate.release() == []


def test_the_breakerth_held_failure_stops_the_run_naming_status_and_message():
    gate = HeldFailures()
    for key in range(BREAKER - 1):
        gate.hold(key, {}, failure())
    with pytest.raises(StageError, match=rf"first {BREAKER} requests all failed permanently, "
                                         r"e\.g\. HTTP 400 'unknown param top_q'"):
        gate.hold(BREAKER, {}, failure())


def test_what_no_success_confirmed_is_released_uncached():
    gate = HeldFailures()
    gate.hold("a", {"x": 1}, failure())
    assert gate.release() == [("a", {"x": 1})] and gate.release() == [] and not gate.open


def test_bad_bodies_in_a_row_stop_the_run_and_a_success_resets_the_count():
    breaker = BadBodyBreaker(["http://127.0.0.1:1"])
    for _ in range(BREAKER - 1):
        breaker.failure(failure("malformed", None))
    breaker.success()
    for _ in range(BREAKER - 1):
        breaker.failure(failure("malformed", None))
        breaker.failure(failure("http_400"))  # other kinds neither count nor reset
    with pytest.raises(StageError, match="not answering chat completions"):
        breaker.failure(failure("bad_reply", None))
