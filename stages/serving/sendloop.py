"""The send loop of a plain run: each pending prompt sent (its max_tokens fitted into the
context, serving/fitting.py), each reply cached as it arrives (requestcache.py); a
permanent failure cached only once a success shows the setup works, and the run stopped
when the first BREAKER all fail (failurestreaks.py). `Generation` runs it; `print_first_request`
shows the body a dry run would send.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from array import array
from typing import Optional

import numpy as np

from stages.common import params
from stages.common.errors import StageError
from stages.serving import cacherecords, fitting
from stages.serving.failurestreaks import BadBodyBreaker, HeldFailures
from stages.serving.client import (
    CHAT_PATH,
    BodyEncoder,
    ChatClient,
    Failure,
    Reply,
    Sampling,
    build_body,
    with_attempt_id,
)
from stages.serving.server import ServerHandle
from stages.serving.progress import Progress, Throughput
from stages.serving.promptindex import PromptLocations
from stages.serving.requestcache import RequestCache
from stages.serving.watchdog import UrlWatchdog, Watchdog


def print_first_request(
    prompt: dict, server: ServerHandle, sampling: Sampling, cfg: params.Generate,
    run: str = "RUN",
) -> None:
    """The dry run's view: exactly the body its first try sends, the key redacted (`run`:
    the sending client's tag; when nothing is sent there is none)."""
    built = build_body(prompt, server.request_model or server.label, sampling, server.engine)
    body = json.loads(with_attempt_id(json.dumps(built, ensure_ascii=False).encode(), 1, run))
    launched = getattr(server.launched, "url", "") or "<launched>"
    where = server.shown_urls()[0] if server.urls else launched
    auth = f"Bearer <${cfg.server.api_key_env}, redacted>" if cfg.server.api_key_env else "(none)"
    print(f"first request: POST {where}{CHAT_PATH}  Authorization: {auth}")
    print(server.redact(json.dumps(body, indent=2, ensure_ascii=False)), flush=True)


class Generation:
    """One run of the send loop over the pending prompts."""

    def __init__(
        self, cfg: params.Generate, plan: PromptLocations, cache: RequestCache,
        server: ServerHandle, client: ChatClient, budget: Optional[fitting.ContextBudget] = None,
    ):
        self.cfg, self.plan, self.cache, self.server, self.client = cfg, plan, cache, server, client
        self.budget = budget  # None: max_tokens as set, the engine's context error clamps
        self.sampling = Sampling.of(cfg)
        self.encoder = BodyEncoder(server.request_model, self.sampling, server.engine)
        self.done = int(np.count_nonzero(plan.seg >= 0))
        self.cached = self.done
        self.transient: dict[int, dict] = {}
        self.gate = HeldFailures()
        self.breaker = BadBodyBreaker(client.urls)
        self.failed = int(np.count_nonzero((plan.seg >= 0) & ~plan.ok))
        self.tally = Throughput()

    def _mark(self, i: int, record: dict | bytes, good: bool = False) -> None:
        key = self.plan.index.key(i)
        try:
            if isinstance(record, bytes):
                seg, off = self.cache.append_json(key, record)
            else:
                seg, off = self.cache.append(key, record)
        except OSError as e:
            raise StageError(f"{self.cache.dir}: cannot append to the request cache: {e}") from None
        idxs = self.plan.index.twins(i)
        if len(idxs) == 1:
            self.plan.seg[i], self.plan.off[i], self.plan.ok[i] = seg, off, good
        else:
            self.plan.set(idxs, seg, off, good)
        self.done += len(idxs)

    async def _one(self, fd: int, i: int) -> None:
        prompt = json.loads(self.plan.line(fd, i))
        fit = self.budget.fit(prompt) if self.budget is not None else None
        if isinstance(fit, fitting.NotSent):  # a permanent failure, without a request
            message = fit.message(self.budget.counter.spec)
            self._failed(i, Failure(fit.kind, None, message, 0, True))
            return
        data = self.encoder.encode(prompt, fit)
        if self.tally.sent == 0 and self.cfg.limit is not None:
            sampling = self.sampling if fit is None else dataclasses.replace(self.sampling, max_tokens=fit)
            print_first_request(prompt, self.server, sampling, self.cfg, self.client.run_tag)
        self.tally.sent += 1
        try:
            reply = await self.client.complete(data)
        except Failure as f:
            self._failed(i, f)
            return
        self._succeeded(i, reply)

    def _failed(self, i: int, f: Failure) -> None:
        """Prompt `i` gave up: transient ones are reported, permanent ones cached once a
        success shows the setup works."""
        self.tally.gave_up()
        record = cacherecords.failure(f)
        n = len(self.plan.index.twins(i))
        self.failed += n
        self.breaker.failure(f)
        if not f.permanent:
            self.transient[i] = record
            self.done += n
        elif self.gate.open:
            self._mark(i, record)
        else:
            self.done += n
            self.gate.hold(i, record, f)

    def _succeeded(self, i: int, reply: Reply) -> None:
        self.tally.answered(reply.prompt_tokens, reply.completion_tokens, reply.latency)
        self.breaker.success()
        self._mark(i, cacherecords.success(reply), True)
        for j, rec in self.gate.success():
            self.done -= len(self.plan.index.twins(j))
            self._mark(j, rec)

    async def run(self, pending: array, watchdog: Watchdog | UrlWatchdog) -> None:
        progress = Progress(self.plan.n, self.done, self.cfg.progress_interval)
        it = iter(pending)
        fd = os.open(self.plan.path, os.O_RDONLY)

        async def worker() -> None:
            for i in it:  # next() never awaits: workers share the iterator safely
                await self._one(fd, i)

        async def ticker() -> None:
            await self._tick(progress)

        async def watch() -> None:
            await watchdog.watch(lambda: (self.tally.finished, self.client.in_flight))

        self.tally.start()
        try:
            with progress.quiet_logs():
                await self._workers(pending, worker, ticker, watch)
        except* StageError as group:
            raise group.exceptions[0] from None
        finally:
            os.close(fd)
            # permanent failures never confirmed by a success: reported, not cached
            for j, rec in self.gate.release():
                self.transient[j] = rec
            in_flight = self.client.in_flight
            progress.tick(self.done, self.failed, self.tally.out_tokens, in_flight, final=True)

    async def _tick(self, progress: Progress) -> None:
        """In the background: fsync the cache when due (about once a second, so a crash
        loses at most that much of the replies) and update the progress line."""
        tick = 0.5 if progress.bar is not None else min(1.0, self.cfg.progress_interval)
        while True:
            await asyncio.sleep(tick)
            if self.cache.sync_due():
                await asyncio.to_thread(self.cache.sync)
            progress.tick(self.done, self.failed, self.tally.out_tokens, self.client.in_flight)

    async def _workers(self, pending: array, worker, ticker, watch) -> None:
        async with asyncio.TaskGroup() as tg:
            background = [tg.create_task(ticker()), tg.create_task(watch())]
            n = min(self.cfg.concurrency, len(pending))
            await asyncio.gather(*(tg.create_task(worker()) for _ in range(n)))
            for task in background:
                task.cancel()
