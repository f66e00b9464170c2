"""The generate stage end to end: a real stage process against the fake SGLang server.

Every test runs `python -m stages.generate` in a scratch folder, against
tests/helpers/fakeserver.py as its own process on loopback (a URL server, or one the stage
launches through `generate.server.launch.command`).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import yaml

from stages import generate
from stages.common import params, reports
from stages.common.errors import StageError
from stages.serving.toolshape import served_tools
from tests.helpers.fakeserver import free_port, secret_pieces, spawn

from tests.helpers.generation import (
    PATHS,
    ROOT,
    KEY,
    make_prompts,
    write_params,
    url_server,
    launch_server,
    stage,
    start_stage,
    here,
    ok,
    outputs,
    cache_entries,
    cache_bytes,
    report,
    to_send,
)


# -------------------------------------------------------------------------- tests


def test_every_prompt_is_accounted_for_and_permanent_failures_are_sent_once(tmp_path):
    rows = make_prompts(tmp_path, 150)
    spec = {
        "rules": [
            {"fault": "context_length", "match": "p0001[0-2]$"},
            {"fault": "bad_request", "match": "p00020$"},
            {"fault": "oom", "match": "p00021$"},
            {"fault": "unclosed_think", "match": "p0003[0-4]$"},
            {"fault": "length", "match": "p0004[0-4]$"},
            {"fault": "abort", "match": "p00050$", "first": 1},
            {"fault": "queue_full", "first": 2, "prob": 0.3},
            {"fault": "rate_limit", "first": 1, "prob": 0.1},
            {"fault": "error", "first": 1, "prob": 0.1},
            {"fault": "malformed", "first": 1, "prob": 0.05},
            {"fault": "drop", "first": 1, "prob": 0.05},
            {"fault": "slow", "prob": 0.1, "seconds": 0.2},
        ]
    }
    with spawn(spec) as fake:
        write_params(tmp_path, server=url_server(fake.url), max_permanent_failures=5)
        r = here(tmp_path)
        completions, failures = outputs(tmp_path)
        permanent = ["p00010", "p00011", "p00012", "p00020", "p00021"]
        assert [f["id"] for f in failures] == permanent
        assert [f["kind"] for f in failures] == ["context_overflow"] * 3 + ["bad_request", "oom"]
        assert all(f["attempts"] == 1 and f["status"] in (400, 500) for f in failures)
        stats = fake.stats()["requests"]
        assert [stats[i]["attempts"] for i in permanent] == [1] * 5

        # completions + failures = prompts, completions in prompt order
        assert len(completions) + len(failures) == len(rows)
        order = {r["id"]: k for k, r in enumerate(rows)}
        assert [order[c["id"]] for c in completions] == sorted(order[c["id"]] for c in completions)
        by_id = {c["id"]: c for c in completions}
        c0 = by_id["p00000"]
        assert c0["messages"][:-1] == rows[0]["messages"]
        # the tools as SGLang (the URL's default dialect) renders them into its prompt
        assert c0["tools"] == served_tools("sglang", rows[0]["tools"]) != rows[0]["tools"]
        answer = c0["messages"][-1]
        assert answer["role"] == "assistant" and answer["content"] and answer["reasoning_content"]
        assert "tools" not in by_id["p00001"]
        assert set(c0) == {"id", "source", "messages", "tools", "finish_reason", "truncated", "usage", "model", "sampling"}  # fmt: skip
        assert c0["model"] == "fake-model" and len(c0["sampling"]) == 16

        # truncation is data: recorded, marked, not dropped
        for i in range(30, 35):
            c = by_id[f"p{i:05d}"]
            assert c["truncated"] and c["finish_reason"] == "length"
            assert c["messages"][-1]["content"] is None and c["messages"][-1]["reasoning_content"]
        for i in range(40, 45):
            assert by_id[f"p{i:05d}"]["truncated"] and by_id[f"p{i:05d}"]["messages"][-1]["content"]
        # an aborted reply is not the model's end: sent again, never cached as an answer
        assert by_id["p00050"]["finish_reason"] == "stop" and fake.attempts("p00050") >= 2
        assert sum(c["truncated"] for c in completions) == 10
        assert not by_id["p00001"]["truncated"]

        assert report(tmp_path) == {**r, "host": reports.host()}  # the file holds the run's
        assert r["requests"] == 150 and r["completed"] == 145 and r["failed"] == 5
        assert r["failed_by_kind"] == {"bad_request": 1, "context_overflow": 3, "oom": 1}
        assert r["truncated"] == 10 and r["retries"] > 0
        assert r["output_tokens"] == sum(c["usage"]["completion_tokens"] for c in completions)
        assert r["request_throughput"] > 0 and r["median_e2e_latency_ms"] > 0
        assert r["p99_e2e_latency_ms"] >= r["p90_e2e_latency_ms"] >= r["median_e2e_latency_ms"]
        assert 0 < r["concurrency"] <= 8.5 and r["sent"] == 150

        # a re-run sends nothing, permanent failures stay failed, bytes identical
        before = (tmp_path / "data/completions/completions.jsonl").read_bytes()
        again = ok(stage(tmp_path))
        assert to_send(again) == 0
        assert (tmp_path / "data/completions/completions.jsonl").read_bytes() == before
        assert [fake.attempts(i) for i in permanent] == [1] * 5

        # retry_failed resends exactly the cached permanent failures
        fake.reset({})
        write_params(tmp_path, server=url_server(fake.url), retry_failed=True, max_permanent_failures=5)
        assert here(tmp_path)["sent"] == 5
        completions, failures = outputs(tmp_path)
        assert len(completions) == 150 and failures == []


def test_sigkill_at_random_moments_then_rerun_is_byte_identical(tmp_path):
    ref, wd = tmp_path / "ref", tmp_path / "killed"
    rows = make_prompts(ref, 250)
    make_prompts(wd, 250)
    spec = {
        "latency": {"min": 0.002, "max": 0.04},
        "rules": [{"fault": "context_length", "match": "p0007[0-1]$"}],
    }
    rng = random.Random(4)
    with spawn(spec) as fake:
        for d in (ref, wd):
            write_params(d, server=url_server(fake.url), concurrency=16)
        ok(stage(ref))
        per_entry = cache_bytes(ref) / len(rows)
        cached = []
        for target in sorted(rng.sample(range(20, 230), 3)):
            proc = start_stage(wd)
            while cache_bytes(wd) < target * per_entry and proc.poll() is None:
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 0.05))  # not always right after a write
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            cached.append(len(cache_entries(wd)))
        assert all(0 < n < len(rows) for n in cached), cached  # every kill landed mid-run
        assert not (wd / "data/completions").exists()
        ok(stage(wd))
    for name in ("completions.jsonl", "failures.jsonl"):
        a = (ref / "data/completions" / name).read_bytes()
        b = (wd / "data/completions" / name).read_bytes()
        assert a == b, name
    keys = cache_entries(wd)
    assert len(keys) == len(set(keys)) == len(rows) - 0  # every request cached exactly once
    completions, failures = outputs(wd)
    assert len(completions) == 248 and len(failures) == 2


def test_a_launched_server_that_dies_is_restarted(tmp_path):
    make_prompts(tmp_path, 120)
    spec = {"exit_after": 30, "once_file": str(tmp_path / "died"), "latency": 0.01}
    write_params(tmp_path, server=launch_server(tmp_path, spec, watchdog_seconds=4))
    out = ok(stage(tmp_path))
    completions, failures = outputs(tmp_path)
    assert len(completions) == 120 and failures == []
    r = report(tmp_path)
    assert r["server"]["restarts"] == 1 and "exited" in r["server"]["restart_reasons"][0]
    log_text = (tmp_path / ".cache/logs/generate-server.log").read_text()
    assert "restarting" in log_text and "exit fault" in log_text
    assert "restarting sglang" in out


def test_a_stalled_launched_server_is_restarted(tmp_path):
    make_prompts(tmp_path, 60)
    spec = {"stall_after": 20, "once_file": str(tmp_path / "stalled"), "latency": 0.01}
    write_params(tmp_path, server=launch_server(tmp_path, spec, watchdog_seconds=2))
    ok(stage(tmp_path))
    completions, _ = outputs(tmp_path)
    assert len(completions) == 60
    r = report(tmp_path)
    assert r["server"]["restarts"] == 1
    assert "no request completed" in r["server"]["restart_reasons"][0]


def test_a_url_server_that_is_gone_stops_the_run_and_the_cache_keeps_its_work(tmp_path):
    rows = make_prompts(tmp_path, 200)
    port = free_port()
    with spawn({"exit_after": 60, "latency": 0.005}, port=port) as fake:
        write_params(tmp_path, server=url_server(fake.url, unreachable_deadline=1.5))
        proc = stage(tmp_path)
    assert proc.returncode == 1
    assert "unreachable_deadline" in proc.stderr and "re-run to resume" in proc.stderr
    kept = len(cache_entries(tmp_path))
    assert kept >= 55
    assert not (tmp_path / "data/completions").exists()
    with spawn({"latency": 0.005}, port=port) as fake:
        out = ok(stage(tmp_path))
        assert to_send(out) == len(rows) - kept
        assert fake.stats()["received"] == len(rows) - kept
    completions, _ = outputs(tmp_path)
    assert [c["id"] for c in completions] == [r["id"] for r in rows]


def test_vllm_reasoning_field_is_read(tmp_path):
    make_prompts(tmp_path, 12)
    with spawn({"reasoning_field": "reasoning"}) as fake:  # vLLM's name for it
        write_params(tmp_path, server=url_server(fake.url, engine="vllm"))
        here(tmp_path)
        body = fake.stats()["last_body"]
    assert "request_id" in body and "rid" not in body and "separate_reasoning" not in body
    completions, _ = outputs(tmp_path)
    assert all(c["messages"][-1]["reasoning_content"] for c in completions)
    assert not any(c["truncated"] for c in completions)


def test_the_api_key_is_never_written_anywhere(tmp_path):
    make_prompts(tmp_path, 30)
    with spawn({"api_key": KEY, "rules": [{"fault": "bad_request", "match": "p00003$", "message": "bad"}]}) as fake:  # fmt: skip
        write_params(tmp_path, server=url_server(fake.url, api_key_env="FAKE_KEY"), limit=30, max_permanent_failures=1)
        proc = stage(tmp_path, FAKE_KEY=KEY)
        text = ok(proc)
        assert "first request" in text and "$FAKE_KEY" in text
        # the body as its first try goes: under the prompt id + "~1." + the run's tag
        assert re.search(r'"rid": "p\d+~1\.[0-9a-f]{16}"', text), text[-2000:]
        wrong = stage(tmp_path, FAKE_KEY="not-the-key")
        missing = stage(tmp_path)
    assert wrong.returncode == 1 and "401" in wrong.stderr
    assert missing.returncode == 1 and "FAKE_KEY is not set" in missing.stderr
    completions, failures = outputs(tmp_path)
    assert len(completions) == 29 and len(failures) == 1
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert leaks == []
    for p in (proc, wrong):
        assert KEY not in p.stdout + p.stderr


def test_limit_runs_the_first_prompts_and_prints_the_first_request(tmp_path, capsys):
    rows = make_prompts(tmp_path, 40)
    with spawn({"record_bodies": True}) as fake:
        write_params(tmp_path, server=url_server(fake.url), limit=3, seed=5)
        here(tmp_path)
        sent = fake.stats()["requests"]["p00000"]["body"]
    out = capsys.readouterr().out
    body = json.loads(out[out.index("{") :])
    assert body == sent  # the first try's, its request id included
    assert body["rid"].startswith("p00000~1.") and body["messages"] == rows[0]["messages"]
    assert body["max_tokens"] == 64 and body["seed"] == 5 and body["tools"] == rows[0]["tools"]
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    assert "Authorization: (none)" in out
    completions, _ = outputs(tmp_path)
    assert [c["id"] for c in completions] == ["p00000", "p00001", "p00002"]


def test_a_changed_sampling_param_starts_a_new_key_space_and_the_old_one_stays(tmp_path):
    make_prompts(tmp_path, 20)
    with spawn() as fake:
        write_params(tmp_path, server=url_server(fake.url), temperature=0.6)
        assert here(tmp_path)["sent"] == 20
        first = (tmp_path / "data/completions/completions.jsonl").read_bytes()
        write_params(tmp_path, server=url_server(fake.url), temperature=0.9)
        assert here(tmp_path)["sent"] == 20
        assert (tmp_path / "data/completions/completions.jsonl").read_bytes() != first
        write_params(tmp_path, server=url_server(fake.url), temperature=0.6)
        assert here(tmp_path)["sent"] == 0
        assert (tmp_path / "data/completions/completions.jsonl").read_bytes() == first
    assert len(list((tmp_path / ".cache/requests").iterdir())) == 2


@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"),
                                              (signal.SIGTERM, 143, "terminated")])
def test_ctrl_c_stops_cleanly_and_stops_the_launched_server(tmp_path, sig, code, word):
    rows = make_prompts(tmp_path, 120)
    # ~15 s of answers: the signal comes mid-run even when this test waits its turn for a CPU
    spec = {"latency": {"min": 0.3, "max": 0.7}}
    write_params(tmp_path, server=launch_server(tmp_path, spec), concurrency=4)
    proc = start_stage(tmp_path)
    deadline = time.monotonic() + 120
    while len(cache_entries(tmp_path)) < 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert word in err
    log_text = (tmp_path / ".cache/logs/generate-server.log").read_text()
    pid = int(log_text.split("fakeserver pid ")[1].split()[0])
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    kept = len(cache_entries(tmp_path))
    assert 10 <= kept < len(rows)
    spec["latency"] = 0.001
    write_params(tmp_path, server=launch_server(tmp_path, spec), concurrency=16)
    out = ok(stage(tmp_path))
    assert to_send(out) == len(rows) - kept
    completions, _ = outputs(tmp_path)
    assert len(completions) == len(rows)


def test_a_setup_the_server_rejects_stops_before_caching_failures(tmp_path):
    make_prompts(tmp_path, 60)
    with spawn({"rules": [{"fault": "bad_request", "message": "top_k is not supported"}]}) as fake:
        write_params(tmp_path, server=url_server(fake.url))
        with pytest.raises(StageError, match="top_k is not supported"):
            here(tmp_path)
    assert cache_entries(tmp_path) == []


@pytest.mark.parametrize(
    "server, message",
    [
        ({"url": "http://x", "launch": {"engine": "sglang", "model": "m"}}, "exactly one of generate.server.url"),  # fmt: skip
        ({}, "exactly one of generate.server.url"),
        ({"url": "localhost:3000"}, "generate.server.url"),
        ({"url": []}, "generate.server.url"),
        ({"url": "http://u:pw-secret-123@127.0.0.1:99999999"},
         r"'http://127.0.0.1:99999999' is not a valid URL \(Port out of range"),
        ({"url": ["http://127.0.0.1:8000", "http://:pw-secret-123@:8000/v1"]},
         r"'http://:8000/v1' is not a valid URL \(no host"),
        ({"url": "http://[::1:8000"}, "is not a valid URL"),
    ],
)
def test_server_params_errors_name_the_key(tmp_path, monkeypatch, server, message):
    monkeypatch.chdir(tmp_path)
    cfg = params.build(params.Generate, {"server": server}, "generate")
    with pytest.raises(StageError, match=message):
        generate.run(cfg, PATHS)


def test_other_params_errors_name_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for extra, message in [
        ({"limit": 0}, "generate.limit"),
        ({"concurrency": 0}, "generate.concurrency"),
        ({"request_timeout": -1}, "generate.request_timeout"),
    ]:
        with pytest.raises(StageError, match=message):  # from build, as the CLI loads them
            generate.run(params.build(params.Generate, {"server": {"url": "http://127.0.0.1:1"}, **extra},
                                 "generate"), PATHS)
    cfg = params.build(params.Generate, {"server": {"url": "http://127.0.0.1:1", "model": "m"}}, "generate")
    with pytest.raises(StageError, match="data/prompts/prompts.jsonl: not found"):
        generate.run(cfg, PATHS)
    (tmp_path / "data/prompts").mkdir(parents=True)
    (tmp_path / "data/prompts/prompts.jsonl").write_text('{"id": "a", "messages": []}\n')
    with pytest.raises(StageError, match="prompts.jsonl:1: 'messages'"):
        generate.run(cfg, PATHS)
    user = [{"role": "user", "content": "q"}]
    for row, message in [
        ({"messages": user, "tools": [1, "f"]}, "'tools' must be a list of objects"),
        ({"messages": [{"role": ["user"], "content": "q"}]}, r"messages\[0\] must be an object"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         r"messages\[0\].content\[0\]"),
        ({"messages": [{"role": "user", "content": "q \udfff"}]}, "text that is not valid Unicode"),
    ]:
        (tmp_path / "data/prompts/prompts.jsonl").write_text(json.dumps({"id": "a", **row}) + "\n")
        with pytest.raises(StageError, match=f"prompts.jsonl:1: {message}"):
            generate.run(cfg, PATHS)


@pytest.mark.slow
def test_real_transformers_serve_on_the_demo_model(tmp_path):
    """The stage launches `transformers serve` on the tiny demo model and gets real answers."""
    from tests.helpers.repo import prebuilt_caches

    prebuilt_caches()
    for sub in ("tokenizers", "demo-model"):
        (tmp_path / ".cache").mkdir(exist_ok=True)
        (tmp_path / ".cache" / sub).symlink_to(ROOT / ".cache" / sub)
    rows = make_prompts(tmp_path, 6)
    server = {"launch": {"engine": "transformers", "model": "demo:tiny-qwen3", "startup_timeout": 240}}  # fmt: skip
    write_params(tmp_path, server=server, limit=2, max_tokens=4, concurrency=2, seed=0)
    proc = stage(tmp_path, timeout=400)
    out = ok(proc)
    body = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert "rid" not in body and "top_k" not in body  # transformers serve rejects them (422)
    completions, failures = outputs(tmp_path)
    assert failures == [] and [c["id"] for c in completions] == [r["id"] for r in rows[:2]]
    for c in completions:
        assert c["model"] == "demo:tiny-qwen3" and c["finish_reason"] in ("stop", "length")
        assert 1 <= c["usage"]["completion_tokens"] <= 4
    r = report(tmp_path)
    assert r["server"]["engine"] == "transformers" and r["completed"] == 2
    assert "stopped transformers" in out


def test_a_list_of_urls_with_one_down_still_runs(tmp_path):
    rows = make_prompts(tmp_path, 40)
    dead = f"http://127.0.0.1:{free_port()}"
    with spawn({"latency": 0.01}) as fake:
        write_params(tmp_path, server={"url": [dead, fake.url + "/v1/"], "unreachable_deadline": 20})
        r = here(tmp_path)
        assert fake.stats()["completed"] == 40
    assert r["completed"] == 40 and r["server"]["urls"] == [dead, fake.url]
    assert [c["id"] for c in outputs(tmp_path)[0]] == [row["id"] for row in rows]


def test_an_empty_prompts_file_gives_empty_outputs(tmp_path):
    (tmp_path / "data/prompts").mkdir(parents=True)
    (tmp_path / "data/prompts/prompts.jsonl").write_text("")
    write_params(tmp_path, server={"url": "http://127.0.0.1:1", "model": "m"})
    r = here(tmp_path)
    assert r["requests"] == r["completed"] == r["failed"] == 0
    assert outputs(tmp_path) == ([], [])


def test_the_same_request_twice_is_sent_once_and_answers_both(tmp_path):
    rows = make_prompts(tmp_path, 10)
    rows.append({**rows[3], "id": "twin-of-3", "source": "other"})
    path = tmp_path / "data/prompts/prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with spawn() as fake:
        write_params(tmp_path, server=url_server(fake.url))
        r = here(tmp_path)
        assert fake.stats()["received"] == 10
    assert r["sent"] == 10 and r["completed"] == 11
    completions, _ = outputs(tmp_path)
    assert completions[-1]["id"] == "twin-of-3" and completions[-1]["source"] == "other"
    assert completions[-1]["messages"] == completions[3]["messages"]


def test_transient_failures_are_reported_and_retried_by_the_next_run(tmp_path):
    make_prompts(tmp_path, 20)
    with spawn({"rules": [{"fault": "queue_full", "match": "p0000[0-1]$"}]}) as fake:
        write_params(tmp_path, server=url_server(fake.url), max_retries=2, max_transient_failures=0.1)
        r = here(tmp_path)
        assert r["failed"] == r["failed_transient"] == 2 and r["completed"] == 18
        _, failures = outputs(tmp_path)
        assert [(f["id"], f["kind"], f["status"], f["attempts"]) for f in failures] == [
            ("p00000", "overloaded", 503, 3),
            ("p00001", "overloaded", 503, 3),
        ]
        fake.reset({})
        r = here(tmp_path)
    assert r["sent"] == 2 and r["completed"] == 20 and outputs(tmp_path)[1] == []


# ------------------------------------------------- unfinished runs, bad replies, secrets


def cache_records(wd: Path) -> list[dict]:
    recs = []
    for seg in sorted((wd / ".cache/requests").glob("*/seg-*.log")):
        for line in seg.read_bytes().splitlines():
            recs.append(json.loads(line[65:]))
    return recs


def test_total_transient_failure_exits_1_and_the_next_run_sends_only_what_failed(tmp_path):
    rows = make_prompts(tmp_path, 40)
    failing = {"rules": [{"fault": kind, "match": f"p0000[{digits}]$"}
                         for kind, digits in (("queue_full", "0-4"), ("rate_limit", "5-6"),
                                              ("error", "7"), ("malformed", "8-9"))]}  # fmt: skip
    with spawn(failing) as fake:
        write_params(tmp_path, server=url_server(fake.url), max_retries=1, max_retries_500=0)
        proc = stage(tmp_path)
        assert proc.returncode == 1
        (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert line.startswith("error: 10 of 40 requests still failing after retries")
        assert "(malformed 2, overloaded 7, server_error 1; e.g. HTTP 503 " in line
        assert "generate.max_transient_failures=0" in line and "dvc repro" in line
        assert "Traceback" not in proc.stderr
        # the outputs are there to inspect, the 30 answers are cached, nothing failed is
        assert report(tmp_path)["failed_transient"] == 10
        assert len(cache_entries(tmp_path)) == 30 and all(r["ok"] for r in cache_records(tmp_path))
        # a tolerance lets the same run finish
        write_params(tmp_path, server=url_server(fake.url), max_retries=0, max_retries_500=0,
                     max_transient_failures=0.25)  # fmt: skip
        assert here(tmp_path)["failed_transient"] == 10
        fake.reset({})
        write_params(tmp_path, server=url_server(fake.url))
        r = here(tmp_path)
        assert fake.stats()["received"] == 10
    assert r["sent"] == 10 and r["completed"] == 40 and r["failed"] == 0
    assert [c["id"] for c in outputs(tmp_path)[0]] == [row["id"] for row in rows]


def test_permanent_failures_have_their_own_tolerance(tmp_path):
    make_prompts(tmp_path, 40)
    rules = [{"fault": "context_length", "match": "p0000[0-1]$"},
             {"fault": "context_length", "match": "p00002$", "message": "too long \ud800"}]  # fmt: skip
    with spawn({"rules": rules}) as fake:
        write_params(tmp_path, server=url_server(fake.url))  # default: 1% of 40 = 0 allowed
        with pytest.raises(StageError) as err:
            here(tmp_path)
        msg = str(err.value)
        assert msg.startswith("3 of 40 requests failed permanently (context_overflow 3)")
        assert "above the 0 that generate.max_permanent_failures=0.01 allows" in msg
        assert "failures.jsonl" in msg
        failures = outputs(tmp_path)[1]  # written, for the user to look at
        assert len(failures) == 3 and failures[2]["message"] == "too long ?"
        for limit in (3, 0.075):
            write_params(tmp_path, server=url_server(fake.url), max_permanent_failures=limit)
            assert here(tmp_path)["sent"] == 0  # cached: data, never resent on its own
        write_params(tmp_path, server=url_server(fake.url), max_permanent_failures=2)
        with pytest.raises(StageError, match="above the 2 that generate.max_permanent_failures=2"):
            here(tmp_path)


@pytest.mark.parametrize("bad", [{"max_transient_failures": 1.5}, {"max_permanent_failures": -1},
                                 {"max_transient_failures": True}])  # fmt: skip
def test_tolerance_params_are_checked(tmp_path, monkeypatch, bad):
    monkeypatch.chdir(tmp_path)
    name = next(iter(bad))
    with pytest.raises(StageError, match=f"generate.{name}"):
        generate.run(params.build(params.Generate, {"server": {"url": "http://127.0.0.1:1"}, **bad}, "generate"), PATHS)


HOSTILE = ["content_dict", "content_number", "reasoning_number", "tool_calls_string",
           "bad_usage", "surrogate", "utf16", "no_choices", "malformed", "echo"]  # fmt: skip


def test_every_bad_reply_is_a_counted_failure_never_cached(tmp_path):
    rows = make_prompts(tmp_path, 30)
    rules = [{"fault": f, "match": f"p{i:05d}$", "message": "<html>oops"} for i, f in enumerate(HOSTILE)]
    with spawn({"rules": rules}) as fake:
        write_params(tmp_path, server=url_server(fake.url), max_retries=1, max_retries_500=1,
                     max_transient_failures=len(HOSTILE))  # fmt: skip
        r = here(tmp_path)
        assert r["completed"] == 20 and r["failed_transient"] == len(HOSTILE)
        assert r["failed_by_kind"] == {"bad_reply": 7, "malformed": 3}
        _, failures = outputs(tmp_path)
        assert [f["id"] for f in failures] == [f"p{i:05d}" for i in range(len(HOSTILE))]
        assert all(f["status"] == 200 and f["attempts"] == 2 for f in failures)
        assert "message.content is a number" in failures[1]["message"]
        assert "lone surrogate" in failures[5]["message"] and "not UTF-8" in failures[6]["message"]
        assert len(cache_entries(tmp_path)) == 20 and all(r["ok"] for r in cache_records(tmp_path))
        fake.reset({})
        r = here(tmp_path)
        assert fake.stats()["received"] == len(HOSTILE)
    assert r["completed"] == 30 and [c["id"] for c in outputs(tmp_path)[0]] == [x["id"] for x in rows]


def test_tool_calls_no_template_can_write_are_failures_never_cached(tmp_path):
    """Arguments that are not a JSON object, or a call without `function`: cached, they
    would stop tokenize on every run (or train on `<function=>`); a cache holding one
    from an earlier version drops it as damaged and sends the request again."""
    make_prompts(tmp_path, 6)
    bad = [{"function": {"name": "f", "arguments": "{not json"}}, {"name": "f", "arguments": "{}"},
           {"function": {"name": "f", "arguments": "[1,2]"}}]
    rules = [{"fault": "patch", "match": f"p{i:05d}$",
              "set": {"choices.0.message.tool_calls": [call]}} for i, call in enumerate(bad)]
    with spawn({"rules": rules}) as fake:
        write_params(tmp_path, server=url_server(fake.url), max_retries_500=1,
                     max_transient_failures=3)
        r = here(tmp_path)
        assert r["completed"] == 3 and r["failed_by_kind"] == {"bad_tool_call": 3}
        _, failures = outputs(tmp_path)
        assert "function.arguments is not JSON" in failures[0]["message"]
        assert "has no 'function' object" in failures[1]["message"]
        assert all(f["attempts"] == 2 for f in failures)
        assert len(cache_entries(tmp_path)) == 3
        # what an earlier version cached: a reply with such a call
        seg = next((tmp_path / ".cache/requests").rglob("seg-*.log"))
        lines = seg.read_bytes().splitlines(keepends=True)
        key, record = lines[0].split(b" ", 1)
        reply = json.loads(record)
        reply["reply"]["choices"][0]["message"]["tool_calls"] = [bad[2]]
        seg.write_bytes(b"".join([key + b" " + json.dumps(reply).encode() + b"\n", *lines[1:]]))
        fake.reset({})
        r = here(tmp_path)
        assert r["cache_damaged"] == 1 and fake.stats()["received"] == 4
        assert r["completed"] == 6


def test_a_server_that_always_answers_garbage_stops_the_run_in_one_line(tmp_path):
    make_prompts(tmp_path, 80)
    with spawn({"rules": [{"fault": "reasoning_number", "match": "[13579]$"}]}) as fake:
        with spawn({"rules": [{"fault": "tool_calls_string"}]}) as garbage:
            write_params(tmp_path, server=url_server(garbage.url), max_retries_500=1)
            proc = stage(tmp_path)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert "32 requests in a row got no well-formed reply" in line and "tool_calls" in line
        assert cache_entries(tmp_path) == []
        # garbage now and then is not a broken server: the run goes on
        write_params(tmp_path, server=url_server(fake.url), max_retries_500=0,
                     max_transient_failures=0.5, concurrency=4)  # fmt: skip
        r = here(tmp_path)
        assert r["completed"] == 40 and r["failed_by_kind"] == {"bad_reply": 40}


def damage(seg: Path) -> None:
    """Replace the first 9 records of a cache segment with 8 kinds of damage and a torn
    last line (what a killed run leaves)."""
    lines = seg.read_bytes().splitlines(keepends=True)
    key = lambda ln: ln[:65]  # noqa: E731
    bad = [
        key(lines[0]) + '{"ok":true,"reply":{"choices":[]}}'.encode("utf-16") + b"\n",
        key(lines[1]) + b'{"ok":true,"reply":5}\n',
        key(lines[2]) + b'{"ok":true,"reply":{"choices":[{"message":{"content":{"a":1}}}]}}\n',
        key(lines[3]) + b'{"ok":true,"reply":{"choices":[{"message":{"content":"\\ud800"}}]}}\n',
        key(lines[4]) + b'{"ok":false,"kind":3}\n',
        key(lines[5]) + b"[1, 2, 3]}\n",
        key(lines[6]) + b'{"ok":true,"reply":{"choices":[{"message":{"content":"cut',
        bytes(random.Random(7).randrange(256) for _ in range(300)).replace(b"\n", b"") + b"\n",
        b"\xff\xfe" + b"7" * 64 + b" {}\n",
    ]
    seg.write_bytes(b"".join(bad[:6]) + bad[7] + bad[8] + b"".join(lines[9:]) + bad[6])


def test_the_cache_reader_survives_any_bytes_and_resends_the_damaged_records(tmp_path):
    rows = make_prompts(tmp_path, 30)
    with spawn() as fake:
        write_params(tmp_path, server=url_server(fake.url), concurrency=1)
        here(tmp_path)
        before = (tmp_path / "data/completions/completions.jsonl").read_bytes()
        (seg,) = (tmp_path / ".cache/requests").glob("*/seg-*.log")
        damage(seg)
        fake.reset({})
        proc = stage(tmp_path)
        out = ok(proc)
        assert "Traceback" not in out
        assert fake.stats()["received"] == 9  # lines 0-8 were replaced; each request resent once
    assert "dropped 8 damaged record(s)" in out  # + a torn last line, which a kill leaves
    assert report(tmp_path)["cache_damaged"] == 8
    assert (tmp_path / "data/completions/completions.jsonl").read_bytes() == before
    assert len(outputs(tmp_path)[0]) == len(rows)


def test_an_edited_cache_record_is_resent_not_trained(tmp_path):
    """An answer edited in the cache, its line still valid JSON, fails its checksum: the
    request is sent again and the completions are those of an untouched cache."""
    make_prompts(tmp_path, 6)
    with spawn() as fake:
        write_params(tmp_path, server=url_server(fake.url), concurrency=1)
        here(tmp_path)
        before = (tmp_path / "data/completions/completions.jsonl").read_bytes()
        (seg,) = (tmp_path / ".cache/requests").glob("*/seg-*.log")
        lines = seg.read_bytes().splitlines(keepends=True)
        rec = json.loads(lines[2][65:])
        rec["reply"]["choices"][0]["message"]["content"] = "an answer nobody was sent"
        lines[2] = lines[2][:65] + json.dumps(rec, separators=(",", ":")).encode() + b"\n"
        seg.write_bytes(b"".join(lines))
        fake.reset({})
        out = ok(stage(tmp_path))
        assert fake.stats()["received"] == 1
    assert f"{seg.relative_to(tmp_path)}: 1 record(s) fail their checksum" in out
    assert report(tmp_path)["cache_damaged"] == 1
    assert (tmp_path / "data/completions/completions.jsonl").read_bytes() == before


SECRET_KEY = 'sk-live/5f0c+1e9a"77b2=4d3c 8e61\\aa02%b9d4/f3e7'  # JSON and URL forms differ
PASSWORD = "hunter2-correct-horse-battery"


def echo_rules(n_good_between: int = 1) -> list[dict]:
    """Rules for every other prompt: the secret in each form and position a server can put
    it, in every kind of reply (JSON and text errors, permanent and transient, a non-JSON
    200, a valid answer)."""
    refs = ["{key}", "{key_json}", "{key_url}", "{key[:20]}", "{key[9:]}", "{key[5:-5]}"]
    kinds = [("bad_request", 400), ("queue_full", 503), ("echo", 400), ("echo", 503),
             ("echo", 200), ("say", 200)]  # fmt: skip
    rules = []
    for ref in refs:
        for pad in (0, 487, 499, 5000):  # messages are cut at 500 characters
            for fault, status in kinds:
                message = "x" * pad + "bad key " + ref + " !"
                i = 2 * len(rules)
                rules.append({"fault": fault, "status": status, "match": f"p{i:05d}$", "message": message})  # fmt: skip
    return rules


def test_a_secret_echoed_everywhere_is_written_nowhere(tmp_path):
    rules = echo_rules()
    make_prompts(tmp_path, 2 * len(rules))
    lenient = dict(max_retries=0, max_retries_500=0, max_transient_failures=1.0,
                   max_permanent_failures=1.0)  # fmt: skip
    seen = []
    # the key, also served as the model name (server.model unset: asked from the server)
    with spawn() as fake:  # the rules are too long for a command line: sent after start
        fake.reset({"api_key": SECRET_KEY, "model": f"org/{SECRET_KEY}", "rules": rules})
        write_params(tmp_path, server=url_server(fake.url, api_key_env="FAKE_KEY"), **lenient)
        proc = stage(tmp_path, FAKE_KEY=SECRET_KEY)
        seen.append(ok(proc))
        r = report(tmp_path)
        assert r["failed"] == 5 * len(rules) // 6 and r["model"] == "org/***"
        fake.reset({"api_key": SECRET_KEY, "rules": [{"fault": "echo", "status": 403, "message": "{key} is not allowed"}]})  # fmt: skip
        write_params(tmp_path, server=url_server(fake.url, api_key_env="FAKE_KEY", model="m"), **lenient)
        proc = stage(tmp_path, FAKE_KEY=SECRET_KEY)
        assert proc.returncode == 1 and "HTTP 403: *** is not allowed" in proc.stderr
        seen.append(proc.stdout + proc.stderr)
    # URL credentials: the password is the secret the server echoes
    with spawn() as fake:
        fake.reset({"rules": rules})
        url = fake.url.replace("http://", f"http://alice:{PASSWORD}@")
        write_params(tmp_path, server=url_server(url, model="m2"), limit=7, **lenient)
        proc = stage(tmp_path)
        seen.append(ok(proc))
        assert report(tmp_path)["server"]["urls"] == [fake.url]
        write_params(tmp_path, server=url_server(url, api_key_env="FAKE_KEY"), **lenient)
        proc = stage(tmp_path, FAKE_KEY=SECRET_KEY)
        assert proc.returncode == 1 and "use one of them" in proc.stderr
        seen.append(proc.stdout + proc.stderr)
    pieces = secret_pieces(SECRET_KEY) | secret_pieces(PASSWORD)
    # everything but the params file, where the user wrote the URL with its password
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "params.yaml"]
    assert any(p.name == "failures.jsonl" for p in written) and any(".log" in p.name for p in written)
    for path in written:
        data = path.read_bytes()
        assert not [x for x in pieces if x.encode() in data], path
    for text in seen:
        assert "Traceback" not in text and not [x for x in pieces if x in text]


def test_dvc_records_no_version_until_every_request_is_answered(tmp_path):
    """The real dvc CLI: a run left with transient failures fails the stage, dvc.lock keeps
    no generate entry, and a plain `dvc repro` (no -f) later sends only what failed."""
    import re

    from tests.helpers.repo import demo_clone, run

    repo = demo_clone(tmp_path)
    with spawn({"rules": [{"fault": "queue_full", "prob": 0.5}]}) as fake:
        config = yaml.safe_load((repo / "params.yaml").read_text())
        config["generate"].update(
            server={"url": fake.url, "unreachable_deadline": 10}, max_retries=0,
            concurrency=4, backoff_base=0.02, backoff_max=0.1,
        )  # fmt: skip
        (repo / "params.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        out = run(["dvc", "repro", "generate"], repo, check=False, timeout=300)
        failed = re.search(r"error: (\d+) of (\d+) requests still failing after retries", out)
        assert failed, out[-3000:]
        n_failed, n = int(failed.group(1)), int(failed.group(2))
        assert 0 < n_failed < n and "Traceback" not in out
        lock = yaml.safe_load((repo / "dvc.lock").read_text()) if (repo / "dvc.lock").exists() else {}
        assert "prepare" in lock["stages"] and "generate" not in lock["stages"]
        fake.reset({})
        out = run(["dvc", "repro", "generate"], repo, timeout=300)
        assert "Running stage 'generate'" in out
        assert fake.stats()["received"] == n_failed  # answered requests came from the cache
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert "generate" in lock["stages"]
    assert len(outputs(repo)[0]) == n
    assert "up to date" in run(["dvc", "status", "generate"], repo)


# ------------------------------------------------------ real-engine behaviours (issue 11)


def test_the_stage_waits_for_a_worker_and_keys_the_cache_with_the_real_model(tmp_path):
    # sglang-router answers /health 200 with no worker and /v1/models 503 until one is up:
    # the model name that keys the cache must be the served one, never a placeholder
    rows = make_prompts(tmp_path, 20)
    with spawn({"model": "served-name", "no_worker_for": 2.5}) as fake:
        write_params(tmp_path, server=url_server(fake.url))
        r = here(tmp_path)
        assert fake.stats()["outcomes"].get("no_worker", 0) == 0  # nothing sent before it was up
    assert r["model"] == "served-name" and r["completed"] == len(rows)
    completions, _ = outputs(tmp_path)
    assert {c["model"] for c in completions} == {"served-name"}
    meta = [json.loads(p.read_text()) for p in (tmp_path / ".cache/requests").glob("*/meta.json")]
    assert [m["model"] for m in meta] == ["served-name"]


def test_no_worker_within_the_deadline_is_one_line(tmp_path):
    make_prompts(tmp_path, 5)
    with spawn({"no_worker_for": 120}) as fake:
        write_params(tmp_path, server=url_server(fake.url, unreachable_deadline=1.5))
        proc = stage(tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert "no model ready" in err and "unreachable_deadline" in err and "HTTP 503" in err
    assert cache_entries(tmp_path) == []


def long_prompts(wd: Path, words: tuple[int, int, int]) -> tuple[list[dict], Path]:
    """30 prompts, three of them `words` long, and a copy of them in wd/ref."""
    rows = make_prompts(wd, 30)
    for i, n in zip((3, 7, 9), words):
        rows[i]["messages"] = [{"role": "user", "content": "w " * n}]
    (wd / "data/prompts/prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ref = wd / "ref"
    ref.mkdir()
    shutil.copytree(wd / "data", ref / "data")
    return rows, ref


def engine_count(messages: list[dict]) -> int:
    """Prompt tokens as an engine counts them: transformers' own chat template path."""
    from stages.models.tokenizer import load_tokenizer

    tok = load_tokenizer("bundled:qwen3.6")
    return len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False, enable_thinking=True))


