"""The numeric tests (`-m numeric`) again under every ATen kernel set this CPU offers and
with 1, 2 and more torch threads than cores.

How a float reduction is split depends on the kernels torch picks (`ATEN_CPU_CAPABILITY`)
and on the threads it has: a bound that holds for one split only fails on the next CPU.
Each run is a fresh pytest process, so torch reads the kernel set at import; its header
line proves which kernels and threads it computed with (a kernel set above the CPU's is
silently lowered by torch: such a set is skipped, saying so).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

from tests.conftest import TORCH_THREADS
from tests.helpers.repo import ROOT, env

pytestmark = pytest.mark.slow

# ATen's kernel sets, lowest first; "default" runs everywhere
CAPABILITIES = ("default", "avx2", "avx512")
THREADS = (1, 2, (os.cpu_count() or 1) + 2)


@functools.cache
def offered() -> tuple[str, ...]:
    """The kernel sets torch takes on this CPU: each asked for, kept if torch says so."""
    def taken(capability: str) -> str:
        return subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
            env=settings_env(capability, 1), capture_output=True, text=True, check=True,
            timeout=120).stdout.strip()

    return tuple(c for c in CAPABILITIES if taken(c) == c.upper())


def settings_env(capability: str, threads: int) -> dict:
    e = env()
    e.update({"ATEN_CPU_CAPABILITY": capability, TORCH_THREADS: str(threads)})
    return e


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("capability", CAPABILITIES)
def test_numeric_tests_pass_under_this_kernel_set_and_thread_count(capability, threads):
    if capability not in offered():
        pytest.skip(f"this CPU offers no {capability} kernels (torch lowers it)")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "numeric", "-p", "no:cacheprovider",
         "-p", "no:xdist", "--timeout=600", "tests/"],
        cwd=ROOT, env=settings_env(capability, threads), capture_output=True, text=True,
        timeout=900)
    out = run.stdout
    assert f"torch kernels: {capability.upper()}, threads: {threads}\n" in out, out[:3000]
    assert run.returncode == 0, out[-4000:] + run.stderr[-2000:]
    assert " passed" in out and " failed" not in out, out[-2000:]
