"""Launching, supervising and stopping engines: real processes on loopback.

The "engine" is tests/fakeserver.py started through `launch.command`, so every test
runs the same spawn / readiness / process-group code as a real SGLang launch; one
test at the end launches the real `transformers serve` on the tiny demo model.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import psutil
import pytest

from stages.common import params
from stages.common.errors import StageError
from stages.serving import servers
from tests.fakeserver import FakeServer, free_port, get_json, launch_command, post_json
from tests.repo import ROOT

FAKE = str(ROOT / "tests" / "fakeserver.py")


def fake_launch(spec: dict | None = None, **kw) -> params.Launch:
    command = launch_command(spec)
    options = dict(engine="sglang", model="unused-name", startup_timeout=120.0, stop_timeout=3.0)
    return params.Launch(command=command, **{**options, **kw})


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


# ------------------------------------------------------------------------ commands


def test_engine_commands_use_the_venv_and_pass_args():
    sg = params.Launch(engine="sglang", model="Qwen/Qwen3-8B", args=["--reasoning-parser", "qwen3"])
    assert servers.engine_command(sg, 31000) == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3-8B",
        "--host", "127.0.0.1", "--port", "31000", "--reasoning-parser", "qwen3",
    ]  # fmt: skip
    tf = servers.engine_command(params.Launch(engine="transformers", model="/m", host="::1"), 5)
    assert tf[0] == str(Path(sys.executable).parent / "transformers")
    assert tf[1:] == ["serve", "/m", "--host", "::1", "--port", "5"]
    vl = servers.engine_command(params.Launch(engine="vllm", model="m", args=["-tp", "2"]), 7)
    assert vl == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "m",
                  "--host", "127.0.0.1", "--port", "7", "-tp", "2"]  # fmt: skip
    custom = params.Launch(
        engine="sglang", model="m", args=["-x"],
        command=["{python}", "s.py", "--json", '{"a": 1}', "--on={host}:{port}", "{model}"],
    )  # fmt: skip
    assert servers.engine_command(custom, 9) == [
        sys.executable, "s.py", "--json", '{"a": 1}', "--on=127.0.0.1:9", "m", "-x",
    ]  # fmt: skip


def test_an_engine_runs_from_the_interpreter_named_by_launch_python(tmp_path):
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    python = venv / "python"
    python.symlink_to(sys.executable)  # a venv's python is a link: kept, not resolved
    (venv / "transformers").write_text("#!/bin/sh\n")
    (venv / "transformers").chmod(0o755)
    for engine, head in [("sglang", [str(python), "-m", "sglang.launch_server"]),
                         ("vllm", [str(python), "-m", "vllm.entrypoints.openai.api_server"]),
                         ("transformers", [str(venv / "transformers"), "serve"])]:
        launch = params.Launch(engine=engine, model="m", python=str(python))
        assert servers.engine_command(launch, 1)[: len(head)] == head
    custom = params.Launch(engine="vllm", model="m", python=str(python), command=["{python}", "x"])
    assert servers.engine_command(custom, 1) == [str(python), "x"]
    with pytest.raises(StageError, match=r"^generate.server.launch.python: .*missing.*make engine-venv"):
        servers.engine_command(params.Launch(engine="vllm", model="m", python=str(tmp_path / "missing")), 1)


def test_resolve_model_and_urls():
    assert servers.resolve_model("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    with pytest.raises(StageError, match="unknown demo model 'demo:nope'"):
        servers.resolve_model("demo:nope")
    assert servers.normalize_url(" http://h:30000/v1/ ") == "http://h:30000"
    assert servers.normalize_url("http://h:30000") == "http://h:30000"


def test_launch_params_validate():
    doc = {"engine": "sglang", "model": "m", "command": ["a", "{port}"], "stop_timeout": 5}
    launch = params.build(params.Launch, doc, "generate.server.launch")
    assert launch.command == ["a", "{port}"] and launch.stop_timeout == 5.0
    with pytest.raises(params.ParamError, match=r"launch\.command: expected a list of a string"):
        params.build(params.Launch, {**doc, "command": "a b"}, "generate.server.launch")
    with pytest.raises(params.ParamError, match=r"max_restarts: expected an integer"):
        params.build(params.Server, {"max_restarts": "3"}, "generate.server")


# ----------------------------------------------------------------------- readiness


def test_ready_means_a_token_was_generated(tmp_path):
    # /health says 200 at once, but generation answers 503 "loading" for 1.5 s
    log = tmp_path / "logs" / "engine.log"
    t0 = time.monotonic()
    with servers.EngineProcess(fake_launch({"not_ready_for": 1.5}), log) as server:
        took = time.monotonic() - t0
        stats = get_json(server.url + "/stats")
        assert took >= 1.5
        assert stats["outcomes"].get("loading", 0) >= 1 and stats["completed"] == 1
        assert server.model_name == "fake-model"  # learned from /v1/models
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert server.healthy(5)
        info = server.info()
        assert info["engine"] == "sglang" and info["restarts"] == 0 and info["url"] == server.url
    text = log.read_text()
    assert "starting:" in text and f"fakeserver pid {server.pid}" in text and "stopped" in text


def test_startup_timeout_names_engine_param_and_log_tail(tmp_path):
    # prints at once, then becomes a fake server that stays "loading"
    boot = (
        "import os, sys; print('engine booting', flush=True); "
        f"os.execv(sys.executable, [sys.executable, {FAKE!r}] + sys.argv[1:])"
    )
    command = ["{python}", "-c", boot, "--host", "{host}", "--port", "{port}"]
    launch = params.Launch(
        engine="sglang", model="m", startup_timeout=4, stop_timeout=3,
        command=command + ["--fault-spec", json.dumps({"not_ready_for": 60})],
    )  # fmt: skip
    server = servers.EngineProcess(launch, tmp_path / "e.log")
    with pytest.raises(StageError) as err:
        server.start()
    msg = str(err.value)
    assert "sglang server did not generate a token within 4 s" in msg
    assert "startup_timeout" in msg and "last check:" in msg
    assert "engine booting" in msg  # the log's last lines
    assert "\n" not in msg
    assert wait_gone([server.pid], 5)


def test_exit_during_startup_reports_code_and_log(tmp_path):
    script = "import sys; print('loading weights'); print('CUDA out of memory', flush=True); sys.exit(7)"  # fmt: skip
    launch = params.Launch(engine="vllm", model="m", command=["{python}", "-c", script])
    t0 = time.monotonic()
    with pytest.raises(StageError, match=r"vllm server exited with code 7 while starting .*loading weights \| CUDA out of memory"):  # fmt: skip
        servers.EngineProcess(launch, tmp_path / "e.log").start()
    assert time.monotonic() - t0 < 60  # not the startup_timeout (600 s)


def test_missing_executable_is_one_line(tmp_path):
    launch = params.Launch(engine="sglang", model="m", command=["/nonexistent/engine"])
    with pytest.raises(StageError, match="sglang server: cannot run /nonexistent/engine"):
        servers.EngineProcess(launch, tmp_path / "e.log").start()


def test_a_port_already_in_use_is_refused_before_spawning(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = servers.EngineProcess(fake_launch(port=port), tmp_path / "e.log")
        with pytest.raises(StageError, match=rf"launch.port: 127.0.0.1:{port} is already in use"):
            server.start()
        assert server.pid is None


def test_api_key_is_sent_but_never_written(tmp_path):
    key = "sk-test-4242-secret"
    log = tmp_path / "e.log"
    with servers.EngineProcess(fake_launch({"api_key": key}), log, api_key=key) as server:
        assert server.healthy(5)
        assert key not in json.dumps(server.info())
    assert key not in log.read_text()
    # without the key: refused, and said at once rather than after startup_timeout
    launch = fake_launch({"api_key": key}, startup_timeout=600)
    t0 = time.monotonic()
    refused = "refused the readiness request .*HTTP 401.*Invalid API key"
    with pytest.raises(StageError, match=refused):
        servers.EngineProcess(launch, tmp_path / "f.log").start()
    assert time.monotonic() - t0 < 120


# ------------------------------------------------------------------------ stopping

# The engine starts a grandchild in its group, then becomes the fake server.
FAMILY = (
    "import os, subprocess, sys; child = subprocess.Popen([sys.executable, '-c', "
    "'import time; time.sleep(600)']); print('child', child.pid, flush=True); "
    f"os.execv(sys.executable, [sys.executable, {FAKE!r}] + sys.argv[1:])"
)


def family_launch(**kw) -> params.Launch:
    options = dict(engine="sglang", model="m", startup_timeout=120, stop_timeout=3,
                   command=["{python}", "-c", FAMILY, "--host", "{host}", "--port", "{port}"])
    return params.Launch(**{**options, **kw})


def group_pids(server: servers.EngineProcess) -> list[int]:
    pids = [p.pid for p in psutil.process_iter() if _pgid(p.pid) == server.pid]
    assert server.pid in pids and len(pids) == 3  # engine, its child, the guard
    return pids


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_stop_kills_the_whole_group_and_is_idempotent(tmp_path):
    server = servers.EngineProcess(family_launch(stop_timeout=60), tmp_path / "e.log")
    server.start()
    pids = group_pids(server)
    t0 = time.monotonic()
    server.stop()
    assert time.monotonic() - t0 < 30  # the engine exits on SIGTERM: not the grace (60 s)
    assert wait_gone(pids, 5)
    server.stop()
    assert server.exit_code() is None and not server.healthy(1)


def test_an_exception_inside_with_stops_the_engine(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with servers.EngineProcess(family_launch(), tmp_path / "e.log") as server:
            pids = group_pids(server)
            raise RuntimeError("boom")
    assert wait_gone(pids, 5)


def test_a_group_ignoring_sigterm_is_killed_after_the_grace():
    script = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(600)"  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, process_group=0)
    proc.stdout.readline()  # the handler is in place
    t0 = time.monotonic()
    servers._kill_group(proc, grace=1.0)
    assert 0.9 <= time.monotonic() - t0 < 30
    assert proc.returncode == -signal.SIGKILL


def test_a_stop_waits_for_the_whole_group_not_just_the_leader(tmp_path):
    # an engine's leader can exit on SIGTERM while its schedulers still shut down (and
    # hold GPU memory): the stop, and so a restart, waits for every member of the group
    marker = tmp_path / "child-done"
    child = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    time.sleep(1.0)\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print(1, flush=True)\n"
        "time.sleep(600)\n"
    )
    leader = (
        "import subprocess, sys, time\n"
        f"c = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE)\n"
        "c.stdout.readline()\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", leader], stdout=subprocess.PIPE, process_group=0)
    child_pid = int(proc.stdout.readline())
    servers._kill_group(proc, grace=10.0)
    assert marker.exists()  # the child finished its own shutdown: it was not SIGKILLed
    assert wait_gone([child_pid], 0.5)


PARENT = """
import json, sys, time
from pathlib import Path
from stages.common import params
from stages.serving import servers
launch = params.Launch(**json.loads(sys.argv[1]))
with servers.EngineProcess(launch, Path(sys.argv[2])) as s:
    print(json.dumps({"pid": s.pid, "url": s.url}), flush=True)
    time.sleep(600)
