"""The server of a run: the fake SGLang server at a URL, or launched as the engine."""

from __future__ import annotations

import asyncio
import logging

import pytest

from stages.common import params
from stages.common.errors import StageError
from stages.common.secrets import Redactor
from stages.serving.server import SERVER_LOG, ServerHandle, server_urls
from stages.serving.watchdog import UrlWatchdog, Watchdog
from tests.helpers.processes import fake_launch, gone


def generate_params(server: dict, **extra) -> params.Generate:
    return params.build(params.Generate, {"server": server, **extra}, "generate")


def handle(cfg: params.Generate) -> ServerHandle:
    return ServerHandle(cfg, None, Redactor([None], urls=server_urls(cfg.server)))


def test_a_url_server_is_asked_its_model_and_shown_without_credentials(fake_server):
    fake = fake_server({"model": "served-name"})
    given = fake.url.replace("http://", "http://user:pw@") + "/v1/"
    server = handle(generate_params({"url": given, "unreachable_deadline": 10}))
    assert server.urls == [given.removesuffix("/v1/")]  # credentials kept: requests use them
    assert server.shown_urls() == [fake.url]

    async def run() -> tuple:
        label = await server.resolve_label()
        async with server.running(tools=True) as urls:
            return label, urls, server.watchdog(), await server.behind_router()

    label, urls, watchdog, router = asyncio.run(run())
    assert label == server.request_model == "served-name"
    assert urls == server.urls and isinstance(watchdog, UrlWatchdog) and router is False
    assert server.info() == {"urls": [fake.url], "engine": "sglang"}


def test_a_router_is_told_apart_from_an_engine(fake_server):
    router = handle(generate_params({"url": fake_server({"router": True}).url, "model": "m"}))
    assert asyncio.run(router.behind_router()) is True


def test_a_launched_engine_lives_for_the_block_and_a_failure_names_its_log(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the engine's log: SERVER_LOG, under the working folder
    launch = fake_launch().__dict__
    server = handle(generate_params({"launch": launch}))
    assert server.label == "unused-name" and server.urls == []

    async def run() -> None:
        async with server.running(tools=False) as urls:
            assert urls == [server.launched.url] and server.request_model == "fake-model"
            assert isinstance(server.watchdog(), Watchdog)
            raise StageError("the engine said no")

    with pytest.raises(StageError, match=rf"^the engine said no \(server log: {SERVER_LOG}\)$"):
        asyncio.run(run())
    assert gone(server.launched.pid) and (tmp_path / SERVER_LOG).is_file()
    info = server.info()
    assert info["engine"] == "sglang" and info["served_model"] == "fake-model"


def test_the_seed_is_honoured_by_vllm_and_by_sglang_only_when_deterministic(fake_server, caplog):
    plain, deterministic = fake_server(), fake_server({"deterministic": True})
    launched = fake_launch(args=["--enable-deterministic-inference"]).__dict__
    cases = [({"url": plain.url, "model": "m"}, 5, False),
             ({"url": deterministic.url, "model": "m"}, 5, True),
             ({"url": plain.url, "model": "m", "engine": "vllm"}, 5, True),
             ({"launch": launched}, 5, True),
             ({"url": plain.url, "model": "m"}, None, None)]
    with caplog.at_level(logging.WARNING, "stages.serving.server"):
        for server, seed, used in cases:
            assert asyncio.run(handle(generate_params(server, seed=seed)).seed_used()) is used
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "generate.seed=5 is ignored" in warning and "--enable-deterministic-inference" in warning
