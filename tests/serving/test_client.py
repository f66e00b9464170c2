"""The chat client against the fake SGLang server: bodies, error kinds, retries, URLs."""

import asyncio
import dataclasses
import json
import time

import pytest

from stages.serving.client import (
    BodyEncoder,
    ChatClient,
    Failure,
    Rejected,
    RetryPolicy,
    Sampling,
    Unreachable,
    build_body,
    classify,
    context_numbers,
    with_attempt_id,
)
from tests.helpers.fakeserver import FakeServer, free_port, secret_pieces

SAMPLING = Sampling(
    max_tokens=64, temperature=0.6, top_p=0.95, top_k=20, seed=7,
    enable_thinking=True, separate_reasoning=True,
)  # fmt: skip
FAST = RetryPolicy(max_retries=4, max_retries_500=1, backoff_base=0.02, backoff_max=0.1)


def prompt(i: int, **extra) -> dict:
    return {"id": f"p{i}", "source": "t", "messages": [{"role": "user", "content": f"q {i}"}], **extra}


def body(i: int, **kw) -> bytes:
    return json.dumps(build_body(prompt(i), "fake-model", SAMPLING, kw.get("engine", "sglang"))).encode()


def client(urls, **kw) -> ChatClient:
    args = dict(
        api_key=None, concurrency=64, request_timeout=5.0, retry=FAST,
        unreachable_deadline=2.0, enable_thinking=True,
    )  # fmt: skip
    args.update(kw)
    return ChatClient(urls if isinstance(urls, list) else [urls], **args)


async def send(c: ChatClient, *bodies: bytes):
    async with c:
        return await asyncio.gather(*(c.complete(b) for b in bodies), return_exceptions=True)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def fake():
    servers = []

    def start(spec=None) -> FakeServer:
        s = FakeServer(spec).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


# ------------------------------------------------------------------ request body


def test_sglang_body_has_every_field_and_the_prompt_id_as_rid():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    b = build_body(prompt(1, tools=tools), "m", SAMPLING, "sglang")
    assert b == {
        "model": "m",
        "messages": prompt(1)["messages"],
        "tools": tools,
        "max_tokens": 64,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "seed": 7,
        "chat_template_kwargs": {"enable_thinking": True},
        "separate_reasoning": True,
        "rid": "p1",
        "return_prompt_token_ids": True,
        "return_token_ids": True,
        "stream": False,
    }


def test_other_engines_get_only_fields_they_accept():
    no_seed = Sampling(**{**SAMPLING.as_dict(), "seed": None})
    t = build_body(prompt(1), "m", no_seed, "transformers")
    assert set(t) == {"model", "messages", "max_tokens", "temperature", "top_p", "chat_template_kwargs", "stream"}
    v = build_body(prompt(1), "m", SAMPLING, "vllm")
    assert v["request_id"] == "p1" and "separate_reasoning" not in v and v["top_k"] == 20


def test_the_fast_encoder_gives_the_same_bytes_as_json_dumps():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    cases = [prompt(1), prompt(2, tools=tools), prompt(3, tools=[]), {"id": 'q"é', "messages": [{"role": "user", "content": "ü \u2028 \\"}]}]  # fmt: skip
    for engine in ("sglang", "vllm", "transformers"):
        enc = BodyEncoder('mo"del', SAMPLING, engine)
        for p in cases:
            expected = json.dumps(build_body(p, 'mo"del', SAMPLING, engine), ensure_ascii=False).encode()
            assert enc.encode(p) == expected
            fitted = dataclasses.replace(SAMPLING, max_tokens=17)  # a prompt near the context
            expected = json.dumps(build_body(p, 'mo"del', fitted, engine), ensure_ascii=False).encode()
            assert enc.encode(p, 17) == expected


def test_error_classes():
    assert classify(400, "Invalid request.") == ("bad_request", "permanent")
    too_long = "This model's maximum context length is 4096 tokens."
    assert classify(400, too_long) == ("context_overflow", "permanent")
    assert classify(422, "Unexpected fields") == ("bad_request", "permanent")
    assert classify(503, "The request queue is full.") == ("overloaded", "transient")
    assert classify(429, "") == ("overloaded", "transient")
    assert classify(408, "") == ("timeout", "transient")
    assert classify(500, "Out of memory even after retracting requests.") == ("oom", "permanent")
    assert classify(500, "Internal server error.") == ("server_error", "t500")
    assert classify(401, "")[1] == classify(404, "")[1] == classify(307, "")[1] == "fatal"


