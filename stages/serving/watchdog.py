"""What watches a server while requests are sent, and decides when it is hung.

`Watchdog(engine, seconds, max_restarts, request_timeout)` restarts a launched engine
(serving/engines.py) that stops making progress; `UrlWatchdog(probes, shown, server,
request_timeout)` ends the run when URL servers, which cannot be restarted from here,
look hung. Run `watch(progress)` of either as a task: `progress()` gives (requests
finished so far, requests in flight). Either is the client's gate: it holds requests
while a restart is in progress. docs/stages.md, generate, "Watchdog".
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from stages.common import params
from stages.common.errors import StageError
from stages.serving.engines import EngineProcess
from stages.serving.probes import GenerationProbe

log = logging.getLogger(__name__)

class Watchdog:
    """Restarts a launched server that stops making progress; run `watch` as a task.

    Every `interval` seconds it calls `progress()` -> (completed so far, in flight),
    and restarts the server (in a worker thread, so the event loop keeps going) when:
      - the engine process has exited;
      - requests are in flight and none completed for `seconds`;
      - nothing completed for `seconds`/2 and a 1-token health generation then fails
        (or takes longer than `seconds`/2) while still nothing completes.
    A restart for "no request completed" is vetoed while the engine proves it is
    generating (`GenerationProbe`): at the tail of a run only long decodes may be left.
    Its generation counter rising vetoes it for as long as it rises; a health generation
    that answers only until nothing completed for `request_timeout` + `seconds`: no
    request of ours takes longer, so by then the engine serves health probes but not our
    requests. More than `max_restarts` restarts in a row without a completion in
    between raise StageError from `watch`, as does a restart whose startup fails.
    """

    def __init__(self, server: EngineProcess, seconds: float, max_restarts: int = 3,
                 request_timeout: Optional[float] = None):
        self.server = server
        self.seconds = float(seconds)
        self.health_trusted = (request_timeout or self.seconds) + self.seconds
        self.max_restarts = max_restarts
        self.restarts = 0
        self.restarting = False
        self.last_reason: Optional[str] = None

    async def wait_ready(self) -> None:
        """Return once no restart is in progress (call before retrying a refused request)."""
        while self.restarting:
            await asyncio.sleep(0.05)

    async def watch(
        self, progress: Callable[[], tuple[int, int]], interval: Optional[float] = None
    ) -> None:
        loop = asyncio.get_running_loop()
        tick = interval if interval is not None else min(max(self.seconds / 20, 0.1), 15.0)
        half = self.seconds / 2
        done, _ = progress()
        last_change = last_probe = time.monotonic()
        vetoed_until = 0.0
        probe = self.server.probe()
        in_a_row = 0
        while True:
            await asyncio.sleep(tick)
            now_done, in_flight = progress()
            now = time.monotonic()
            if now_done != done:
                done, last_change, in_a_row = now_done, now, 0
                continue
            reason = None
            code = self.server.exit_code()
            quiet = now - last_change
            if code is not None:
                reason = f"engine exited with code {code}"
            elif in_flight > 0 and quiet >= self.seconds:
                if now < vetoed_until:
                    continue
                seen = await loop.run_in_executor(None, probe.evidence, half)
                if seen == "tokens" or (seen == "health" and quiet < self.health_trusted):
                    vetoed_until = time.monotonic() + half
                    log.info(
                        "%s: no request completed for %.0f s with %d in flight, but the engine "
                        "is generating: not restarting (%s)", self.server.engine, quiet,
                        in_flight, seen,
                    )  # fmt: skip
                    continue
                reason = f"no request completed for {quiet:.0f} s with {in_flight} in flight"
                if seen == "health":
                    reason += " (its health generation answers: requests hang)"
            elif quiet >= half and now - last_probe >= half:
                last_probe = now
                ok = await loop.run_in_executor(None, self.server.healthy, half, probe)
                now_done, in_flight = progress()
                quiet = time.monotonic() - last_change
                if ok or now_done != done:
                    continue
                if in_flight > 0 and quiet >= self.seconds:
                    reason = f"no request completed for {quiet:.0f} s with {in_flight} in flight"
                else:
                    reason = (
                        f"health generation failed or took over {half:g} s "
                        f"(nothing completed for {quiet:.0f} s)"
                    )
            if reason is None:
                continue
            in_a_row += 1
            await self._restart(reason, in_a_row)
            last_change = last_probe = time.monotonic()

    async def _restart(self, reason: str, in_a_row: int) -> None:
        """Restart the engine for `reason`, unless that would be one restart too many."""
        if in_a_row > self.max_restarts:
            raise StageError(
                f"{self.server.engine} server: giving up after {self.max_restarts} "
                f"restart(s) in a row without a completed request "
                f"(generate.server.max_restarts); last problem: {reason}; "
                f"log {self.server.log_path}"
            )
        self.last_reason = reason
        self.restarting = True
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.server.restart, reason)
        finally:
            self.restarting = False
        self.restarts += 1


class UrlWatchdog:
    """Ends the run when the URL servers look hung; run `watch` as a task.

    Requests in flight, none finished for `server.watchdog_seconds`, and no URL proving it
    generates (`GenerationProbe`): the servers look hung, and a warning says so. Still so
    after `server.hang_timeout` more: `watch` raises StageError (the cache keeps every
    answer so far). A health generation that answers proves it only until nothing
    finished for `request_timeout` + `watchdog_seconds` (Watchdog says why).
    """

    restarting = False  # as the client's gate: a URL server is never restarted from here

    def __init__(self, probes: list[GenerationProbe], shown: list[str], server: params.Server,
                 request_timeout: float):
        self.probes = probes
        self.shown = ", ".join(shown)
        self.limit = server.watchdog_seconds
        self.hang_timeout = server.hang_timeout
        self.health_trusted = request_timeout + self.limit

    async def watch(self, progress: Callable[[], tuple[int, int]]) -> None:
        limit, tick = self.limit, min(self.limit / 4, 30.0)
        last, since, hung_since = progress()[0], time.monotonic(), None
        while True:
            await asyncio.sleep(tick)
            done, in_flight = progress()
            if done != last or in_flight == 0:
                last, since, hung_since = done, time.monotonic(), None
                continue
            quiet = time.monotonic() - since
            if quiet < limit:
                continue
            checks = [asyncio.to_thread(p.evidence, min(limit / 2, 30.0)) for p in self.probes]
            seen = set(await asyncio.gather(*checks))
            if "tokens" in seen or ("health" in seen and quiet < self.health_trusted):
                hung_since = None
                continue
            _, in_flight = progress()
            if hung_since is None:
                hung_since = time.monotonic()
                log.warning(
                    "no request finished for %.0f s with %d in flight and the server at %s "
                    "shows no generation: it may be hung; the run stops in %g s unless it "
                    "recovers (generate.server.watchdog_seconds=%g, hang_timeout=%g)",
                    quiet, in_flight, self.shown, self.hang_timeout, limit, self.hang_timeout,
                )  # fmt: skip
            elif time.monotonic() - hung_since >= self.hang_timeout:
                raise StageError(
                    f"server {self.shown} hung: no request finished for {quiet:.0f} s "
                    f"with {in_flight} in flight and no sign of generation "
                    f"(generate.server.watchdog_seconds={limit:g} + "
                    f"hang_timeout={self.hang_timeout:g}); every answer so far is in the "
                    "request cache: restart the server and re-run"
                )

    async def wait_ready(self) -> None:
        """Nothing to wait for: there is no restart (the client's gate asks)."""
