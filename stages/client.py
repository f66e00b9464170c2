"""Async client for OpenAI-compatible chat completions (SGLang, vLLM, `transformers serve`).

One aiohttp session, a connection pool at least as wide as the concurrency, and a
fixed pool of workers (in generate.py) that each take the next prompt as soon as
their last one finishes: no batch barrier, so one slow reply never holds the others.

Errors are sorted by what a retry can change:
  permanent  400/413/422 (`bad_request`), a prompt over the context (`context_length`),
             500 "Out of memory even after retracting" (`oom`): sent once, never again.
  transient  429/503 (`overloaded`), 408/504 and client timeouts (`timeout`), 502 and
             dropped connections (`connection`), unparsable bodies (`malformed`), a 400
             "duplicate rid" when a retry races the server's abort (`duplicate_rid`):
             retried with exponential backoff + jitter up to `max_retries`;
             other 5xx (`server_error`) up to `max_retries_500`.
  fatal      401/403/404: the configuration is wrong; the run stops (StageError).
  down       the server refuses connections: requests wait (not counted as retries)
             until `unreachable_deadline` passes with no answer from any URL.
The API key only ever lives in a request header; every message that leaves this
module passes through `redact`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp

from stages.errors import StageError

CHAT_PATH = "/v1/chat/completions"
CONTEXT_HINTS = ("context length", "context_length", "maximum context", "too long", "exceeds the")
OOM_HINT = "out of memory even after retracting"
MAX_MESSAGE = 500


@dataclass(frozen=True)
class Sampling:
    """The params that decide a reply; their fingerprint names the cache key space."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: Optional[int]
    enable_thinking: bool
    separate_reasoning: bool
    ignore_eos: bool = False

    def as_dict(self) -> dict:
        # ignore_eos only when set: every cache keyed before it existed stays valid
        extra = {"ignore_eos": True} if self.ignore_eos else {}
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "enable_thinking": self.enable_thinking,
            "separate_reasoning": self.separate_reasoning,
            **extra,
        }


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 8
    max_retries_500: int = 2
    backoff_base: float = 1.0
    backoff_max: float = 60.0

    def delay(self, retry_no: int, rng: random.Random) -> float:
        """Sleep before retry number `retry_no` (1-based): half fixed, half jitter."""
        full = min(self.backoff_max, self.backoff_base * (2 ** min(retry_no - 1, 30)))
        return full * (0.5 + 0.5 * rng.random())


@dataclass
class Reply:
    content: Optional[str]
    reasoning: Optional[str]
    tool_calls: Optional[list]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    attempts: int
    latency: float  # seconds, the successful attempt (sglang.bench_serving's e2e latency)
    raw: bytes = b""  # the reply body exactly as the server sent it


class Failure(Exception):
    """A request that gave up: permanent (never resent) or transient (retries spent)."""

    def __init__(
        self, kind: str, status: Optional[int], message: str, attempts: int, permanent: bool
    ):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.status = status
        self.message = message
        self.attempts = attempts
        self.permanent = permanent


class Unreachable(StageError):
    pass


class Rejected(StageError):
    """The server refused the whole configuration (auth, path, model)."""


@dataclass
class _Attempt:
    kind: str
    status: Optional[int]
    message: str
    retry_after: float = 0.0


def build_body(prompt: dict, model: str, sampling: Sampling, engine: str) -> dict:
    """The request for one prompt. `engine` decides which non-OpenAI fields are sent:
    `transformers serve` rejects unknown fields with 422, vLLM has no
    separate_reasoning switch and names the request id `request_id`."""
    body: dict[str, Any] = {"model": model, "messages": prompt["messages"]}
    if prompt.get("tools"):
        body["tools"] = prompt["tools"]
    body["max_tokens"] = sampling.max_tokens
    body["temperature"] = sampling.temperature
    body["top_p"] = sampling.top_p
    if engine != "transformers":
        body["top_k"] = sampling.top_k
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.ignore_eos:  # benchmarks: every answer runs to max_tokens
        body["ignore_eos"] = True
    body["chat_template_kwargs"] = {"enable_thinking": sampling.enable_thinking}
    if engine == "sglang":
        body["separate_reasoning"] = sampling.separate_reasoning
        body["rid"] = prompt["id"]
    elif engine == "vllm":
        body["request_id"] = prompt["id"]
    body["stream"] = False
    return body