# ----------------------------------------------------------------- against the fake


def test_replies_are_parsed_and_vllm_reasoning_field_is_read(fake):
    for field in ("reasoning_content", "reasoning"):
        s = fake({"reasoning_field": field})
        (reply,) = run(send(client(s.url), body(1)))
        assert reply.reasoning and reply.content and reply.finish_reason == "stop"
        assert reply.completion_tokens == 40 and reply.prompt_tokens > 0 and reply.attempts == 1


def test_truncations_come_back_as_replies(fake):
    s = fake({"rules": [{"fault": "unclosed_think", "match": "p1$"}]})
    (r1,) = run(send(client(s.url), body(1)))
    assert r1.content is None and r1.reasoning and r1.finish_reason == "length"


def test_an_aborted_reply_is_retried_never_returned(fake):
    # SGLang answers 200 with finish_reason "abort" when an admin abort, a pause or a
    # weight update cuts a request: the model did not stop, so the request is sent again
    s = fake({"rules": [{"fault": "abort", "match": "p1$", "first": 2}, {"fault": "abort", "match": "p2$"}]})
    r1, f2 = run(send(client(s.url), body(1), body(2)))
    assert r1.finish_reason == "stop" and r1.attempts == 3 == s.attempts("p1")
    assert (f2.kind, f2.status, f2.permanent, f2.attempts) == ("aborted", 200, False, 5)


# SGLang 0.5.23's own texts (TokenizerManager) and vLLM's
SGLANG_TOO_LONG = (
    "Requested token count exceeds the model's maximum context length of 40960 tokens. You "
    "requested a total of 50000 tokens: 17232 tokens from the input messages and 32768 tokens "
    "for the completion. Please reduce the number of tokens in the input messages or the "
    "completion to fit within the limit."
)


def test_context_numbers_are_read_from_each_engines_error():
    assert context_numbers(SGLANG_TOO_LONG) == (40960, 17232)
    sglang_input = "The input (41000 tokens) is longer than the model's context length (40960 tokens)."
    assert context_numbers(sglang_input) == (40960, 41000)
    vllm = ("'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum "
            "context length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778).")  # fmt: skip
    assert context_numbers(vllm) == (4096, 2778)
    for text in (
        "This model's maximum context length is 4096 tokens. However, you requested 8000 output "
        "tokens and your prompt contains 2778 input tokens, for a total of 10778 tokens.",
        "This model's maximum context length is 4096 tokens. However, you requested 10778 tokens "
        "(2778 in the messages, 8000 in the completion). Please reduce the length.",
    ):
        assert context_numbers(text) == (4096, 2778), text
    assert context_numbers("This model's maximum context length is 4096 tokens.") is None


def test_a_prompt_near_the_context_is_resent_once_with_max_tokens_clamped(fake):
    # the fake counts 4 + words per message: "q 1" is 6 prompt tokens, 64 asked, context 40
    s = fake({"max_context": 40, "record_bodies": True})
    (reply,) = run(send(client(s.url, min_new_tokens=8), body(1)))
    assert reply.attempts == 2 == s.attempts("p1")
    assert s.stats()["requests"]["p1"]["body"]["max_tokens"] == 40 - 6
    assert reply.finish_reason == "length" and reply.completion_tokens == 34


def test_a_prompt_leaving_less_than_min_new_tokens_is_a_context_overflow(fake):
    s = fake({"max_context": 40})
    (f,) = run(send(client(s.url, min_new_tokens=35), body(1)))
    assert (f.kind, f.status, f.permanent, f.attempts) == ("context_overflow", 400, True, 1)
    assert "maximum context length of 40 tokens" in f.message and s.attempts("p1") == 1
    s.reset({"max_context": 6})  # the prompt alone fills the context
    (f,) = run(send(client(s.url, min_new_tokens=1), body(1)))
    assert (f.kind, f.attempts) == ("context_overflow", 1) and "is longer than" in f.message


