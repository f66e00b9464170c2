"""Hostile input at every edge: a server, a file or a user that means harm (issue 26).

Each part asserts what a run must do whatever it is given: exit 1 with one line naming
the file or URL (no traceback), or a correct result; never a hang (every test is timed),
never a secret written in any encoding (every file written and the output scanned),
never an input changed in place. Properties are checked with Hypothesis over nested,
huge and mistyped JSON for each metadata file and probe body; stage runs are few.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import shutil
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from markdown_it import MarkdownIt

from stages import merge
from stages.common import outputs as stage_outputs
from stages.common import secrets
from stages.common.errors import StageError
from stages.common.params import INT32, MAX_PATH, Merge, Validate, check_ranges
from stages.dataset import fingerprint, lineage, rowcheck, setchecks
from stages.dataset.shards import list_shards
from stages.process import cli
from stages.serving import probes
from tests.helpers import stagecli
from tests.helpers.fakeserver import FakeServer, secret_pieces, spawn
from tests.helpers.generation import (
    launch_server,
    make_prompts,
    ok,
    outputs,
    report,
    stage,
    url_server,
    write_params,
)
from tests.helpers.sets import BASE_FP as FP, ids, rows, save

ROOT = Path(__file__).resolve().parents[1]
MERGE_PATHS = stagecli.paths("merge")
VALIDATE_PATHS = stagecli.paths("validate")
PROPERTY = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

# --------------------------------------------------------------------- hostile JSON

NASTY_TEXT = ["\ud800", "x" * 5000, "", "\n---\n# h\n<script>alert(1)</script>",
              "<img src=x onerror=alert(1)>", "`", "a|b", "../../etc/passwd", "\0", "NaN"]
leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
        | st.text(max_size=12) | st.sampled_from(NASTY_TEXT))
values = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)
# whole files that are no JSON object: nested past any limit, cut, binary, empty
JUNK = [b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 5000 + b"1" + b"}" * 5000, b"{", b"",
        b"\xff\xfe\x00", b"[1, 2]", b'"text"', b"1e999999", b"9" * 5000]


def shaped(skeleton: dict) -> st.SearchStrategy:
    """A JSON object like `skeleton` whose every value may be any other value instead."""
    def field(value):
        inner = shaped(value) if isinstance(value, dict) else st.just(value)
        return inner | values
    return st.fixed_dictionaries({k: field(v) for k, v in skeleton.items()},
                                 optional={"extra": values})


def files(skeleton: dict) -> st.SearchStrategy:
    """The bytes of a metadata file: mostly shaped like `skeleton`, sometimes junk."""
    return (shaped(skeleton).map(lambda d: json.dumps(d).encode())
            | st.sampled_from(JUNK))


def one_line_or_value(call):
    """Run `call`: it returns, or raises a StageError of one line; nothing else."""
    try:
        return call()
    except StageError as e:
        assert "\n" not in str(e) and len(str(e)) < 5000, str(e)
        return e


# ------------------------------------------------------------- metadata files

STATE = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": "f",
         "_indices_data_files": None}


@PROPERTY
@given(files(STATE) | st.lists(st.sampled_from(
    ["data-00000-of-00001.arrow", "fifo.arrow", "../x.arrow", "/etc/passwd", "", ".", "sub",
     "gone.arrow"]), max_size=4).map(
        lambda names: json.dumps({"_data_files": [{"filename": n} for n in names]}).encode()))
def test_any_state_json_lists_regular_files_of_its_folder_or_is_one_line(tmp_path, text):
    folder = tmp_path / "set"
    if not folder.exists():
        save(folder, rows(ids("a", 2)))
        os.mkfifo(folder / "fifo.arrow")
        (folder / "sub").mkdir()
    (folder / "state.json").write_bytes(text)
    started = time.monotonic()
    found = one_line_or_value(lambda: list_shards(folder))
    assert time.monotonic() - started < 5
    if not isinstance(found, StageError):
        assert all(p.parent == folder and p.is_file() for p in found), found


@PROPERTY
@given(files(FP | {"policy": {"max_seq_len": 64, "min_loss_tokens": 1}}),
       files(FP | {"policy": {"max_seq_len": 32, "min_loss_tokens": 2}}))
def test_any_fingerprint_pair_merges_into_limits_validate_can_use(tmp_path, base, new):
    (tmp_path / "base.json").write_bytes(base)
    (tmp_path / "new.json").write_bytes(new)
    read = [one_line_or_value(lambda p=p: fingerprint.read(tmp_path / p, True))
            for p in ("base.json", "new.json")]
    if any(isinstance(r, StageError) for r in read):
        return
    merged = fingerprint.widened(*read)
    findings = rowcheck.Findings(setchecks.DATASET_CHECKS, 3)
    (tmp_path / "fingerprint.json").write_text(json.dumps(merged))
    fp = setchecks.check_fingerprint(findings, tmp_path) or {}
    cfg = Validate(vocab_size=10, max_seq_len=None, min_loss_tokens=None)
    done = one_line_or_value(lambda: setchecks.limits(cfg, findings, fp, tmp_path))
    if not isinstance(done, StageError):
        check_ranges(done[0], "validate")  # whatever was recorded: a value in range


@PROPERTY
@given(files({"features": {"id": {"dtype": "string", "_type": "Value"}}}))
def test_any_dataset_info_is_a_finding_never_a_crash(tmp_path, text):
    (tmp_path / "dataset_info.json").write_bytes(text)
    findings = rowcheck.Findings(setchecks.DATASET_CHECKS, 3)
    setchecks.check_info(findings, tmp_path)


@PROPERTY
@given(files({"merged": {"rows": 10}}))
def test_any_merge_report_gives_a_row_count_or_a_finding(tmp_path, text):
    (tmp_path / "merge.json").write_bytes(text)
    findings = rowcheck.Findings(setchecks.DATASET_CHECKS, 3)
    expected = setchecks.check_row_count(findings, 10, tmp_path, tmp_path / "merge.json")
    assert (expected == 10) or not findings.checks["row_count"]["passed"]
    assert expected is None or (type(expected) is int and expected >= 0)


GENERATE = {"model": "m", "sampling": "h", "sampling_params": {"temperature": 0.6},
            "requests": 3, "failed_by_kind": {"timeout": 1}, "sources": {"s": {"completed": 1}},
            "server": {"engine": "sglang", "version": "1", "args": ["--tp", "8"],
                       "urls": ["http://h:1"], "url": "http://h:2", "model": "m"}}
PREPARE = {"sources": {"s": {"read": 3, "kept": 2, "dropped_by_reason": {"empty": 1}}}}
TOKENIZE = {"sources": {"s": {"conversations": 1, "rows": 1, "tokens": 5, "dropped": {}}}}
HISTORY = {"history": [{"version": 1, "rows": 3, "model": "m", "note": "n", "created": "c",
                        "git_commit": "abc"}]}
MERGE_REPORT = {
    "base": {"path": "data/base", "present": True, "rows": 3, "tokens": 9, "loss_tokens": 3,
             "shards": 1, "bytes": 1},
    "new": {"path": "data/tokenized", "rows": 2, "tokens": 6, "loss_tokens": 2, "shards": 1,
            "bytes": 1},
    "merged": {"rows": 5, "tokens": 15, "loss_tokens": 5, "shards": 2, "bytes": 2},
    "duplicates": {"policy": "keep-base", "ids": 0, "base_rows": 0, "new_rows": 0,
                   "dropped_base_rows": 0, "dropped_new_rows": 0},
}
CARD = MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"])


def card_markup(text: str) -> tuple:
    """(headings, links, images, html) of a card's body as a renderer sees it."""
    body = text.split("\n---\n", 1)[1]
    tokens = CARD.parse(body)
    inline = [c for t in tokens if t.type == "inline" for c in t.children or []]
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    headings = [re.sub(r"version \d+$", "version N", h) for h in headings]
    html = [t for t in tokens + inline if t.type.startswith("html") or t.type == "hr"]
    return (headings, sum(t.type == "link_open" for t in inline),
            sum(t.type == "image" for t in inline), html)


