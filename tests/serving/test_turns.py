"""Conversations regenerated turn by turn and several samples per prompt: the generate
stage (stages/serving/turns.py) against the fake server, which records every request it
answers and its reply (`record_log`)."""

from __future__ import annotations

import json
import signal
import time

import datasets
import numpy as np
import pytest

from stages.chat import regenerate
from stages.serving.toolshape import served_tools
from tests.helpers.fakeserver import spawn
from tests.helpers.generation import (cache_entries, here, ok, outputs, report,
                                 start_stage, stage, url_server, write_params)
from tests.helpers.turnlog import check_history, conversation, write_prompts



def log_of(server) -> list[dict]:
    return server.stats(requests=False)["log"]


def test_four_turns_each_carrying_the_targets_earlier_answers(tmp_path):
    rows = write_prompts(tmp_path, [conversation(i, 4) for i in range(6)] + [
        [{"role": "user", "content": "a single question"}]])
    with spawn({"record_log": True, "reasoning_tokens": 6, "reply_tokens": 8}) as server:
        write_params(tmp_path, server=url_server(server.url), enable_thinking=True)
        here(tmp_path)
        log = log_of(server)
    by_conv = check_history(log, rows)
    assert len(log) == 6 * 4 + 1
    assert all(len(by_conv[f"c{i:04d}"]) == 4 for i in range(6))
    done, failed = outputs(tmp_path)
    assert not failed and len(done) == 7
    row = done[0]
    # the row holds every answer whole, reasoning included, as the log saw it
    answers = [m for m in row["messages"] if m["role"] == "assistant"]
    replies = [e["reply"] for e in by_conv["c0000"]]
    assert [a["content"] for a in answers] == [r["content"] for r in replies]
    assert [a["reasoning_content"] for a in answers] == [r["reasoning_content"] for r in replies]
    assert [m for m in row["messages"] if m["role"] == "user"] == \
        [m for m in conversation(0, 4) if m["role"] == "user"]
    assert len(row["turns"]) == 4
    assert row["usage"]["completion_tokens"] == sum(t["usage"]["completion_tokens"]
                                                    for t in row["turns"])
    assert "turns" not in done[6] and done[6]["id"] == "c0006"  # a plain prompt's row
    rep = report(tmp_path)
    assert rep["turns"]["answered"] == 25 and rep["sent"] == 25
    assert rep["completed"] + rep["failed"] == rep["requests"] == 7


def test_an_answer_after_an_empty_thinking_goes_on_whole_as_the_engine_split_it(tmp_path):
    """The engine's parser cut an empty thinking (null) from an answer that writes
    `</think>` itself: the next turn carries that answer whole, as the engine said it,
    and a later run against a server that does not say it splits rebuilds the same rows
    from the cache (the record says who split). A server that says nothing is split here."""
    rows = write_prompts(tmp_path, [conversation(i, 3) for i in range(2)])
    patch = {"fault": "patch", "match": "-t1($|~)", "set": {
        "choices.0.message.content": "x </think> y", "choices.0.message.reasoning_content": None}}
    silent = {"endpoints": {"/get_server_info": {"body": "{}"}}}
    with spawn({"record_log": True, "rules": [patch]}) as server:
        write_params(tmp_path, server=url_server(server.url), enable_thinking=True)
        here(tmp_path)
        by_conv = check_history(log_of(server), rows)
    assert by_conv["c0000"][1]["messages"][2] == {
        "role": "assistant", "content": "x </think> y", "reasoning_content": ""}
    first = (tmp_path / "data/completions/completions.jsonl").read_bytes()
    with spawn({"record_log": True, "rules": [patch], **silent}) as server:
        write_params(tmp_path, server=url_server(server.url), enable_thinking=True)
        here(tmp_path)
        assert log_of(server) == []
    assert (tmp_path / "data/completions/completions.jsonl").read_bytes() == first
    with spawn({"record_log": True, "rules": [patch], **silent}) as server:
        write_params(tmp_path, server=url_server(server.url), enable_thinking=True,
                     cache_dir=".cache/other")
        here(tmp_path)
        said = log_of(server)[-1]["messages"][2]
    assert (said["content"], said.get("reasoning_content")) == (" y", None)