def test_permanent_failures_are_sent_once(fake):
    s = fake({"rules": [
        {"fault": "bad_request", "match": "p1$"},
        {"fault": "context_length", "match": "p2$"},
        {"fault": "oom", "match": "p3$"},
    ]})  # fmt: skip
    out = run(send(client(s.url), body(1), body(2), body(3)))
    assert [(f.kind, f.status, f.permanent, f.attempts) for f in out] == [
        ("bad_request", 400, True, 1),
        ("context_overflow", 400, True, 1),
        ("oom", 500, True, 1),
    ]
    assert [s.attempts(f"p{i}") for i in (1, 2, 3)] == [1, 1, 1]


def test_transient_errors_are_retried_then_succeed(fake):
    kinds = ["queue_full", "rate_limit", "timeout", "malformed", "no_choices", "drop", "error"]
    once = ("error", "no_choices")  # 500s and bad replies: max_retries_500 (1 here)
    rules = [{"fault": k, "match": f"p{i}$", "first": 1 if k in once else 2} for i, k in enumerate(kinds)]
    s = fake({"rules": rules})
    out = run(send(client(s.url), *(body(i) for i in range(len(kinds)))))
    for i, reply in enumerate(out):
        assert not isinstance(reply, BaseException), (kinds[i], reply)
        expected = 2 if kinds[i] in once else 3
        assert reply.attempts == expected == s.attempts(f"p{i}"), kinds[i]


def test_retries_are_bounded_per_kind(fake):
    s = fake({"rules": [{"fault": "queue_full", "match": "p1$"}, {"fault": "error", "match": "p2$"}]})
    f1, f2 = run(send(client(s.url), body(1), body(2)))
    assert (f1.kind, f1.status, f1.permanent, f1.attempts) == ("overloaded", 503, False, 5)
    assert (f2.kind, f2.status, f2.permanent, f2.attempts) == ("server_error", 500, False, 2)
    assert s.attempts("p1") == 5 and s.attempts("p2") == 2


def test_backoff_is_exponential_with_jitter(fake):
    s = fake({"rules": [{"fault": "queue_full", "first": 4}]})
    policy = RetryPolicy(max_retries=8, max_retries_500=1, backoff_base=0.1, backoff_max=10)
    (reply,) = run(send(client(s.url, retry=policy), body(1)))
    assert reply.attempts == 5
    times = s.stats()["requests"]["p1"]["times"]
    gaps = [b - a for a, b in zip(times, times[1:])]
    for n, gap in enumerate(gaps, 1):
        full = 0.1 * 2 ** (n - 1)
        assert full / 2 - 0.01 <= gap <= full + 0.15, (n, gaps)


def test_a_hung_request_times_out_and_does_not_stall_the_others(fake):
    s = fake({"rules": [{"fault": "hang", "match": "p0$"}], "latency": 0.01})
    c = client(s.url, request_timeout=4.0, retry=RetryPolicy(0, 0, 0.01, 0.01))

    async def go():
        async with c:
            hung = asyncio.ensure_future(c.complete(body(0)))
            others = await asyncio.gather(*(c.complete(body(i)) for i in range(1, 40)))
            waiting = not hung.done()  # the others did not wait for its timeout
            with pytest.raises(Failure) as e:
                await hung
            return others, waiting, e.value

    others, waiting, failure = run(go())
    assert len(others) == 39 and waiting
    assert failure.kind == "timeout" and not failure.permanent


def test_every_try_goes_under_a_request_id_of_its_own(fake):
    """Each try is sent as `<id>~<attempt>.<run>`, the vLLM request_id alike; the body
    is otherwise the one encoded. Real SGLang: tests/test_real_sglang.py."""
    hang = {"fault": "hang", "match": "p1$", "first": 1, "seconds": 60}
    s = fake({"outlives_client": 60, "record_bodies": True, "rules": [hang]})
    c = client(s.url, request_timeout=1.0, retry=RetryPolicy(1, 0, 0.01, 0.01))
    (reply,) = run(send(c, body(1)))
    assert reply.attempts == 2 == s.attempts("p1") and reply.content
    assert s.stats()["requests"]["p1"]["body"]["rid"] == f"p1~2.{c.run_tag}"
    assert len(c.run_tag) == 16
    for engine, field in (("sglang", "rid"), ("vllm", "request_id")):
        sent = json.loads(with_attempt_id(body(2, engine=engine), 3, "ab"))
        assert sent == {**json.loads(body(2, engine=engine)), field: "p2~3.ab"}
    assert with_attempt_id(body(2, engine="transformers"), 2, "ab") == body(2, engine="transformers")


