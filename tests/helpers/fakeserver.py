"""A fake SGLang-compatible chat server with injected faults, for tests and benchmarks.

Run it:     python tests/helpers/fakeserver.py --port N [--host H] [--fault-spec JSON-or-FILE]
Import it:  FakeServer(spec).start()  -> in this process, on a thread (.url, .stats(), .stop())
            spawn(spec)               -> a subprocess (.url, .pid, .stats(), .stop())
            command(port, spec)       -> the argv that runs it
            launch_command(spec)      -> the same as a generate.server.launch.command

It answers POST /v1/chat/completions (non-streaming) like SGLang 0.5.23: `choices[0].message`
with `content` ("" when empty) and `reasoning_content` (`reasoning` in vLLM mode),
`finish_reason`, `usage`, and `id` = the request's `rid`; with a `tokenizer`, the token
ids where its dialect puts them. The reply text is a pure function of the
request's messages, tools and sampling params, so a re-run gets identical replies.
Also: GET /health, /health_generate, /v1/models, /get_model_info, /get_server_info,
/metrics (`sglang:generation_tokens_total`, rising while requests decode), /stats
(per-request attempts, arrival times and outcomes) and POST /admin/reset, /admin/stall.

Fault spec: a JSON object, every key optional.

  seed              int     0      seeds every random choice (per request id + attempt,
                                   so the same attempt always gets the same fate)
  model             str     "fake-model"  the served model name
  check_model       bool    false  404 when a request names another model
  dialect           str     "sglang" | "vllm": where token ids go (see tokenizer) and
                                   whether an empty content is "" (SGLang) or null
  tools_as          str     null   whose rendering of a request's tools the tokenizer path
                                   imitates (stages/serving/toolshape.py); null: the dialect's
  reasoning_field   str     "reasoning_content" | "reasoning" (vLLM) | "both"
  reasoning_tokens  int     16     reasoning words when thinking is on (the default;
                                   off with chat_template_kwargs.enable_thinking=false)
  reply_tokens      int     24     content words. max_tokens cuts the reply: inside the
                                   reasoning -> content null, finish_reason "length"
  latency           number | {"min": a, "max": b} | {"median": m, "sigma": s}
                                   seconds before each reply (uniform / lognormal)
  max_context       int     null   prompt_tokens + max_tokens above it -> SGLang's 400
                                   (its exact text); also /v1/models max_model_len
  api_key           str     null   require "Authorization: Bearer <key>" (else 401)
  not_ready_for     number  0      chat answers 503 "loading" for this many seconds
                                   after start while /health already says 200
  no_worker_for     number  0      chat and /v1/models answer 503 for this many seconds
                                   while /health says 200 (sglang-router before a worker
                                   is healthy)
  require_tool_call_id bool false  400 for a role:tool message without tool_call_id
                                   (sglang-router's request schema)
  router            bool    false  GET /workers lists this server (as sglang-router does)
  deterministic     bool    false  /get_server_info enable_deterministic_inference
                                   (SGLang honours `seed` only then); its reasoning_parser
                                   is "qwen3" (replies come with the thinking cut out)
  exit_after        int     null   the process exits (code 3) right after reply K
  stall_after       int     null   after reply K generation hangs: chat requests never
                                   answer, /health stays 200, /health_generate hangs
  stall_health      str     "hang" | "fail" (503) | "ok" (200: generation hangs, its
                                   health check does not) — /health_generate while stalled
  once_file         str     null   exit/stall only if this file is absent; the file is
                                   created when they fire, so a restarted server is sound
  record            bool    true   keep per-request stats (false for benchmarks)
  record_bodies     bool    false  keep each request id's last body in /stats
  record_log        bool    false  keep every answered request in arrival order in /stats
                                   `log`: {"rid", "messages", "seed", "reply": the message
                                   sent} (a recorder between a stage and the server)
  tokenizer         str     null   a tokenizer folder: the server then renders each
                                   request with its chat template (and the request's
                                   chat_template_kwargs) and counts real tokens, like an
                                   engine. Token ids, as SGLang 0.5.23 gives them:
                                   `return_prompt_token_ids` (or `return_token_ids`) ->
                                   `choices[0].prompt_token_ids`, `return_token_ids` ->
                                   `choices[0].response_token_ids` (through the stop
                                   token); as vLLM (dialect vllm): `return_token_ids` ->
                                   a top-level `prompt_token_ids` and `choices[0].token_ids`
  answer_by_characters bool false  generated ids spell the answer one character a token:
                                   the same text, not its canonical encoding
  endpoints         object  {}     hostile answers of the GET probes: {"/v1/models",
                                   "/get_server_info", "/workers", "/metrics", "/health",
                                   "/health_generate": ANSWER}, ANSWER one of
                                   {"body": TEXT, "status": N} (exact text, {key...} refs),
                                   {"nested": DEPTH} (JSON arrays that deep),
                                   {"bytes": N} (a JSON string N bytes long),
                                   {"endless": true} (a chunked body without end),
                                   {"trickle": S} (a byte every S seconds, without end),
                                   {"hang": true} (no answer at all)
  startup_message   str     null   printed on stdout (the engine's log) at start, its
                                   {key...} refs rendered with `api_key`, and {env_keys}
                                   with the names of environment variables holding it
  outlives_client   number  0      seconds a request whose client went away still runs
                                   under its rid. As SGLang, a rid that is running is
                                   refused: 400 "Duplicate request ID detected."
                                   When it ends (at once if 0), it takes every request
                                   running under a rid that *starts with* its own with
                                   it: they end with finish_reason "abort" (SGLang
                                   0.5.23's scheduler aborts by prefix)
  rules             list    []     faults, first matching rule wins:
      {"fault": KIND, "match": REGEX on rid, "first": N (only attempts 1..N of each
       id), "prob": P (0..1), "seconds": S (hang/slow), "status": CODE, "message": STR}

Fault kinds: queue_full (503), rate_limit (429), timeout (408), error (500, or
"status"/"message"), oom (500 "Out of memory even after retracting"), context_length
(400, SGLang's "input longer than the context" text: the prompt alone fills it),
bad_request (400), hang (never answers; "seconds" to give up after S and
answer), slow (answer after "seconds"), malformed (200 with a cut JSON body),
no_choices (200, valid JSON without choices), drop (connection closed, no response),
exit (the process exits at once), stall (stall from now on), length (finish_reason
"length", content cut short), unclosed_think (reasoning only, content null,
"length"), abort (finish_reason "abort"), tool_call (a well-formed call of the request's
first tool, arguments "{}", content "", finish_reason "tool_calls"; with a tokenizer
its generated ids are the thinking and the call as the chat template writes them).

Hostile replies (a 200 that must never be cached): content_dict, content_number,
reasoning_number (reasoning_content 7), tool_calls_string, bad_usage
(completion_tokens "many"), surrogate (content holds an escaped lone surrogate
\\ud800), utf16 (a valid reply encoded as UTF-16), echo (a text/plain body: "message",
status "status", default 200), say (a valid reply whose content is "message").

A patch rule answers, and logs, the valid reply with its "set" paths replaced
({"dotted.path": JSON value}, e.g. {"choices.0.message": null}).

Hostile transports (a rule's extra keys): raw ("body": the exact text sent,
{reply} = the valid reply's JSON, "content_type", "headers"), huge ("bytes": a valid
reply whose content is that long, streamed), endless (a 200 whose chunked body never
ends), gzip_bomb ("bytes" of zeros, gzip Content-Encoding), redirect ("location", a
3xx "status", default 307). "retry_after" adds that Retry-After header to an error
reply. "models": the exact JSON body of GET /v1/models. Each text field may quote the
secret with {key...} references.

A rule's "message" may quote the secret the request carried (the Bearer key, or the
password of Basic auth, or its user part when there is no password: a token-only URL):
{key} whole, {key_json} JSON-escaped, {key_ujson} every character \\uXXXX-escaped,
{key_url} URL-encoded, {key_pct} every byte %xx (lower case), {key_b64} base64,
{auth} the whole Authorization header, {auth_b64} that header in base64; each
optionally sliced like {key[:9]} or {key_url[3:]}.

A request without `rid` is tracked under "sha:" + a hash of its messages; a try's rid
(`ID~N.RUN`, stages/serving/client.py) is counted as an attempt of ID.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from aiohttp import web

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
    "rho sigma tau upsilon phi chi psi omega red orange yellow green blue indigo violet "
    "north south east west river mountain forest desert ocean island valley meadow cloud "
    "rain snow wind storm sun moon star comet planet orbit atom cell gene code data graph"
).split()

ERRORS: dict[str, tuple[int, str, str]] = {
    "queue_full": (503, "ServiceUnavailableError", "The request queue is full."),
    "rate_limit": (429, "TooManyRequests", "Too many requests, please retry later."),
    "timeout": (408, "RequestTimeout", "Request timed out in the queue."),
    "error": (500, "InternalServerError", "Internal server error."),
    "oom": (500, "InternalServerError", "Out of memory even after retracting requests."),
    "bad_request": (400, "BadRequestError", "Invalid request."),
    "context_length": (400, "BadRequestError", ""),  # message built per request
}
HOSTILE = {
    "content_dict", "content_number", "reasoning_number", "tool_calls_string", "bad_usage",
    "surrogate", "utf16", "echo", "say",
}  # fmt: skip
TRANSPORT = {"raw", "huge", "endless", "gzip_bomb", "redirect"}
KINDS = set(ERRORS) | HOSTILE | TRANSPORT | {
    "hang", "slow", "malformed", "no_choices", "drop", "exit", "stall",
    "length", "unclosed_think", "abort", "tool_call", "patch",
}  # fmt: skip
NO_WORKER = "No models available - no workers registered"  # sglang-router's words
TRY_ID = re.compile(r"~(\d+)\.[0-9a-f]+$")  # a try's rid: the prompt's + "~ATTEMPT.RUN"
DECODE_RATE = 20.0  # tokens/s a decoding request adds to /metrics
SECRET_REF = re.compile(
    r"\{(key|auth)(_json|_ujson|_url|_pct|_b64|_hex|_htmlx|_html)?(?:\[(-?\d*):(-?\d*)\])?\}")
DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "model": "fake-model",
    "check_model": False,
    "dialect": "sglang",
    "tools_as": None,
    "reasoning_field": "reasoning_content",
    "reasoning_tokens": 16,
    "reply_tokens": 24,
    "latency": 0,
    "max_context": None,
    "api_key": None,
    "not_ready_for": 0,
    "no_worker_for": 0,
    "require_tool_call_id": False,
    "router": False,
    "deterministic": False,
    "exit_after": None,
    "stall_after": None,
    "stall_health": "hang",
    "once_file": None,
    "record": True,
    "record_bodies": False,
    "record_log": False,
    "tokenizer": None,
    "answer_by_characters": False,
    "rules": [],
    "models": None,
    "endpoints": {},
    "startup_message": None,
    "outlives_client": 0,
}


def load_spec(spec: dict | str | Path | None) -> dict:
    """A full spec from a dict, a JSON string or a JSON file; unknown keys are errors."""
    if spec is None:
        spec = {}
    elif isinstance(spec, Path) or (isinstance(spec, str) and not spec.lstrip().startswith("{")):
        spec = json.loads(Path(spec).read_text(encoding="utf-8"))
    elif isinstance(spec, str):
        spec = json.loads(spec)
    unknown = set(spec) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"fault spec: unknown keys {sorted(unknown)}")
    full = {**DEFAULTS, **spec}
    for i, rule in enumerate(full["rules"]):
        if rule.get("fault") not in KINDS:
            raise ValueError(f"fault spec: rules[{i}].fault must be one of {sorted(KINDS)}")
        if set(rule) - {"fault", "match", "first", "prob", "seconds", "status", "message",
                        "set", "body", "content_type", "headers", "bytes", "location",
                        "retry_after"}:
            raise ValueError(f"fault spec: rules[{i}] has unknown keys")
    if full["dialect"] not in ("sglang", "vllm"):
        raise ValueError("fault spec: dialect must be sglang or vllm")
    if full["reasoning_field"] not in ("reasoning_content", "reasoning", "both"):
        raise ValueError("fault spec: reasoning_field must be reasoning_content, reasoning or both")
    return full


def _words(digest: bytes, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        out += [WORDS[b % len(WORDS)] for b in digest[: n - len(out)]]
        digest = hashlib.blake2b(digest).digest()
    return out


def _count(messages: list) -> int:
    total = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        total += 4 + (len(content.split()) if isinstance(content, str) else 0)
    return total


class _State:
    def __init__(self, spec: dict, die) -> None:
        self.spec = spec
        self.die = die  # called when the process must go away (exit fault)
        self.started = time.monotonic()
        self.reset(spec)

    def reset(self, spec: dict) -> None:
        self.spec = spec
        self.received = 0
        self.completed = 0
        self.in_flight = 0
        self.faults: dict[str, int] = {}
        self.requests: dict[str, dict] = {}
        self.attempts: dict[str, int] = {}
        self.running: set = set()  # rids being answered
        self.abandoned: dict[str, float] = {}  # rid -> until when it runs without a client
        self.aborted: set = set()  # running rids a gone client's rid began: they abort
        self.stalled = False
        self.dying = False
        self.last_body: Any = None
        self.log: list[dict] = []  # record_log: answered requests in order
        self.tokens_done = 0  # generation tokens of finished replies (for /metrics)
        self.decoding: dict[int, float] = {}  # request -> when its decode started
        self.frozen_tokens: int | None = None  # /metrics while stalled

    def is_running(self, rid: str) -> bool:
        """Whether a request under `rid` is still running (SGLang refuses a second one)."""
        if rid in self.running:
            return True
        if self.abandoned:
            now = time.monotonic()
            self.abandoned = {r: t for r, t in self.abandoned.items() if t > now}
        return rid in self.abandoned

    def abort_begun_by(self, rid: str) -> None:
        """SGLang's abort of a gone client's request: every running rid it begins."""
        self.aborted.update(r for r in self.running if r != rid and r.startswith(rid))

    def fire_once(self) -> bool:
        """True when a one-shot fault (exit/stall) may fire now; records that it did."""
        marker = self.spec["once_file"]
        if not marker:
            return True
        try:
            with open(marker, "x", encoding="utf-8") as f:
                f.write(str(os.getpid()))
        except FileExistsError:
            return False
        return True


def _error(status: int, kind: str, message: str) -> web.Response:
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.json_response(body, status=status)


def request_secret(request: web.Request) -> str:
    """The secret a request carried: a Bearer key, a Basic-auth password, or the user of
    Basic auth without a password (a token-only URL); "" if none."""
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth[len("Bearer ") :]
    if auth.startswith("Basic "):
        import base64

        user, _, password = base64.b64decode(auth[len("Basic ") :]).decode("utf-8").partition(":")
        return password or user
    return ""


def render(message: str, secret: str, auth: str | None = None) -> str:
    """A rule's message with {key...} references to the request's secret (and {auth...}
    to its Authorization header, by default `Bearer <secret>`) filled in."""
    import base64
    from urllib.parse import quote

    def forms(value: str) -> dict:
        data = value.encode("utf-8", "surrogatepass")
        return {None: value, "_json": json.dumps(value)[1:-1],
                "_ujson": "".join(f"\\u{ord(c):04x}" for c in value),
                "_url": quote(value, safe=""), "_pct": "".join(f"%{b:02x}" for b in data),
                "_b64": base64.b64encode(data).decode(), "_hex": data.hex(),
                "_html": "".join(f"&#{ord(c)};" for c in value),
                "_htmlx": "".join(f"&#x{ord(c):x};" for c in value)}

    values = {"key": secret, "auth": f"Bearer {secret}" if auth is None else auth}

    def one(m: re.Match) -> str:
        text = forms(values[m.group(1)])[m.group(2)]
        if m.group(3) is not None or m.group(4) is not None:
            lo = int(m.group(3)) if m.group(3) else None
            hi = int(m.group(4)) if m.group(4) else None
            text = text[lo:hi]
        return text

    return SECRET_REF.sub(one, message)


def echo(text: str, request: web.Request) -> str:
    """`text` with its {key...}/{auth...} references filled in from `request`."""
    return render(text, request_secret(request), request.headers.get("Authorization", ""))


ECHO_FORMS = ("key", "key_json", "key_ujson", "key_url", "key_pct", "key_b64", "key_hex",
              "key_html", "key_htmlx", "auth_b64")


def secret_pieces(secret: str, n: int = 8) -> set[str]:
    """Every n-character piece of every form `render` can echo the secret in, and of the
    secret's base64 wherever it starts in an encoded header (for greps)."""
    import base64

    forms = {render(f"{{{ref}}}", secret) for ref in ECHO_FORMS if ref.startswith("key")}
    for prefix in ("", "x", "xy"):  # each alignment, the bytes around it cut away
        coded = base64.b64encode((prefix + secret).encode()).decode().rstrip("=")
        forms.add(coded[(0, 2, 3)[len(prefix)] : -1])
    return {f[i : i + n] for f in forms for i in range(len(f) - n + 1)}


