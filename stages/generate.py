"""Generate: have the target model answer every prompt, and keep every answer.

Reads data/prompts/prompts.jsonl, sends each prompt to an OpenAI-compatible server
(`generate.server.url`: one URL or a list; or `generate.server.launch`: a server this
stage starts on loopback, watches, restarts when it hangs, and stops at the end), and
writes, in prompt order:

  data/completions/completions.jsonl  the prompt + the assistant answer, finish_reason,
                                      truncated, usage, model, sampling fingerprint
  data/completions/failures.jsonl     prompts that failed: kind, HTTP status, message,
                                      attempts (completions + failures = prompts)
  reports/generate.json               requests, failures by kind, tokens, req/s,
                                      output tok/s, latency percentiles, concurrency

Every reply goes first into a crash-safe request cache (`generate.cache_dir`, default
.cache/requests, outside the DVC outs). Kill the run at any moment and run it again:
only the missing requests are sent. Changing a sampling param or the model starts a new
key space; the old one stays for a rollback. Permanent failures (400, prompt too long,
OOM after retracting) are cached too and not resent (`generate.retry_failed: true`
resends them); transient ones (503, 429, timeouts, ...) are retried on the next run.

`generate.limit: N` runs the first N prompts and prints the first request body.
Ctrl-C stops cleanly with exit status 130, SIGTERM with 143; the cache keeps every
finished request. The API key is read from the environment variable named by
`generate.server.api_key_env` and is never written anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from array import array
from pathlib import Path
from typing import Any, Optional

import numpy as np

from stages import cli, outputs
from stages import params as P
from stages.client import (
    CHAT_PATH,
    BodyEncoder,
    ChatClient,
    Failure,
    RetryPolicy,
    Sampling,
    build_body,
    parse_reply,
)
from stages.errors import StageError, json_object
from stages.requestcache import KeyIndex, RequestCache, fingerprint, request_key

log = logging.getLogger("stages.generate")

PROMPTS = Path("data/prompts/prompts.jsonl")
OUT = Path("data/completions")
SERVER_LOG = Path(".cache/logs/generate-server.log")
# This many permanent failures before the first success means the setup is wrong
# (a param the server rejects, a wrong model): stop instead of caching them all.
BREAKER = 32
TRUNCATED_FINISH = ("length", "abort")
FALLBACK_MODEL = "default"


# ------------------------------------------------------------------------ params


def check(cfg: P.Generate) -> None:
    s = cfg.server
    if (s.url is None) == (s.launch is None):
        raise StageError(
            "generate.server: set exactly one of generate.server.url (a running server) "
            "or generate.server.launch (a server this stage starts)"
        )
    if isinstance(s.url, list) and not s.url:
        raise StageError("generate.server.url: empty list (give at least one URL)")
    for u in [s.url] if isinstance(s.url, str) else (s.url or []):
        if not u.startswith(("http://", "https://")):
            raise StageError(f"generate.server.url: {u!r} is not an http(s):// URL")
    positive = {
        "generate.concurrency": cfg.concurrency,
        "generate.max_tokens": cfg.max_tokens,
        "generate.request_timeout": cfg.request_timeout,
        "generate.progress_interval": cfg.progress_interval,
        "generate.backoff_base": cfg.backoff_base,
        "generate.backoff_max": cfg.backoff_max,
        "generate.server.unreachable_deadline": s.unreachable_deadline,
        "generate.server.watchdog_seconds": s.watchdog_seconds,
    }
    for name, value in positive.items():
        if value <= 0:
            raise StageError(f"{name}: must be > 0, got {value}")
    if cfg.limit is not None and cfg.limit < 1:
        raise StageError(f"generate.limit: must be >= 1 or null, got {cfg.limit}")
    retries = {
        "generate.max_retries": cfg.max_retries,
        "generate.max_retries_500": cfg.max_retries_500,
    }
    for name, value in retries.items():
        if value < 0:
            raise StageError(f"{name}: must be >= 0, got {value}")
    if not 0 <= cfg.temperature:
        raise StageError(f"generate.temperature: must be >= 0, got {cfg.temperature}")
    if not 0 < cfg.top_p <= 1:
        raise StageError(f"generate.top_p: must be in (0, 1], got {cfg.top_p}")


def api_key(server: P.Server) -> Optional[str]:
    if not server.api_key_env:
        return None
    key = os.environ.get(server.api_key_env)
    if not key:
        raise StageError(
            f"generate.server.api_key_env: environment variable {server.api_key_env} is not set"
        )
    return key


def sampling_of(cfg: P.Generate) -> Sampling:
    return Sampling(
        max_tokens=cfg.max_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        seed=cfg.seed,
        enable_thinking=cfg.enable_thinking,
        separate_reasoning=cfg.separate_reasoning,
        ignore_eos=cfg.ignore_eos,
    )


# ------------------------------------------------------------------------- plan


class Plan:
    """Where each prompt is in the prompts file and in the cache: arrays, not objects."""

    def __init__(self, path: Path, limit: Optional[int], namespace: str):
        self.path = path
        offsets = array("q")
        keys = bytearray()
        pos = 0
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise StageError(f"{path}: not found (run the prepare stage first)") from None
        with f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(offsets) >= limit:
                    break
                prompt = _parse_prompt(line, path, lineno)
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

    def locate(self, cache: RequestCache, retry_failed: bool) -> None:
        """Point every prompt at its cached reply; a completion beats a cached failure."""
        damaged = 0
        for key, seg, off, js in cache.scan():
            idxs = self.index.find(key)
            if not idxs or (self.seg[idxs[0]] >= 0 and self.ok[idxs[0]]):
                continue
            try:
                good = json.loads(js).get("ok") is True
            except (ValueError, AttributeError):
                damaged += 1
                continue
            if not good and (retry_failed or self.seg[idxs[0]] >= 0):
                continue
            self.set(idxs, seg, off, good)
        if damaged:
            log.warning("request cache: %d damaged entries ignored (they are resent)", damaged)

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


def _parse_prompt(line: bytes, path: Path, lineno: int) -> dict:
    where = f"{path}:{lineno}"
    prompt = json_object(line, where)
    if not isinstance(prompt.get("id"), str) or not prompt["id"]:
        raise StageError(f"{where}: missing string 'id'")
    messages = prompt.get("messages")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and "role" in m for m in messages
    ):
        raise StageError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    if "tools" in prompt and not isinstance(prompt["tools"], list):
        raise StageError(f"{where}: 'tools' must be a list")
    return prompt


# ------------------------------------------------------------------------ server


class Server:
    """What the stage needs from a server: URLs, the model name, restart hooks."""

    def __init__(self, cfg: P.Generate, key: Optional[str]):
        self.cfg = cfg
        self.key = key
        self.launched = None
        self.urls: list[str] = []
        s = cfg.server
        if s.launch is not None:
            self.engine = s.launch.engine
            self.label = s.model or s.launch.model
        else:
            from stages.servers import normalize_url

            self.urls = [normalize_url(u) for u in ([s.url] if isinstance(s.url, str) else s.url)]
            self.engine = s.engine or "sglang"
            self.label = s.model  # None: asked from the server
        self.request_model = s.model

    async def resolve_label(self) -> str:
        """The model name that keys the cache (a URL server without server.model is asked)."""
        if self.label is None:
            self.label = self.request_model = await _served_model(self.urls, self.key, self.cfg)
        return self.label

    def info(self) -> dict:
        if self.launched is not None:
            info = dict(self.launched.info())
        else:
            info = {"urls": self.urls, "engine": self.engine}
        return _scrub(info, self.key)


async def _served_model(urls: list[str], key: Optional[str], cfg: P.Generate) -> str:
    """The model the URL servers serve (GET /v1/models), when generate.server.model is unset."""
    import aiohttp

    await _any_reachable(urls, cfg.server.unreachable_deadline, key)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    names: set[str] = set()
    down = ""
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as s:
        for url in urls:
            try:
                async with s.get(url + "/v1/models") as r:
                    status = r.status
                    data = await r.json(content_type=None)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
                down = down or f"{url}: {type(e).__name__}"  # the client avoids it while it is down
                continue
            except ValueError:
                data, status = None, -1
            if status in (401, 403):
                raise StageError(
                    f"{url}/v1/models answered HTTP {status}: check the API key "
                    f"(generate.server.api_key_env={cfg.server.api_key_env})"
                )
            try:
                names.add(str(data["data"][0]["id"]))
            except (KeyError, IndexError, TypeError):
                # SGLang and vLLM answer any model name when they serve one model
                log.warning(
                    "%s/v1/models gave no model (HTTP %s): sending model %r; set "
                    "generate.server.model to name it (it also keys the request cache)",
                    url, status, FALLBACK_MODEL,
                )  # fmt: skip
                names.add(FALLBACK_MODEL)
    if not names:
        raise StageError(f"cannot read the served model: {down}; set generate.server.model")
    if len(names) > 1:
        raise StageError(f"generate.server.url: the URLs serve different models {sorted(names)}")
    return names.pop()


def _scrub(obj: Any, key: Optional[str]) -> Any:
    if not key:
        return obj
    return json.loads(json.dumps(obj).replace(key, "***"))


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


class Generation:
    """One run of the send loop over the pending prompts."""

    def __init__(
        self, cfg: P.Generate, plan: Plan, cache: RequestCache, server: Server, client: ChatClient
    ):
        self.cfg, self.plan, self.cache, self.server, self.client = cfg, plan, cache, server, client
        self.sampling = sampling_of(cfg)
        self.encoder = BodyEncoder(server.request_model, self.sampling, server.engine)
        self.done = int(np.count_nonzero(plan.seg >= 0))
        self.cached = self.done
        self.transient: dict[int, dict] = {}
        self.held: list[tuple[int, dict]] = []
        self.any_success = False
        self.sent = 0
        self.finished = 0  # requests of this run that completed or gave up
        self.completed = 0
        self.failed = int(np.count_nonzero((plan.seg >= 0) & ~plan.ok))
        self.out_tokens = 0
        self.in_tokens = 0
        self.latencies = array("d")
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
        data = self.encoder.encode(prompt)
        if self.sent == 0 and self.cfg.limit is not None:
            _print_first_request(prompt, self.server, self.sampling, self.cfg)
        self.sent += 1
        try:
            reply = await self.client.complete(data)
        except Failure as f:
            self.finished += 1
            record = {
                "ok": False, "kind": f.kind, "status": f.status,
                "message": f.message, "attempts": f.attempts,
            }  # fmt: skip
            n = len(self.plan.index.twins(i))
            self.failed += n
            if not f.permanent:
                self.transient[i] = record
                self.done += n
            elif self.any_success:
                self._mark(i, record)
            else:
                self.held.append((i, record))
                self.done += n
                if len(self.held) >= BREAKER:
                    raise StageError(
                        f"the first {BREAKER} requests all failed permanently, e.g. HTTP "
                        f"{f.status} {f.message[:200]!r}: check generate.* sampling params and "
                        "the model (nothing was cached as failed)"
                    ) from None
            return
        self.finished += 1
        self.completed += 1
        self.out_tokens += reply.completion_tokens
        self.in_tokens += reply.prompt_tokens
        self.latencies.append(reply.latency)
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
            tick = 0.5 if progress.bar is not None else min(1.0, self.cfg.progress_interval)
            while True:
                await asyncio.sleep(tick)
                if self.cache.sync_due():
                    await asyncio.to_thread(self.cache.sync)
                progress.tick(self.done, self.failed, self.out_tokens, self.client.in_flight)

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
                "mean_e2e_latency_ms", "median_e2e_latency_ms", "p90_e2e_latency_ms",
                "p99_e2e_latency_ms", "concurrency")  # fmt: skip
        return dict.fromkeys(zero, 0.0)

    def metrics(self) -> dict:
        dur = (self.last_done - self.first_send) if self.last_done and self.first_send else 0.0
        lat = np.asarray(self.latencies, dtype=np.float64) if len(self.latencies) else np.zeros(1)

        def pct(q: float) -> float:
            return round(float(np.percentile(lat, q)) * 1000, 1) if self.completed else 0.0

        rate = (lambda x: round(x / dur, 3) if dur > 0 else 0.0)
        return {
            "duration_s": round(dur, 3),
            "request_throughput": rate(self.completed),
            "input_throughput": rate(self.in_tokens),
            "output_throughput": rate(self.out_tokens),
            "mean_e2e_latency_ms": round(float(lat.mean()) * 1000, 1) if self.completed else 0.0,
            "median_e2e_latency_ms": pct(50),
            "p90_e2e_latency_ms": pct(90),
            "p99_e2e_latency_ms": pct(99),
            "concurrency": round(float(lat.sum()) / dur, 2) if dur > 0 and self.completed else 0.0,
        }


# ----------------------------------------------------------------------- outputs


def write_outputs(
    plan: Plan,
    cache: RequestCache,
    transient: dict[int, dict],
    model: str,
    sampling_fp: str,
    split: bool,
) -> dict:
    """completions.jsonl + failures.jsonl in prompt order, from the cache only."""
    counts = {
        "completed": 0, "failed": 0, "failed_transient": 0, "truncated": 0,
        "prompt_tokens": 0, "output_tokens": 0,
    }  # fmt: skip
    kinds: dict[str, int] = {}
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    with outputs.atomic_dir(OUT) as tmp, open(plan.path, "rb") as src, open(
        tmp / "completions.jsonl", "w", encoding="utf-8", newline="\n"
    ) as comp, open(tmp / "failures.jsonl", "w", encoding="utf-8", newline="\n") as fail:
        for i in range(plan.n):
            line = src.readline()
            if len(line) != plan.offsets[i + 1] - plan.offsets[i]:
                raise StageError(f"{plan.path}: changed while generate was running; run it again")
            prompt = json.loads(line)
            if plan.seg[i] >= 0:
                rec = cache.read(int(plan.seg[i]), int(plan.off[i]))
            else:  # retries spent this run: reported, not cached, resent next run
                rec = transient[plan.index.twins(i)[0]]
                counts["failed_transient"] += 1
            if rec["ok"]:
                row = completion_row(prompt, rec["reply"], model, sampling_fp, split)
                counts["completed"] += 1
                counts["truncated"] += row["truncated"]
                counts["prompt_tokens"] += row["usage"]["prompt_tokens"]
                counts["output_tokens"] += row["usage"]["completion_tokens"]
                comp.write(dumps(row) + "\n")
            else:
                counts["failed"] += 1
                kinds[rec["kind"]] = kinds.get(rec["kind"], 0) + 1
                fail.write(dumps(failure_row(prompt, rec)) + "\n")
    counts["failed_by_kind"] = dict(sorted(kinds.items()))
    return counts


def completion_row(prompt: dict, reply: dict, model: str, sampling_fp: str, split: bool) -> dict:
    content, reasoning, tool_calls, finish, n_prompt, n_completion = parse_reply(reply, split)
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
        sampling=sampling_fp,
    )
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


def run(cfg: P.Generate) -> dict:
    check(cfg)
    key = api_key(cfg.server)
    try:
        return asyncio.run(_run(cfg, key))
    except asyncio.CancelledError:  # our SIGTERM handler cancelled the run (Ctrl-C: asyncio
        raise cli.Terminated from None  # raises KeyboardInterrupt itself)


async def _run(cfg: P.Generate, key: Optional[str]) -> dict:
    try:  # SIGTERM (a killed `dvc repro`) stops like Ctrl-C: cache closed, server stopped
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    except (RuntimeError, ValueError):  # not the main thread
        pass
    t0 = time.monotonic()
    server = Server(cfg, key)
    label = await server.resolve_label()
    sampling = sampling_of(cfg)
    sampling_fp = fingerprint(sampling.as_dict())
    namespace = fingerprint({"model": label, "sampling": sampling.as_dict()})
    plan = Plan(PROMPTS, cfg.limit, namespace)
    meta = {"model": label, "sampling": sampling.as_dict(), "sampling_fingerprint": sampling_fp}
    with RequestCache(cfg.cache_dir, namespace, meta) as cache:
        plan.locate(cache, cfg.retry_failed)
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
        counts = write_outputs(plan, cache, transient, label, sampling_fp, cfg.enable_thinking)
    report = {
        "requests": plan.n,
        **counts,
        "from_cache": gen.cached if gen else plan.n,
        "sent": gen.sent if gen else 0,
        "retries": gen.client.retries if gen else 0,
        "wall_time_s": round(time.monotonic() - t0, 3),
        **(gen.metrics() if gen else Generation.metrics_empty()),
        "model": label,
        "sampling": sampling_fp,
        "sampling_params": sampling.as_dict(),
        "server": server.info(),
        "cache_dir": str(cache.dir),
    }
    outputs.write_report("generate", _scrub(report, key))
    failed = counts["failed"]
    log.info(
        "done: %d completed (%d truncated), %d failed %s -> %s",
        counts["completed"], counts["truncated"], failed, counts["failed_by_kind"] or "", OUT,
    )  # fmt: skip
    if transient:
        log.warning(
            "%d prompts failed with transient errors (retries spent); they are in "
            "failures.jsonl and are resent by the next run (dvc repro -f generate)",
            len(transient),
        )
    return report


def _print_first_request(prompt: dict, server: Server, sampling: Sampling, cfg: P.Generate) -> None:
    """The dry run's view: exactly the body sent (or that would be), the key redacted."""
    body = build_body(prompt, server.request_model or server.label, sampling, server.engine)
    where = server.urls[0] if server.urls else getattr(server.launched, "url", "") or "<launched>"
    auth = f"Bearer <${cfg.server.api_key_env}, redacted>" if cfg.server.api_key_env else "(none)"
    print(f"first request: POST {where}{CHAT_PATH}  Authorization: {auth}")
    print(json.dumps(body, indent=2, ensure_ascii=False), flush=True)


