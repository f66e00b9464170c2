"""The CPUs a stage may use, and how many of them sat idle (stages/process/cpus.py)."""

from __future__ import annotations

import os

import pytest

from stages.process import cpus
from stages.process.cpus import CpuTimes


def test_idle_cpus_since_a_reading(monkeypatch):
    monkeypatch.setattr(cpus, "usable", lambda: 2)
    since = CpuTimes(idle=100, total=1000)  # ticks of this process's CPUs
    for now, idle in ((CpuTimes(600, 2000), 1.0), (CpuTimes(350, 2000), 0.5),
                      (CpuTimes(200, 2000), 0.2), (None, 0.0)):
        monkeypatch.setattr(cpus, "times", lambda: now)
        assert cpus.idle_since(since) == pytest.approx(idle), now
    assert cpus.idle_since(None) == 0.0  # no /proc/stat: nothing to tell idle by
    if os.path.exists("/proc/stat"):
        monkeypatch.undo()
        now = cpus.times()
        assert 0 <= now.idle <= now.total
        assert 1 <= cpus.usable() <= (os.cpu_count() or 1)