def hostile(body: dict, spec: dict, fault: str, message: str) -> web.Response:
    """A 200 that is not a well-formed chat completion (or one echoing `message`)."""
    if fault == "echo":
        return web.Response(text=message, content_type="text/plain")
    reply = reply_for(body, spec)
    msg = reply["choices"][0]["message"]
    if fault == "content_dict":
        msg["content"] = {"text": msg["content"]}
    elif fault == "content_number":
        msg["content"] = 42
    elif fault == "reasoning_number":
        msg["reasoning_content"] = 7
    elif fault == "tool_calls_string":
        msg["tool_calls"] = "lookup(city='Paris')"
    elif fault == "bad_usage":
        reply["usage"]["completion_tokens"] = "many"
    elif fault == "surrogate":
        msg["content"] = "broken \ud800 text"
    elif fault == "say":
        msg["content"] = message
    text = json.dumps(reply)  # ASCII: a lone surrogate travels as the escape \ud800
    if fault == "utf16":
        return web.Response(body=text.encode("utf-16"), content_type="application/json")
    return web.Response(text=text, content_type="application/json")


def patched(reply: dict, rule: dict) -> dict:
    """The valid reply with a patch rule's `set` paths replaced (answered, and logged, as
    any reply)."""
    for path, value in rule.get("set", {}).items():
        *parents, last = path.split(".")
        node = reply
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return reply


