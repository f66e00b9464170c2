"""Generate: have the target model answer every prompt, and keep every answer.

Reads data/prompts/prompts.jsonl, sends each prompt to an OpenAI-compatible server
(`generate.server.url`: one URL or a list; or `generate.server.launch`: a server this
stage starts on loopback, watches, restarts when it hangs, and stops at the end), and
writes, in prompt order:

  data/completions/completions.jsonl  the prompt + the assistant answer, finish_reason,
                                      truncated, usage, model, sampling hash,
                                      and engine_tokens where the engine gave its ids
  data/completions/failures.jsonl     prompts that failed: kind, HTTP status, message,
                                      attempts (completions + failures = prompts)
  data/completions/generation.json    the model and sampling params of the rows (tokenize
                                      follows their enable_thinking), why rows lack
                                      engine ids when some do
  reports/generate.json               requests, failures by kind, tokens, req/s,
                                      output tok/s, latency percentiles, concurrency

Every reply goes first into a crash-safe request cache (`generate.cache_dir`, default
.cache/requests, outside the DVC outs). Kill the run at any moment and run it again:
only the missing requests are sent. Changing a sampling param or the model starts a new
key space; the old one stays for a rollback. Permanent failures (400, a prompt that
leaves fewer than `generate.min_new_tokens` in the context, OOM after retracting) are
cached too and not resent (`generate.retry_failed: true` resends them); transient ones
(503, 429, timeouts, bad replies, aborted replies, ...) are retried on the next run. A
run left with more failures than `generate.max_transient_failures` /
`generate.max_permanent_failures` allow writes its outputs for inspection and exits 1,
so DVC records no version and the next `dvc repro` runs it again (see `verdict`).

A URL server is used once /v1/models names its model (a router answers /health with no
worker behind it); that name keys the cache. One that stops finishing requests without
proving it generates ends the run after `watchdog_seconds` + `server.hang_timeout`.

`generate.limit: N` runs the first N prompts and prints the first request body.
Ctrl-C stops cleanly with exit status 130, SIGTERM with 143; the cache keeps every
finished request. The API key is read from the environment variable named by
`generate.server.api_key_env` and is never written anywhere; neither are credentials
in a server URL (stages/common/secrets.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from array import array
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

import numpy as np

from stages.chat import conversation, engineids
from stages.common import outputs, params, secrets
from stages.common.errors import StageError, json_object, open_regular, parse_json, writable
from stages.common.secrets import Redactor, redacting_logs, strip_url_credentials, url_credentials
from stages.process import cli
from stages.serving import fitting, replies, servesetup
from stages.serving.client import (
    BodyEncoder,
    CHAT_PATH,
    ChatClient,
    Failure,
    Reply,
    RetryPolicy,
    Sampling,
    build_body,
    parse_reply,
)
from stages.serving.requestcache import KeyIndex, RequestCache, request_key, short_hash

log = logging.getLogger("stages.generate")

PATHS = {"prompts": "prepare's folder", "out": "folder the completions are written to",
         "reports": "folder of the stage reports"}
SERVER_LOG = Path(".cache/logs/generate-server.log")
# This many permanent failures before the first success means the setup is wrong
# (a param the server rejects, a wrong model): stop instead of caching them all.
BREAKER = 32
BAD_BODIES = ("malformed", "bad_reply")  # a 200 whose body is not a chat completion
# "abort" is retried now (client.py), but caches written before may still hold one
TRUNCATED_FINISH = ("length", "abort")


# ------------------------------------------------------------------------ params


def check(cfg: params.Generate) -> None:
    s = cfg.server
    if (s.url is None) == (s.launch is None):
        raise StageError(
            "generate.server: set exactly one of generate.server.url (a running server) "
            "or generate.server.launch (a server this stage starts)"
        )
    if isinstance(s.url, list) and not s.url:
        raise StageError("generate.server.url: empty list (give at least one URL)")
    for u in server_urls(s):
        shown = strip_url_credentials(u)
        if not u.startswith(("http://", "https://")):
            raise StageError(f"generate.server.url: {shown!r} is not an http(s):// URL")
        try:  # a bad port or no host would only show as an unreachable server, much later
            parts = urlsplit(u)
            if parts.port == 0 or not parts.hostname:
                raise ValueError("no host or port 0")
        except ValueError as e:
            raise StageError(f"generate.server.url: {shown!r} is not a valid URL ({e})") from None
        if s.api_key_env and any(url_credentials(u)):
            raise StageError(
                "generate.server.url: has credentials (user:password@) and "
                "generate.server.api_key_env is set too; a request carries one "
                "Authorization header: use one of them"
            )
    params.check_ranges(cfg, "generate")
    if s.router_timeout is not None and cfg.request_timeout > s.router_timeout:
        raise StageError(servesetup.router_timeout_advice(cfg.request_timeout, s.router_timeout))
    for name in ("max_transient_failures", "max_permanent_failures"):
        limit = getattr(cfg, name)
        if isinstance(limit, float) and not 0 <= limit <= 1:
            raise StageError(
                f"generate.{name}: a fraction must be in [0, 1], got {limit} "
                "(write a whole number for a count)"
            )
        if isinstance(limit, int) and limit < 0:
            raise StageError(f"generate.{name}: must be >= 0, got {limit}")


def check_cache_dir(cache_dir: str, paths) -> None:
    """StageError when the request cache would live inside a folder the pipeline writes
    (this stage's paths, any out in dvc.yaml): the stage that writes it replaces it
    whole, cache and all, and every request would be sent again."""
    cache = Path(cache_dir).resolve()
    taken = [str(p) for p in vars(paths).values()] + cli.pipeline_outs()
    for folder in taken:
        where = Path(folder).resolve()
        if cache == where or where in cache.parents:
            raise StageError(
                f"generate.cache_dir: {cache_dir} is inside {folder}, which the pipeline "
                "writes (dvc.yaml): a stage replaces it whole and the request cache with "
                "it; keep the cache outside every stage's outputs (default .cache/requests)"
            )


def server_urls(server: params.Server) -> list[str]:
    """generate.server.url as a list (empty for a launched server)."""
    return [server.url] if isinstance(server.url, str) else list(server.url or [])


def api_key(server: params.Server) -> Optional[str]:
    if not server.api_key_env:
        return None
    key = os.environ.get(server.api_key_env)
    if not key:
        raise StageError(
            f"generate.server.api_key_env: environment variable {server.api_key_env} is not set"
        )
    return key


# ------------------------------------------------------------------------- plan


class PromptLocations:
    """Where each prompt is in the prompts file and in the cache: arrays, not objects."""

    def __init__(self, path: Path, limit: Optional[int], namespace: str):
        self.path = path
        offsets = array("q")
        keys = bytearray()
        pos = 0
        self.tools = False  # whether any prompt carries tools (an engine needs a parser)
        try:
            f = open_regular(path)
        except FileNotFoundError:
            raise StageError(f"{path}: not found (run the prepare stage first)") from None
        with f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(offsets) >= limit:
                    break
                prompt = _parse_prompt(line, path, lineno)
                self.tools = self.tools or bool(prompt.get("tools"))
                offsets.append(pos)
                keys += request_key(namespace, prompt["messages"], prompt.get("tools"))
                pos += len(line)
        offsets.append(pos)
        self.n = len(offsets) - 1
        self.offsets = np.frombuffer(offsets, dtype=np.int64).copy()
        self.index = KeyIndex(bytes(keys))
        self.seg = np.full(self.n, -1, dtype=np.int32)
        self.off = np.zeros(self.n, dtype=np.int64)
        self.ok = np.zeros(self.n, dtype=bool)

    def locate(self, cache: RequestCache, retry_failed: bool) -> int:
        """Point every prompt at its cached reply; a completion beats a cached failure.

        Returns how many damaged records were dropped (their requests are sent again).
        """
        damaged = 0
        for key, seg, off, js in cache.scan():
            idxs = self.index.find(key)
            if not idxs or (self.seg[idxs[0]] >= 0 and self.ok[idxs[0]]):
                continue
            rec = cached_record(js)
            if rec is None:
                damaged += 1
                continue
            good = rec["ok"]
            if not good and (retry_failed or self.seg[idxs[0]] >= 0):
                continue
            self.set(idxs, seg, off, good)
        damaged += cache.damaged
        if damaged:
            log.warning(
                "request cache %s: dropped %d damaged record(s); a request left without an "
                "intact record is sent again",
                cache.dir, damaged,
            )  # fmt: skip
        return damaged

    def set(self, idxs: list[int], seg: int, off: int, good: bool) -> None:
        self.seg[idxs] = seg
        self.off[idxs] = off
        self.ok[idxs] = good

    def pending(self) -> array:
        """Prompts without a cached reply, each distinct request once (8 bytes each)."""
        missing = np.flatnonzero(self.seg < 0)
        keep = np.ones(len(missing), dtype=bool)
        for k in np.flatnonzero(self.index.shared[missing]).tolist():
            i = int(missing[k])
            keep[k] = self.index.twins(i)[0] == i
        out = array("q")
        out.frombytes(missing[keep].astype(np.int64).tobytes())
        return out

    def first_prompt(self) -> dict:
        with open(self.path, "rb") as f:
            return json.loads(f.readline())

    def line(self, fd: int, i: int) -> bytes:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return os.pread(fd, end - start, start)


def cached_record(js: bytes) -> Optional[dict]:
    """A cache record as written by Generation, or None for anything else on disk."""
    try:
        rec = parse_json(js)
    except ValueError:  # UnicodeDecodeError included
        return None
    if not isinstance(rec, dict):
        return None
    if rec.get("ok") is True:
        return rec if replies.problem(rec.get("reply")) is None else None
    fields = (
        rec.get("ok") is False
        and isinstance(rec.get("kind"), str)
        and isinstance(rec.get("message"), str)
        and isinstance(rec.get("attempts"), int)
        and (rec.get("status") is None or isinstance(rec.get("status"), int))
    )
    return rec if fields and writable(rec) else None


def _parse_prompt(line: bytes, path: Path, lineno: int) -> dict:
    where = f"{path}:{lineno}"
    prompt = json_object(line, where)
    if not isinstance(prompt.get("id"), str) or not prompt["id"]:
        raise StageError(f"{where}: missing string 'id'")
    bad = conversation.problem(prompt.get("messages"), prompt.get("tools")) or \
        conversation.unicode_problem(line, prompt)
    if bad:
        raise StageError(f"{where}: {bad}")
    return prompt


# ------------------------------------------------------------------------ server


class ServerHandle:
    """The server this run talks to (launched or at URLs): its URLs, the model name, restart
    hooks. Its params are `params.Server`; a launched engine process is `servers.EngineProcess`."""

    def __init__(self, cfg: params.Generate, key: Optional[str], redact: Redactor):
        self.cfg = cfg
        self.key = key
        self.redact = redact
        self.launched = None
        self.urls: list[str] = []
        s = cfg.server
        if s.launch is not None:
            self.engine = s.launch.engine
            self.label = s.model or s.launch.model
        else:
            from stages.serving.servers import normalize_url

            self.urls = [normalize_url(u) for u in server_urls(s)]  # credentials kept: used
            self.engine = s.engine or "sglang"
            self.label = s.model  # None: asked from the server
        self.request_model = s.model

    async def resolve_label(self) -> str:
        """The model name that keys the cache (a URL server without server.model is asked,
        once it is ready)."""
        if self.label is None:
            served = await self.ready()
            if served is None:
                raise StageError(
                    f"{self.shown_urls()[0]}/v1/models lists no model: set generate.server.model "
                    "(it is sent with every request and keys the request cache)"
                )
            self.request_model = served
            self.label = self.redact(served)  # written into every row
        return self.label

    async def ready(self) -> Optional[str]:
        from stages.serving.servers import wait_ready

        return await wait_ready(self.urls, self.cfg.server.unreachable_deadline, self.key)

    def shown_urls(self) -> list[str]:
        return [strip_url_credentials(u) for u in self.urls]

    def info(self) -> dict:
        launch = self.cfg.server.launch
        if self.launched is not None:
            info = dict(self.launched.info())
        elif launch is not None:  # every answer came from the cache: nothing was started
            info = {"engine": self.engine, "model": launch.model, "started": False,
                    "args": secrets.redact_args(launch.args),
                    "command": secrets.redact_args(launch.command) if launch.command else None,
                    "version": None}
        else:
            info = {"urls": self.shown_urls(), "engine": self.engine}
        return self.redact.scrub(info)




# --------------------------------------------------------------------------- run


class Progress:
    """A tqdm bar on a terminal, otherwise a log line every `interval` seconds."""

    def __init__(self, total: int, done: int, interval: float):
        self.total, self.start_done = total, done
        self.interval = interval
        self.t0 = time.monotonic()
        self.last_log = self.t0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=done, unit="req", dynamic_ncols=True, smoothing=0.05
            )

    def tick(
        self, done: int, failed: int, out_tokens: int, in_flight: int, final: bool = False
    ) -> None:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        rate = (done - self.start_done) / elapsed
        tok = out_tokens / elapsed
        if self.bar is not None:
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


class BadBodyBreaker:
    """Stops the run once BREAKER requests in a row got no well-formed reply after their
    retries: the server is not answering chat completions."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.in_a_row = 0  # requests given up on bad bodies since the last success

    def success(self) -> None:
        self.in_a_row = 0

    def failure(self, f: Failure) -> None:
        if f.kind not in BAD_BODIES:
            return
        self.in_a_row += 1
        if self.in_a_row >= BREAKER:
            raise StageError(
                f"{BREAKER} requests in a row got no well-formed reply after retries, "
                f"e.g. {f.message[:200]!r}: the server at "
                f"{', '.join(self.urls)} is not answering chat completions; "
                "fix it and run again (answered requests are kept)"
            ) from None


LATENCY_KEYS = ("mean_e2e_latency_ms", "median_e2e_latency_ms", "p90_e2e_latency_ms",
                "p99_e2e_latency_ms")


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
        self.held: list[tuple[int, dict]] = []
        self.any_success = False
        self.breaker = BadBodyBreaker(client.urls)
        self.sent = 0
        self.finished = 0  # requests of this run that completed or gave up
        self.completed = 0
        self.failed = int(np.count_nonzero((plan.seg >= 0) & ~plan.ok))
        self.out_tokens = 0
        self.in_tokens = 0
        self.latencies = Latencies()
        self.first_send: Optional[float] = None
        self.last_done: Optional[float] = None

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
        if isinstance(fit, fitting.TooLong):  # a permanent failure, without a request
            message = fit.message(self.budget.counter.spec)
            self._failed(i, Failure("context_overflow", None, message, 0, True))
            return
        data = self.encoder.encode(prompt, fit)
        if self.sent == 0 and self.cfg.limit is not None:
            sampling = self.sampling if fit is None else dataclasses.replace(self.sampling, max_tokens=fit)
            _print_first_request(prompt, self.server, sampling, self.cfg)
        self.sent += 1
        try:
            reply = await self.client.complete(data)
        except Failure as f:
            self._failed(i, f)
            return
        self._succeeded(i, reply)

    def _failed(self, i: int, f: Failure) -> None:
        """Prompt `i` gave up: transient ones are reported, permanent ones cached once a
        success shows the setup works."""
        self.finished += 1
        record = {
            "ok": False, "kind": f.kind, "status": f.status,
            "message": f.message, "attempts": f.attempts,
        }  # fmt: skip
        n = len(self.plan.index.twins(i))
        self.failed += n
        self.breaker.failure(f)
        if not f.permanent:
            self.transient[i] = record
            self.done += n
        elif self.any_success:
            self._mark(i, record)
        else:
            self.held.append((i, record))
            self.done += n
            if len(self.held) >= BREAKER:
                status = f"HTTP {f.status} " if f.status else ""
                raise StageError(
                    f"the first {BREAKER} requests all failed permanently, e.g. "
                    f"{status}{f.message[:200]!r}: check generate.* sampling params and "
                    "the model (nothing was cached as failed)"
                ) from None

    def _succeeded(self, i: int, reply: Reply) -> None:
        self.finished += 1
        self.completed += 1
        self.breaker.success()
        self.out_tokens += reply.completion_tokens
        self.in_tokens += reply.prompt_tokens
        self.latencies.add(reply.latency)
        self.last_done = time.monotonic()
        # The server's reply is cached as it came (no re-encoding): the completion row
        # is derived from it when the outputs are written.
        raw = reply.raw.strip()
        if b"\n" in raw:
            raw = json.dumps(json.loads(raw), ensure_ascii=False, separators=(",", ":")).encode()
        record = b'{"ok":true,"attempts":%d,"latency":%.4f,"reply":%s}' % (
            reply.attempts, reply.latency, raw,
        )  # fmt: skip
        self._mark(i, record, True)
        if not self.any_success:
            self.any_success = True
            for j, rec in self.held:
                self.done -= len(self.plan.index.twins(j))
                self._mark(j, rec)
            self.held.clear()

    async def run(self, pending: array, watch=None) -> None:
        progress = Progress(self.plan.n, self.done, self.cfg.progress_interval)
        it = iter(pending)
        fd = os.open(self.plan.path, os.O_RDONLY)

        async def worker() -> None:
            for i in it:  # next() never awaits: workers share the iterator safely
                await self._one(fd, i)

        async def ticker() -> None:
            await self._tick(progress)

        self.first_send = time.monotonic()
        quiet_logs = contextlib.nullcontext()
        if progress.bar is not None:
            from tqdm.contrib.logging import logging_redirect_tqdm

            quiet_logs = logging_redirect_tqdm()  # log lines above the bar, not through it
        try:
            with quiet_logs:
                await self._workers(pending, worker, ticker, watch)
        except* StageError as group:
            raise group.exceptions[0] from None
        finally:
            os.close(fd)
            # permanent failures never confirmed by a success: reported, not cached
            for j, rec in self.held:
                self.transient[j] = rec
            self.held.clear()
            in_flight = self.client.in_flight
            progress.tick(self.done, self.failed, self.out_tokens, in_flight, final=True)

    async def _tick(self, progress: Progress) -> None:
        """In the background: fsync the cache when due (about once a second, so a crash
        loses at most that much of the replies) and update the progress line."""
        tick = 0.5 if progress.bar is not None else min(1.0, self.cfg.progress_interval)
        while True:
            await asyncio.sleep(tick)
            if self.cache.sync_due():
                await asyncio.to_thread(self.cache.sync)
            progress.tick(self.done, self.failed, self.out_tokens, self.client.in_flight)

    async def _workers(self, pending: array, worker, ticker, watch) -> None:
        async with asyncio.TaskGroup() as tg:
            background = [tg.create_task(ticker())]
            if watch is not None:
                background.append(tg.create_task(watch(self)))
            n = min(self.cfg.concurrency, len(pending))
            await asyncio.gather(*(tg.create_task(worker()) for _ in range(n)))
            for task in background:
                task.cancel()

    @staticmethod
    def metrics_empty() -> dict:
        zero = ("duration_s", "request_throughput", "input_throughput", "output_throughput",
                *LATENCY_KEYS, "concurrency")  # fmt: skip
        return dict.fromkeys(zero, 0.0)

    def metrics(self) -> dict:
        dur = (self.last_done - self.first_send) if self.last_done and self.first_send else 0.0
        rate = (lambda x: round(x / dur, 3) if dur > 0 else 0.0)
        busy = self.latencies.total()
        return {
            "duration_s": round(dur, 3),
            "request_throughput": rate(self.completed),
            "input_throughput": rate(self.in_tokens),
            "output_throughput": rate(self.out_tokens),
            **self.latencies.summary(),
            "concurrency": round(busy / dur, 2) if dur > 0 and self.completed else 0.0,
        }


# ----------------------------------------------------------------------- outputs


def write_outputs(
    plan: PromptLocations,
    cache: RequestCache,
    transient: dict[int, dict],
    meta: dict,
    why_without_ids: str,
    out: Path,
) -> dict:
    """completions.jsonl + failures.jsonl in prompt order, from the cache only, and
    generation.json: `meta` (the model, sampling params and their hash the rows were
    generated with), and when some rows lack the engine's ids, why (`why_without_ids`),
    which tokenize reads."""
    model, sampling_hash = meta["model"], meta["sampling_hash"]
    enable_thinking = meta["sampling"]["enable_thinking"]
    counts = {
        "completed": 0, "failed": 0, "failed_transient": 0, "truncated": 0,
        "prompt_tokens": 0, "output_tokens": 0,
    }  # fmt: skip
    ids = dict.fromkeys(("rows_with_ids", "rows_unusable_ids", "rows_without_ids"), 0)
    kinds: dict[str, int] = {}
    transient_kinds: dict[str, int] = {}
    by_source: dict[str, dict] = {}  # the same counts per source, for the lineage card
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    with outputs.atomic_dir(out) as tmp, open(plan.path, "rb") as src, open(
        tmp / conversation.COMPLETIONS_FILE, "w", encoding="utf-8", newline="\n"
    ) as comp, open(tmp / "failures.jsonl", "w", encoding="utf-8", newline="\n") as fail:
        for i in range(plan.n):
            line = src.readline()
            if len(line) != plan.offsets[i + 1] - plan.offsets[i]:
                raise StageError(f"{plan.path}: changed while generate was running; run it again")
            prompt = json.loads(line)
            if plan.seg[i] >= 0:
                rec = cached_record(cache.read_json(int(plan.seg[i]), int(plan.off[i])))
                if rec is None:
                    raise StageError(
                        f"{cache.dir}: changed while generate was running; run it again"
                    )
            else:  # retries spent this run: reported, not cached, resent next run
                rec = transient[plan.index.twins(i)[0]]
                counts["failed_transient"] += 1
                transient_kinds[rec["kind"]] = transient_kinds.get(rec["kind"], 0) + 1
            mine = by_source.setdefault(str(prompt.get("source")), {
                "completed": 0, "truncated": 0, "failed": 0, "failed_by_kind": {}})
            if rec["ok"]:
                row = completion_row(prompt, rec["reply"], model, sampling_hash, enable_thinking)
                counts["completed"] += 1
                counts["truncated"] += row["truncated"]
                mine["completed"] += 1
                mine["truncated"] += row["truncated"]
                counts["prompt_tokens"] += row["usage"]["prompt_tokens"]
                counts["output_tokens"] += row["usage"]["completion_tokens"]
                served = row.get("engine_tokens")
                ids["rows_without_ids" if served is None else "rows_unusable_ids"
                    if "unusable" in served else "rows_with_ids"] += 1
                comp.write(dumps(row) + "\n")
            else:
                counts["failed"] += 1
                kinds[rec["kind"]] = kinds.get(rec["kind"], 0) + 1
                mine["failed"] += 1
                mine["failed_by_kind"][rec["kind"]] = mine["failed_by_kind"].get(rec["kind"], 0) + 1
                fail.write(dumps(failure_row(prompt, rec)) + "\n")
        generation = dict(meta)
        if ids["rows_without_ids"]:
            ids["why_without"] = generation["engine_ids_missing"] = why_without_ids
        (tmp / conversation.GENERATION_FILE).write_text(
            json.dumps(generation, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    counts["engine_ids"] = ids
    counts["failed_by_kind"] = dict(sorted(kinds.items()))
    counts["failed_transient_by_kind"] = dict(sorted(transient_kinds.items()))
    permanent = {k: v - transient_kinds.get(k, 0) for k, v in counts["failed_by_kind"].items()}
    counts["failed_permanent_by_kind"] = {k: v for k, v in permanent.items() if v}
    counts["sources"] = by_source
    return counts


def completion_row(
    prompt: dict, reply: dict, model: str, sampling_hash: str, enable_thinking: bool
) -> dict:
    # parsed again here, not taken from the client's Reply: rows are written from the
    # cached reply, so a row from a resumed run (its reply sent by an earlier run) and
    # one from a fresh run come out the same; the client's parse feeds only live counts
    parsed = parse_reply(reply, enable_thinking)
    content, reasoning, tool_calls, finish, n_prompt, n_completion = parsed
    answer: dict[str, Any] = {
        "role": "assistant", "content": content, "reasoning_content": reasoning,
    }  # fmt: skip
    if tool_calls:
        answer["tool_calls"] = tool_calls
    row: dict[str, Any] = {
        "id": prompt["id"],
        "source": prompt.get("source"),
        "messages": prompt["messages"] + [answer],
    }
    if "tools" in prompt:
        row["tools"] = prompt["tools"]
    # Thinking that never closed leaves reasoning and no answer: data, not a success.
    truncated = finish in TRUNCATED_FINISH or (not content and not tool_calls)
    row.update(
        finish_reason=finish,
        truncated=truncated,
        usage={"prompt_tokens": n_prompt, "completion_tokens": n_completion},
        model=model,
        sampling=sampling_hash,
    )
    served = engineids.from_reply(reply)
    if served is not None:
        row["engine_tokens"] = served
    return row


def failure_row(prompt: dict, rec: dict) -> dict:
    return {
        "id": prompt["id"],
        "source": prompt.get("source"),
        "kind": rec["kind"],
        "status": rec["status"],
        "message": rec["message"],
        "attempts": rec["attempts"],
    }


# ---------------------------------------------------------------------- the stage


def run(cfg: params.Generate, paths) -> dict:
    """`paths`: the PATHS, as dvc.yaml gives them (`cli.pipeline_paths`)."""
    check(cfg)
    check_cache_dir(cfg.cache_dir, paths)
    key = api_key(cfg.server)
    redact = Redactor([key], urls=server_urls(cfg.server))
    with redacting_logs(redact):
        try:
            return asyncio.run(_run(cfg, key, redact, paths))
        except asyncio.CancelledError:  # our SIGTERM handler cancelled the run (Ctrl-C:
            raise cli.Terminated from None  # asyncio raises KeyboardInterrupt itself)
        except StageError as e:  # any message may quote a URL or a server's words
            e.args = (redact(str(e)),)
            raise


async def _run(cfg: params.Generate, key: Optional[str], redact: Redactor, paths) -> dict:
    try:  # SIGTERM (a killed `dvc repro`) stops like Ctrl-C: cache closed, server stopped
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    except (RuntimeError, ValueError):  # not the main thread
        pass
    t0 = time.monotonic()
    server = ServerHandle(cfg, key, redact)
    label = await server.resolve_label()
    seed_used = await asyncio.to_thread(_seed_used, server, cfg)
    router = bool(server.urls) and await asyncio.to_thread(
        servesetup.behind_router, cfg, server.urls, server.shown_urls(), key)
    sampling = Sampling.of(cfg)
    sampling_hash = short_hash(sampling.as_dict())
    namespace = short_hash({"model": label, "sampling": sampling.as_dict()})
    plan = PromptLocations(paths.prompts / conversation.PROMPTS_FILE, cfg.limit, namespace)
    meta = {"model": label, "sampling": sampling.as_dict(), "sampling_hash": sampling_hash}
    with RequestCache(cfg.cache_dir, namespace, meta) as cache:
        damaged = plan.locate(cache, cfg.retry_failed)
        pending = plan.pending()
        log.info(
            "%d prompts: %d answered in the cache %s, %d requests to send",
            plan.n, int(np.count_nonzero(plan.seg >= 0)), cache.dir, len(pending),
        )  # fmt: skip
        if cfg.limit is not None and plan.n and not pending:
            _print_first_request(plan.first_prompt(), server, sampling, cfg)
        gen = None
        if pending:
            gen = await _send(cfg, plan, cache, server, key, pending)
        transient = gen.transient if gen else {}
        counts = write_outputs(plan, cache, transient, meta,
                               engineids.why_without(server.engine, router), paths.out)
    report = {
        "requests": plan.n,
        **counts,
        "from_cache": gen.cached if gen else plan.n,
        "sent": gen.sent if gen else 0,
        "retries": gen.client.retries if gen else 0,
        "clamped": gen.client.clamped if gen else 0,
        "context": gen.budget.report() if gen and gen.budget else None,
        "wall_time_s": round(time.monotonic() - t0, 3),
        **(gen.metrics() if gen else Generation.metrics_empty()),
        "model": label,
        "sampling": sampling_hash,
        "sampling_params": sampling.as_dict(),
        "seed_honoured": seed_used,
        "server": server.info(),
        "cache_dir": str(cache.dir),
        "cache_damaged": damaged,
    }
    outputs.write_report(paths.reports, "generate", server.redact.scrub(report))
    _conclude(counts, plan.n, cfg, transient, paths.out)
    return report


def _conclude(counts: dict, n: int, cfg: params.Generate, transient: dict, out: Path) -> None:
    """Say how the run ended; fail it (exit 1: DVC records nothing) when too much failed."""
    log.info(
        "done: %d completed (%d truncated), %d failed %s -> %s",
        counts["completed"], counts["truncated"], counts["failed"],
        counts["failed_by_kind"] or "", out,
    )  # fmt: skip
    ids = counts["engine_ids"]
    if ids["rows_without_ids"]:
        log.info("%d of %d completions carry no engine token ids: %s", ids["rows_without_ids"],
                 counts["completed"], ids["why_without"])
    if ids["rows_unusable_ids"]:
        log.warning("%d completions came with token ids that are not a list of token ids "
                    "(counted as such by tokenize's serve-render check)", ids["rows_unusable_ids"])
    problem = verdict(counts, n, cfg, transient, out)
    if problem:
        raise StageError(problem)
    if counts["failed_transient"]:
        log.warning(
            "%d prompts failed with transient errors (retries spent), within "
            "generate.max_transient_failures: they are in failures.jsonl and are resent "
            "by the next run (dvc repro -f generate)",
            counts["failed_transient"],
        )


def _seed_used(server: ServerHandle, cfg: params.Generate) -> Optional[bool]:
    """Whether the server honours generate.seed (None: no seed, or cannot tell); says so
    when it does not. The seed keys the request cache either way: it is what was asked."""
    from stages.serving import servers

    if cfg.seed is None:
        return None
    launch = cfg.server.launch
    argv = None if launch is None else list(launch.args) + list(launch.command or [])
    url = server.urls[0] if server.urls else None
    used = servers.seed_honoured(server.engine, url, server.key, argv)
    if used is False:
        log.warning(
            "generate.seed=%s is ignored: SGLang uses a request's seed only when started with "
            "%s; replies are sampled anew on a re-send (the cache keeps them stable)",
            cfg.seed, servers.DETERMINISTIC_FLAG,
        )  # fmt: skip
    return used


def allowed(limit: int | float, n: int) -> int:
    """How many failures a tolerance allows: an integer is a count, a float a fraction."""
    return limit if isinstance(limit, int) else int(limit * n)


def verdict(counts: dict, n: int, cfg: params.Generate, transient: dict[int, dict],
            out: Path) -> Optional[str]:
    """Why this run is not a finished dataset version (one line), or None when it is.

    Transient failures may pass when sent again: beyond `max_transient_failures` the work
    is not done. Permanent ones are data, beyond `max_permanent_failures` the setup is
    suspect. Either way the stage exits 1, DVC records nothing, and the next `dvc repro`
    runs it again: transient requests are resent, answered ones come from the cache.
    """
    n_transient = counts["failed_transient"]
    limit = cfg.max_transient_failures
    if n_transient > allowed(limit, n):
        first = transient[min(transient)]  # the first in prompt order: the same every run
        status = f"HTTP {first['status']} " if first["status"] else ""
        return (
            f"{n_transient} of {n} requests still failing after retries with errors that may "
            f"pass when sent again ({_kinds(counts['failed_transient_by_kind'])}; e.g. "
            f"{status}{first['message'][:120]!r}), above the {allowed(limit, n)} that "
            f"generate.max_transient_failures={limit} allows: the run is not finished and no "
            "version is recorded; run `dvc repro` again once the server is healthy (only "
            "unanswered requests are sent)"
        )
    n_permanent = counts["failed"] - n_transient
    limit = cfg.max_permanent_failures
    if n_permanent > allowed(limit, n):
        kinds = _kinds(counts["failed_permanent_by_kind"])
        return (
            f"{n_permanent} of {n} requests failed permanently ({kinds}), above the "
            f"{allowed(limit, n)} that generate.max_permanent_failures={limit} allows: see "
            f"{out / 'failures.jsonl'}; fix the prompts or params and set "
            "generate.retry_failed: true to resend them, or raise the tolerance"
        )
    return None


def _kinds(by_kind: dict[str, int]) -> str:
    return ", ".join(f"{kind} {count}" for kind, count in by_kind.items())


def _print_first_request(
    prompt: dict, server: ServerHandle, sampling: Sampling, cfg: params.Generate
) -> None:
    """The dry run's view: exactly the body sent (or that would be), the key redacted."""
    body = build_body(prompt, server.request_model or server.label, sampling, server.engine)
    launched = getattr(server.launched, "url", "") or "<launched>"
    where = server.shown_urls()[0] if server.urls else launched
    auth = f"Bearer <${cfg.server.api_key_env}, redacted>" if cfg.server.api_key_env else "(none)"
    print(f"first request: POST {where}{CHAT_PATH}  Authorization: {auth}")
    print(server.redact(json.dumps(body, indent=2, ensure_ascii=False)), flush=True)


async def _send(
    cfg: params.Generate,
    plan: PromptLocations,
    cache: RequestCache,
    server: ServerHandle,
    key: Optional[str],
    pending: array,
) -> Generation:
    from stages.serving import servers

    retry = RetryPolicy.of(cfg)
    if cfg.server.launch is None:
        await server.ready()  # a router with no worker answers 503
        budget = await _budget(cfg, server.urls, server.request_model, key)
        async with ChatClient(
            server.urls, api_key=key, concurrency=cfg.concurrency,
            request_timeout=cfg.request_timeout, retry=retry, enable_thinking=cfg.enable_thinking,
            unreachable_deadline=cfg.server.unreachable_deadline,
            min_new_tokens=cfg.min_new_tokens,
        ) as client:  # fmt: skip
            gen = Generation(cfg, plan, cache, server, client, budget)
            await gen.run(pending, watch=_watch_url)
            return gen
    launch = servesetup.launch_for(cfg.server.launch, plan.tools)
    launched = servers.EngineProcess(launch, SERVER_LOG, key)
    server.launched = launched
    try:
        # in a thread: an engine can take minutes to start and Ctrl-C must still work
        await asyncio.to_thread(launched.start)
        server.request_model = cfg.server.model or launched.model_name
        budget = await _budget(cfg, [launched.url], server.request_model, key)
        watchdog = servers.Watchdog(launched, cfg.server.watchdog_seconds, cfg.server.max_restarts,
                                    cfg.request_timeout)
        async with ChatClient(
            [launched.url], api_key=key, concurrency=cfg.concurrency,
            request_timeout=cfg.request_timeout, retry=retry, enable_thinking=cfg.enable_thinking,
            unreachable_deadline=cfg.server.unreachable_deadline, gate=watchdog,
            min_new_tokens=cfg.min_new_tokens,
        ) as client:  # fmt: skip

            async def watch(gen: Generation) -> None:
                await watchdog.watch(lambda: (gen.finished, client.in_flight))

            gen = Generation(cfg, plan, cache, server, client, budget)
            await gen.run(pending, watch=watch)
            return gen
    except StageError as e:
        if str(SERVER_LOG) in str(e):
            raise
        raise StageError(f"{e} (server log: {SERVER_LOG})") from None
    finally:
        launched.stop()


async def _budget(
    cfg: params.Generate, urls: list[str], model: str, key: Optional[str]
) -> Optional[fitting.ContextBudget]:
    """How this run fits max_tokens into the context (stages/serving/fitting.py), or None."""
    from stages.serving import servers

    context = cfg.context_length
    if context is None and cfg.tokenizer is not None:
        context = await asyncio.to_thread(servers.served_context, urls, model, key)
    return await asyncio.to_thread(fitting.budget, context, cfg.max_tokens, cfg.min_new_tokens,
                                   cfg.tokenizer, cfg.enable_thinking)


async def _watch_url(gen: Generation) -> None:
    """A URL server cannot be restarted from here. Requests in flight, none finished for
    watchdog_seconds, and no URL proving it generates: the server looks hung. Still so
    after hang_timeout more: the run stops (the cache keeps every answer so far). A
    health generation that answers proves it only until nothing finished for
    request_timeout + watchdog_seconds (servers.Watchdog says why)."""
    from stages.serving.servers import GenerationProbe

    s = gen.cfg.server
    model = gen.server.request_model or ""
    probes = [GenerationProbe(u, gen.server.engine, model, gen.server.key) for u in gen.server.urls]
    limit, tick = s.watchdog_seconds, min(s.watchdog_seconds / 4, 30.0)
    health_trusted = gen.cfg.request_timeout + limit
    last, since, hung_since = gen.done, time.monotonic(), None
    while True:
        await asyncio.sleep(tick)
        if gen.done != last or gen.client.in_flight == 0:
            last, since, hung_since = gen.done, time.monotonic(), None
            continue
        quiet = time.monotonic() - since
        if quiet < limit:
            continue
        checks = [asyncio.to_thread(p.evidence, min(limit / 2, 30.0)) for p in probes]
        seen = set(await asyncio.gather(*checks))
        if "tokens" in seen or ("health" in seen and quiet < health_trusted):
            hung_since = None
            continue
        if hung_since is None:
            hung_since = time.monotonic()
            log.warning(
                "no request finished for %.0f s with %d in flight and the server at %s shows no "
                "generation: it may be hung; the run stops in %g s unless it recovers "
                "(generate.server.watchdog_seconds=%g, hang_timeout=%g)",
                quiet, gen.client.in_flight, ", ".join(gen.server.shown_urls()), s.hang_timeout,
                limit, s.hang_timeout,
            )  # fmt: skip
        elif time.monotonic() - hung_since >= s.hang_timeout:
            raise StageError(
                f"server {', '.join(gen.server.shown_urls())} hung: no request finished for {quiet:.0f} s "
                f"with {gen.client.in_flight} in flight and no sign of generation "
                f"(generate.server.watchdog_seconds={limit:g} + hang_timeout={s.hang_timeout:g}); "
                "every answer so far is in the request cache: restart the server and re-run"
            )


if __name__ == "__main__":
    cli.entry("generate", __doc__, run, PATHS)