@pytest.mark.slow  # counts long prompts with the chat template
def test_prompts_are_fitted_to_the_served_context_before_sending(tmp_path):
    # the context comes from the fake's /v1/models max_model_len; each prompt is counted
    # locally: one near the context is sent once with max_tokens lowered to what is left
    # (no 400 first), ones leaving fewer than min_new_tokens are never sent (the fake
    # counts 4 + words per message, fewer than the render has, and refuses with a 400)
    rows, ref = long_prompts(tmp_path, (940, 980, 1000))
    near = engine_count(rows[3]["messages"])
    assert 16 <= 1000 - near < 64 and 1000 - engine_count(rows[7]["messages"]) < 16
    with spawn({"max_context": 1000, "record_bodies": True}) as fake, spawn({}) as roomy:
        write_params(tmp_path, server=url_server(fake.url), min_new_tokens=16, max_permanent_failures=2)
        write_params(ref, server=url_server(roomy.url), min_new_tokens=16)
        r = here(tmp_path)
        here(ref)
        reqs = fake.stats()["requests"]
    assert reqs["p00003"]["attempts"] == 1 and reqs["p00003"]["body"]["max_tokens"] == 1000 - near
    assert "p00007" not in reqs and "p00009" not in reqs  # zero requests
    assert all(reqs[r["id"]]["attempts"] == 1 and reqs[r["id"]]["body"]["max_tokens"] == 64
               for i, r in enumerate(rows) if i not in (3, 7, 9))  # fmt: skip
    completions, failures = outputs(tmp_path)
    assert [(f["id"], f["kind"], f["status"], f["attempts"]) for f in failures] == [
        ("p00007", "context_overflow", None, 0), ("p00009", "context_overflow", None, 0),
    ]  # fmt: skip
    assert f"is {engine_count(rows[9]['messages'])} tokens" in failures[1]["message"]
    assert "generate.min_new_tokens=16" in failures[0]["message"]
    assert r["failed_by_kind"] == {"context_overflow": 2} and len(completions) == 28
    assert r["clamped"] == 0 and r["sent"] == 28
    fit = r["context"]
    assert (fit["context_length"], fit["tokenizer"], fit["fitted"], fit["refused"]) == (
        1000, "bundled:qwen3.6", 1, 2)
    assert 3 <= fit["encoded"] < 10  # the byte bound settles short prompts unencoded
    # a fitted max_tokens is per request: every prompt keeps the key it has without one
    assert set(cache_entries(tmp_path)) == set(cache_entries(ref))


