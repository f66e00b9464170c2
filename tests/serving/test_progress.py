"""A send loop's tally and the speed it reports."""

from __future__ import annotations

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
