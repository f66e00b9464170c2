"""Async client for OpenAI-compatible chat completions (SGLang, vLLM, `transformers serve`).

One aiohttp session with a connection pool at least as wide as the concurrency; a fixed
pool of workers (in generate.py) each takes the next prompt as soon as its last one
finishes, so one slow reply never holds the others. Errors are sorted by what a retry
can change: permanent (sent once), too long (sent again once with max_tokens clamped to
what the context leaves), transient (retried with exponential backoff and jitter),
fatal (the run stops) and down (requests wait until `unreachable_deadline`); a
`Failure` names its kind. The API key only ever lives in a request header, URL
credentials only in the URL a request goes to, and every message that leaves this module
passes through `redact` (common/secrets.py) before it is cut to length. Which status is
which: docs/stages.md, generate, "Failures by kind".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp

from stages.chat import thinking

from stages.serving import engineids
from stages.common import params
from stages.common.errors import StageError
from stages.common.reading import parse_json
from stages.common.secrets import Redactor, strip_url_credentials
from stages.serving import replies

CHAT_PATH = "/v1/chat/completions"
# the request id field each engine reads (build_body); `transformers serve` takes none
ID_FIELDS = {"sglang": "rid", "vllm": "request_id"}
TRY_MARK = "~"  # in a request id, what follows it names the try (with_attempt_id)
CONTEXT_HINTS = ("context length", "context_length", "maximum context", "too long", "exceeds the")
# (context, prompt tokens) in the engines' context errors, in the order they appear
CONTEXT_ERRORS = (  # SGLang: prompt + max_new_tokens over the context
    (re.compile(r"maximum context length of (\d+) tokens.*?(\d+) tokens from the input", re.S), 1, 2),
    # SGLang: the prompt alone fills the context
    (re.compile(r"input \((\d+) tokens\) is longer than the model's context length \((\d+)"), 2, 1),
    # vLLM: "maximum context length is C tokens ... your request has P input tokens" (or
    # "your prompt contains P input tokens")
    (re.compile(r"maximum context length is (\d+) tokens.*?(\d+) input tokens", re.S), 1, 2),
    # vLLM: "... you requested T tokens (P in the messages, O in the completion)"
    (re.compile(r"maximum context length is (\d+) tokens.*?\((\d+) in the messages", re.S), 1, 2),
)
OOM_HINT = "out of memory even after retracting"
MAX_MESSAGE = 500
MAX_BODY_READ = 1 << 20  # of an error body, this much is decoded for its message
# a reply body longer than this (decompressed) is refused while it arrives: a million
# tokens of text is under 16 MiB; this bounds memory per request against a server that
# sends without end or a gzip bomb
MAX_REPLY_BYTES = 64 << 20
# a 200 that is not a reply to keep (stages/serving/replies.py): retried up to max_retries_500
BAD_REPLIES = (replies.BAD_REPLY, replies.BAD_TOOL_CALL)


@dataclass(frozen=True)
class Sampling:
    """The params that decide a reply; their hash names the request-cache key space.

    Each field is the `generate` param of the same name (stages/common/params.py)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: Optional[int]
    enable_thinking: bool
    separate_reasoning: bool
    ignore_eos: bool = False

    @classmethod
    def of(cls, cfg: params.Generate) -> "Sampling":
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})

    def as_dict(self) -> dict:
        # ignore_eos only when set: every cache keyed before it existed stays valid
        kept = dataclasses.asdict(self)  # field order: part of the cache key space's hash
        if not self.ignore_eos:
            del kept["ignore_eos"]
        return kept


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry; each field is the `generate` param of the same
    name, whose default and range live in stages/common/params.py (taken from there)."""

    max_retries: int = params.Generate.max_retries
    max_retries_500: int = params.Generate.max_retries_500
    backoff_base: float = params.Generate.backoff_base
    backoff_max: float = params.Generate.backoff_max

    @classmethod
    def of(cls, cfg: params.Generate) -> "RetryPolicy":
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})

    def delay(self, retry_no: int, rng: random.Random) -> float:
        """Sleep before retry number `retry_no` (1-based): half fixed, half jitter."""
        full = min(self.backoff_max, self.backoff_base * (2 ** min(retry_no - 1, 30)))
        return full * (0.5 + 0.5 * rng.random())


@dataclass
class ReplyParts:
    """What a checked reply body says, as a completion row takes it (`parse_reply`)."""

    content: Optional[str]
    reasoning: Optional[str]
    tool_calls: Optional[list]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Reply(ReplyParts):
    """A reply the client accepted: its parts, and how it came."""

    attempts: int
    latency: float  # seconds, the successful attempt (sglang.bench_serving's e2e latency)
    raw: bytes = b""  # the reply body exactly as the server sent it
    reasoning_split: bool = False  # the engine cut the thinking out (parse_reply)


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


@dataclass
class _Sent:
    """An HTTP answer to one try (`raw` None: the body was over MAX_REPLY_BYTES)."""

    status: int
    raw: Optional[bytes]
    retry_after: Optional[str]  # the header as sent
    latency: float  # seconds


@dataclass
class _Tries:
    """One request's counts across its tries."""

    attempts: int = 0
    retries: int = 0
    retries_500: int = 0
    waits: int = 0
    clamped: bool = False  # max_tokens already lowered once to fit the context


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
    # the engine's own token ids come back: tokenize checks its render against them, and
    # may train on them (stages/serving/engineids.py)
    body.update(engineids.request_fields(engine))
    body["stream"] = False
    id_field = ID_FIELDS.get(engine)
    if id_field:  # last: with_attempt_id adds each try's suffix to it
        body[id_field] = prompt["id"]
    return body


