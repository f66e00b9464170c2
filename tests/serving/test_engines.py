"""Launching and stopping engines: real processes on loopback.

The "engine" is tests/helpers/fakeserver.py started through `launch.command`, so every test
runs the same spawn / readiness / process-group code as a real SGLang launch; one
test at the end launches the real `transformers serve` on the tiny demo model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from stages.common import params
from stages.common.errors import StageError
from stages.serving import engines
from tests.helpers.fakeserver import get_json, post_json
from tests.helpers.processes import fake_launch, gone, pgid, wait_gone
from tests.helpers.repo import ROOT

FAKE = str(ROOT / "tests" / "helpers" / "fakeserver.py")


# ------------------------------------------------------------------------ commands


def test_engine_commands_use_the_venv_and_pass_args():
    sg = params.Launch(engine="sglang", model="Qwen/Qwen3-8B", args=["--reasoning-parser", "qwen3"])
    assert engines.engine_command(sg, 31000) == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3-8B",
        "--host", "127.0.0.1", "--port", "31000", "--reasoning-parser", "qwen3",
    ]  # fmt: skip
    tf = engines.engine_command(params.Launch(engine="transformers", model="/m", host="::1"), 5)
    assert tf[0] == str(Path(sys.executable).parent / "transformers")
    assert tf[1:] == ["serve", "/m", "--host", "::1", "--port", "5"]
    vl = engines.engine_command(params.Launch(engine="vllm", model="m", args=["-tp", "2"]), 7)
    assert vl == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "m",
                  "--host", "127.0.0.1", "--port", "7", "-tp", "2"]  # fmt: skip
    custom = params.Launch(
        engine="sglang", model="m", args=["-x"],
        command=["{python}", "s.py", "--json", '{"a": 1}', "--on={host}:{port}", "{model}"],
    )  # fmt: skip
    assert engines.engine_command(custom, 9) == [
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
        assert engines.engine_command(launch, 1)[: len(head)] == head
    custom = params.Launch(engine="vllm", model="m", python=str(python), command=["{python}", "x"])
    assert engines.engine_command(custom, 1) == [str(python), "x"]
    with pytest.raises(StageError, match=r"^generate.server.launch.python: .*missing.*make engine-venv"):
        engines.engine_command(params.Launch(engine="vllm", model="m", python=str(tmp_path / "missing")), 1)


def test_resolve_model():
    assert engines.resolve_model("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    with pytest.raises(StageError, match="unknown demo model 'demo:nope'"):
        engines.resolve_model("demo:nope")


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
    with engines.EngineProcess(fake_launch({"not_ready_for": 1.5}), log) as server:
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
    server = engines.EngineProcess(launch, tmp_path / "e.log")
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
        engines.EngineProcess(launch, tmp_path / "e.log").start()
    assert time.monotonic() - t0 < 60  # not the startup_timeout (600 s)


def test_missing_executable_is_one_line(tmp_path):
    launch = params.Launch(engine="sglang", model="m", command=["/nonexistent/engine"])
    with pytest.raises(StageError, match="sglang server: cannot run /nonexistent/engine"):
        engines.EngineProcess(launch, tmp_path / "e.log").start()


def test_a_port_already_in_use_is_refused_before_spawning(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = engines.EngineProcess(fake_launch(port=port), tmp_path / "e.log")
        with pytest.raises(StageError, match=rf"launch.port: 127.0.0.1:{port} is already in use"):
            server.start()
        assert server.pid is None


def test_api_key_is_sent_but_never_written(tmp_path):
    key = "sk-test-4242-secret"
    log = tmp_path / "e.log"
    with engines.EngineProcess(fake_launch({"api_key": key}), log, api_key=key) as server:
        assert server.healthy(5)
        assert key not in json.dumps(server.info())
    assert key not in log.read_text()
    # without the key: refused, and said at once rather than after startup_timeout
    launch = fake_launch({"api_key": key}, startup_timeout=600)
    t0 = time.monotonic()
    refused = "refused the readiness request .*HTTP 401.*Invalid API key"
    with pytest.raises(StageError, match=refused):
        engines.EngineProcess(launch, tmp_path / "f.log").start()
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


def group_pids(server: engines.EngineProcess) -> list[int]:
    pids = [p.pid for p in psutil.process_iter() if pgid(p.pid) == server.pid]
    assert server.pid in pids and len(pids) == 3  # engine, its child, the guard
    return pids


def test_stop_kills_the_whole_group_and_is_idempotent(tmp_path):
    server = engines.EngineProcess(family_launch(stop_timeout=60), tmp_path / "e.log")
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
        with engines.EngineProcess(family_launch(), tmp_path / "e.log") as server:
            pids = group_pids(server)
            raise RuntimeError("boom")
    assert wait_gone(pids, 5)


PARENT = """
import json, sys, time
from pathlib import Path
from stages.common import params
from stages.serving import engines
launch = params.Launch(**json.loads(sys.argv[1]))
with engines.EngineProcess(launch, Path(sys.argv[2])) as s:
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
            groups.append([p.pid for p in psutil.process_iter() if pgid(p.pid) == engine])
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


# ------------------------------------------------------------ real transformers serve


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    launch = params.Launch(engine="transformers", model="demo:tiny-qwen3", startup_timeout=240)
    log = tmp_path_factory.mktemp("serve") / "transformers.log"
    with engines.EngineProcess(launch, log) as server:
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
