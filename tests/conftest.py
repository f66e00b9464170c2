"""Shared fixtures: the fake SGLang server (tests/fakeserver.py), in-process or as a process."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from tests.fakeserver import FakeProcess, FakeServer, spawn

# Property tests draw the same examples on every run, so a suite that passed once passes
# again (CI included); HYPOTHESIS_PROFILE=explore draws new ones, many more of them.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))


@pytest.fixture
def fake_server():
    """fake_server(spec=None) -> a FakeServer on a thread of this process; all stopped after."""
    started: list[FakeServer] = []

    def start(spec: dict | None = None, port: int = 0) -> FakeServer:
        server = FakeServer(spec, port=port).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def fake_process(tmp_path):
    """fake_process(spec=None) -> a FakeProcess (its own process; `exit` faults really exit)."""
    started: list[FakeProcess] = []

    def start(spec: dict | None = None, port: int | None = None) -> FakeProcess:
        proc = spawn(spec, port=port, log_path=tmp_path / f"fakeserver-{len(started)}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