async def _send(
    cfg: P.Generate,
    plan: Plan,
    cache: RequestCache,
    server: Server,
    key: Optional[str],
    pending: array,
) -> Generation:
    from stages import servers

    retry = RetryPolicy(cfg.max_retries, cfg.max_retries_500, cfg.backoff_base, cfg.backoff_max)
    split = cfg.enable_thinking
    if cfg.server.launch is None:
        await _any_reachable(server.urls, cfg.server.unreachable_deadline, key)
        async with ChatClient(
            server.urls, api_key=key, concurrency=cfg.concurrency,
            request_timeout=cfg.request_timeout, retry=retry, split_reasoning=split,
            unreachable_deadline=cfg.server.unreachable_deadline,
        ) as client:  # fmt: skip
            gen = Generation(cfg, plan, cache, server, client)
            await gen.run(pending, watch=_watch_url)
            return gen
    launched = servers.LaunchedServer(cfg.server.launch, SERVER_LOG, key)
    server.launched = launched
    try:
        # in a thread: an engine can take minutes to start and Ctrl-C must still work
        await asyncio.to_thread(launched.start)
        server.request_model = cfg.server.model or launched.model_name
        watchdog = servers.Watchdog(launched, cfg.server.watchdog_seconds, cfg.server.max_restarts)
        async with ChatClient(
            [launched.url], api_key=key, concurrency=cfg.concurrency,
            request_timeout=cfg.request_timeout, retry=retry, split_reasoning=split,
            unreachable_deadline=cfg.server.unreachable_deadline, gate=watchdog,
        ) as client:  # fmt: skip

            async def watch(gen: Generation) -> None:
                await watchdog.watch(lambda: (gen.finished, client.in_flight))

            gen = Generation(cfg, plan, cache, server, client)
            await gen.run(pending, watch=watch)
            return gen
    except StageError as e:
        if str(SERVER_LOG) in str(e):
            raise
        raise StageError(f"{e} (server log: {SERVER_LOG})") from None
    finally:
        launched.stop()