def test_a_gone_try_takes_no_other_request_with_it(fake):
    """SGLang refuses a rid it is running, and when it sees a try's client gone it aborts
    every request whose rid begins with that try's (the fake does both, as SGLang 0.5.23).
    A prompt sent again at once while its timed-out try runs on, and a prompt whose id
    the first one's begins ("p1", "p10"), are both answered. Either fails when a try goes
    under its bare prompt id."""
    hang = {"fault": "hang", "match": "p1$", "first": 1, "seconds": 60}
    slow = {"fault": "slow", "match": "p1$|p10$", "seconds": 3}
    s = fake({"outlives_client": 1, "rules": [hang, slow]})
    once = RetryPolicy(0, 0, 0.01, 0.01)
    quick = client(s.url, request_timeout=1.0, retry=once)
    patient = client(s.url, request_timeout=30.0, retry=once)

    async def go():
        async with quick, patient:
            p10 = asyncio.ensure_future(patient.complete(body(10)))
            with pytest.raises(Failure) as gone:  # runs on 1 s more, then SGLang aborts it
                await quick.complete(body(1))
            again = await patient.complete(body(1))
            return gone.value, await p10, again

    gone, p10, again = run(go())
    assert gone.kind == "timeout"
    assert p10.content and again.content and again.finish_reason == "stop"
    assert s.attempts("p1") == 2 and s.stats()["outcomes"].get("abort", 0) == 0


def test_api_key_is_sent_and_a_wrong_one_stops_the_run(fake):
    s = fake({"api_key": "sekret-123"})
    (reply,) = run(send(client(s.url, api_key="sekret-123"), body(1)))
    assert reply.content
    (err,) = run(send(client(s.url, api_key="wrong-key"), body(1)))
    assert isinstance(err, Rejected) and "401" in str(err) and "wrong-key" not in str(err)


def test_a_server_that_is_gone_is_waited_for_until_the_deadline():
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    (err,) = run(send(client(url, unreachable_deadline=1.0), body(1)))
    assert isinstance(err, Unreachable) and "unreachable_deadline" in str(err)
    assert 1.0 <= time.monotonic() - t0 < 30  # bounded on a busy machine too


def test_a_server_that_comes_back_is_used(fake):
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def go():
        c = client(url, unreachable_deadline=10.0)
        async with c:
            task = asyncio.ensure_future(c.complete(body(1)))
            await asyncio.sleep(0.5)
            s = await asyncio.to_thread(lambda: FakeServer(None, port=port).start())
            try:
                return await task
            finally:
                s.stop()

    reply = run(go())
    assert reply.content and reply.attempts == 1  # refused connections are not attempts


def test_least_in_flight_spreads_requests_over_urls(fake):
    slow = fake({"latency": 0.3})
    quick = fake({"latency": 0.01})
    c = client([slow.url, quick.url], concurrency=8)
    todo = iter(range(60))

    async def worker():
        for i in todo:
            await c.complete(body(i))

    async def go():
        async with c:
            await asyncio.gather(*(worker() for _ in range(8)))

    run(go())
    n_slow, n_quick = slow.stats()["completed"], quick.stats()["completed"]
    assert n_slow + n_quick == 60
    assert n_slow >= 1 and n_quick > 3 * n_slow


# ------------------------------------------------------------- hostile servers

BAD_BODIES = {
    "content_dict": "bad_reply", "content_number": "bad_reply", "reasoning_number": "bad_reply",
    "tool_calls_string": "bad_reply", "bad_usage": "bad_reply", "surrogate": "bad_reply",
    "no_choices": "bad_reply", "utf16": "malformed", "malformed": "malformed", "echo": "malformed",
}  # fmt: skip


@pytest.mark.parametrize("fault", sorted(BAD_BODIES))
def test_a_bad_reply_is_a_counted_failure_retried_a_bounded_number_of_times(fake, fault):
    s = fake({"rules": [{"fault": fault, "match": "p1$", "message": "not json"}]})
    (f,) = run(send(client(s.url), body(1)))
    assert isinstance(f, Failure) and not f.permanent, f
    assert (f.kind, f.status) == (BAD_BODIES[fault], 200)
    retries = FAST.max_retries if f.kind == "malformed" else FAST.max_retries_500
    assert f.attempts == s.attempts("p1") == retries + 1
    # retryable: a server that recovers answers on the next attempt
    s2 = fake({"rules": [{"fault": fault, "match": "p1$", "first": 1, "message": "x"}]})
    (reply,) = run(send(client(s2.url), body(1)))
    assert reply.attempts == 2 and isinstance(reply.content, str)


