"""Shared fixtures: the fake SGLang server (tests/helpers/fakeserver.py), in-process or as a
process; and the summary line of each real engine or trainer (`real_engine` marker): ran, or why not."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from tests.helpers.fakeserver import FakeProcess, FakeServer, spawn

# Property tests draw the same examples on every run, so a suite that passed once passes
# again (CI included); HYPOTHESIS_PROFILE=explore draws new ones, many more of them.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

# tests/test_every_cpu.py runs the numeric tests with a given number of torch threads, more
# than the cores too: torch caps OMP_NUM_THREADS at the cores when it starts, not this
TORCH_THREADS = "TEST_TORCH_THREADS"


def pytest_configure(config):
    if os.environ.get(TORCH_THREADS):
        import torch

        torch.set_num_threads(int(os.environ[TORCH_THREADS]))


def pytest_report_header(config):
    """The kernel set and threads torch computes with, once something has imported it."""
    import sys

    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        return (f"torch kernels: {torch.backends.cpu.get_cpu_capability()}, "
                f"threads: {torch.get_num_threads()}")
    return None


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


# ------------------------------------------------------------- which real engines ran


def pytest_collection_modifyitems(items) -> None:
    # a user property travels with each report, from xdist workers too
    for item in items:
        marker = item.get_closest_marker("real_engine")
        if marker is not None:
            item.user_properties.append(("real_engine", marker.args[0]))


def pytest_terminal_summary(terminalreporter) -> None:
    """One line per real engine whose tests were collected: how many passed, failed and
    were skipped, and the first skip's reason."""
    engines: dict[str, dict] = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            name = dict(getattr(report, "user_properties", ())).get("real_engine")
            if name is None or (outcome == "passed" and report.when != "call"):
                continue
            counts = engines.setdefault(name, {})
            counts[outcome] = counts.get(outcome, 0) + 1
            if outcome == "skipped" and "why" not in counts:
                longrepr = report.longrepr
                why = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
                counts["why"] = why.removeprefix("Skipped: ")
    if not engines:
        return
    terminalreporter.section("real engines")
    for name, counts in sorted(engines.items()):
        ran = counts.get("passed", 0) + counts.get("failed", 0) + counts.get("error", 0)
        said = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped")
                         if counts.get(k))
        verdict = "RAN" if ran else "DID NOT RUN"
        why = f" ({counts['why']})" if counts.get("why") else ""
        terminalreporter.write_line(f"{name}: {verdict}: {said}{why}")
