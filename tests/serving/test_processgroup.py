"""Ending an engine's process group: real process groups on loopback."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from stages.serving import processgroup
from tests.helpers.processes import wait_gone


def test_a_group_ignoring_sigterm_is_killed_after_the_grace():
    script = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(600)"  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, process_group=0)
    proc.stdout.readline()  # the handler is in place
    t0 = time.monotonic()
    processgroup.kill_group(proc, grace=1.0)
    assert 0.9 <= time.monotonic() - t0 < 30
    assert proc.returncode == -signal.SIGKILL


def test_a_stop_waits_for_the_whole_group_not_just_the_leader(tmp_path):
    # an engine's leader can exit on SIGTERM while its schedulers still shut down (and
    # hold GPU memory): the stop, and so a restart, waits for every member of the group
    marker = tmp_path / "child-done"
    child = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    time.sleep(1.0)\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print(1, flush=True)\n"
        "time.sleep(600)\n"
    )
    leader = (
        "import subprocess, sys, time\n"
        f"c = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE)\n"
        "c.stdout.readline()\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", leader], stdout=subprocess.PIPE, process_group=0)
    child_pid = int(proc.stdout.readline())
    processgroup.kill_group(proc, grace=10.0)
    assert marker.exists()  # the child finished its own shutdown: it was not SIGKILLed
    assert wait_gone([child_pid], 0.5)