@pytest.fixture
def card_repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports").mkdir()
    (tmp_path / "base").mkdir()
    (tmp_path / "base/state.json").write_text('{"_fingerprint": "s"}')
    return tmp_path


def write_card_inputs(root: Path, generate, prepare, tokenize, history, lock) -> None:
    for name, doc in (("generate", generate), ("prepare", prepare), ("tokenize", tokenize)):
        (root / f"reports/{name}.json").write_bytes(doc)
    (root / "base/lineage.json").write_bytes(history)
    (root / "dvc.lock").write_bytes(lock)


def build_card(root: Path, recorded: dict):
    path = root / "fingerprint.json"  # read as merge reads the new rows' fingerprint
    path.write_text(json.dumps(recorded))
    read = fingerprint.read(path, required=True)
    lin = lineage.build(copy.deepcopy(MERGE_REPORT), read, Path("base"), "st", MERGE_PATHS)
    text = lineage.card(lin, MERGE_PATHS)
    json.dumps(lin, ensure_ascii=False).encode("utf-8")  # lineage.write can write both
    text.encode("utf-8")
    return lin, text


def benign_markup(root: Path) -> list:
    """The markup of a card built from well-formed facts: what every card must keep."""
    write_card_inputs(root, *(json.dumps(d).encode() for d in (GENERATE, PREPARE, TOKENIZE,
                                                               HISTORY)), b"stages: {}\n")
    headings, links, images, html = card_markup(build_card(root, FP)[1])
    # links: the loader's docs and the samples page validate writes
    assert html == [] and links == 2 and images == 2 and headings[0].startswith("distill-data")
    return [headings, links, images]


@PROPERTY
@given(files(GENERATE), files(PREPARE), files(TOKENIZE), files(HISTORY),
       st.sampled_from([b"stages: {}\n", b"[" * 50_000, b"a: &a [*a]\n", b"\xff",
                        yaml.safe_dump({"stages": {"s": {"outs": [{"path": "data/prompts",
                                                                   "md5": "`<b>x</b>`"}]}}})
                        .encode()]),
       shaped(FP))
def test_any_reports_and_base_history_make_a_card_with_our_markup_only(
        card_repo, generate, prepare, tokenize, history, lock, fingerprint):
    benign = benign_markup(card_repo)
    write_card_inputs(card_repo, generate, prepare, tokenize, history, lock)
    built = one_line_or_value(lambda: build_card(card_repo, fingerprint))
    if isinstance(built, StageError):
        return
    lin, text = built
    headings, links, images, html = card_markup(text)
    assert [headings, links, images] == benign and html == [], text
    header = lineage.front_matter(text, Path("README.md"))
    assert header["distill_data"]["history"] == json.loads(json.dumps(lin["history"]))


def test_a_hostile_model_id_and_base_history_stay_text_in_the_card(card_repo):
    evil = "m\n---\n# owned\n<script>alert(1)</script> ``` <img src=x onerror=alert(1)> [x](y)"
    generate = dict(GENERATE, model=evil, server=dict(GENERATE["server"], args=[evil]))
    history = {"history": [{"version": 1, "rows": 3, "model": evil, "note": evil,
                            "created": evil, "git_commit": evil}]}
    benign = benign_markup(card_repo)
    write_card_inputs(card_repo, json.dumps(generate).encode(), json.dumps(PREPARE).encode(),
                      json.dumps({"sources": {evil: {"rows": 1}}}).encode(),
                      json.dumps(history).encode(), b"stages: {}\n")
    lin, text = build_card(card_repo, FP)
    headings, links, images, html = card_markup(text)
    assert [headings, links, images] == benign and html == []
    header = lineage.front_matter(text, Path("README.md"))
    assert header["distill_data"]["model"] == evil
    assert header["distill_data"]["history"][0]["model"] == evil


