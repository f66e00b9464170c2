"""How a generate run is going, and how its requests went.

`Progress(total, done, interval)` shows a tqdm bar on a terminal, otherwise a log line
every `interval` seconds; call `tick` as requests finish, inside `quiet_logs()` so log
lines print above the bar. `Latencies` keeps each completed request's end-to-end seconds
and summarises them as sglang.bench_serving names them; `speed` gives a run's throughput
in the same names; `Throughput` is a send loop's tally (plain or turn by turn) and its speed. docs/stages.md, generate,
"Progress" and "Report".
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from array import array
from typing import Optional

import numpy as np
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger(__name__)

LATENCY_KEYS = ("mean_e2e_latency_ms", "median_e2e_latency_ms", "p90_e2e_latency_ms",
                "p99_e2e_latency_ms")


class Progress:
    """A tqdm bar on a terminal, otherwise a log line every `interval` seconds."""

    def __init__(self, total: int, done: int, interval: float):
        self.total, self.start_done = total, done
        self.interval = interval
        self.t0 = time.monotonic()
        self.last_log = self.t0
        self.bar = None
        self.skipped = 0  # what the bar has moved past without timing it (tick's skipped)
        if sys.stderr.isatty():
            self.bar = tqdm(
                total=total, initial=done, unit="req", dynamic_ncols=True, smoothing=0.05
            )

    def quiet_logs(self) -> contextlib.AbstractContextManager:
        """Log lines printed above the bar, not through it (nothing to do without one)."""
        return logging_redirect_tqdm() if self.bar is not None else contextlib.nullcontext()

    def tick(
        self, done: int, failed: int, out_tokens: int, in_flight: int, final: bool = False,
        skipped: int = 0,
    ) -> None:
        """`skipped`: of `done`, the work found done already after the start (a resumed
        turn-by-turn run meets its cached turns as it walks), left out of the speed as the
        `done` given at the start is: counted, they made a resumed run's req/s the cache's
        reading speed and its ETA near zero while most of the sending was still to come."""
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        rate = (done - self.start_done - skipped) / elapsed
        tok = out_tokens / elapsed
        if self.bar is not None:
            # moved past outside tqdm's speed, as its `initial` is: n and the n it last
            # timed both advance
            self.bar.n += skipped - self.skipped
            self.bar.last_print_n += skipped - self.skipped
            self.skipped = skipped
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix_str(
                f"failed={failed} {rate:.1f} req/s {tok:.0f} tok/s in-flight={in_flight}"
            )
            if final:
                self.bar.close()
            return
        now = time.monotonic()
        if final or now - self.last_log >= self.interval:
            self.last_log = now
            left = self.total - done
            eta = _hms(left / rate) if rate > 0 else "?"
            log.info(
                "%d/%d done (%.1f%%), %d failed, %.1f req/s, %.0f output tok/s, %d in flight, "
                "ETA %s", done, self.total, 100.0 * done / max(self.total, 1), failed, rate, tok,
                in_flight, eta,
            )  # fmt: skip


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


class Latencies:
    """Each completed request's end-to-end seconds, summarised as sglang.bench_serving
    names them (milliseconds)."""

    def __init__(self):
        self.seconds = array("d")

    def add(self, seconds: float) -> None:
        self.seconds.append(seconds)

    def total(self) -> float:
        return float(np.sum(np.asarray(self.seconds, dtype=np.float64))) if self.seconds else 0.0

    def summary(self) -> dict:
        if not self.seconds:
            return dict.fromkeys(LATENCY_KEYS, 0.0)
        lat = np.asarray(self.seconds, dtype=np.float64)
        ms = (lambda x: round(float(x) * 1000, 1))
        return {
            "mean_e2e_latency_ms": ms(lat.mean()),
            "median_e2e_latency_ms": ms(np.percentile(lat, 50)),
            "p90_e2e_latency_ms": ms(np.percentile(lat, 90)),
            "p99_e2e_latency_ms": ms(np.percentile(lat, 99)),
        }


# what a run reports of its speed, as sglang.bench_serving names it
SPEED_KEYS = ("duration_s", "request_throughput", "input_throughput", "output_throughput",
              *LATENCY_KEYS, "concurrency")


def speed(seconds: float, completed: int, in_tokens: int, out_tokens: int,
          latencies: Latencies) -> dict:
    """A run's throughput over its `seconds` from first send to last answer, its latencies,
    and its mean concurrency (the requests' seconds in flight over the run's)."""
    rate = (lambda x: round(x / seconds, 3) if seconds > 0 else 0.0)
    busy = latencies.total()
    return {
        "duration_s": round(seconds, 3),
        "request_throughput": rate(completed),
        "input_throughput": rate(in_tokens),
        "output_throughput": rate(out_tokens),
        **latencies.summary(),
        "concurrency": round(busy / seconds, 2) if seconds > 0 and completed else 0.0,
    }


class Throughput:
    """A send loop's tally: requests sent, finished (answered or given up) and answered,
    the answers' tokens and latencies, and its speed from the first send to the last
    answer (`metrics`). The plain and the turn-by-turn loop each keep one."""

    def __init__(self) -> None:
        self.sent = self.finished = self.completed = 0
        self.out_tokens = self.in_tokens = 0
        self.latencies = Latencies()
        self.first_send: Optional[float] = None
        self.last_done: Optional[float] = None

    def start(self) -> None:
        self.first_send = time.monotonic()

    def answered(self, prompt_tokens: int, completion_tokens: int, latency: float) -> None:
        self.finished += 1
        self.completed += 1
        self.out_tokens += completion_tokens
        self.in_tokens += prompt_tokens
        self.latencies.add(latency)
        self.last_done = time.monotonic()

    def gave_up(self) -> None:
        self.finished += 1

    def metrics(self) -> dict:
        dur = (self.last_done - self.first_send) if self.last_done and self.first_send else 0.0
        return speed(dur, self.completed, self.in_tokens, self.out_tokens, self.latencies)

    @staticmethod
    def metrics_empty() -> dict:
        return dict.fromkeys(SPEED_KEYS, 0.0)
