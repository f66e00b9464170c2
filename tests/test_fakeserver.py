"""The fake SGLang server itself (tests/helpers/fakeserver.py): its replies and its faults."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.helpers.fakeserver import get_json, post_json


def chat(url: str, rid: str | None = None, **extra) -> tuple[int, dict]:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 64, **extra}
    if rid is not None:
        body["rid"] = rid
    try:
        return 200, post_json(url + "/v1/chat/completions", body, timeout=5)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_fake_replies_are_deterministic_and_shaped_like_sglang():
    from tests.helpers.fakeserver import load_spec, reply_for

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


def test_a_tool_call_reply_has_the_ids_of_the_call_it_makes():
    # an engine's generated ids are those of the text its tool-call parser took the call
    # from; ids of the text answer the fault replaced made tokenize drop every row where
    # the target called a tool (answers.text_differs), failing the stage
    from transformers import PreTrainedTokenizerFast

    from stages.models.tokenizer import ensure_bundled
    from tests.helpers.fakeserver import load_spec, reply_for

    folder = str(ensure_bundled().resolve())
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    body = {"messages": [{"role": "user", "content": "x y"}], "tools": tools,
            "return_token_ids": True}
    choice = reply_for(body, load_spec({"tokenizer": folder}), "tool_call")["choices"][0]
    said = PreTrainedTokenizerFast.from_pretrained(folder).decode(choice["response_token_ids"])
    thought = choice["message"]["reasoning_content"]
    assert said == (f"{thought}\n</think>\n\n<tool_call>\n<function=lookup>\n</function>\n"
                    "</tool_call><|im_end|>")


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