# -------------------------------------------------------------------- probes


@pytest.fixture(scope="module")
def probed():
    server = FakeServer().start()
    yield server
    server.stop()


def probe_all(url: str, models: bool) -> None:
    """Every probe of a server, each bounded; they answer "cannot tell", never raise."""
    started = time.monotonic()
    assert probes.seed_honoured("sglang", url, None) in (True, False, None)
    assert probes.is_router(url, None, 1.0) in (True, False)
    context = probes.served_context([url], "fake-model", None)
    assert context is None or 0 < context <= INT32
    tokens = probes.generation_tokens(url, None, 2.0)
    assert tokens is None or isinstance(tokens, float)
    assert probes.engine_healthy(url, "sglang", "fake-model", None, 2.0) in (True, False)
    probe = probes.GenerationProbe(url, "sglang", "fake-model", None)
    assert probe.evidence(2.0) in ("tokens", "health", None)
    if models:
        ready_or_one_line(url)
    assert time.monotonic() - started < 60


def ready_or_one_line(url: str) -> None:
    try:
        name = asyncio.run(probes.wait_ready([url], 1.0))
    except StageError as e:
        assert "\n" not in str(e) and url in str(e)
    else:
        assert name is None or (isinstance(name, str) and 0 < len(name) <= MAX_PATH)


ENDPOINTS = ["/v1/models", "/get_server_info", "/workers", "/metrics", "/health_generate"]


@pytest.mark.slow  # 25 bodies, every probe of each: about 10 s
@settings(PROPERTY, max_examples=25)
@given(st.sampled_from(ENDPOINTS), values.map(json.dumps) | st.sampled_from(
    [j.decode("latin-1") for j in JUNK]) | st.integers(101, 5000).map(lambda d: "[" * d + "]" * d)
    | shaped({"data": [{"id": "m", "max_model_len": 4096}]}).map(json.dumps))
def test_any_probe_body_is_read_bounded_and_never_raises(probed, path, body):
    probed.reset({"endpoints": {path: {"body": body}}})
    probe_all(probed.url, models=path == "/v1/models")


@pytest.mark.parametrize("answer", [{"nested": 200_000}, {"bytes": 20 << 20}, {"endless": True},
                                    {"trickle": 0.2}, {"hang": True}])
def test_endless_huge_slow_and_silent_probes_end_in_bounded_time(probed, answer):
    probed.reset({"endpoints": {p: answer for p in ENDPOINTS}})
    started = time.monotonic()
    assert probes.generation_tokens(probed.url, None, 1.0) is None
    # a body nested past the limit still comes with a 200: /health_generate needs no body
    assert probes.engine_healthy(probed.url, "sglang", "m", None, 1.0) is ("nested" in answer)
    assert probes.is_router(probed.url, None, 1.0) is False
    assert time.monotonic() - started < 30
    ready_or_one_line(probed.url)
    assert time.monotonic() - started < 90


# ----------------------------------------------------------- secrets, end to end

KEY = 'sk-hostile/7e41+c09b"d2=8fa5 \\91c3%e6d0'  # every encoding spells it differently
TOKEN = "tok-url-only-4b9d2e77c1"
# each rule: a way for a server to echo what a request carried
ECHOES = [
    {"fault": "say", "message": "{key_ujson}"},  # the escapes as text in an answer
    {"fault": "say", "message": "{key_b64} / {auth_b64} / {key_pct}"},
    {"fault": "raw", "body": '{"id": "r", "object": "chat.completion", "x": "{key}", "x": 0,'
     ' "choices": [{"index": 0, "message": {"role": "assistant", "content": "a {key_ujson}",'
     ' "reasoning_content": "{auth_b64}"}, "finish_reason": "stop"}],'
     ' "usage": {"prompt_tokens": 2, "completion_tokens": 2}}'},
    {"fault": "raw", "status": 400, "body": '{"message": "bad {key_ujson} {key_b64}"}'},
    {"fault": "raw", "status": 503, "body": '{"error": {"message": "{auth_b64}"}, "k": 1}'},
    {"fault": "echo", "status": 400, "message": "{key_pct} {auth_b64} {key[3:20]}"},
    {"fault": "echo", "status": 200, "message": "{key_ujson} not json"},
    {"fault": "raw", "status": 200, "body": '{"detail": "{key_b64}"}'},  # not a reply
    {"fault": "say", "message": "{key_hex} {key_html} {key_htmlx}"},  # issue 32
    {"fault": "echo", "status": 400, "message": "<p>{key_html}</p> {key_hex[2:30]}"},
]


def echo_rules() -> list[dict]:
    return [dict(rule, match=f"p{i:05d}$") for i, rule in enumerate(ECHOES)]


def leaks(root: Path, texts: list[str], secret: str) -> list[str]:
    pieces = secret_pieces(secret)
    found = [str(p) for p in root.rglob("*") if p.is_file() and p.name != "params.yaml"
             and any(x.encode() in p.read_bytes() for x in pieces)]
    return found + [t[:200] for t in texts if any(x in t for x in pieces)]


