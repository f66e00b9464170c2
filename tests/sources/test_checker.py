"""The decontamination checker process: the answers Index.check gives, in order, and a
clear error when the process is gone."""

from __future__ import annotations

import json

import pytest

from stages.common import params
from stages.common.errors import StageError
from stages.sources import checker, decontam

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
            "clips in May. How many clips did Natalia sell altogether in April and May?")


@pytest.fixture
def saved(tmp_path):
    evals = tmp_path / "e.jsonl"
    evals.write_text(json.dumps({"q": QUESTION}) + "\n")
    cfg = params.Decontaminate(evals=[params.EvalSet("e", str(evals), "columns", prompt_field="q")])
    index = decontam.build(cfg, "error").index
    folder = tmp_path / "index"
    folder.mkdir()
    index.save(folder)
    return index, str(folder)


def started(folder: str) -> checker.Checker:
    c = checker.Checker(lambda: folder)
    while not c.ready():
        pass
    return c


def test_answers_are_index_checks_in_the_order_sent(saved):
    index, folder = saved
    batches = [
        (["You are terse.", "Tell me a joke."], [2]),
        (["clean", f"Please solve: {QUESTION.upper()}", "Über alles? " + QUESTION], [1, 1, 1]),
        ([], []),
    ]
    c = started(folder)
    try:
        for texts, counts in batches:  # all sent before the first answer is read
            c.send(texts, counts)
        answers = [c.hits() for _ in batches]
    finally:
        c.close()
    assert answers == [index.check(texts, counts) for texts, counts in batches]
    assert [h is not None for h in answers[1]] == [False, True, True]


def test_a_text_holding_nul_is_left_to_the_caller(saved):
    _, folder = saved
    c = started(folder)
    try:
        c.send(["a \0 b", QUESTION], [2])
        assert c.hits() is None
    finally:
        c.close()


def test_a_checker_that_died_is_a_one_line_error(saved):
    _, folder = saved
    c = started(folder)
    try:
        c.send(["sent before it died"], [1])
        c.proc.kill()
        c.proc.join()
        with pytest.raises(StageError, match="checker process ended unexpectedly"):
            c.hits()  # its answer may have left before the kill; the next one cannot
            c.hits()
        with pytest.raises(StageError, match="checker process ended unexpectedly"):
            c.send(["anything"], [1])
    finally:
        c.close()


def test_a_stopped_checker_is_given_up_on_in_bounded_time(saved):
    import os
    import signal
    import time

    index, folder = saved
    c = checker.Checker(lambda: folder, timeout=1.0)
    while not c.ready():
        pass
    proc = c.proc
    os.kill(proc.pid, signal.SIGSTOP)  # stopped, not dead: it reads and answers nothing
    try:
        big = ["word " * 50_000] * 20  # past what the pipe holds: a send would block
        started = time.monotonic()
        for _ in range(3):
            c.send(big, [20])
        assert c.hits() is None  # the caller checks this batch itself
        assert c.hits() is None and c.gave_up and not c.ready()
        c.send(["more"], [1])  # ignored: its hits come back None too
        assert c.hits() is None
        assert time.monotonic() - started < 15
        assert not proc.is_alive()  # killed: SIGTERM alone waits for a stopped process
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        c.close()