# what a real key looks like, and one whose JSON and URL forms differ from it
KEYS = ["sk-live-5f0c1e9a77b24d3c8e61aa02b9d4f3e7", 'sk/5f0c+1e9a"77b2=4d3c 8e61\\aa02%b9d4/f3e7']
KEY = KEYS[0]


def echoes() -> list[str]:
    """A key in every form and position a server can echo it, cut or whole."""
    refs = ["{key}", "{key_json}", "{key_url}", "{key[:20]}", "{key[9:]}", "{key[5:-5]}"]
    out = []
    for ref in refs:
        for pad in (0, 1, 470, 487, 495, 499, 5000):  # the message is cut at 500 characters
            out.append("x" * pad + "invalid key " + ref + " end")
    return out


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("status, fault", [(400, "bad_request"), (503, "queue_full"), (400, "echo"), (503, "echo"), (200, "echo")])
def test_a_key_echoed_in_an_error_body_is_masked_in_every_form_and_position(fake, status, fault, key):
    messages = echoes()
    rules = [{"fault": fault, "status": status, "match": f"p{i}$", "message": m} for i, m in enumerate(messages)]
    s = fake({"api_key": key, "rules": rules})
    out = run(send(client(s.url, api_key=key), *(body(i) for i in range(len(messages)))))
    pieces = secret_pieces(key)
    for m, f in zip(messages, out):
        assert isinstance(f, Failure), f
        assert not any(p in f.message for p in pieces), f.message
        assert "***" in f.message or len(m) > 490  # masked, unless the cut fell before it


def test_a_key_echoed_inside_a_valid_reply_is_masked_before_it_is_cached(fake):
    rules = [{"fault": "say", "match": "p1$", "message": "your key is {key} ({key_url[:12]})"}]
    s = fake({"api_key": KEY, "rules": rules})
    (reply,) = run(send(client(s.url, api_key=KEY), body(1)))
    assert reply.content == "your key is *** (***)"
    assert not any(p.encode() in reply.raw for p in secret_pieces(KEY))


def test_url_credentials_are_sent_as_basic_auth_and_never_shown(fake):
    s = fake({"rules": [{"fault": "bad_request", "match": "p2$", "message": "who is {key}?"}]})
    url = s.url.replace("http://", "http://alice:pa55-w0rd-secret@")
    c = client(url)
    assert c.urls == [s.url]
    ok, bad = run(send(c, body(1), body(2)))
    assert isinstance(ok.content, str)
    assert bad.message == "who is ***?"


def test_each_engine_is_asked_for_its_token_ids_in_its_own_words():
    """SGLang 0.5.23 and vLLM name the switch differently; `transformers serve` refuses
    any field it does not know (422)."""
    fields = ("return_prompt_token_ids", "return_token_ids")
    asked = {e: {f: build_body(prompt(1), "m", SAMPLING, e).get(f) for f in fields}
             for e in ("sglang", "vllm", "transformers")}
    assert asked == {"sglang": {"return_prompt_token_ids": True, "return_token_ids": True},
                     "vllm": {"return_prompt_token_ids": None, "return_token_ids": True},
                     "transformers": dict.fromkeys(fields)}
    encoded = BodyEncoder("m", SAMPLING, "sglang").encode(prompt(1))
    assert json.loads(encoded) == build_body(prompt(1), "m", SAMPLING, "sglang")


def test_a_reply_is_cached_with_the_engines_ids_as_sent(fake, tmp_path):
    """The ids are kept whole (tokenize may train on them): the client passes the body on
    as the engine sent it."""
    from stages.models import tokenizer

    s = fake({"tokenizer": str(tokenizer.ensure_bundled().resolve())})
    reply, = run(send(client(s.url), body(1)))
    choice = json.loads(reply.raw)["choices"][0]
    assert choice["prompt_token_ids"][0] == 248045 and choice["response_token_ids"][-1] == 248046


@pytest.mark.parametrize("rule", [{"fault": "huge", "bytes": 3 << 20}, {"fault": "endless"},
                                  {"fault": "gzip_bomb", "bytes": 64 << 20}])  # fmt: skip