def test_a_secret_echoed_in_every_encoding_is_written_nowhere(tmp_path):
    make_prompts(tmp_path, 2 * len(ECHOES))
    lenient = dict(max_retries=0, max_retries_500=0, max_transient_failures=1.0,
                   max_permanent_failures=1.0)
    seen = []
    with spawn({"api_key": KEY, "rules": echo_rules()}) as fake:
        write_params(tmp_path, server=url_server(fake.url, api_key_env="FAKE_KEY"), **lenient)
        proc = stage(tmp_path, FAKE_KEY=KEY)
        seen.append(ok(proc))
    completions, failures = outputs(tmp_path)
    assert len(completions) + len(failures) == 2 * len(ECHOES)
    assert "***" in json.dumps(completions) and "***" in json.dumps(failures)
    # a token-only URL: the token is what the server echoes back
    with spawn({"rules": echo_rules()}) as fake:
        url = fake.url.replace("http://", f"http://{TOKEN}@")
        write_params(tmp_path, server=url_server(url, model="m"), cache_dir=".cache/tok",
                     **lenient)
        proc = stage(tmp_path)
        seen.append(ok(proc))
        assert report(tmp_path)["server"]["urls"] == [fake.url]
    for text in seen:
        assert "Traceback" not in text
    assert leaks(tmp_path, seen, KEY) == [] and leaks(tmp_path, seen, TOKEN) == []


def test_a_launched_engine_gets_no_copy_of_the_key_and_its_log_is_redacted(tmp_path):
    make_prompts(tmp_path, 4)
    spec = {"api_key": KEY, "startup_message":
            "env {env_keys}; args --api-key {key} {key_b64} {auth_b64} {key_ujson}"}
    log = tmp_path / ".cache/logs/generate-server.log"
    write_params(tmp_path, server=launch_server(tmp_path, spec, api_key_env="FAKE_KEY"))
    out = ok(stage(tmp_path, FAKE_KEY=KEY, COPY_OF_KEY=f"x{KEY}x"))
    assert "env []; args --api-key ***" in log.read_text()
    # vLLM reads VLLM_API_KEY as its own --api-key: that one variable it keeps
    server = launch_server(tmp_path, spec, api_key_env="VLLM_API_KEY")
    server["launch"]["engine"] = "vllm"
    write_params(tmp_path, server=server, cache_dir=".cache/vllm")  # sent, not cached
    out += ok(stage(tmp_path, VLLM_API_KEY=KEY, COPY_OF_KEY=KEY))
    assert 'env ["VLLM_API_KEY"]' in log.read_text()
    assert leaks(tmp_path, [out], KEY) == []


def test_the_values_of_secret_engine_flags_are_written_nowhere(tmp_path):
    """A Hub token or admin key passed as an engine flag, in any spelling the engine's
    parser takes: an engine logs its own arguments (SGLang its whole ServerArgs; the fake
    server the flags it ignores), and the report and card list the launch args."""
    make_prompts(tmp_path, 2)
    flags = {"--admin-api-key": "ADMIN-SECRET-1111aaaa", "--api_key": "UNDERSCORE-2222bbbb",
             "--hf-token": "hf_TOKEN_SECRET_3333cccc"}
    server = launch_server(tmp_path, {})
    server["launch"]["args"] = [x for pair in flags.items() for x in pair]
    write_params(tmp_path, server=server)
    out = ok(stage(tmp_path))
    log = (tmp_path / ".cache/logs/generate-server.log").read_text()
    assert "ignoring ['--admin-api-key', '***', '--api_key', '***'" in log
    assert report(tmp_path)["server"]["args"][1::2] == ["***"] * 3
    for value in flags.values():
        assert leaks(tmp_path, [out], value) == []


# ------------------------------------------------------------------- hangs


def test_a_launched_engine_whose_chat_hangs_while_health_passes_is_restarted(tmp_path):
    make_prompts(tmp_path, 24)
    spec = {"stall_after": 6, "stall_health": "ok", "latency": 0.01,
            "once_file": str(tmp_path / "stalled-once")}
    server = launch_server(tmp_path, spec, watchdog_seconds=1, max_restarts=2)
    write_params(tmp_path, server=server, request_timeout=2, max_retries=50, concurrency=4)
    started = time.monotonic()
    out = ok(stage(tmp_path, timeout=120))
    assert time.monotonic() - started < 90
    r = report(tmp_path)
    assert r["completed"] == 24 and r["server"]["restarts"] == 1, out
    assert "requests hang" in r["server"]["restart_reasons"][0]


def test_a_url_server_whose_chat_hangs_while_health_passes_ends_the_run(tmp_path):
    make_prompts(tmp_path, 30)
    with spawn({"stall_after": 5, "stall_health": "ok", "latency": 0.01}) as fake:
        server = url_server(fake.url, watchdog_seconds=1, hang_timeout=1)
        write_params(tmp_path, server=server, request_timeout=2, max_retries=50, concurrency=4)
        started = time.monotonic()
        proc = stage(tmp_path, timeout=120)
    assert time.monotonic() - started < 60
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert "hung" in line and fake.url in line


def fifo_at(root: Path, rel: str) -> None:
    path = root / rel
    if path.exists():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)


def merged_repo(root: Path) -> None:
    save(root / "data/merged", rows(ids("m", 6)), shards=2)
    (root / "reports").mkdir(exist_ok=True)
    (root / "reports/merge.json").write_text(json.dumps({"merged": {"rows": 6}}))
    (root / "params.yaml").write_text(yaml.safe_dump(
        {"validate": {"vocab_size": 100, "max_seq_len": 64, "min_loss_tokens": 1,
                      "train_check": {"enabled": False}},
         "merge": {"base": "data/base"}}))


