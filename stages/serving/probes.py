"""HTTP probes of a server: is it generating, what does it serve, is it a router.

Every probe is one bounded request (`ask`: the whole answer within its timeout and
MAX_PROBE_BYTES, redirects never followed) and answers False or None rather than raise
when a server is down or hostile. `wait_ready(urls, deadline)` waits for URL servers to
name their model; `GenerationProbe(url, ...).evidence(timeout)` is what the watchdogs ask
before calling an engine hung; `served_context`, `seed_honoured`, `reasoning_split` and
`is_router` read a server's setup. docs/stages.md, generate, "Readiness", "Seed" and
"Hostile servers".
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any, NamedTuple, Optional

import aiohttp

from stages.common import params
from stages.common.errors import StageError
from stages.common.reading import parse_json, writable
from stages.serving.client import read_capped

log = logging.getLogger(__name__)

# what sglang-router 0.3.2 lists for workers whose model it cannot learn (vLLM's: it asks
# SGLang's /get_model_info); not a name to send or to key the cache with
ROUTER_UNKNOWN_MODEL = "unknown"
PROBE_PROMPT = [{"role": "user", "content": "Say OK."}]
# a probe's answer (/v1/models, /get_server_info, /workers, /metrics, /health*, a 1-token
# chat) is kilobytes; a server that sends more, or sends it slower than the probe's
# timeout in all, is not answering the probe
MAX_PROBE_BYTES = 8 << 20
GENERATION_COUNTERS = ("sglang:generation_tokens_total", "vllm:generation_tokens_total")
DETERMINISTIC_FLAG = "--enable-deterministic-inference"
REASONING_FLAG = "--reasoning-parser"


class Answer(NamedTuple):
    """A server's answer to one probe."""

    status: int
    body: bytes


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, not an address to follow: the key would go wherever it
    points (the chat client does not follow them either)."""

    def redirect_request(self, *args, **kwargs):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def ask(
    url: str, body: Any = None, api_key: Optional[str] = None, timeout: float = 10.0
) -> Answer:
    """The answer to one HTTP request (a POST of `body` as JSON, else a GET), whole within
    `timeout` seconds and MAX_PROBE_BYTES; network failures, and answers past either,
    raise OSError."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    end = time.monotonic() + timeout
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return Answer(r.status, _read_bounded(r, end))
    except urllib.error.HTTPError as e:
        with e:
            return Answer(e.code, _read_bounded(e, end))
    except http.client.HTTPException as e:  # a cut or garbled answer: same as a network error
        raise ConnectionError(f"{type(e).__name__}: {e}") from None


def _read_bounded(response, end: float) -> bytes:
    """A response body, or OSError once it passes MAX_PROBE_BYTES or the deadline `end`
    (each read waits at most the socket timeout: a trickle would never end). read1: one
    read of the socket (one chunk of a chunked body) at a time, so the deadline is seen."""
    chunks, size = [], 0
    while chunk := response.read1(1 << 16):
        size += len(chunk)
        if size > MAX_PROBE_BYTES:
            raise ConnectionError(f"an answer over {MAX_PROBE_BYTES} bytes")
        if time.monotonic() > end:
            raise TimeoutError("the answer did not arrive whole in time")
        chunks.append(chunk)
    return b"".join(chunks)