_MAX_TOKENS_MARK = 2**40 + 7  # no real max_tokens: marks where it goes in the encoded body


class BodyEncoder:
    """`build_body` as bytes, fast: the fields every request shares are encoded once.

    Gives exactly `json.dumps(build_body(...), ensure_ascii=False).encode()`.
    """

    def __init__(self, model: str, sampling: Sampling, engine: str):
        # markers no model name can hold (the name is in the body too, and a server
        # names it): a nonce of this run
        nonce = os.urandom(8).hex()
        messages, rid = f"\0messages-{nonce}\0", f"\0rid-{nonce}\0"
        probe = {"id": rid, "messages": messages}
        marked = dataclasses.replace(sampling, max_tokens=_MAX_TOKENS_MARK)
        text = json.dumps(build_body(probe, model, marked, engine), ensure_ascii=False)
        self._head, rest = text.split(json.dumps(messages))
        self._to_max_tokens, rest = rest.split(str(_MAX_TOKENS_MARK), 1)  # max_tokens precedes seed
        self._max_tokens = str(sampling.max_tokens)
        if json.dumps(rid) in rest:
            self._mid, self._tail = rest.split(json.dumps(rid))
        else:
            self._mid, self._tail = rest, None
        self._dumps = json.JSONEncoder(ensure_ascii=False).encode

    def encode(self, prompt: dict, max_tokens: Optional[int] = None) -> bytes:
        """The body; `max_tokens` replaces generate.max_tokens (a prompt near the context)."""
        parts = [self._head, self._dumps(prompt["messages"])]
        if prompt.get("tools"):
            parts.append(', "tools": ')
            parts.append(self._dumps(prompt["tools"]))
        parts.append(self._to_max_tokens)
        parts.append(self._max_tokens if max_tokens is None else str(int(max_tokens)))
        parts.append(self._mid)
        if self._tail is not None:
            parts.append(self._dumps(prompt["id"]))
            parts.append(self._tail)
        return "".join(parts).encode()


