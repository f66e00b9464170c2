"""Watching servers while requests are sent: the fake server, launched or at a URL,
stalled, killed or hung on purpose."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest

from stages.common import params
from stages.common.errors import StageError
from stages.serving.engines import EngineProcess
from stages.serving.probes import GenerationProbe
from stages.serving.watchdog import UrlWatchdog, Watchdog
from tests.helpers.fakeserver import get_json, post_json
from tests.helpers.processes import fake_launch, gone


# ------------------------------------------------------------------- launched engines

RID = "client-{}"


async def drive(server, watchdog: Watchdog, n: int, workers: int = 4) -> int:
    """A minimal client: retries any failure once the watchdog is not restarting."""
    done = in_flight = 0
    queue = list(range(n))

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done, in_flight
        while queue:
            i = queue.pop()
            body = {"rid": RID.format(i), "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 8}  # fmt: skip
            while True:
                await watchdog.wait_ready()
                in_flight += 1
                try:
                    async with session.post(server.url + "/v1/chat/completions", json=body) as r:
                        if r.status == 200 and (await r.json())["choices"]:
                            done += 1
                            break
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    pass
                finally:
                    in_flight -= 1
                await asyncio.sleep(0.05)

    watch = asyncio.create_task(watchdog.watch(lambda: (done, in_flight)))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        work = asyncio.gather(*(worker(session) for _ in range(workers)))
        finished, _ = await asyncio.wait({work, watch}, timeout=40, return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        watch.cancel()
        if watch in finished:
            work.cancel()
            watch.result()  # raises the watchdog's StageError
        assert work in finished, "the client did not finish"
    return done


@pytest.mark.slow  # waits out watchdog periods
def test_watchdog_restarts_a_stalled_server_that_says_healthy(tmp_path):
    # After 5 replies (1 is the readiness probe) generation hangs; /health stays 200.
    spec = {"stall_after": 5, "once_file": str(tmp_path / "stalled-once")}
    with EngineProcess(fake_launch(spec), tmp_path / "e.log") as server:
        first = server.pid
        watchdog = Watchdog(server, seconds=1.0)
        t0 = time.monotonic()
        done = asyncio.run(drive(server, watchdog, 16))
        assert done == 16
        assert watchdog.restarts == 1 and server.restarts == 1 and server.pid != first
        assert re.fullmatch(r"no request completed for \d+ s with 4 in flight", watchdog.last_reason)
        assert gone(first)
        assert get_json(server.url + "/stats")["completed"] == 1 + 12  # probe + the rest
        assert time.monotonic() - t0 < 120
    assert "restarting: no request completed" in (tmp_path / "e.log").read_text()


def test_watchdog_restarts_an_engine_that_died_mid_run(tmp_path):
    spec = {"exit_after": 4, "once_file": str(tmp_path / "died-once"), "latency": 0.05}
    with EngineProcess(fake_launch(spec), tmp_path / "e.log") as server:
        watchdog = Watchdog(server, seconds=5.0)
        assert asyncio.run(drive(server, watchdog, 12)) == 12
        assert watchdog.restarts == 1
        assert watchdog.last_reason == "engine exited with code 3"


def test_watchdog_probes_an_idle_server_and_restarts_it(tmp_path):
    spec = {"stall_health": "fail"}
    with EngineProcess(fake_launch(spec), tmp_path / "e.log") as server:
        post_json(server.url + "/admin/stall", {})
        assert not server.healthy(2)  # sglang dialect: /health_generate
        watchdog = Watchdog(server, seconds=1.0)

        async def run() -> None:
            task = asyncio.create_task(watchdog.watch(lambda: (0, 0)))
            while watchdog.restarts == 0 and not task.done():
                await asyncio.sleep(0.05)
            task.cancel()

        asyncio.run(run())
        assert watchdog.restarts == 1 and "health generation failed" in watchdog.last_reason
        assert server.healthy(5)


@pytest.mark.slow  # waits out watchdog periods
def test_watchdog_gives_up_on_a_server_that_never_recovers(tmp_path):
    # Every start stalls after its readiness probe: generation hangs, health generation fails.
    spec = {"stall_after": 1, "stall_health": "fail"}  # stalls right after the readiness probe
    with EngineProcess(fake_launch(spec), tmp_path / "e.log") as server:
        watchdog = Watchdog(server, seconds=0.8, max_restarts=1)
        with pytest.raises(StageError, match=r"giving up after 1 restart\(s\) in a row .*max_restarts.*last problem"):  # fmt: skip
            asyncio.run(drive(server, watchdog, 4, workers=2))
        assert server.restarts == 1


# ----------------------------------------------------------------------- URL servers


def url_watchdog(url: str, seconds: float, hang_timeout: float,
                 request_timeout: float = 600) -> UrlWatchdog:
    server = params.Server(url=url, watchdog_seconds=seconds, hang_timeout=hang_timeout)
    probe = GenerationProbe(url, "sglang", "fake-model", None)
    return UrlWatchdog([probe], [url], server, request_timeout)


def test_a_hung_url_server_ends_the_watch_after_the_hang_timeout(fake_server):
    server = fake_server({"stall_health": "fail"})
    post_json(server.url + "/admin/stall", {})
    t0 = time.monotonic()
    hung = r"server http://\S+ hung: .* with 2 in flight .*hang_timeout=0.5\); every answer"
    with pytest.raises(StageError, match=hung):
        asyncio.run(asyncio.wait_for(url_watchdog(server.url, 0.4, 0.5).watch(lambda: (7, 2)), 60))
    assert 0.9 <= time.monotonic() - t0 < 60


def test_a_url_server_whose_requests_finish_or_that_has_none_is_not_hung(fake_server):
    server = fake_server({"stall_health": "fail"})
    post_json(server.url + "/admin/stall", {})
    finished = iter(range(10**6))
    for progress in (lambda: (next(finished), 2), lambda: (0, 0)):

        async def run() -> bool:
            task = asyncio.create_task(url_watchdog(server.url, 0.2, 0.2).watch(progress))
            await asyncio.sleep(1.5)
            task.cancel()
            return task.done()

        assert asyncio.run(run()) is False


def test_a_health_generation_vouches_for_a_url_server_only_so_long(fake_server):
    # generation hangs while /health_generate answers 200: trusted until nothing finished
    # for request_timeout + watchdog_seconds (1.5 s here), then the hang timeout runs
    server = fake_server({"stall_health": "ok"})
    post_json(server.url + "/admin/stall", {})
    t0 = time.monotonic()
    with pytest.raises(StageError, match="hung"):
        watchdog = url_watchdog(server.url, 0.5, 0.5, request_timeout=1.0)
        asyncio.run(asyncio.wait_for(watchdog.watch(lambda: (0, 1)), 60))
    assert 2.0 <= time.monotonic() - t0 < 60