@pytest.mark.parametrize("fit", [{"tokenizer": None}, {"context_length": 4000}],
                         ids=["no-local-count", "context-param-too-large"])  # fmt: skip
@pytest.mark.slow  # counts long prompts with the chat template
def test_the_engines_context_error_still_clamps_when_the_local_fit_cannot(tmp_path, fit):
    # no tokenizer to count with, or a context_length larger than the server's: the
    # engine's 400 names both numbers and the request is resent once with what fits
    # (the fake counts 4 + words per message: 44, 84 and 104 tokens; context 96)
    rows, ref = long_prompts(tmp_path, (40, 80, 100))
    with spawn({"max_context": 96, "record_bodies": True}) as fake, spawn({}) as roomy:
        write_params(tmp_path, server=url_server(fake.url), min_new_tokens=16,
                     max_permanent_failures=2, **fit)  # fmt: skip
        write_params(ref, server=url_server(roomy.url), min_new_tokens=16)
        r = here(tmp_path)
        here(ref)
        reqs = fake.stats()["requests"]
    assert reqs["p00003"]["attempts"] == 2 and reqs["p00003"]["body"]["max_tokens"] == 52
    assert reqs["p00007"]["attempts"] == 1 and reqs["p00009"]["attempts"] == 1
    assert all(reqs[r["id"]]["attempts"] == 1 for i, r in enumerate(rows) if i not in (3, 7, 9))
    assert all(reqs[r["id"]]["body"]["max_tokens"] == 64 for i, r in enumerate(rows) if i != 3)
    completions, failures = outputs(tmp_path)
    assert [(f["id"], f["kind"], f["status"]) for f in failures] == [
        ("p00007", "context_overflow", 400), ("p00009", "context_overflow", 400),
    ]  # fmt: skip
    assert "maximum context length of 96 tokens" in failures[0]["message"]
    assert r["failed_by_kind"] == {"context_overflow": 2} and len(completions) == 28
    assert r["clamped"] == 1
    assert set(cache_entries(tmp_path)) == set(cache_entries(ref))