def parse_reply(data: Any, enable_thinking: bool, reasoning_split: bool = False) -> ReplyParts:
    """The parts of a reply body that replies.check accepted. With thinking on, a reply
    without reasoning is cut here by the engine parser's rule (thinking.split_reply),
    unless the engine's own parser cut it (`reasoning_split`, or a reasoning of "" in the
    reply): then no reasoning means an empty thinking, and a `</think>` left in the
    content is the answer's own text."""
    choice = data["choices"][0]
    msg = choice["message"]
    content = msg.get("content") or None
    said = (msg.get("reasoning_content"), msg.get("reasoning"))
    reasoning = said[0] or said[1] or None
    split = reasoning_split or any(isinstance(r, str) for r in said)  # "": an empty one
    if reasoning is None and enable_thinking and not split:
        reasoning, content = thinking.split_reply(content)
    tool_calls = msg.get("tool_calls") or None
    usage = data.get("usage") or {}
    return ReplyParts(
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
    if status in (401, 403, 404) or 300 <= status < 400:
        # a redirect is never followed: the API key would go wherever it points
        return "rejected", "fatal"
    if status == 400 and "duplicate" in low and ("rid" in low or "request id" in low):
        return "duplicate_rid", "transient"  # ours are unique per try: another client's
    if status in (400, 413, 422) or (400 <= status < 500 and status not in (408, 429)):
        if any(h in low for h in CONTEXT_HINTS):
            return "context_overflow", "permanent"
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


def context_numbers(message: str) -> Optional[tuple[int, int]]:
    """(context length, prompt tokens) from an engine's context error, else None."""
    for pattern, ctx, prompt in CONTEXT_ERRORS:
        m = pattern.search(message)
        if m:
            return int(m.group(ctx)), int(m.group(prompt))
    return None


def with_max_tokens(body: bytes, max_tokens: int) -> bytes:
    """The same request asking for at most `max_tokens` (rare: only prompts near the context)."""
    data = json.loads(body)
    data["max_tokens"] = max_tokens
    return json.dumps(data, ensure_ascii=False).encode()


def with_attempt_id(body: bytes, attempt: int, run: str) -> bytes:
    """The request as try number `attempt` of run `run` sends it: under the request id
    `<prompt id>~<attempt>.<run>`, every try its own.

    SGLang refuses a rid it is running (400 "Duplicate request ID detected"), and a try
    that timed out on our side runs on there until SGLang sees the client gone. Then it
    aborts every request whose rid *starts with* that rid (its scheduler matches by
    prefix), so no id we send may begin another: prompt ids hold no TRY_MARK (the prompt
    index refuses one that does), and `run` is of fixed length. The cache key never holds
    the id.
    """
    if not body.endswith(b'"}'):  # no id field: build_body puts it last, a string
        return body
    return b"".join((body[:-2], f"{TRY_MARK}{attempt}.{run}".encode(), b'"}'))


def _error_message(raw: bytes) -> str:
    """The server's message in an error body, whole, its escapes undone (so that the
    caller's redaction sees a secret however it was spelled): the caller redacts, then
    cuts."""
    try:
        data = parse_json(raw)
    except ValueError:
        return raw[:MAX_BODY_READ].decode("utf-8", "replace")
    if isinstance(data, dict):
        for key in ("message", "detail", "error"):
            val = data.get(key)
            if isinstance(val, dict):
                val = val.get("message")
            if val:
                return val if isinstance(val, str) else json.dumps(val, ensure_ascii=False)
    return json.dumps(data, ensure_ascii=False)


def read_body(raw: bytes) -> tuple[Any, Optional[tuple[str, str]]]:
    """(parsed reply, None) for a well-formed 200 body, else (None, (kind, why))."""
    try:
        data = parse_json(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, ("malformed", "the body is not UTF-8")
    except ValueError as e:
        return None, ("malformed", f"the body is not JSON ({e})")
    bad = replies.check(data)
    return (None, bad) if bad else (data, None)


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
        enable_thinking: bool = False,
        reasoning_split: bool = False,
        gate: Any = None,
        connect_timeout: float = 30.0,
        min_new_tokens: int = 1,
    ):
        # shown in messages without credentials; aiohttp sends a URL's own as Basic auth
        self.urls = [strip_url_credentials(u.rstrip("/")) for u in urls]
        self._endpoints = [u.rstrip("/") + CHAT_PATH for u in urls]
        self._key = api_key or None
        self.redact = Redactor([self._key], urls=urls)
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
        self.enable_thinking = enable_thinking
        self.reasoning_split = reasoning_split  # ServerHandle.reasoning_split
        self.min_new_tokens = min_new_tokens
        # a launched server's watchdog: `.restarting` and `async wait_ready()`
        self.gate = gate
        self.inflight = [0] * len(self.urls)
        self._down_until = [0.0] * len(self.urls)
        self._rr = 0
        self._rng = random.Random()
        self.last_contact = time.monotonic()
        self.retries = 0
        self.run_tag = os.urandom(8).hex()  # in every try's request id (with_attempt_id)
        self.clamped = 0  # requests resent with max_tokens lowered to fit the context
        self.session: Optional[aiohttp.ClientSession] = None

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

    def _room(self, message: str, clamped: bool) -> Optional[int]:
        """max_tokens that fits the context the engine reported, if worth a second try."""
        numbers = None if clamped else context_numbers(message)
        if numbers is None:
            return None
        room = numbers[0] - numbers[1]
        return room if room >= self.min_new_tokens else None

    async def complete(self, body: bytes) -> Reply:
        """Send one request until it succeeds or gives up: each try is `_attempt`, what
        its answer means is `_judge`, and whether to try again is `_back_off`.

        Raises Failure (this request), Unreachable or Rejected (the whole run).
        """
        tries = _Tries()
        while True:
            await self._wait_gate()
            i = self._pick()
            tries.attempts += 1
            sent = await self._attempt(i, with_attempt_id(body, tries.attempts, self.run_tag))
            if isinstance(sent, _Attempt):  # no HTTP answer
                if sent.kind == "down":
                    tries.attempts -= 1  # never reached the server: not an attempt
                    await self._wait_down(i, sent, tries)
                    continue
                err, cls = sent, "transient"
            else:
                self.last_contact = time.monotonic()
                self._down_until[i] = 0.0
                judged = self._judge(i, sent, tries.attempts)
                if isinstance(judged, Reply):
                    return judged
                err, cls = judged
                overflow = err.kind == "context_overflow"
                room = self._room(err.message, tries.clamped) if overflow else None
                if room is not None:
                    body, tries.clamped = with_max_tokens(body, room), True
                    self.clamped += 1
                    continue  # not a retry: the engine said what fits
                if cls == "permanent":
                    text = self._say(err.message, MAX_MESSAGE)
                    raise Failure(err.kind, err.status, text, tries.attempts, True)
            await self._back_off(err, cls, tries)

    async def _attempt(self, i: int, body: bytes) -> "_Sent | _Attempt":
        """One POST to URL `i`: the server's answer, or why none came."""
        self.inflight[i] += 1
        t0 = time.perf_counter()
        try:
            async with self.session.post(
                self._endpoints[i], data=body, allow_redirects=False
            ) as resp:
                raw = await read_capped(resp, MAX_REPLY_BYTES)
                status = resp.status
                retry_after = resp.headers.get("Retry-After")
                if 300 <= status < 400:
                    where = resp.headers.get("Location", "nowhere")
                    raw = f"a redirect to {where[:300]}; use the address it names".encode()
        except aiohttp.ConnectionTimeoutError:
            return _Attempt("down", None, f"{self.urls[i]}: connect timed out")
        except (asyncio.TimeoutError, TimeoutError):
            limit = f"request_timeout={self.request_timeout:g} s"
            return _Attempt("timeout", None, f"no reply within {limit}")
        except aiohttp.ClientConnectorError as e:
            return _Attempt("down", None, f"{self.urls[i]}: cannot connect ({e.os_error or e})")
        except (aiohttp.ClientError, ConnectionError) as e:
            return _Attempt("connection", None, f"{type(e).__name__}: {e}")
        finally:
            self.inflight[i] -= 1
        return _Sent(status, raw, retry_after, time.perf_counter() - t0)

    def _judge(self, i: int, sent: "_Sent", attempts: int) -> "Reply | tuple[_Attempt, str]":
        """A server's answer: the reply, or what went wrong and its class (see
        `classify`; "t500" counts against max_retries_500). Raises Rejected when the
        whole run cannot succeed."""
        status, raw = sent.status, sent.raw
        if raw is None:
            return _Attempt("bad_reply", status, f"HTTP {status} with a body over "
                            f"{MAX_REPLY_BYTES} bytes (client.MAX_REPLY_BYTES)"), "t500"
        if status == 200:
            data, bad = read_body(raw)
            if bad is None and data["choices"][0].get("finish_reason") == "abort":
                # an admin abort, pause or weight update cut it: not the model's end
                bad = ("aborted", "the server aborted the request")
            if bad is None:
                return self._reply(data, raw, attempts, sent.latency)
            kind, why = bad
            text = self.redact(_error_message(raw))
            err = _Attempt(kind, status, f"{why}: {text[:120]!r}")
            return err, "t500" if kind in BAD_REPLIES else "transient"
        message = _error_message(raw)
        kind, cls = classify(status, message)
        if cls == "fatal":
            raise Rejected(
                f"{self.urls[i]}{CHAT_PATH} answered HTTP {status}: "
                f"{self._say(message, 200)} (check generate.server.url/model"
                f" and the key in generate.server.api_key_env)"
            )
        return _Attempt(kind, status, message, _retry_after(sent.retry_after)), cls

    async def _wait_down(self, i: int, err: "_Attempt", tries: "_Tries") -> None:
        """URL `i` refused: wait (not a retry) unless no URL answered for too long."""
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
        tries.waits += 1
        await asyncio.sleep(min(self.retry.delay(min(tries.waits, 6), self._rng), 10.0))

    async def _back_off(self, err: "_Attempt", cls: str, tries: "_Tries") -> None:
        """Sleep before the next try, or raise Failure when this class's retries are spent."""
        if cls == "t500":
            tries.retries_500 += 1
            over = tries.retries_500 > self.retry.max_retries_500
        else:
            tries.retries += 1
            over = tries.retries > self.retry.max_retries
        if over:
            text = self._say(err.message, MAX_MESSAGE)
            raise Failure(err.kind, err.status, text, tries.attempts, False)
        self.retries += 1
        delay = self.retry.delay(tries.retries + tries.retries_500, self._rng)
        if err.retry_after:
            delay = max(delay, min(err.retry_after, self.retry.backoff_max))
        await asyncio.sleep(delay)

    def _say(self, text: str, limit: int) -> str:
        """A server's words as written: secrets masked, then cut, then UTF-8 safe (a JSON
        error body can hold a lone surrogate, which no file can take)."""
        return self.redact(text)[:limit].encode("utf-8", "replace").decode("utf-8")

    def _reply(self, data: dict, raw: bytes, attempts: int, latency: float) -> Reply:
        """A checked reply. With a secret to keep, every reply is re-encoded from its
        parse, in which any escapes that spelled the secret are undone and it is masked:
        what the parse dropped (a repeated key) is never written."""
        if self.redact:
            if self.redact.found_in(data):
                data = self.redact.scrub(data)
            raw = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
        parsed = parse_reply(data, self.enable_thinking, self.reasoning_split)
        return Reply(**vars(parsed), attempts=attempts, latency=latency, raw=raw,
                     reasoning_split=self.reasoning_split)


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> Optional[bytes]:
    """The whole body, or None once it passes `limit` bytes (the rest is never read)."""
    if (resp.content_length or 0) > limit:
        return None
    chunks, size = [], 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _retry_after(value: Optional[str]) -> float:
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0