def test_a_body_past_the_size_cap_is_refused_while_it_arrives(fake, monkeypatch, rule):
    import stages.serving.client

    monkeypatch.setattr(stages.serving.client, "MAX_REPLY_BYTES", 1 << 20)
    s = fake({"rules": [{**rule, "match": "p1$"}]})
    started = time.monotonic()
    ok, f = run(send(client(s.url, request_timeout=300.0), body(0), body(1)))
    assert isinstance(ok.content, str)
    assert isinstance(f, Failure) and (f.kind, f.status, f.permanent) == ("bad_reply", 200, False)
    assert "body over 1048576 bytes" in f.message and f.attempts == FAST.max_retries_500 + 1
    assert time.monotonic() - started < 120  # stopped at the cap, not at request_timeout


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_never_followed_and_stops_the_run_in_one_line(fake, status):
    echo = fake({"record_bodies": True})
    s = fake({"api_key": KEY, "rules": [{"fault": "redirect", "status": status, "match": "p1$",
                                         "location": echo.url + "/v1/chat/completions?k={key}"}]})
    ok, err = run(send(client(s.url, api_key=KEY), body(0), body(1)))
    assert isinstance(ok.content, str)
    assert isinstance(err, Rejected) and f"HTTP {status}: a redirect to {echo.url}" in str(err)
    assert echo.stats()["received"] == 0  # neither the body nor the key went there
    assert not any(p in str(err) for p in secret_pieces(KEY))


# ------------------------------------------------------------------ hostile input

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MARKERS = st.sampled_from(["\0messages\0", "\0rid\0", '"\\u0000messages\\u0000"',
                           str(2**40 + 7), "messages", '"'])


@settings(max_examples=80, deadline=None)
@given(st.lists(MARKERS | st.text(max_size=6), max_size=4).map("".join),
       st.text(max_size=12), st.sampled_from(["sglang", "vllm", "transformers"]))
def test_any_model_name_encodes_as_json_dumps_would(model, rid, engine):
    # a served model id is a server's words: "\0messages\0" once split the encoder
    p = {"id": rid or "r", "messages": [{"role": "user", "content": model}]}
    expected = json.dumps(build_body(p, model, SAMPLING, engine), ensure_ascii=False).encode()
    assert BodyEncoder(model, SAMPLING, engine).encode(p) == expected


# a 200 whose content holds the key with every character \u-escaped: parsed, it is the key
ESCAPED_REPLY = ('{"id": "r", "object": "chat.completion", "x": "{key}", "x": 0, "choices": '
                 '[{"index": 0, "message": {"role": "assistant", "content": "ok {key_ujson} ok", '
                 '"reasoning_content": "{key_pct} {auth_b64}"}, "finish_reason": "stop"}], '
                 '"usage": {"prompt_tokens": 3, "completion_tokens": 3}}')


def test_a_key_spelled_with_escapes_or_dropped_by_the_parse_is_never_kept(fake):
    # "x" twice: the parse keeps the second, so a check of the parse alone would let
    # the raw bytes, first "x" and all, into the cache
    s = fake({"api_key": KEY, "rules": [{"fault": "raw", "match": "p1$", "body": ESCAPED_REPLY},
                                        {"fault": "raw", "match": "p2$", "status": 400,
                                         "body": '{"detail": {"x": "{key_ujson}"}}'}]})
    reply, failure = run(send(client(s.url, api_key=KEY), body(1), body(2)))
    assert reply.content == "ok *** ok" and reply.reasoning.count("***") == 2
    pieces = secret_pieces(KEY)
    assert not [p for p in pieces if p.encode() in reply.raw], reply.raw
    assert isinstance(failure, Failure) and "***" in failure.message
    assert not [p for p in pieces if p in failure.message], failure.message


def test_a_token_only_url_is_a_secret_in_every_message(fake):
    token = "tok-only-7d1e9b3c55aa"
    s = fake({"rules": [{"fault": "echo", "status": 400, "match": "p1$",
                         "message": "{key} {key_b64} {auth_b64} {key_ujson}"}]})
    c = client(s.url.replace("http://", f"http://{token}@"))
    (failure,) = run(send(c, body(1)))
    assert isinstance(failure, Failure) and c.urls == [s.url]
    assert not [p for p in secret_pieces(token) if p in failure.message], failure.message