@pytest.mark.parametrize("stage_name, fifo, named", [
    ("validate", "data/merged/data-00001-of-00002.arrow", "data-00001-of-00002.arrow"),
    ("validate", "data/merged/state.json", "state.json"),
    ("validate", "data/merged/dataset_info.json", "dataset_info.json"),
    ("validate", "data/merged/fingerprint.json", "fingerprint.json"),
    ("validate", "reports/merge.json", "merge.json"),
    ("merge", "data/base/data-00000-of-00002.arrow", "data-00000-of-00002.arrow"),
    ("merge", "data/base/fingerprint.json", "fingerprint.json"),
    ("merge", "data/base/lineage.json", "lineage.json"),
    ("merge", "data/tokenized/state.json", "state.json"),
    ("merge", "reports/generate.json", "generate.json"),
])  # fmt: skip
def test_a_fifo_named_like_a_shard_or_metadata_is_one_line_not_a_hang(tmp_path, stage_name,
                                                                       fifo, named):
    merged_repo(tmp_path)
    save(tmp_path / "data/base", rows(ids("b", 4)), shards=2)
    save(tmp_path / "data/tokenized", rows(ids("n", 3)))
    fifo_at(tmp_path, fifo)
    started = time.monotonic()
    line, _ = stagecli.fail(stage_name, tmp_path, timeout=120)
    assert named in line and time.monotonic() - started < 110
    assert stat_is_fifo(tmp_path / fifo)  # read, never replaced


def stat_is_fifo(path: Path) -> bool:
    import stat

    return stat.S_ISFIFO(os.lstat(path).st_mode)


def test_validate_with_a_fifo_shard_honours_sigterm_and_ends(tmp_path):
    merged_repo(tmp_path)
    fifo_at(tmp_path, "data/merged/data-00000-of-00002.arrow")
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(stagecli.command("validate"), cwd=tmp_path, env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)  # TimeoutExpired: it ignored SIGTERM too
        pytest.fail("validate blocked on the FIFO")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr.read()


@pytest.mark.parametrize("name", ["completions", "prompts"])
def test_a_fifo_as_the_rows_file_is_one_line(tmp_path, name):
    stage_name = {"completions": "tokenize", "prompts": "generate"}[name]
    fifo_at(tmp_path, f"data/{name}/{name}.jsonl")
    params = {"tokenize": {}, "generate": {"server": {"url": "http://127.0.0.1:9", "model": "m"}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({stage_name: params[stage_name]}))
    line, _ = stagecli.fail(stage_name, tmp_path, timeout=120)
    assert f"{name}.jsonl" in line


# --------------------------------------------------- values out of their range


def test_validate_names_a_mistyped_row_count_and_an_overflowing_limit(tmp_path, monkeypatch):
    merged_repo(tmp_path)
    (tmp_path / "reports/merge.json").write_text('{"merged": {"rows": "6"}}')
    fp = json.loads((tmp_path / "data/merged/fingerprint.json").read_text())
    fp["policy"] = {"max_seq_len": 2**70, "min_loss_tokens": 1}
    fp["tokenizer"]["vocab_size"] = 100
    (tmp_path / "data/merged/fingerprint.json").write_text(json.dumps(fp))
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    params["validate"]["max_seq_len"] = None
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    line, _ = stagecli.fail("validate", tmp_path)
    assert "validate.max_seq_len: null" in line
    params["validate"]["max_seq_len"] = 64
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    line, _ = stagecli.fail("validate", tmp_path)
    assert "row_count" in line and "fingerprint" in line
    checks = json.loads((tmp_path / "reports/validate.json").read_text())["checks"]
    assert 'merged.rows is "6"' in checks["row_count"]["examples"][0]
    assert "policy.max_seq_len must be >= 1 and <= 2147483647" in checks["fingerprint"]["examples"][0]


def test_merge_refuses_a_base_limit_that_no_tokenize_could_have_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save(tmp_path / "data/base", rows(ids("b", 4)), fingerprint=FP | {
        "policy": {"max_seq_len": 2**70}})
    save(tmp_path / "data/tokenized", rows(ids("n", 3)), fingerprint=FP | {
        "policy": {"max_seq_len": 64}})
    with pytest.raises(StageError, match=r"data/base/fingerprint\.json: policy\.max_seq_len "
                                         r"must be >= 1 and <= 2147483647"):
        merge.run(Merge(base="data/base"), MERGE_PATHS)
    assert not (tmp_path / "data/merged").exists()


# ------------------------------------------------------ a careless user's params


@pytest.mark.parametrize("cache_dir", ["data/completions/cache", "data/completions",
                                       "data/merged/x", "reports/cache", "data/prompts/c"])
def test_a_request_cache_inside_a_folder_the_pipeline_writes_is_refused(tmp_path, cache_dir):
    make_prompts(tmp_path, 3)
    write_params(tmp_path, server=url_server("http://127.0.0.1:9"), cache_dir=cache_dir)
    line, _ = stagecli.fail("generate", tmp_path)
    assert line.startswith(f"error: generate.cache_dir: {cache_dir} is inside ")
    assert not (tmp_path / "data/completions").exists()
    assert not (tmp_path / cache_dir).exists()


# ------------------------------------------------- one rule for where a stage writes

parts = st.lists(st.sampled_from(["a", "b", "sub", ".", ".."]), min_size=1, max_size=4)


@PROPERTY
@given(parts, parts, st.booleans())
def test_an_input_inside_or_holding_a_replaced_folder_is_refused_whatever_its_spelling(
        tmp_path, given, replaced, through_link):
    """outputs.check_apart, the one rule: refused exactly when the two real paths nest,
    however the paths are spelled (dots, a link to the input)."""
    root = tmp_path / "r"
    (root / "w/x").mkdir(parents=True, exist_ok=True)
    if not (root / "link").is_symlink():
        (root / "link").symlink_to(root / "w/x")
    start = root / ("link" if through_link else "w/x")
    a, b = start.joinpath(*given), root.joinpath("w/x", *replaced)
    real_a, real_b = Path(os.path.realpath(a)), Path(os.path.realpath(b))
    nested = real_a.is_relative_to(real_b) or real_b.is_relative_to(real_a)
    found = one_line_or_value(lambda: stage_outputs.check_apart({"merge.base": a}, [("--out", b)]))
    assert isinstance(found, StageError) == nested, (a, b)
    if nested:
        assert str(a) in str(found) and str(b) in str(found)


@pytest.mark.parametrize("stage_name, params_doc, named", [
    ("merge", {"merge": {"base": "data/merged/sub"}}, "merge.base: data/merged/sub is inside"),
    ("merge", {"merge": {"base": "data"}}, "--out data/merged is inside merge.base data"),
    ("validate", {"validate": {}}, None),
])
def test_a_base_inside_the_merged_set_is_refused_before_anything_is_replaced(
        tmp_path, stage_name, params_doc, named):
    """Issue 32's data loss: the base inside data/merged went with it on the next run."""
    merged_repo(tmp_path)
    save(tmp_path / "data/merged/sub", rows(ids("b", 4)))
    save(tmp_path / "data/tokenized", rows(ids("n", 3)))
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "data").rglob("*"))
    if stage_name == "validate":  # its plots folder is what it replaces
        (tmp_path / "reports/plots").mkdir(parents=True)
        shutil.move(tmp_path / "data/merged", tmp_path / "reports/plots/merged")
        (tmp_path / "params.yaml").write_text(yaml.safe_dump({"validate": {}}))
        proc = subprocess.run(
            [*stagecli.command("validate")[:3], "--merged", "reports/plots/merged",
             "--reports", "reports"], cwd=tmp_path, capture_output=True, text=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1"), timeout=300)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert "--merged: reports/plots/merged is inside the plots folder" in line
        assert (tmp_path / "reports/plots/merged/sub/state.json").is_file()
        return
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params_doc))
    line, _ = stagecli.fail(stage_name, tmp_path)
    assert named in line, line
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "data").rglob("*")) == before


