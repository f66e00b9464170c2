"""Probing servers: the fake SGLang server on loopback, late, dead or guarded by a key."""

from __future__ import annotations

import asyncio
import time

import pytest

from stages.common.errors import StageError
from stages.serving import probes
from tests.helpers.fakeserver import FakeServer, free_port, spawn


def test_normalize_url():
    assert probes.normalize_url(" http://h:30000/v1/ ") == "http://h:30000"
    assert probes.normalize_url("http://h:30000") == "http://h:30000"


def test_wait_ready_waits_for_a_late_server_and_gives_up_on_a_dead_one():
    port = free_port()
    late = FakeServer(port=port)

    async def run() -> tuple[float, str]:
        loop = asyncio.get_running_loop()
        loop.call_later(0.7, late.start)
        t0 = time.monotonic()
        name = await probes.wait_ready([f"http://127.0.0.1:{port}"], deadline=120)
        return time.monotonic() - t0, name

    try:
        took, name = asyncio.run(run())
        assert 0.6 < took and name == "fake-model"
    finally:
        late.stop()
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(StageError, match=rf"no model ready at {dead} within 0.6 s .*unreachable_deadline"):  # fmt: skip
        asyncio.run(probes.wait_ready([dead], deadline=0.6))
    assert time.monotonic() - t0 < 30


def test_wait_ready_stops_at_once_on_a_wrong_key(fake_server):
    server = fake_server({"api_key": "k"})
    assert asyncio.run(probes.wait_ready([server.url], deadline=2, api_key="k")) == "fake-model"
    with pytest.raises(StageError, match="HTTP 401: check the API key"):
        asyncio.run(probes.wait_ready([server.url], deadline=20, api_key="wrong"))


def test_the_served_context_is_max_model_len_of_the_served_model():
    with spawn({"max_context": 4096}) as a, spawn({"max_context": 2048}) as b, spawn({}) as c:
        assert probes.served_context([a.url], "fake-model", None) == 4096
        assert probes.served_context([a.url, b.url], "fake-model", None) == 2048
        assert probes.served_context([a.url], "other-model", None) == 4096  # its only model
        assert probes.served_context([a.url, c.url], "fake-model", None) is None


def test_whether_the_engine_splits_reasoning_is_read_from_its_flags_or_its_setup(fake_server):
    assert probes.reasoning_split("sglang", None, None, ["--reasoning-parser", "qwen3"])
    assert probes.reasoning_split("vllm", None, None, ["--reasoning-parser=qwen3"])
    assert not probes.reasoning_split("sglang", None, None, ["--tool-call-parser", "qwen3"])
    url = fake_server().url
    assert probes.reasoning_split("sglang", url, None)  # /get_server_info's reasoning_parser
    assert not probes.reasoning_split("vllm", url, None)  # vLLM does not say: split here
    for body in ('{"reasoning_parser": null}', '{"model_path": "m"}', '{"reasoning_parser": 1}',
                 "[]", "not json"):
        bare = fake_server({"endpoints": {"/get_server_info": {"body": body}}}).url
        assert not probes.reasoning_split("sglang", bare, None), body