@pytest.mark.slow  # one answer takes 6 s by design
def test_a_healthy_engine_busy_with_long_decodes_is_not_restarted(tmp_path):
    # one request decodes for 6 s; nothing completes meanwhile, but /metrics shows
    # tokens coming and /health_generate answers: the watchdog must not restart it
    make_prompts(tmp_path, 12)
    spec = {"latency": 0.01, "rules": [{"fault": "slow", "match": "p00011$", "seconds": 6}]}
    write_params(tmp_path, server=launch_server(tmp_path, spec, watchdog_seconds=1.5), concurrency=4)
    out = ok(stage(tmp_path))
    completions, failures = outputs(tmp_path)
    assert len(completions) == 12 and failures == []
    assert report(tmp_path)["server"]["restarts"] == 0, out
    assert "the engine is generating: not restarting" in out


def test_a_hung_url_server_ends_the_run_in_bounded_time_keeping_its_answers(tmp_path):
    rows = make_prompts(tmp_path, 60)
    with spawn({"stall_after": 20, "latency": 0.01, "stall_health": "fail"}) as fake:
        server = url_server(fake.url, watchdog_seconds=1, hang_timeout=1.5)
        # waiting for the requests to time out would take many times longer than it may
        write_params(tmp_path, server=server, concurrency=4, request_timeout=600)
        t0 = time.monotonic()
        proc = stage(tmp_path)
        took = time.monotonic() - t0
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert "hung" in err and "hang_timeout=1.5" in err and "re-run" in err
    assert took < 120
    kept = len(cache_entries(tmp_path))
    assert kept >= 20
    with spawn({"latency": 0.005}) as fake:
        write_params(tmp_path, server=url_server(fake.url))
        assert to_send(ok(stage(tmp_path))) == len(rows) - kept