def test_adopt_with_a_missing_base_is_an_error_not_a_first_version(tmp_path):
    save(tmp_path / "data/tokenized", rows(ids("n", 3)))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(
        {"merge": {"base": "data/bsae", "adopt": True}}))
    line, _ = stagecli.fail("merge", tmp_path)
    assert "merge.base data/bsae: not found, and merge.adopt is true" in line
    assert not (tmp_path / "data/merged").exists()


@pytest.mark.parametrize("stage_name, key, value", [
    ("tokenize", "tokenizer", "data/tokenized/tok"),
    ("tokenize", "chat_template", "data/tokenized/t.jinja"),
    ("generate", "cache_dir", "data"),
])
def test_other_stages_inputs_keep_out_of_what_they_replace(tmp_path, stage_name, key, value):
    make_prompts(tmp_path, 2)
    (tmp_path / "data/completions").mkdir(parents=True)
    (tmp_path / "data/completions/completions.jsonl").write_text("")
    section = {key: value}
    if stage_name == "generate":
        section["server"] = {"url": "http://127.0.0.1:9", "model": "m"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({stage_name: section}))
    line, _ = stagecli.fail(stage_name, tmp_path)
    assert f"{value}" in line and "is inside" in line, line


# ------------------------------------------------ one redactor for everything written

SCHEMES = ["s3", "https", "hf", "gs", "az", "ftp", "git+ssh", "x-custom"]
PARAMS = ["Signature", "X-Amz-Signature", "X-Amz-Credential", "X-Amz-Security-Token", "sig",
          "token", "X-Goog-Signature", "access_token", "api_key", "password"]
secret_word = st.text(st.sampled_from(string.ascii_letters + string.digits + "-_.~+%"),
                      min_size=8, max_size=30)


def with_credential(scheme: str, form: str, secret: str, param: str) -> str:
    return {"userinfo": f"{scheme}://user:{secret}@bucket/x",
            "token": f"{scheme}://{secret}@host/x",
            "path": f"{scheme}://datasets/u:{secret}@org/name",
            "param": f"{scheme}://host/x.parquet?a=1&{param}={secret}&b=2"}[form]


@PROPERTY
@given(secret_word, st.sampled_from(SCHEMES), st.sampled_from(["userinfo", "token", "path",
       "param"]), st.sampled_from(PARAMS), st.booleans(),
       st.sampled_from(["", "merge.base ", "error: cannot read (", "'", '"', "<", "\n"]))
def test_a_credential_in_any_url_is_found_by_shape_and_told_in_every_encoding(
        secret, scheme, form, param, through_pathlib, around):
    """secrets.WRITTEN's shape rules find the credential without being told (pathlib's
    `s3:/` included); once told (tell_params), every encoding of it is masked too."""
    url = with_credential(scheme, form, secret, param)
    shown = str(Path(url)) if through_pathlib else url
    assert secret not in secrets.Redactor()(f"{around}{shown}{around}"), shown
    told = secrets.Redactor()
    told.add(secrets.credentials_in(url))
    for encoded in (secret.encode().hex(), "".join(f"&#{ord(c)};" for c in secret),
                    json.dumps({"k": secret})):
        assert secret.encode().hex() not in told(f"x {encoded} y")
        assert secret not in told(f"x {encoded} y")


@pytest.mark.parametrize("text", ["a:/" * 30000 + "@", "&" + "signature" * 8000 + " =",
                                  "x:/" + "/a" * 50000 + "@", "/" + ":" * 100000 + "@",
                                  ("?token=" + "a" * 10 + "&") * 20000])
