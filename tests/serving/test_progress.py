"""A send loop's tally and the speed it reports."""

from __future__ import annotations

import io
import logging
import time

from tqdm import tqdm

from stages.serving import progress
from stages.serving.progress import SPEED_KEYS, Throughput


def test_throughput_counts_answers_and_give_ups_and_their_speed():
    tally = Throughput()
    assert tally.metrics() == dict(tally.metrics(), duration_s=0.0, request_throughput=0.0)
    tally.start()
    tally.sent = 3
    tally.answered(prompt_tokens=10, completion_tokens=5, latency=0.5)
    tally.answered(prompt_tokens=10, completion_tokens=5, latency=1.5)
    tally.gave_up()
    assert (tally.finished, tally.completed, tally.in_tokens, tally.out_tokens) == (3, 2, 20, 10)
    tally.first_send, tally.last_done = 100.0, 102.0  # the speed is over the answers' span
    m = tally.metrics()
    assert set(m) == set(SPEED_KEYS)
    assert (m["duration_s"], m["request_throughput"], m["input_throughput"],
            m["output_throughput"], m["concurrency"]) == (2.0, 1.0, 10.0, 5.0, 1.0)
    assert Throughput.metrics_empty() == dict.fromkeys(SPEED_KEYS, 0.0)


def test_work_found_done_after_the_start_is_left_out_of_the_speed_and_eta(monkeypatch, caplog):
    # a resumed turn-by-turn run meets its cached turns as it walks: 9,000 found in the
    # cache and 100 answered in 10 s is 10 req/s, 900 left is 90 s, not 910 req/s and 1 s
    clock = iter([1000.0, 1010.0, 1010.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    p = progress.Progress(10_000, 0, 0.0)
    p.bar = None  # the log line (a terminal's bar: below)
    with caplog.at_level(logging.INFO, logger=progress.log.name):
        p.tick(9_100, 0, 0, 4, skipped=9_000)
    line = caplog.records[-1].getMessage()
    assert "10.0 req/s" in line and "ETA 0h01m30s" in line, line


def test_the_bar_moves_past_work_found_done_without_timing_it():
    p = progress.Progress(20_000, 0, 0.0)
    p.bar = tqdm(total=20_000, file=io.StringIO(), mininterval=0, miniters=1)
    time.sleep(0.05)
    p.tick(10_010, 0, 0, 4, skipped=10_000)
    time.sleep(0.05)
    p.tick(10_020, 0, 0, 4, skipped=10_000)
    assert p.bar.n == 10_020
    assert p.bar.format_dict["rate"] < 1_000  # 20 answered in ~0.1 s, not 10,020