def test_max_turns_bounds_the_turns(tmp_path):
    rows = write_prompts(tmp_path, [conversation(i, 4) for i in range(3)])
    with spawn({"record_log": True}) as server:
        write_params(tmp_path, server=url_server(server.url), max_turns=2)
        here(tmp_path)
        check_history(log_of(server), rows)
        assert len(log_of(server)) == 6
    done, _ = outputs(tmp_path)
    assert [len(r["turns"]) for r in done] == [2, 2, 2]
    assert report(tmp_path)["turns"]["cut_by_max_turns"] == 3


def test_sigkill_between_turns_then_a_byte_identical_resume(tmp_path):
    ref, wd = tmp_path / "ref", tmp_path / "killed"
    convs = [conversation(i, 4) for i in range(40)]
    spec = {"record_log": True, "latency": 0.02}
    for d in (ref, wd):
        rows = write_prompts(d, convs)
    with spawn(spec) as server:
        write_params(ref, server=url_server(server.url), concurrency=4)
        ok(stage(ref))
    with spawn(spec) as server:
        write_params(wd, server=url_server(server.url), concurrency=4)
        proc = start_stage(wd)
        deadline = time.monotonic() + 60
        while len(cache_entries(wd)) < 40 and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        cached = len(cache_entries(wd))
        assert 0 < cached < 160, cached  # the kill landed mid-run
        answered = {json.loads(line.split(b" ", 1)[1])["reply"]["id"]
                    for seg in (wd / ".cache/requests").glob("*/seg-*.log")
                    for line in seg.read_bytes().splitlines() if line.endswith(b"}")}
        first = len(log_of(server))
        ok(stage(wd))
        resumed = log_of(server)[first:]
        check_history(log_of(server), rows)
    assert not answered & {e["rid"] for e in resumed}  # no answered turn sent again
    assert report(wd)["sent"] == len(resumed) == 160 - len(answered)
    for name in ("completions.jsonl", "failures.jsonl", "generation.json"):
        assert (wd / "data/completions" / name).read_bytes() == \
            (ref / "data/completions" / name).read_bytes(), name


def test_a_tool_conversation_is_cut_where_the_sources_calls_begin(tmp_path):
    msgs = conversation(0, 4, tool_at=3)
    parts = regenerate.split(msgs)
    assert parts.tool_cut and len(parts.turns) == 2  # turns 1..3, the third the target's
    rows = write_prompts(tmp_path, [msgs])
    with spawn({"record_log": True}) as server:
        write_params(tmp_path, server=url_server(server.url))
        here(tmp_path)
        log = log_of(server)
    check_history(log, rows)
    assert len(log) == 3
    assert "42" not in json.dumps([e["messages"] for e in log])  # no source tool result
    done, _ = outputs(tmp_path)
    assert len(done[0]["turns"]) == 3


def test_a_turn_that_fails_for_good_ends_its_conversation_or_drops_it(tmp_path):
    write_prompts(tmp_path, [conversation(i, 3) for i in range(4)])
    spec = {"rules": [{"fault": "bad_request", "match": r"^c0001-t2$"}]}
    with spawn(spec) as server:
        write_params(tmp_path, server=url_server(server.url), max_permanent_failures=1)
        here(tmp_path)
        done, failed = outputs(tmp_path)
        assert [len(r["turns"]) for r in done] == [3, 1, 3, 3] and not failed
        turns = report(tmp_path)["turns"]
        assert turns["cut_by_failure"] == 1 and turns["failed"] == 1
        write_params(tmp_path, server=url_server(server.url), max_permanent_failures=1,
                     on_turn_failure="drop")
        here(tmp_path)
    done, failed = outputs(tmp_path)
    assert [r["id"] for r in done] == ["c0000", "c0002", "c0003"]
    assert [(f["id"], f["turn"]) for f in failed] == [("c0001", 2)]
    rep = report(tmp_path)
    assert rep["sent"] == 0 and rep["completed"] + rep["failed"] == 4