class BodyEncoder:
    """`build_body` as bytes, fast: the fields every request shares are encoded once.

    Gives exactly `json.dumps(build_body(...), ensure_ascii=False).encode()`.
    """

    def __init__(self, model: str, sampling: Sampling, engine: str):
        probe = {"id": "\0rid\0", "messages": "\0messages\0"}
        text = json.dumps(build_body(probe, model, sampling, engine), ensure_ascii=False)
        self._head, rest = text.split('"\\u0000messages\\u0000"')
        if '"\\u0000rid\\u0000"' in rest:
            self._mid, self._tail = rest.split('"\\u0000rid\\u0000"')
        else:
            self._mid, self._tail = rest, None
        self._dumps = json.JSONEncoder(ensure_ascii=False).encode

    def encode(self, prompt: dict) -> bytes:
        parts = [self._head, self._dumps(prompt["messages"])]
        if prompt.get("tools"):
            parts.append(', "tools": ')
            parts.append(self._dumps(prompt["tools"]))
        parts.append(self._mid)
        if self._tail is not None:
            parts.append(self._dumps(prompt["id"]))
            parts.append(self._tail)
        return "".join(parts).encode()


def split_think(content: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(reasoning, content) from raw text when the server has no reasoning parser.

    Mirrors SGLang's qwen3 parser: text before `</think>` is reasoning (the opening
    `<think>` may be in the prompt or the reply); an opened, never closed block is
    all reasoning and no content.
    """
    if not content:
        return None, content
    text = content
    stripped = text.lstrip()
    opened = stripped.startswith("<think>")
    if opened:
        text = stripped[len("<think>") :]
    if "</think>" in text:
        reasoning, _, rest = text.partition("</think>")
        return reasoning.strip("\n") or None, rest.lstrip("\n") or None
    if opened:
        return text.strip("\n") or None, None
    return None, content


def parse_reply(data: Any, split: bool) -> tuple:
    """(content, reasoning, tool_calls, finish_reason, prompt_tokens, completion_tokens)."""
    choice = data["choices"][0]
    msg = choice["message"]
    content = msg.get("content") or None
    reasoning = msg.get("reasoning_content") or msg.get("reasoning") or None
    if reasoning is None and split:
        reasoning, content = split_think(content)
    tool_calls = msg.get("tool_calls") or None
    usage = data.get("usage") or {}
    return (
        content,
        reasoning,
        tool_calls,
        str(choice.get("finish_reason") or "unknown"),
        int(usage.get("prompt_tokens") or 0),
        int(usage.get("completion_tokens") or 0),
    )


def classify(status: int, message: str) -> tuple[str, str]:
    """(kind, class) of an HTTP error; class is permanent/transient/t500/fatal."""
    low = message.lower()
    if status in (401, 403, 404):
        return "rejected", "fatal"
    if status == 400 and "duplicate" in low and ("rid" in low or "request id" in low):
        return "duplicate_rid", "transient"  # our own retry raced the server's abort
    if status in (400, 413, 422) or (400 <= status < 500 and status not in (408, 429)):
        if any(h in low for h in CONTEXT_HINTS):
            return "context_length", "permanent"
        return "bad_request", "permanent"
    if status in (429, 503):
        return "overloaded", "transient"
    if status in (408, 504):
        return "timeout", "transient"
    if status == 502:
        return "connection", "transient"
    if OOM_HINT in low:
        return "oom", "permanent"
    return "server_error", "t500"


def _error_message(raw: bytes) -> str:
    try:
        data = json.loads(raw)
        if isinstance(data, dict):
            for key in ("message", "detail", "error"):
                val = data.get(key)
                if isinstance(val, dict):
                    val = val.get("message")
                if val:
                    return str(val)
    except ValueError:
        pass
    return raw[:MAX_MESSAGE].decode("utf-8", "replace")


class ChatClient:
    """Sends one request at a time per caller; spreads callers over URLs by least in-flight."""

    def __init__(
        self,
        urls: list[str],
        *,
        api_key: Optional[str],
        concurrency: int,
        request_timeout: float,
        retry: RetryPolicy,
        unreachable_deadline: float,
        split_reasoning: bool = False,
        gate: Any = None,
        connect_timeout: float = 30.0,
    ):
        self.urls = [u.rstrip("/") for u in urls]
        self._endpoints = [u + CHAT_PATH for u in self.urls]
        self._key = api_key or None
        self._headers = {"Content-Type": "application/json"}
        if self._key:
            self._headers["Authorization"] = f"Bearer {self._key}"
        self._concurrency = concurrency
        self._timeout = aiohttp.ClientTimeout(
            total=request_timeout, sock_connect=min(connect_timeout, request_timeout)
        )
        self.request_timeout = request_timeout
        self.retry = retry
        self.unreachable_deadline = unreachable_deadline
        self.split = split_reasoning
        # a launched server's watchdog: `.restarting` and `async wait_ready()`
        self.gate = gate
        self.inflight = [0] * len(self.urls)
        self._down_until = [0.0] * len(self.urls)
        self._rr = 0
        self._rng = random.Random()
        self.last_contact = time.monotonic()
        self.retries = 0
        self.session: Optional[aiohttp.ClientSession] = None

    def redact(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    async def __aenter__(self) -> "ChatClient":
        connector = aiohttp.TCPConnector(
            limit=self._concurrency + 16, limit_per_host=0, ttl_dns_cache=300
        )
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, headers=self._headers
        )
        return self

    async def __aexit__(self, *exc) -> None:
        if self.session is not None:
            await self.session.close()

    @property
    def in_flight(self) -> int:
        return sum(self.inflight)

    def _pick(self) -> int:
        n = len(self.urls)
        if n == 1:
            return 0
        now = time.monotonic()
        start = self._rr = (self._rr + 1) % n
        best = -1
        for j in range(n):
            i = (start + j) % n
            if self._down_until[i] > now:
                continue
            if best < 0 or self.inflight[i] < self.inflight[best]:
                best = i
        if best < 0:  # every URL looks down: try the one that has waited longest
            best = min(range(n), key=lambda i: self._down_until[i])
        return best

    async def _wait_gate(self) -> None:
        if self.gate is not None and self.gate.restarting:
            await self.gate.wait_ready()
            self.last_contact = time.monotonic()  # a restart is not silence

    async def complete(self, body: bytes) -> Reply:
        """Send one request until it succeeds or gives up.

        Raises Failure (this request), Unreachable or Rejected (the whole run).
        """
        attempts = retries = retries_500 = waits = 0
        while True:
            await self._wait_gate()
            i = self._pick()
            attempts += 1
            self.inflight[i] += 1
            t0 = time.perf_counter()
            err: Optional[_Attempt] = None
            try:
                async with self.session.post(self._endpoints[i], data=body) as resp:
                    raw = await resp.read()
                    status = resp.status
                    retry_after = resp.headers.get("Retry-After")
            except aiohttp.ConnectionTimeoutError:
                err = _Attempt("down", None, f"{self.urls[i]}: connect timed out")
            except (asyncio.TimeoutError, TimeoutError):
                limit = f"request_timeout={self.request_timeout:g} s"
                err = _Attempt("timeout", None, f"no reply within {limit}")
            except aiohttp.ClientConnectorError as e:
                err = _Attempt("down", None, f"{self.urls[i]}: cannot connect ({e.os_error or e})")
            except (aiohttp.ClientError, ConnectionError) as e:
                err = _Attempt("connection", None, f"{type(e).__name__}: {e}")
            finally:
                self.inflight[i] -= 1
            latency = time.perf_counter() - t0

            if err is None:
                self.last_contact = time.monotonic()
                self._down_until[i] = 0.0
                if status == 200:
                    try:
                        parsed = parse_reply(json.loads(raw), self.split)
                        return Reply(*parsed, attempts=attempts, latency=latency, raw=raw)
                    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
                        why = f"unparsable 200 reply ({type(e).__name__}: {e}): {raw[:120]!r}"
                        err = _Attempt("malformed", status, why)
                        cls = "transient"
                else:
                    message = _error_message(raw)
                    kind, cls = classify(status, message)
                    err = _Attempt(kind, status, message, _retry_after(retry_after))
                    if cls == "fatal":
                        raise Rejected(
                            f"{self.urls[i]}{CHAT_PATH} answered HTTP {status}: "
                            f"{self.redact(message)[:200]} (check generate.server.url/model"
                            f" and the key in generate.server.api_key_env)"
                        )
                    if cls == "permanent":
                        text = self.redact(message)[:MAX_MESSAGE]
                        raise Failure(kind, status, text, attempts, True)
            elif err.kind == "down":
                attempts -= 1  # never reached the server: not an attempt
                self._down_until[i] = time.monotonic() + self.retry.backoff_base
                silent = time.monotonic() - self.last_contact
                if silent > self.unreachable_deadline:
                    raise Unreachable(
                        f"{err.message}; no answer from {', '.join(self.urls)} for "
                        f"{silent:.0f} s (generate.server.unreachable_deadline="
                        f"{self.unreachable_deadline:g}); completed requests are kept in the "
                        "cache, "
                        "re-run to resume"
                    )
                waits += 1
                await asyncio.sleep(min(self.retry.delay(min(waits, 6), self._rng), 10.0))
                continue
            else:
                cls = "transient"

            if cls == "t500":
                retries_500 += 1
                over = retries_500 > self.retry.max_retries_500
            else:
                retries += 1
                over = retries > self.retry.max_retries
            if over:
                text = self.redact(err.message)[:MAX_MESSAGE]
                raise Failure(err.kind, err.status, text, attempts, False)
            self.retries += 1
            delay = self.retry.delay(retries + retries_500, self._rng)
            if err.retry_after:
                delay = max(delay, min(err.retry_after, self.retry.backoff_max))
            await asyncio.sleep(delay)


def _retry_after(value: Optional[str]) -> float:
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0
