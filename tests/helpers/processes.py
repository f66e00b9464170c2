"""Processes in tests: the fake server (tests/helpers/fakeserver.py) launched as an engine, and
waiting until processes are gone."""

from __future__ import annotations

import os
import time

import psutil

from stages.common import params
from tests.helpers.fakeserver import launch_command


def fake_launch(spec: dict | None = None, **kw) -> params.Launch:
    """A `generate.server.launch` whose "engine" is the fake server with `spec`."""
    command = launch_command(spec)
    options = dict(engine="sglang", model="unused-name", startup_timeout=120.0, stop_timeout=3.0)
    return params.Launch(command=command, **{**options, **kw})


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