def test_samples_per_prompt_three_then_four_sends_only_the_fourth(tmp_path):
    rows = write_prompts(tmp_path, [conversation(i, 2) for i in range(3)] + [
        [{"role": "user", "content": f"single {i}"}] for i in range(3)])
    with spawn({"record_log": True}) as server:
        write_params(tmp_path, server=url_server(server.url), samples_per_prompt=3, seed=7)
        here(tmp_path)
        three = log_of(server)
        done3, _ = outputs(tmp_path)
        write_params(tmp_path, server=url_server(server.url), samples_per_prompt=4, seed=7)
        here(tmp_path)
        four = log_of(server)[len(three):]
    done4, _ = outputs(tmp_path)
    assert len(three) == 3 * (3 * 2 + 3) and len(four) == 3 * 2 + 3
    assert {e["seed"] for e in four} == {7 + 3}
    assert len(done3) == 18 and len(done4) == 24
    assert len({r["id"] for r in done4}) == 24
    for i in range(6):  # rows in prompt order, then sample order
        mine = done4[4 * i: 4 * i + 4]
        assert [r["sample"] for r in mine] == [0, 1, 2, 3]
        assert all(r["messages"][:len(rows[i]["messages"])] == rows[i]["messages"] for r in mine)
        assert len({json.dumps(r["messages"]) for r in mine}) == 4  # four distinct answers
    # the first three samples' rows are the same bytes as before
    old = {r["id"]: r for r in done3}
    assert all(old[r["id"]] == r for r in done4 if r["sample"] < 3)
    assert [r["id"] for r in done4 if r["sample"] == 0] == [r["id"] for r in rows]


@pytest.mark.parametrize("ids", ["render", "engine"])
def test_expand_gives_one_row_per_turn_equal_to_its_request_and_reply(tmp_path, ids):
    from stages import tokenize
    from stages.models import tokenizer

    write_prompts(tmp_path, [conversation(i, 3) for i in range(3)])
    spec = {"record_log": True, "tokenizer": str(tokenizer.ensure_bundled().resolve()),
            "reasoning_tokens": 5, "reply_tokens": 7}
    with spawn(spec) as server:
        write_params(tmp_path, server=url_server(server.url), enable_thinking=True,
                     tokenizer=None)
        here(tmp_path)
        log = {e["rid"]: e for e in log_of(server)}
    done, _ = outputs(tmp_path)
    out = tmp_path / "tokenized"
    rep = tokenize.tokenize_file(tmp_path / "data/completions/completions.jsonl", out,
                                 multi_turn="expand", ids=ids, num_proc=1)
    ds = datasets.load_from_disk(str(out))
    assert len(ds) == 9 and rep["serve_check"]["checked_by_ids"] == 9
    assert rep["serve_check"]["mismatches"] == 0
    by_id = {r["id"]: r for r in ds}
    for row in done:
        for k, turn in enumerate(row["turns"], 1):
            rid = row["id"] if k == len(row["turns"]) else f"{row['id']}#{k}"
            got = by_id[rid]
            input_ids, mask = np.array(got["input_ids"]), np.array(got["loss_mask"])
            start = int(np.flatnonzero(mask)[0])
            served = turn["engine_tokens"]
            # the prompt is exactly the turn's request as the engine tokenized it
            assert input_ids[:start].tolist() == served["prompt_ids"]
            # and the supervised tokens are the turn's reply
            assert input_ids[mask == 1].tolist() == served["completion_ids"]
            assert log[f"{row['id']}-t{k}"]["reply"]["content"] in \
                json.dumps(row["messages"][2 * k])