def generate_one(url: str, model: str, api_key: Optional[str], timeout: float) -> Optional[str]:
    """Ask for a 1-token chat completion. None when it worked, else what went wrong."""
    body = {"model": model, "messages": PROBE_PROMPT, "max_tokens": 1, "temperature": 0.0}
    try:
        status, raw = ask(f"{url}/v1/chat/completions", body, api_key, timeout)
    except (OSError, urllib.error.URLError) as e:
        return f"{type(e).__name__}: {getattr(e, 'reason', e)}"
    if status != 200:
        return f"HTTP {status}: {raw[:200].decode(errors='replace').strip()}"
    try:
        choices = parse_json(raw)["choices"]
        choices[0]["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError):
        return f"HTTP 200 without a completion: {raw[:200].decode(errors='replace')}"
    return None


def engine_healthy(
    url: str, engine: str, model: str, api_key: Optional[str], timeout: float
) -> bool:
    """True when the engine at `url` still generates: SGLang's /health_generate (it
    answers at once when the engine emitted a token meanwhile, so it works under load),
    else a 1-token chat completion."""
    if engine == "sglang":
        try:
            status, _ = ask(f"{url}/health_generate", None, api_key, timeout)
        except (OSError, urllib.error.URLError):
            return False
        return status == 200
    return generate_one(url, model, api_key, timeout) is None


def generation_tokens(url: str, api_key: Optional[str], timeout: float) -> Optional[float]:
    """The engine's generation-token counter from /metrics (vLLM; SGLang with
    --enable-metrics), None when it has none."""
    try:
        status, raw = ask(f"{url}/metrics", None, api_key, timeout)
    except (OSError, urllib.error.URLError):
        return None
    if status != 200:
        return None
    total, seen = 0.0, False
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith(GENERATION_COUNTERS):
            try:
                total += float(line.rsplit(None, 1)[1])
                seen = True
            except (IndexError, ValueError):
                continue
    return total if seen else None


class GenerationProbe:
    """Does the engine at `url` prove it is generating? The watchdogs ask this before
    calling an engine hung: long decodes can finish nothing for a long time while the
    engine works at full speed.

    `evidence` says how sure that is: "tokens" when its /metrics generation-token
    counter rose since the last look by more than the probes' own 1-token generations,
    which proves work on requests; "health" when only a health generation answers, which
    proves the engine can generate, not that it serves our requests (a chat path can
    hang while /health_generate answers 200); None when neither."""

    def __init__(self, url: str, engine: str, model: str, api_key: Optional[str]):
        self.url, self.engine, self.model, self.api_key = url, engine, model, api_key
        self.last: Optional[float] = None
        self.probed = 0  # health generations since the last look at the counter

    def evidence(self, timeout: float) -> Optional[str]:
        tokens = generation_tokens(self.url, self.api_key, min(timeout, 10.0))
        if tokens is not None and self.last is None:  # no baseline yet: look twice
            self.last, self.probed = tokens, 0
            time.sleep(min(timeout / 4, 2.0))
            tokens = generation_tokens(self.url, self.api_key, min(timeout, 10.0))
        if tokens is not None:
            rose = self.last is not None and tokens - self.last > self.probed
            self.last, self.probed = tokens, 0
            if rose:
                return "tokens"
        return "health" if self.healthy(timeout) else None

    def healthy(self, timeout: float) -> bool:
        """One health generation (see engine_healthy), counted against the counter."""
        self.probed += 1
        return engine_healthy(self.url, self.engine, self.model, self.api_key, timeout)


def has_flag(argv: list[str], flag: str) -> bool:
    """Whether `argv` gives `flag` (alone or as flag=value)."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _server_info(url: Optional[str], api_key: Optional[str], key: str) -> Any:
    """One field of SGLang's GET /get_server_info (its server args); None when the server
    does not answer it or does not hold the field."""
    try:
        status, raw = ask(f"{url}/get_server_info", None, api_key, 10.0)
        return parse_json(raw).get(key) if status == 200 else None
    except (OSError, urllib.error.URLError, ValueError, AttributeError):
        return None


def seed_honoured(
    engine: str, url: Optional[str], api_key: Optional[str], argv: Optional[list[str]] = None
) -> Optional[bool]:
    """Whether the engine uses a request's `seed`: vLLM does, per request; SGLang only
    when started with --enable-deterministic-inference (read from `argv` for an engine
    we launch, else from its /get_server_info); None when it cannot be told."""
    if engine == "vllm":
        return True
    if engine != "sglang":
        return None
    if argv is not None:
        return has_flag(argv, DETERMINISTIC_FLAG)
    value = _server_info(url, api_key, "enable_deterministic_inference")
    return value if isinstance(value, bool) else None


def reasoning_split(
    engine: str, url: Optional[str], api_key: Optional[str], argv: Optional[list[str]] = None
) -> bool:
    """Whether the engine cuts the thinking out of a reply's content itself (started with
    --reasoning-parser: read from `argv` for an engine we launch, else from SGLang's
    /get_server_info); False where that cannot be told (vLLM or a router at a URL)."""
    if argv is not None:
        return has_flag(argv, REASONING_FLAG)
    if engine != "sglang":
        return False
    value = _server_info(url, api_key, "reasoning_parser")
    return isinstance(value, str) and bool(value)


def is_router(url: str, api_key: Optional[str], timeout: float = 10.0) -> bool:
    """sglang-router lists its workers at GET /workers; engines have no such path."""
    try:
        status, raw = ask(f"{url}/workers", None, api_key, timeout)
        parse_json(raw)
    except (OSError, urllib.error.URLError, ValueError):
        return False
    return status == 200


def normalize_url(url: str) -> str:
    """"http://h:30000/v1/" -> "http://h:30000": the client appends the API paths."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def wait_ready(urls: list[str], deadline: float, api_key: Optional[str] = None) -> Optional[str]:
    """Wait until one URL lists the model it serves (GET /v1/models: 200) and return it;
    None when a URL has no model list (404). A 5xx (sglang-router: 503 until a worker is
    healthy) or no connection is waited out for `deadline` seconds, then StageError."""
    end = time.monotonic() + deadline
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    pause, warned = 0.5, False
    async with aiohttp.ClientSession(headers=headers) as session:
        while True:
            names, listless, last = set(), False, ""
            for url in urls:
                left = max(end - time.monotonic(), 1.0)  # one GET cannot outlast the deadline
                status, data, why = await _get_models(session, url, min(left, 30.0))
                if status in (401, 403):
                    raise StageError(
                        f"{url}/v1/models answered HTTP {status}: check the API key "
                        "(generate.server.api_key_env)"
                    )
                ids = model_ids(data) if status == 200 else []
                if ids and ids[0] != ROUTER_UNKNOWN_MODEL:
                    names.add(ids[0])
                elif status == 200 or status == 404:
                    listless = True
                else:
                    last = f"{url}/v1/models: {why or f'HTTP {status}'}"
            if len(names) > 1:
                raise StageError(f"generate.server.url: the URLs serve different models {sorted(names)}")
            if names or listless:
                if warned:
                    log.info("server ready: model %s", next(iter(names), "(not listed)"))
                return next(iter(names), None)
            left = end - time.monotonic()
            if left <= 0:
                raise StageError(
                    f"no model ready at {', '.join(urls)} within {deadline:g} s "
                    f"(generate.server.unreachable_deadline): {last}"
                )
            if not warned:
                log.warning("waiting for a ready model (%s); up to %.0f s more", last, left)
                warned = True
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, 10.0)


