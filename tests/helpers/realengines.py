"""What the real-engine tests share (tests/test_real_engines.py: vLLM and the router;
tests/test_real_sglang.py: SGLang): the stage run as a user runs it, its params and
prompts, its processes, and `RecordingProxy`, which stands between the stage and an
engine and keeps every request and raw reply as the engine sent it."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import psutil
import yaml

from stages.common import params
from stages.serving import engines
from tests.helpers import stagecli
from tests.helpers.fakeserver import TRY_ID
from tests.helpers.repo import env as repo_env

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict:
    e = repo_env()  # the venv's bin first on PATH: `dvc`, and `python` for its stages
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["HF_HUB_OFFLINE"] = "1"
    return e


@contextlib.contextmanager
def started(launch: dict, folder: Path, name: str):
    """One real engine started through the stage's own launcher (`launch`: a
    `generate.server.launch`), its log in `folder`, for the tests of a module."""
    spec = params.build(params.Launch, launch, "test")
    t0 = time.monotonic()
    with engines.EngineProcess(spec, folder / f"{name.lower()}.log") as server:
        print(f"{name} ready in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        yield server


def write_params(wd: Path, server: dict, **gen) -> None:
    cfg = {
        "server": server, "concurrency": 4, "max_tokens": 40, "temperature": 0.7,
        "seed": 0, "request_timeout": 120, "progress_interval": 0.5,
        "backoff_base": 0.2, "backoff_max": 2, **gen,
    }  # fmt: skip
    (wd / "params.yaml").write_text(yaml.safe_dump({"generate": cfg}), encoding="utf-8")


def write_prompts(wd: Path, rows: list[dict]) -> None:
    path = wd / "data/prompts/prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def user_prompts(n: int, prefix: str = "q") -> list[dict]:
    return [{"id": f"{prefix}{i:03d}", "source": "chat",
             "messages": [{"role": "user", "content": f"Question {i}: explain item {i * 37}."}]}
            for i in range(n)]  # fmt: skip


def stage(wd: Path, module: str = "generate", timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        stagecli.command(module), cwd=wd, env=env(),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def progress(lines: list[str]) -> int:
    """Requests done so far, from the stage's progress lines."""
    done = [ln for ln in list(lines) if " done (" in ln]
    return int(done[-1].split(" done (")[0].split()[-1].split("/")[0]) if done else 0


def stage_pid(root: psutil.Process) -> int | None:
    """The stage's own Python process. Without $SHELL, DVC runs `sh -c CMD` and dash
    does not exec the command, so the shell's one-string argument must not match."""
    for child in root.children(recursive=True):
        try:
            if "stages.generate" in child.cmdline():
                return child.pid
        except psutil.Error:
            continue
    return None


def engine_pids(launcher_pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(launcher_pid).children(recursive=True)]
    except psutil.Error:
        return []


class RecordingProxy:
    """A reverse proxy on loopback to `upstream` that records each chat request and the
    engine's raw answer (`exchanges`: dicts with `request`, `status`, `raw`; status None
    until the answer is in), in the order the requests came. A client that gives up (or
    is killed) does not cut the engine's answer short: it is recorded all the same, in its
    request's place, before any request sent after it (a run resumed after a SIGKILL asks
    again while the engine still answers the killed run)."""

    def __init__(self, upstream: str):
        target = urllib.parse.urlsplit(upstream)
        self.exchanges: list[dict] = []
        lock = threading.Lock()
        record = self.exchanges

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(size) if size else None
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() in ("content-type", "authorization")}
                entry = None
                if self.command == "POST" and self.path.endswith("/chat/completions"):
                    entry = {"request": json.loads(body), "status": None, "raw": b""}
                    with lock:
                        record.append(entry)
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=3600)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    raw, status = resp.read(), resp.status
                    kind = resp.getheader("Content-Type", "application/json")
                finally:
                    conn.close()
                if entry is not None:
                    entry.update(raw=raw, status=status)  # raw first: status says it is in
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", kind)
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                except OSError:  # the client gave up (its timeout): recorded anyway
                    pass

            do_GET = do_POST = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def replies(self) -> dict[str, dict]:
        """What a request asked (`asked(messages, tools)`) -> the engine's last 200 reply
        to it: the one the client kept (it asks again only after refusing one). Prompts
        that ask the same are sent once and share it."""
        return {asked(x["request"]["messages"], x["request"].get("tools")): json.loads(x["raw"])
                for x in list(self.exchanges)
                if x["status"] == 200 and isinstance(x["request"].get("rid"), str)}

    def retried(self) -> list[tuple]:
        """(rid, status, the start of the answer) of every exchange that was not a first
        try answered 200: what a test shows when its counts are off."""
        return [(x["request"].get("rid"), x["status"], x["raw"][:300])
                for x in list(self.exchanges)
                if x["status"] != 200 or _attempt(x["request"].get("rid")) != 1]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def asked(messages: list, tools: list | None) -> str:
    """A request's messages and tools as one key (`RecordingProxy.replies`)."""
    return json.dumps([messages, tools or None], sort_keys=True)


def _attempt(rid) -> int | None:
    """Which try of its prompt a request id names (client.with_attempt_id's form)."""
    found = TRY_ID.search(rid) if isinstance(rid, str) else None
    return int(found.group(1)) if found else None