def test_a_turn_where_the_target_calls_a_tool_ends_its_conversation_kept(tmp_path):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    rows = write_prompts(tmp_path, [conversation(i, 4) for i in range(3)])
    for row in rows:
        row["tools"] = tools
    (tmp_path / "data/prompts/prompts.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    spec = {"record_log": True, "rules": [{"fault": "tool_call", "match": r"^c0001-t2$"}]}
    with spawn(spec) as server:
        write_params(tmp_path, server=url_server(server.url))
        here(tmp_path)
        log = log_of(server)
    check_history(log, rows)
    assert len(log) == 4 + 2 + 4  # nothing asked after the call: its result would be ours
    done, failed = outputs(tmp_path)
    assert not failed and [len(r["turns"]) for r in done] == [4, 2, 4]
    # every turn was served the tools as SGLang (the URL's default dialect) renders them
    assert all(r["tools"] == served_tools("sglang", tools) != tools for r in done)
    call = done[1]["messages"][-1]
    assert call["tool_calls"][0]["function"]["name"] == "lookup"
    assert done[1]["finish_reason"] == "tool_calls" and not done[1]["truncated"]
    rep = report(tmp_path)
    assert rep["turns"]["ended_by_tool_call"] == 1
    assert rep["sources"]["multi"]["ended_by_tool_call"] == 1


def test_limit_walks_the_first_conversations_and_prints_the_first_request(tmp_path, capsys):
    rows = write_prompts(tmp_path, [conversation(i, 3) for i in range(5)])
    with spawn({"record_log": True}) as server:
        write_params(tmp_path, server=url_server(server.url), limit=2)
        here(tmp_path)
        assert len(log_of(server)) == 6
    out = capsys.readouterr().out
    body = json.loads(out[out.index("{"):])
    assert body["messages"] == rows[0]["messages"] and "turns" not in body
    done, _ = outputs(tmp_path)
    assert [r["id"] for r in done] == ["c0000", "c0001"]


def test_twin_conversations_ask_each_turn_once_and_share_its_answer(tmp_path):
    conv = conversation(0, 4)
    write_prompts(tmp_path, [conv, conversation(1, 2), conv])
    with spawn({"record_log": True, "latency": 0.05}) as server:
        write_params(tmp_path, server=url_server(server.url), concurrency=4)
        here(tmp_path)
        log = log_of(server)
    assert len(log) == 4 + 2  # the twin waited for the turns its first asked
    done, _ = outputs(tmp_path)
    assert done[0]["messages"] == done[2]["messages"] and len(done[2]["turns"]) == 4
    assert report(tmp_path)["turns"]["answered"] == 10


def test_prepares_regenerate_lines_feed_the_turn_path(tmp_path, monkeypatch):
    from tests.helpers.sources import run as prepare_run, write_jsonl

    monkeypatch.chdir(tmp_path)  # prepare_run moves there: back after the test

    convs = [conversation(0, 3), conversation(1, 4, tool_at=2), conversation(2, 1)]
    path = write_jsonl(tmp_path / "src.jsonl", [{"messages": c} for c in convs])
    source = [{"name": "mix", "path": str(path), "format": "messages"}]
    _, rows, _ = prepare_run(tmp_path, source, multi_turn="regenerate")
    with spawn({"record_log": True}) as server:
        write_params(tmp_path, server=url_server(server.url))
        here(tmp_path)
        log = log_of(server)
    check_history(log, rows)
    assert len(log) == 3 + 2 + 1
    done, _ = outputs(tmp_path)
    assert [len(r.get("turns", [None])) for r in done] == [3, 2, 1]
    assert [r["id"] for r in done] == [r["id"] for r in rows]


@pytest.mark.parametrize("turns, message", [
    ("nope", "'turns' must be a list of lists of user messages"),
    ([[{"role": "assistant", "content": "x"}]], "'turns' must be a list of lists of user"),
    ([[]], "'turns' must be a list of lists of user messages"),
    ([[{"role": "user", "content": 5}]], "turns: "),
])
def test_a_bad_turns_field_is_one_line_naming_the_line(tmp_path, turns, message):
    rows = write_prompts(tmp_path, [conversation(0, 2), conversation(1, 2)])
    rows[1]["turns"] = turns
    (tmp_path / "data/prompts/prompts.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with spawn() as server:
        write_params(tmp_path, server=url_server(server.url))
        proc = stage(tmp_path)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "prompts.jsonl:2: " in last and message in last, last
    assert not (tmp_path / "data/completions").exists()


def test_progress_leaves_the_turns_found_in_the_cache_out_of_the_speed(tmp_path, monkeypatch):
    from stages.serving import progress

    ticks = []
    real = progress.Progress.tick
    monkeypatch.setattr(progress.Progress, "tick", lambda self, *a, **kw: (
        ticks.append((self.total, a[0], kw.get("skipped", 0))), real(self, *a, **kw))[1])
    write_prompts(tmp_path, [conversation(i, 3) for i in range(4)])
    with spawn() as server:
        write_params(tmp_path, server=url_server(server.url), max_turns=1)
        here(tmp_path)
        ticks.clear()
        write_params(tmp_path, server=url_server(server.url))  # every turn: 4 cached, 8 sent
        here(tmp_path)
    # progress counts turns; the cached first turns are done but not the run's speed
    assert ticks[-1] == (12, 12, 4)