def test_the_redactor_reads_a_long_hostile_text_in_one_pass(text):
    """Every log line, error and server body goes through it: no pattern may backtrack
    over the text (a quadratic one took 86 s on the first of these)."""
    started = time.monotonic()
    secrets.Redactor(["sk-some-key-123"])(text)
    assert time.monotonic() - started < 5


def test_an_api_key_with_a_control_character_is_one_line_naming_the_variable(tmp_path):
    make_prompts(tmp_path, 2)
    write_params(tmp_path, server=url_server("http://127.0.0.1:9", api_key_env="FAKE_KEY"))
    proc = stage(tmp_path, FAKE_KEY=KEY + "\r")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert "FAKE_KEY" in line and "control" in line and "'\\r'" in line
    assert leaks(tmp_path, [proc.stderr, proc.stdout], KEY) == []


# one form in the quick tier (each runs four stages); the redactor's unit tests take
# every form, the slow tier runs each end to end
@pytest.mark.parametrize("form", ["userinfo", *(pytest.param(f, marks=pytest.mark.slow)
                                                for f in ("token", "path", "param"))])
def test_a_credential_in_a_path_param_is_written_nowhere(tmp_path, form):
    """Issue 32's leaks: a base, a tokenizer, a source and a model path holding a
    credential, through merge's report, card, lineage.json and log, and the error lines of
    tokenize, prepare and validate."""
    secret = "SeCrEt-" + form + "-0123456789"
    url = with_credential("s3" if form != "path" else "hf", form, secret, "X-Amz-Signature")
    merged_repo(tmp_path)
    shutil.rmtree(tmp_path / "data/merged")
    save(tmp_path / "data/tokenized", rows(ids("n", 3)))
    make_prompts(tmp_path, 2)
    (tmp_path / "data/completions").mkdir(parents=True)
    (tmp_path / "data/completions/completions.jsonl").write_text("")
    texts = []
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"merge": {"base": url}}))
    proc, _ = stagecli.measured("merge", cli.pipeline_command("merge")[3:], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    texts += [proc.stdout, proc.stderr]
    assert "merge.base" in proc.stderr  # the warning that names it, redacted
    for stage_name, section in [
            ("tokenize", {"tokenizer": url}),
            ("prepare", {"sources": [{"name": "s", "path": url, "format": "messages"}]}),
            ("validate", {"train_check": {"model": url}})]:
        (tmp_path / "params.yaml").write_text(yaml.safe_dump({stage_name: section}))
        proc, _ = stagecli.measured(stage_name, cli.pipeline_command(stage_name)[3:], tmp_path)
        texts += [proc.stdout, proc.stderr]
    shown = json.loads((tmp_path / "reports/merge.json").read_text())["base"]["path"]
    assert shown == secrets.Redactor()(url) and secret not in shown
    found = [str(p) for p in tmp_path.rglob("*") if p.is_file() and p.name != "params.yaml"
             and secret.encode() in p.read_bytes()]
    assert found == [] and not [t[:300] for t in texts if secret in t]


# ------------------------------------------ one reader for every file a user controls

def test_a_fifo_named_parquet_in_a_base_is_one_line_with_or_without_adopt(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    save(tmp_path / "data/tokenized", rows(ids("n", 3)))
    (tmp_path / "data/base").mkdir(parents=True)
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]], "labels": [[-100, 2, 3]]}),
                   tmp_path / "data/base/a.parquet")
    fifo_at(tmp_path, "data/base/b.parquet")
    for adopting in (False, True):
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(
            {"merge": {"base": "data/base", "adopt": adopting}}))
        started = time.monotonic()
        line, _ = stagecli.fail("merge", tmp_path, timeout=120)
        assert "b.parquet: not a regular file (a FIFO)" in line, line
        assert time.monotonic() - started < 110 and stat_is_fifo(tmp_path / "data/base/b.parquet")
        assert not (tmp_path / "data/merged").exists()


@pytest.mark.parametrize("where", ["out/export.json", "merged/fingerprint.json",
                                   "merged/state.json"])
def test_a_fifo_in_an_export_folder_is_one_line_not_a_hang(tmp_path, where):
    from tests.helpers.sets import EDGE_ROWS, write_merged
    from tests.helpers.stagecli import export_fails as fails

    write_merged(tmp_path / "merged", [EDGE_ROWS])
    if where.startswith("out/"):  # an earlier export's folder, its report a FIFO
        (tmp_path / "out").mkdir()
        (tmp_path / "out/data.jsonl").write_text("")
    fifo_at(tmp_path, where)
    started = time.monotonic()
    line = fails("--for", "trl", "--merged", "merged", "--out", "out", cwd=tmp_path)
    assert f"{Path(where).name}: not a regular file (a FIFO)" in line, line
    assert time.monotonic() - started < 110 and stat_is_fifo(tmp_path / where)


# ------------------------------------------ unclear errors, each one line (issue 32)

def test_an_oversized_model_list_fails_fast_not_at_the_readiness_deadline(probed):
    probed.reset({"endpoints": {"/v1/models": {"bytes": 20 << 20}}})
    started = time.monotonic()
    with pytest.raises(StageError, match=r"/v1/models: HTTP 200 with a body over \d+ bytes"):
        asyncio.run(probes.wait_ready([probed.url], 300.0))
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("fingerprint, says", [
    ("[" * 5000 + "]" * 5000, "fingerprint.json is missing or unreadable"),
    (json.dumps(FP | {"tokenizer": {"vocab_size": 2**70}}),
     "fingerprint.json: tokenizer.vocab_size must be"),
])
def test_validate_names_an_unreadable_or_out_of_range_fingerprint_as_such(tmp_path, fingerprint,
                                                                          says):
    merged_repo(tmp_path)
    (tmp_path / "data/merged/fingerprint.json").write_text(fingerprint)
    doc = yaml.safe_load((tmp_path / "params.yaml").read_text())
    doc["validate"]["vocab_size"] = None
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(doc))
    line, _ = stagecli.fail("validate", tmp_path)
    assert line.startswith("error: validate.vocab_size: null, and ") and says in line, line