async def _get_models(session: Any, url: str,
                      timeout: float) -> tuple[Optional[int], Any, str]:
    """(status, parsed body or None, what went wrong) of GET url/v1/models."""
    try:
        async with session.get(url + "/v1/models", allow_redirects=False,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            raw = await read_capped(r, MAX_PROBE_BYTES)
            status = r.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return None, None, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if raw is None and status == 200:  # a list that can never be read: no use waiting
        raise StageError(f"{url}/v1/models: HTTP 200 with a body over {MAX_PROBE_BYTES} "
                         "bytes, which is no model list; check generate.server.url")
    if raw is None:
        return None, None, f"HTTP {status} with a body over {MAX_PROBE_BYTES} bytes"
    try:
        return status, parse_json(raw), ""
    except ValueError:
        return status, None, f"HTTP {status} (not JSON)"


def model_ids(data: Any) -> list[str]:
    """The usable model names a /v1/models body lists: each is sent with every request and
    written in every row, so an id that is not a non-empty string of at most params.MAX_PATH
    characters UTF-8 can write (a number, an object, 5 MB, a lone surrogate) is left out."""
    try:
        ids = [m.get("id") if isinstance(m, dict) else None for m in data["data"]]
    except (KeyError, TypeError):
        return []
    return [i for i in ids
            if isinstance(i, str) and 0 < len(i) <= params.MAX_PATH and writable(i)]


def served_context(urls: list[str], model: str, api_key: Optional[str]) -> Optional[int]:
    """The context length `model` is served with: `max_model_len` of its /v1/models entry
    (SGLang's and vLLM's model card), the smallest over `urls`; None when a URL does not
    say (transformers serve, a router without the field) or cannot be asked."""
    found = []
    for url in urls:
        try:
            status, raw = ask(f"{url}/v1/models", None, api_key)
            cards = parse_json(raw)["data"] if status == 200 else []
            cards = [c for c in cards if isinstance(c, dict)]
            # the card of `model`, else the only one listed
            mine = [c for c in cards if c.get("id") == model] or cards[:1] * (len(cards) == 1)
            card = mine[0] if mine else None
        except (OSError, urllib.error.URLError, ValueError, KeyError, TypeError):
            return None
        n = card.get("max_model_len") if card else None
        if type(n) is not int or not 0 < n <= params.INT32:
            return None
        found.append(n)
    return min(found) if found else None