def test_the_report_says_whether_the_seed_is_honoured(tmp_path):
    make_prompts(tmp_path, 4)
    write_params(tmp_path, server=launch_server(tmp_path, {}), seed=5)
    out = ok(stage(tmp_path))
    assert report(tmp_path)["seed_honoured"] is False  # SGLang without the flag
    assert "--enable-deterministic-inference" in out
    for spec, engine, expected in [({"deterministic": True}, "sglang", True), ({}, "vllm", True)]:
        with spawn(spec) as fake:
            write_params(tmp_path, server=url_server(fake.url, engine=engine), seed=5)
            assert here(tmp_path)["seed_honoured"] is expected
    write_params(tmp_path, server=launch_server(tmp_path, {}), seed=None)
    assert here(tmp_path)["seed_honoured"] is None


def test_a_request_timeout_longer_than_the_routers_is_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    server = {"url": "http://127.0.0.1:1", "router_timeout": 1800}
    cfg = params.build(params.Generate, {"server": server, "request_timeout": 3600}, "generate")
    with pytest.raises(StageError, match=r"--request-timeout-secs 3660"):
        generate.run(cfg, PATHS)


def test_a_router_with_its_default_timeout_gets_a_warning_with_the_fix(tmp_path):
    make_prompts(tmp_path, 3)
    with spawn({"router": True}) as fake:
        write_params(tmp_path, server=url_server(fake.url), request_timeout=3600)
        out = ok(stage(tmp_path))
    assert "is an sglang-router" in out and "--request-timeout-secs 3660" in out
    with spawn({}) as fake:  # an engine: no warning
        write_params(tmp_path, server=url_server(fake.url), request_timeout=3600)
        assert "sglang-router" not in ok(stage(tmp_path))


@pytest.mark.parametrize("served", [5, {"a": 1}, "", "m\ud800", "m" * 5000, None])
def test_a_served_model_id_that_is_no_name_is_not_sent_nor_written(tmp_path, served):
    make_prompts(tmp_path, 3)
    with spawn() as fake:
        fake.reset({"models": {"object": "list", "data": [{"id": served}]}})
        write_params(tmp_path, server=url_server(fake.url))
        proc = stage(tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert "/v1/models lists no model: set generate.server.model" in line
    assert not (tmp_path / "data/completions").exists()