async def _any_reachable(urls: list[str], deadline: float, key: Optional[str]) -> None:
    """Return once one of the URLs answers (the client avoids the others while they are down)."""
    from stages import servers

    tasks = [asyncio.ensure_future(servers.wait_reachable(u, deadline, key)) for u in urls]
    try:
        for next_done in asyncio.as_completed(tasks):
            try:
                return await next_done
            except StageError:
                if all(t.done() for t in tasks):
                    raise
    finally:
        for t in tasks:
            t.cancel()


async def _watch_url(gen: Generation) -> None:
    """A URL server cannot be restarted from here: say loudly when it stops making progress."""
    limit = gen.cfg.server.watchdog_seconds
    last, since = gen.done, time.monotonic()
    while True:
        await asyncio.sleep(min(limit / 4, 30.0))
        if gen.done != last or gen.client.in_flight == 0:
            last, since = gen.done, time.monotonic()
        elif time.monotonic() - since >= limit:
            log.warning(
                "no request finished for %.0f s with %d in flight: the server at %s may be hung "
                "(generate.server.watchdog_seconds=%g)",
                time.monotonic() - since, gen.client.in_flight, ", ".join(gen.server.urls), limit,
            )  # fmt: skip
            since = time.monotonic()


if __name__ == "__main__":
    cli.entry("generate", __doc__, run)