"""


@pytest.mark.slow  # three parents, three engines
def test_no_orphan_when_the_parent_is_interrupted_terminated_or_killed(tmp_path):
    launch = family_launch()
    doc = {k: getattr(launch, k) for k in ("engine", "model", "command", "stop_timeout")}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
    parents = [
        subprocess.Popen(
            [sys.executable, "-c", PARENT, json.dumps(doc), str(tmp_path / f"{sig.name}.log")],
            cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        for sig in sigs
    ]  # started together: each needs seconds to import and launch
    try:
        groups = []
        for parent in parents:
            engine = json.loads(parent.stdout.readline())["pid"]
            groups.append([p.pid for p in psutil.process_iter() if _pgid(p.pid) == engine])
            assert len(groups[-1]) == 3  # engine, its child, the guard
        for parent, sig in zip(parents, sigs):
            parent.send_signal(sig)
        for parent, group, sig in zip(parents, groups, sigs):
            parent.wait(60)  # seconds when idle; a busy machine may take many more
            assert wait_gone(group, 30), (sig.name, [p for p in group if not gone(p)])
    finally:
        for parent in parents:
            parent.kill()
            parent.wait()
    assert parents[1].returncode == -signal.SIGTERM  # still dies of the signal, after cleanup
    # SIGINT and SIGTERM: the parent stopped the engine itself; SIGKILL: the guard did
    logs = {sig: (tmp_path / f"{sig.name}.log").read_text() for sig in sigs}
    assert "stopped (exit" in logs[signal.SIGINT] and "stopped (exit" in logs[signal.SIGTERM]
    assert "stopped (exit" not in logs[signal.SIGKILL]


# ------------------------------------------------------------------------ watchdog

RID = "client-{}"


async def drive(server, watchdog: servers.Watchdog, n: int, workers: int = 4) -> int:
    """A minimal client: retries any failure once the watchdog is not restarting."""
    done = in_flight = 0
    queue = list(range(n))

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done, in_flight
        while queue:
            i = queue.pop()
            body = {"rid": RID.format(i), "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 8}  # fmt: skip
            while True:
                await watchdog.wait_ready()
                in_flight += 1
                try:
                    async with session.post(server.url + "/v1/chat/completions", json=body) as r:
                        if r.status == 200 and (await r.json())["choices"]:
                            done += 1
                            break
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    pass
                finally:
                    in_flight -= 1
                await asyncio.sleep(0.05)

    watch = asyncio.create_task(watchdog.watch(lambda: (done, in_flight)))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        work = asyncio.gather(*(worker(session) for _ in range(workers)))
        finished, _ = await asyncio.wait({work, watch}, timeout=40, return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        watch.cancel()
        if watch in finished:
            work.cancel()
            watch.result()  # raises the watchdog's StageError
        assert work in finished, "the client did not finish"
    return done


@pytest.mark.slow  # waits out watchdog periods
def test_watchdog_restarts_a_stalled_server_that_says_healthy(tmp_path):
    # After 5 replies (1 is the readiness probe) generation hangs; /health stays 200.
    spec = {"stall_after": 5, "once_file": str(tmp_path / "stalled-once")}
    with servers.EngineProcess(fake_launch(spec), tmp_path / "e.log") as server:
        first = server.pid
        watchdog = servers.Watchdog(server, seconds=1.0)
        t0 = time.monotonic()
        done = asyncio.run(drive(server, watchdog, 16))
        assert done == 16
        assert watchdog.restarts == 1 and server.restarts == 1 and server.pid != first
        assert re.fullmatch(r"no request completed for \d+ s with 4 in flight", watchdog.last_reason)
        assert gone(first)
        assert get_json(server.url + "/stats")["completed"] == 1 + 12  # probe + the rest
        assert time.monotonic() - t0 < 120
    assert "restarting: no request completed" in (tmp_path / "e.log").read_text()


def test_watchdog_restarts_an_engine_that_died_mid_run(tmp_path):
    spec = {"exit_after": 4, "once_file": str(tmp_path / "died-once"), "latency": 0.05}
    with servers.EngineProcess(fake_launch(spec), tmp_path / "e.log") as server:
        watchdog = servers.Watchdog(server, seconds=5.0)
        assert asyncio.run(drive(server, watchdog, 12)) == 12
        assert watchdog.restarts == 1
        assert watchdog.last_reason == "engine exited with code 3"


def test_watchdog_probes_an_idle_server_and_restarts_it(tmp_path):
    spec = {"stall_health": "fail"}
    with servers.EngineProcess(fake_launch(spec), tmp_path / "e.log") as server:
        post_json(server.url + "/admin/stall", {})
        assert not server.healthy(2)  # sglang dialect: /health_generate
        watchdog = servers.Watchdog(server, seconds=1.0)

        async def run() -> None:
            task = asyncio.create_task(watchdog.watch(lambda: (0, 0)))
            while watchdog.restarts == 0 and not task.done():
                await asyncio.sleep(0.05)
            task.cancel()

        asyncio.run(run())
        assert watchdog.restarts == 1 and "health generation failed" in watchdog.last_reason
        assert server.healthy(5)


@pytest.mark.slow  # waits out watchdog periods
def test_watchdog_gives_up_on_a_server_that_never_recovers(tmp_path):
    # Every start stalls after its readiness probe: generation hangs, health generation fails.
    spec = {"stall_after": 1, "stall_health": "fail"}  # stalls right after the readiness probe
    with servers.EngineProcess(fake_launch(spec), tmp_path / "e.log") as server:
        watchdog = servers.Watchdog(server, seconds=0.8, max_restarts=1)
        with pytest.raises(StageError, match=r"giving up after 1 restart\(s\) in a row .*max_restarts.*last problem"):  # fmt: skip
            asyncio.run(drive(server, watchdog, 4, workers=2))
        assert server.restarts == 1


# ----------------------------------------------------------------------- URL servers


def test_wait_ready_waits_for_a_late_server_and_gives_up_on_a_dead_one():
    port = free_port()
    late = FakeServer(port=port)

    async def run() -> tuple[float, str]:
        loop = asyncio.get_running_loop()
        loop.call_later(0.7, late.start)
        t0 = time.monotonic()
        name = await servers.wait_ready([f"http://127.0.0.1:{port}"], deadline=120)
        return time.monotonic() - t0, name

    try:
        took, name = asyncio.run(run())
        assert 0.6 < took and name == "fake-model"
    finally:
        late.stop()
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(StageError, match=rf"no model ready at {dead} within 0.6 s .*unreachable_deadline"):  # fmt: skip
        asyncio.run(servers.wait_ready([dead], deadline=0.6))
    assert time.monotonic() - t0 < 30


def test_wait_ready_stops_at_once_on_a_wrong_key(fake_server):
    server = fake_server({"api_key": "k"})
    assert asyncio.run(servers.wait_ready([server.url], deadline=2, api_key="k")) == "fake-model"
    with pytest.raises(StageError, match="HTTP 401: check the API key"):
        asyncio.run(servers.wait_ready([server.url], deadline=20, api_key="wrong"))


# ----------------------------------------------------------- the fake server itself


def chat(url: str, rid: str | None = None, **extra) -> tuple[int, dict]:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 64, **extra}
    if rid is not None:
        body["rid"] = rid
    try:
        return 200, post_json(url + "/v1/chat/completions", body, timeout=5)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_fake_replies_are_deterministic_and_shaped_like_sglang():
    from tests.fakeserver import load_spec, reply_for

    spec = load_spec(None)
    body = {"rid": "a", "messages": [{"role": "user", "content": "x y"}], "max_tokens": 100}
    one, again = reply_for(body, spec), reply_for(dict(body), spec)
    assert one["choices"] == again["choices"] and one["id"] == "a"
    msg = one["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"].endswith(".")
    assert one["choices"][0]["finish_reason"] == "stop"
    assert one["usage"]["completion_tokens"] == 16 + 24
    assert reply_for({**body, "temperature": 0.1}, spec)["choices"] != one["choices"]
    off = reply_for({**body, "chat_template_kwargs": {"enable_thinking": False}}, spec)
    assert off["choices"][0]["message"]["reasoning_content"] is None
    cut = reply_for({**body, "max_tokens": 10}, spec)["choices"][0]
    # SGLang 0.5.23 writes an empty content as "" (vLLM: null), and no tool_calls key
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == ""
    assert "tool_calls" not in cut["message"]
    vllm_cut = reply_for({**body, "max_tokens": 10}, load_spec({"dialect": "vllm"}))
    assert vllm_cut["choices"][0]["message"]["content"] is None
    vllm = reply_for(body, load_spec({"reasoning_field": "reasoning"}))["choices"][0]["message"]
    assert vllm["reasoning"] == msg["reasoning_content"] and "reasoning_content" not in vllm
    raw = reply_for({**body, "separate_reasoning": False}, spec)["choices"][0]["message"]
    assert raw["reasoning_content"] is None and "\n</think>\n\n" in raw["content"]


def test_fake_faults_follow_the_spec_and_are_counted(fake_server):
    server = fake_server({
        "seed": 3,
        "rules": [
            {"fault": "queue_full", "match": "^busy", "first": 2},
            {"fault": "context_length", "match": "^long"},
            {"fault": "unclosed_think", "match": "^think"},
            {"fault": "error", "match": "^half", "prob": 0.5},
        ],
    })  # fmt: skip
    assert [chat(server.url, "busy-1")[0] for _ in range(3)] == [503, 503, 200]
    status, err = chat(server.url, "long-1")
    assert status == 400 and err["object"] == "error" and err["code"] == 400
    assert "longer than the model's context length" in err["message"]
    status, reply = chat(server.url, "think-1")
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["choices"][0]["message"]["content"] == ""  # SGLang's empty content
    fates = [chat(server.url, f"half-{i}")[0] for i in range(40)]
    assert 8 < fates.count(500) < 32
    stats = server.stats()
    busy = stats["requests"]["busy-1"]
    assert busy["attempts"] == 3 and busy["outcomes"] == ["queue_full", "queue_full", "ok"]
    assert busy["times"] == sorted(busy["times"]) and len(busy["times"]) == 3
    server.reset()  # same seed, same fates
    assert [chat(server.url, f"half-{i}")[0] for i in range(40)] == fates
    assert server.attempts("busy-1") == 0


def test_fake_stall_keeps_health_but_not_generation(fake_server):
    server = fake_server({"stall_after": 1, "stall_health": "fail"})
    assert chat(server.url, "r1")[0] == 200
    with pytest.raises(TimeoutError):  # a stalled request never answers
        post_json(server.url + "/v1/chat/completions", {"messages": [], "rid": "r2"}, timeout=0.5)
    with urllib.request.urlopen(server.url + "/health", timeout=2) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as err:
        get_json(server.url + "/health_generate")
    assert err.value.code == 503
    assert server.stats()["stalled"] is True


# ------------------------------------------------------------ real transformers serve


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    launch = params.Launch(engine="transformers", model="demo:tiny-qwen3", startup_timeout=240)
    log = tmp_path_factory.mktemp("serve") / "transformers.log"
    with servers.EngineProcess(launch, log) as server:
        yield server


@pytest.mark.slow  # a real transformers serve
def test_real_transformers_serve_on_the_demo_model(demo_server):
    assert demo_server.model_name == demo_server.model_path
    assert Path(demo_server.model_path).is_dir()
    body = {
        "model": demo_server.model_name,
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 8,
        "temperature": 0.7,
        "seed": 1,
    }
    reply = post_json(demo_server.url + "/v1/chat/completions", body, timeout=60)
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")
    assert reply["usage"]["completion_tokens"] >= 1
    assert demo_server.healthy(30)
    info = demo_server.info()
    assert info["engine"] == "transformers" and info["version"]