async def transport(request, body: dict, spec: dict, rule: dict):
    """A reply whose framing, encoding or size is the attack (see the module docstring)."""
    fault = rule["fault"]
    if fault == "raw":
        text = echo(rule.get("body", ""), request).replace("{reply}", json.dumps(reply_for(body, spec)))
        headers = {k: echo(v, request) for k, v in rule.get("headers", {}).items()}
        return web.Response(body=text.encode("utf-8", "surrogatepass"), status=rule.get("status", 200),
                            headers={"Content-Type": rule.get("content_type", "application/json"), **headers})
    if fault == "redirect":
        location = echo(rule.get("location", "/v1/chat/completions"), request)
        return web.Response(status=rule.get("status", 307), headers={"Location": location})
    response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
    if fault == "gzip_bomb":
        import zlib

        comp = zlib.compressobj(9, zlib.DEFLATED, 31)
        zero = b"\0" * (1 << 20)
        data = b"".join(comp.compress(zero) for _ in range(rule.get("bytes", 1 << 30) >> 20))
        data += comp.flush()
        response.headers["Content-Encoding"] = "gzip"
        response.content_length = len(data)
        await response.prepare(request)
        await response.write(data)
        await response.write_eof()
        return response
    response.enable_chunked_encoding()
    await response.prepare(request)
    if fault == "endless":
        await response.write(b'{"choices": [')
        while True:
            await response.write(b" " * 1024)
            await asyncio.sleep(0.001)
    reply = json.dumps(reply_for(body, spec))
    head, _, tail = reply.partition('"content": "')
    await response.write((head + '"content": "').encode())
    chunk = b"a" * (1 << 20)
    left = rule.get("bytes", 100 << 20)
    while left > 0:
        await response.write(chunk[:left])
        left -= len(chunk)
    await response.write(('"' + tail.partition('"')[2]).encode())
    await response.write_eof()
    return response