@pytest.mark.parametrize("stage_name", ["merge", "validate"])
def test_a_reports_runs_that_is_no_folder_stops_the_stage_before_its_work(tmp_path,
                                                                         stage_name):
    merged_repo(tmp_path)
    save(tmp_path / "data/tokenized", rows(ids("n", 3)))
    (tmp_path / "reports/runs").write_text("not a folder")
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "data").rglob("*"))
    line, _ = stagecli.fail(stage_name, tmp_path)
    assert "reports/runs is not a folder" in line, line
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "data").rglob("*")) == before


# ------------------------------------------- a shard cut short under its reader (issue 32)

# runs `python -m stages.<stage> ARGV` with every open_shard and open_columns of TARGET
# cutting that file to CUT bytes once it is open: what another process truncating it
# mid-read does
_CUTTING = """
import contextlib, os, runpy, sys
from stages.dataset import shards
target, cut, stage = sys.argv.pop(1), int(sys.argv.pop(1)), sys.argv.pop(1)
def cutting(opened):
    @contextlib.contextmanager
    def opening(path, *args, **kwargs):
        with opened(path, *args, **kwargs) as reader:
            if os.path.samefile(path, target) and os.path.getsize(target) > cut:
                os.truncate(target, cut)
            yield reader
    return opening
shards.open_shard, shards.open_columns = cutting(shards.open_shard), cutting(shards.open_columns)
runpy.run_module("stages." + stage, run_name="__main__", alter_sys=True)
"""


def cut_repo(root: Path) -> None:
    """A merged set, a base and new rows of a few MB each: many pages past any cut."""
    merged_repo(root)
    shutil.rmtree(root / "data/merged")
    save(root / "data/merged", rows(ids("m", 40000)))
    save(root / "data/base", rows(ids("b", 40000)))
    save(root / "data/tokenized", rows(ids("n", 3)))


@pytest.mark.parametrize("stage_name, shard", [
    ("export", "data/merged/data-00000-of-00001.arrow"),
    ("validate", "data/merged/data-00000-of-00001.arrow"),
    ("merge", "data/base/data-00000-of-00001.arrow"),
])  # fmt: skip
@pytest.mark.parametrize("when", ["before", "while"])
def test_a_shard_cut_short_before_or_while_read_is_one_line_never_sigbus(tmp_path, stage_name,
                                                                         shard, when):
    cut_repo(tmp_path)
    path = tmp_path / shard
    merged_size = list_shards(tmp_path / "data/merged")[0].stat().st_size
    cut = path.stat().st_size // 3 // 4096 * 4096 + 100  # mid-page, mid-batch
    argv = (["--for", "trl", "--merged", "data/merged", "--out", "out"]
            if stage_name == "export" else cli.pipeline_command(stage_name)[3:])
    if when == "before":
        os.truncate(path, cut)
        code = [stagecli._RUN, stage_name]
    else:
        code = [_CUTTING, str(path), str(cut), stage_name]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1",
               PEAK_RSS_FILE=str(tmp_path / ".peak"))
    proc = subprocess.run([sys.executable, "-c", *code, *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])  # -7: SIGBUS
    assert "Traceback" not in proc.stderr and "Fatal Python error" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert path.name in line and ("cut short" in line or "truncated" in line
                                  or "damaged" in line), line
    assert path.stat().st_size == cut  # read, never rewritten
    if stage_name == "export":
        assert not (tmp_path / "out").exists()
    if stage_name == "merge":  # the merged set it had is left as it was
        assert list_shards(tmp_path / "data/merged")[0].stat().st_size == merged_size


# ---------------------------------------------- no room for the output (issue 32)

def _no_room_below(limit: int):
    import resource

    def cap():  # a write past `limit` bytes fails with EFBIG, as a full disk with ENOSPC
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return cap


@pytest.mark.parametrize("stage_name, how, out", [
    ("export", "trl", "out"),
    ("export", "specforge", "out"),
    ("merge", "copy", "data/merged"),
    ("merge", "rewrite", "data/merged"),
])  # fmt: skip
def test_an_output_with_no_room_is_named_as_such_and_left_as_it_was(tmp_path, stage_name, how,
                                                                    out):
    cut_repo(tmp_path)
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    params["merge"]["link"] = False  # base shards copied: the output needs room
    if how == "rewrite":  # every base row replaced by a new one: the base shard rewritten
        params["merge"]["on_duplicate"] = "keep-new"
        save(tmp_path / "data/tokenized", rows(ids("b", 3)))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    if stage_name == "merge":
        shutil.rmtree(tmp_path / "data/merged")
        argv = cli.pipeline_command("merge")[3:]
    else:
        argv = ["--for", how, "--merged", "data/merged", "--out", "out"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    if stage_name == "export":  # an earlier export of a smaller set, which must stay
        save(tmp_path / "small", rows(ids("s", 3)))
        subprocess.run([sys.executable, "-m", "stages.export", "--for", how, "--merged",
                        "small", "--out", "out"], cwd=tmp_path, env=env, check=True,
                       capture_output=True, timeout=240)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    proc = subprocess.run([sys.executable, "-m", f"stages.{stage_name}", *argv], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240,
                          preexec_fn=_no_room_below(1 << 20))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith(f"error: {out}: no room to write this output"), line
    assert "data/base" not in line and "data-0000" not in line, line  # no input blamed
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # nothing half-written, nothing the user had changed