def _pick_rule(spec: dict, rid: str, attempt: int) -> dict | None:
    for i, rule in enumerate(spec["rules"]):
        if "match" in rule and not re.search(rule["match"], rid):
            continue
        if "first" in rule and attempt > rule["first"]:
            continue
        prob = rule.get("prob", 1.0)
        if prob < 1.0 and random.Random(f"{spec['seed']}:{i}:{rid}:{attempt}").random() >= prob:
            continue
        return rule
    return None


def _latency(spec: dict, rid: str, attempt: int) -> float:
    lat = spec["latency"]
    if isinstance(lat, (int, float)):
        return float(lat)
    rng = random.Random(f"{spec['seed']}:latency:{rid}:{attempt}")
    if "median" in lat:
        return lat["median"] * math.exp(rng.gauss(0.0, lat.get("sigma", 0.5)))
    return rng.uniform(lat.get("min", 0.0), lat.get("max", 0.0))


def reply_for(body: dict, spec: dict, fault: str | None = None) -> dict:
    """The deterministic completion for a request body (what the server would send)."""
    messages = body.get("messages") or []
    kwargs = body.get("chat_template_kwargs") or {}
    thinking = kwargs.get("enable_thinking", True) is not False
    key = json.dumps(
        [messages, body.get("tools"), body.get("temperature"), body.get("top_p"),
         body.get("top_k"), body.get("seed"), thinking],
        sort_keys=True, ensure_ascii=False, separators=(",", ":"),
    )  # fmt: skip
    digest = hashlib.blake2b(key.encode()).digest()
    n_reason = spec["reasoning_tokens"] if thinking else 0
    n_reply = spec["reply_tokens"]
    words = _words(digest, n_reason + n_reply)
    limit = body.get("max_tokens") or body.get("max_completion_tokens")
    budget = n_reason + n_reply if limit is None else int(limit)
    finish = "stop"
    if fault == "unclosed_think":
        budget = min(budget, max(n_reason, 1))
        if not n_reason:
            words, n_reason = _words(digest, 1), 1
    elif fault == "length":
        budget = min(budget, n_reason + max(n_reply // 2, 1))
    reasoning = words[: min(n_reason, budget)]
    content = words[n_reason : min(n_reason + n_reply, budget)]
    if budget < n_reason + n_reply:
        finish = "length"
    if fault == "abort":
        finish = "abort"
    reasoning_text = " ".join(reasoning) or None
    content_text = " ".join(content) + ("." if finish == "stop" and content else "") or None
    sglang = spec["dialect"] == "sglang"
    message: dict[str, Any] = {"role": "assistant", "content": content_text}
    if not sglang:
        message["tool_calls"] = None  # SGLang leaves the key out when there are none
    field = spec["reasoning_field"]
    if body.get("separate_reasoning") is False and field == "reasoning_content":
        # SGLang without separation: the raw text, think block and all, in content
        if reasoning_text is not None:
            closed = len(reasoning) == n_reason and budget > n_reason
            tail = "\n</think>\n\n" + (content_text or "") if closed else ""
            message["content"] = reasoning_text + tail
        reasoning_text = None
    if field in ("reasoning_content", "both"):
        message["reasoning_content"] = reasoning_text
    if field in ("reasoning", "both"):
        message["reasoning"] = reasoning_text
    if fault == "tool_call":
        tools = body.get("tools") or [{"function": {"name": "lookup"}}]
        message["content"], finish = None, "tool_calls"
        message["tool_calls"] = [{"id": "call_" + digest[:4].hex(), "type": "function", "function": {
            "name": tools[0]["function"]["name"], "arguments": "{}"}}]
        content = []
    if sglang and message["content"] is None:
        message["content"] = ""  # serving_chat.py: `content=text if text else ""`
    prompt_tokens = _count(messages)
    completion_tokens = len(reasoning) + len(content)
    ids = None
    if spec["tokenizer"]:
        closed = bool(content) or finish == "stop"  # the model wrote </think>
        ids = _engine_ids(spec["tokenizer"], body, thinking, reasoning_text, content_text,
                          closed, finish == "stop", spec["answer_by_characters"],
                          spec["tools_as"] or spec["dialect"],
                          message["tool_calls"] if fault == "tool_call" else None)
        prompt_tokens, completion_tokens = len(ids[0]), len(ids[1])
    reply = {
        "id": body.get("rid") or "chatcmpl-" + digest[:12].hex(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or spec["model"],
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    if ids is not None and not sglang and body.get("return_token_ids"):
        reply["prompt_token_ids"], reply["choices"][0]["token_ids"] = ids
    elif ids is not None and sglang:
        choice = reply["choices"][0]
        if body.get("return_prompt_token_ids") or body.get("return_token_ids"):
            choice["prompt_token_ids"] = ids[0]
        if body.get("return_token_ids"):
            choice["response_token_ids"] = ids[1]
    return reply


_TOKENIZERS: dict[str, Any] = {}


def _engine_ids(folder: str, body: dict, thinking: bool, reasoning: str | None,
                content: str | None, closed: bool, stopped: bool,
                by_characters: bool = False, dialect: str = "sglang",
                answer_calls: list | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) as an engine serving `folder` would have them: the
    chat template renders the request (JSON-text tool arguments parsed into objects,
    as vLLM and SGLang do; the tools as the dialect's engine dumps them), the text is encoded whole with control tokens parsed, and
    the completion is what the model wrote after the generation prompt, through its stop
    token (with `by_characters`, its answer one token per character: the same text, not
    its canonical encoding). With `answer_calls` (the tool_call fault), the model wrote its
    thinking and those calls as the template writes them, which the engine's tool-call
    parser took out of the text: the ids are of that text, not of an answer it replaced."""
    from transformers import PreTrainedTokenizerFast

    from stages.serving.toolshape import served_tools  # held to real SGLang's own dump

    tok = _TOKENIZERS.get(folder)
    if tok is None:
        tok = _TOKENIZERS[folder] = PreTrainedTokenizerFast.from_pretrained(folder)
    messages = []
    for m in body.get("messages") or []:
        m = {k: v for k, v in m.items() if v is not None}
        calls = []
        for c in m.get("tool_calls") or []:
            args = c["function"].get("arguments")
            if isinstance(args, str):
                c = {**c, "function": {**c["function"], "arguments": json.loads(args)}}
            calls.append(c)
        if calls:
            m["tool_calls"] = calls
        messages.append(m)
    prompt = tok.apply_chat_template(
        messages, tools=served_tools(dialect, body.get("tools")), tokenize=False,
        add_generation_prompt=True,
        **(body.get("chat_template_kwargs") or {}))
    encode = functools.partial(tok, add_special_tokens=False)
    if answer_calls:
        said = {"role": "assistant", "content": "", "tool_calls": [
            {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in answer_calls]}
        if thinking and reasoning:
            said["reasoning_content"] = reasoning
        whole = tok.apply_chat_template(
            messages + [said], tools=served_tools(dialect, body.get("tools")), tokenize=False,
            **(body.get("chat_template_kwargs") or {}))
        if whole.startswith(prompt):  # through <|im_end|>, not the newline the format adds
            return encode(prompt)["input_ids"], encode(whole[len(prompt):].rstrip("\n"))["input_ids"]
    written = ((reasoning or "") + ("\n</think>\n\n" if closed else "")) if thinking else ""
    end = "<|im_end|>" if stopped else ""
    if not by_characters:
        return encode(prompt)["input_ids"], encode(written + (content or "") + end)["input_ids"]
    ids = encode(written)["input_ids"] if written else []
    for piece in [*(content or ""), end]:
        ids += encode(piece)["input_ids"] if piece else []
    return encode(prompt)["input_ids"], ids


def build_app(spec: dict, die) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    state = _State(spec, die)

    def authorized(request: web.Request) -> bool:
        key = state.spec["api_key"]
        return key is None or request.headers.get("Authorization") == f"Bearer {key}"

    async def forever() -> None:
        await asyncio.Event().wait()

    def stall_now() -> None:
        if not state.stalled and state.fire_once():
            state.stalled = True

    async def chat(request: web.Request) -> web.StreamResponse:
        spec = state.spec
        state.received += 1
        if not authorized(request):
            return _error(401, "AuthenticationError", "Invalid API key.")
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "BadRequestError", "Request body is not valid JSON.")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error(400, "BadRequestError", "Field 'messages' must be a list.")
        running = rid = body.get("rid")
        if isinstance(rid, str):
            rid = TRY_ID.sub("", rid)
        else:
            running = None
            rid = "sha:" + hashlib.blake2b(
                json.dumps(body["messages"], sort_keys=True).encode(), digest_size=8
            ).hexdigest()
        attempt = state.attempts.get(rid, 0) + 1
        state.attempts[rid] = attempt
        record = None
        if spec["record"]:
            record = state.requests.setdefault(rid, {"attempts": 0, "times": [], "outcomes": []})
            record["attempts"] = attempt
            record["times"].append(time.time())
            if spec["record_bodies"]:
                record["body"] = body
        state.last_body = body
        if running is not None and state.is_running(running):
            if record is not None:
                record["outcomes"].append("duplicate_rid")
            return _error(400, "BadRequestError", "Duplicate request ID detected.")
        state.in_flight += 1
        if running is not None:
            state.running.add(running)
        outcome = ["cancelled"]  # what a client that gave up saw, unless a fault says more
        try:
            response, outcome[0] = await _answer(request, body, rid, attempt, outcome)
            return response
        except asyncio.CancelledError:  # the client went away: the request may run on
            if running is not None and spec["outlives_client"] > 0:
                state.abandoned[running] = time.monotonic() + spec["outlives_client"]
                # SGLang sees the client gone when the request yields output: its end
                asyncio.get_running_loop().call_later(
                    spec["outlives_client"], state.abort_begun_by, running)
            elif running is not None:
                state.abort_begun_by(running)
            raise
        finally:
            state.running.discard(running)
            state.aborted.discard(running)
            state.in_flight -= 1
            state.faults[outcome[0]] = state.faults.get(outcome[0], 0) + 1
            if record is not None:
                record["outcomes"].append(outcome[0])

    async def _answer(request, body, rid, attempt, outcome) -> tuple[web.StreamResponse, str]:
        spec = state.spec
        if state.dying or state.stalled:
            outcome[0] = "stalled"
            await forever()
        if time.monotonic() - state.started < spec["not_ready_for"]:
            return _error(503, "ServiceUnavailableError", "The server is still loading."), "loading"
        if time.monotonic() - state.started < spec["no_worker_for"]:
            return _error(503, "ServiceUnavailableError", NO_WORKER), "no_worker"
        if spec["require_tool_call_id"]:
            for k, m in enumerate(body["messages"]):
                if isinstance(m, dict) and m.get("role") == "tool" and "tool_call_id" not in m:
                    msg = f"Invalid JSON data: messages[{k}]: missing field `tool_call_id`"
                    return _error(400, "invalid_request_error", msg), "no_tool_call_id"
        if spec["check_model"] and body.get("model") not in (None, spec["model"]):
            msg = f"The model `{body.get('model')}` does not exist."
            return _error(404, "NotFoundError", msg), "not_found"
        rule = _pick_rule(spec, rid, attempt)
        fault = rule["fault"] if rule else None
        if fault:
            outcome[0] = fault
        if fault in ERRORS:
            status, kind, message = ERRORS[fault]
            if fault == "context_length":
                prompt = _count(body.get("messages") or [])
                message = _too_long(prompt, 0, spec.get("max_context") or prompt)
            message = echo(rule.get("message", message), request)
            response = _error(rule.get("status", status), kind, message)
            if "retry_after" in rule:
                response.headers["Retry-After"] = echo(str(rule["retry_after"]), request)
            return response, fault
        if fault in TRANSPORT:
            return await transport(request, body, spec, rule), fault
        if fault in HOSTILE:
            message = echo(rule.get("message", ""), request)
            response = hostile(body, spec, fault, message)
            response.set_status(rule.get("status", 200))
            return response, fault
        if fault == "hang":
            if "seconds" not in rule:
                await forever()
            await asyncio.sleep(rule["seconds"])
        elif fault == "slow":
            await decode(rule.get("seconds", 1.0))
        elif fault == "drop":
            request.transport.abort()
            await forever()
        elif fault == "exit":
            state.dying = True
            state.die()
            await forever()
        elif fault == "stall":
            stall_now()
            await forever()
        max_context = spec["max_context"]
        if max_context is not None:
            prompt, extra = _count(body["messages"]), int(body.get("max_tokens") or 0)
            if prompt >= max_context or prompt + extra > max_context:
                return _error(400, "BadRequestError", _too_long(prompt, extra, max_context)), "too_long"
        delay = _latency(spec, rid, attempt)
        if delay > 0:
            await decode(delay)
        if state.dying or state.stalled:
            await forever()
        if body.get("rid") in state.aborted:
            fault = outcome[0] = "abort"
        if fault == "malformed":
            text = json.dumps(reply_for(body, spec))
            return web.Response(text=text[: len(text) // 2], content_type="application/json"), fault
        if fault == "no_choices":
            return web.json_response({"object": "chat.completion", "id": rid}), fault
        reply = reply_for(body, spec, fault)
        if fault == "patch":
            reply = patched(reply, rule)
        state.completed += 1
        if spec["record_log"]:
            state.log.append({"rid": rid, "messages": body["messages"], "seed": body.get("seed"),
                              "reply": reply["choices"][0]["message"]})
        state.tokens_done += reply["usage"]["completion_tokens"]
        response = web.json_response(reply)
        done = state.completed
        if spec["exit_after"] is not None and done >= spec["exit_after"] and state.fire_once():
            state.dying = True
            await response.prepare(request)
            await response.write_eof()
            asyncio.get_running_loop().call_later(0.02, state.die)
        elif spec["stall_after"] is not None and done >= spec["stall_after"]:
            stall_now()
        return response, fault or "ok"

    async def decode(seconds: float) -> None:
        """Sleep like a decoding request: /metrics counts its tokens as they come."""
        token = id(asyncio.current_task())
        state.decoding[token] = time.monotonic()
        try:
            await asyncio.sleep(seconds)
        finally:
            state.decoding.pop(token, None)

    def generation_tokens() -> int:
        now = time.monotonic()
        live = state.tokens_done + int(DECODE_RATE * sum(now - t for t in state.decoding.values()))
        if state.stalled or state.dying:
            if state.frozen_tokens is None:
                state.frozen_tokens = live
            return state.frozen_tokens
        return live

    async def metrics(request: web.Request) -> web.Response:
        text = (
            "# HELP sglang:generation_tokens_total Number of generation tokens processed.\n"
            "# TYPE sglang:generation_tokens_total counter\n"
            f'sglang:generation_tokens_total{{model_name="{state.spec["model"]}"}} '
            f"{float(generation_tokens())}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": state.spec["model"],
             "enable_deterministic_inference": state.spec["deterministic"],
             "reasoning_parser": "qwen3"}  # it cuts thinking out as SGLang's parser does
        )  # fmt: skip

    async def workers(request: web.Request) -> web.Response:
        if not state.spec["router"]:
            return _error(404, "NotFoundError", "Not Found")
        url = f"http://{request.host}"
        return web.json_response({"workers": [{"url": url, "model_id": state.spec["model"]}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(request: web.Request) -> web.Response:
        if state.stalled or state.dying:
            if state.spec["stall_health"] == "fail":
                return _error(503, "ServiceUnavailableError", "health generation failed")
            if state.spec["stall_health"] != "ok":
                await forever()
        return web.Response(status=200)

    async def models(request: web.Request) -> web.Response:
        if not authorized(request):
            return _error(401, "AuthenticationError", "Invalid API key.")
        if time.monotonic() - state.started < state.spec["no_worker_for"]:
            return _error(503, "ServiceUnavailableError", NO_WORKER)
        if state.spec["models"] is not None:
            return web.Response(text=echo(json.dumps(state.spec["models"]), request),
                                content_type="application/json")
        name = state.spec["model"]
        card = {"id": name, "object": "model", "created": 0, "owned_by": "sglang", "root": name}
        if state.spec["max_context"]:
            card["max_model_len"] = state.spec["max_context"]
        return web.json_response({"object": "list", "data": [card]})

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": state.spec["model"], "is_generation": True})

    async def stats(request: web.Request) -> web.Response:
        out = {
            "pid": os.getpid(),
            "received": state.received,
            "completed": state.completed,
            "in_flight": state.in_flight,
            "stalled": state.stalled,
            "outcomes": state.faults,
            "last_body": state.last_body,
            "log": state.log,
        }
        if request.query.get("requests", "1") != "0":
            out["requests"] = state.requests
        return web.json_response(out)

    async def admin_reset(request: web.Request) -> web.Response:
        data = await request.json() if request.can_read_body else {}
        state.reset(load_spec(data.get("spec", state.spec)))
        return web.json_response({"ok": True})

    async def admin_stall(request: web.Request) -> web.Response:
        state.stalled = True
        return web.json_response({"ok": True})

    def hostile_or(handler):
        """`handler`, unless the spec's `endpoints` names a hostile answer for its path."""
        async def answer(request: web.Request) -> web.StreamResponse:
            rule = state.spec["endpoints"].get(request.path)
            if rule is None:
                return await handler(request)
            return await probe_answer(request, rule)

        return answer

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", hostile_or(health))
    app.router.add_get("/health_generate", hostile_or(health_generate))
    app.router.add_get("/v1/models", hostile_or(models))
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/get_server_info", hostile_or(server_info))
    app.router.add_get("/metrics", hostile_or(metrics))
    app.router.add_get("/workers", hostile_or(workers))
    app.router.add_get("/stats", stats)
    app.router.add_post("/admin/reset", admin_reset)
    app.router.add_post("/admin/stall", admin_stall)
    return app


async def probe_answer(request: web.Request, rule: dict) -> web.StreamResponse:
    """A GET probe's hostile answer (the spec's `endpoints`, see the module docstring)."""
    if rule.get("hang"):
        await asyncio.Event().wait()
    if "body" in rule:
        return web.Response(body=echo(rule["body"], request).encode("utf-8", "surrogatepass"),
                            status=rule.get("status", 200), content_type="application/json")
    if "nested" in rule:
        depth = rule["nested"]
        return web.Response(text="[" * depth + "]" * depth, content_type="application/json")
    response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    if "bytes" in rule:
        await response.write(b'"')
        left = rule["bytes"]
        while left > 0:
            await response.write(b"a" * min(left, 1 << 20))
            left -= 1 << 20
        await response.write(b'"')
        await response.write_eof()
        return response
    pause = rule.get("trickle", 0)
    while True:  # endless, or a trickle
        await response.write(b" " * (1 if "trickle" in rule else 1 << 16))
        await asyncio.sleep(pause)


def _too_long(prompt: int, extra: int, max_context: int) -> str:
    """SGLang 0.5.23's texts (TokenizerManager._validate_one_request), word for word."""
    if prompt >= max_context:
        return (
            f"The input ({prompt} tokens) is longer than the model's context length "
            f"({max_context} tokens)."
        )
    return (
        f"Requested token count exceeds the model's maximum context length of {max_context} "
        f"tokens. You requested a total of {prompt + extra} tokens: {prompt} tokens from the "
        f"input messages and {extra} tokens for the completion. Please reduce the number of "
        f"tokens in the input messages or the completion to fit within the limit."
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post_json(url: str, body: Any, timeout: float = 10.0, headers: dict | None = None) -> Any:
    data = json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class _Client:
    url: str

    def stats(self, requests: bool = True) -> dict:
        return get_json(f"{self.url}/stats" + ("" if requests else "?requests=0"))

    def reset(self, spec: dict | None = None) -> None:
        post_json(f"{self.url}/admin/reset", {} if spec is None else {"spec": spec})

    def attempts(self, rid: str) -> int:
        return self.stats()["requests"].get(rid, {}).get("attempts", 0)


class FakeServer(_Client):
    """The fake server on a background thread of this process (its own event loop).

    An `exit` fault cannot end the test process: here it closes the listener and
    aborts every open connection instead, which looks the same to a client.
    """

    def __init__(self, spec: dict | str | None = None, host: str = "127.0.0.1", port: int = 0):
        self.spec = load_spec(spec)
        self.host = host
        self.port = port
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    def start(self) -> "FakeServer":
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._serve())
            except BaseException as e:  # reported to start()
                failure.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="fakeserver", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failure:
            raise failure[0]
        self.url = f"http://{self.host}:{self.port}"
        return self

    async def _serve(self) -> None:
        app = build_app(self.spec, self._die)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True, backlog=4096)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def _die(self) -> None:
        async def close() -> None:
            if self._runner is not None:
                for site in list(self._runner.sites):
                    await site.stop()
                server = self._runner.server
                for proto in list(getattr(server, "connections", []) if server else []):
                    if proto.transport is not None:
                        proto.transport.abort()

        asyncio.ensure_future(close())

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> "FakeServer":
        return self.start() if not self.url else self

    def __exit__(self, *exc) -> None:
        self.stop()


def command(port: int, spec: dict | str | None = None, host: str = "127.0.0.1") -> list[str]:
    """The argv that runs this server as its own process."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--host", host, "--port", str(port)]
    if spec is not None:
        argv += ["--fault-spec", spec if isinstance(spec, str) else json.dumps(spec)]
    return argv


def launch_command(spec: dict | None = None) -> list[str]:
    """A `generate.server.launch.command` that runs this server as the "engine"."""
    argv = ["{python}", str(Path(__file__).resolve()), "--host", "{host}", "--port", "{port}"]
    return argv + (["--fault-spec", json.dumps(spec)] if spec is not None else [])


class FakeProcess(_Client):
    """The fake server as a subprocess; `stop()` kills it."""

    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.url = url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "FakeProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def spawn(
    spec: dict | str | None = None, port: int | None = None, log_path: Path | None = None
) -> FakeProcess:
    """Start the server as a subprocess on a free loopback port; return once /health answers."""
    port = port or free_port()
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(command(port, spec), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120  # a busy machine may take long to start Python
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"fakeserver exited with code {proc.returncode}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1).close()
            return FakeProcess(proc, url)
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("fakeserver did not answer /health within 120 s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--fault-spec", default=None, help="JSON object or a JSON file")
    parser.add_argument("--model", default=None, help="served model name (overrides the spec)")
    parser.add_argument("--startup-delay", type=float, default=0.0, help="seconds before listening")
    # Engine flags (a launch spec's args) are accepted and ignored.
    args, ignored = parser.parse_known_args(argv)
    spec = load_spec(args.fault_spec)
    if args.model:
        spec["model"] = args.model
    print(f"fakeserver pid {os.getpid()} port {args.port} ignoring {ignored}", flush=True)
    if spec["startup_message"]:
        key = spec["api_key"] or ""
        holding = sorted(name for name, value in os.environ.items() if key and key in value)
        text = render(spec["startup_message"], key).replace("{env_keys}", json.dumps(holding))
        print(text, flush=True)
    time.sleep(args.startup_delay)

    def die() -> None:
        print("fakeserver: exit fault, exiting now", flush=True)
        os._exit(3)

    app = build_app(spec, die)
    web.run_app(
        app, host=args.host, port=args.port, access_log=None, print=None,
        handler_cancellation=True, reuse_address=True, backlog=4096,
    )  # fmt: skip


if __name__ == "__main__":
    main()
