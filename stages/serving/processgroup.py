"""An engine's process group: ended whole, and never outliving the stage that started it.

`start_guard(leader, grace, stderr)` adds a small process to the group of `leader` that
ends the group once the stage is gone, even killed by SIGKILL; `kill_group(proc, grace)`
sends the group SIGTERM, waits for every member (an engine's schedulers hold GPU memory
until they exit, not just the leader), and SIGKILLs what is left after `grace` seconds.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import Optional

log = logging.getLogger(__name__)

# Runs inside the engine's process group and kills that group once the process that
# launched it is gone (reparented), which covers a SIGKILLed stage. It ignores the
# group's SIGTERM so that a normal stop reaches the engine first; the final SIGKILL
# of the group ends it too.
_GUARD = """
import os, signal, sys, time
parent, pgid, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
while os.getppid() == parent:
    time.sleep(0.5)
try:
    os.killpg(pgid, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            os.kill(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    os.killpg(pgid, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


def start_guard(leader: int, grace: float, stderr: int) -> subprocess.Popen:
    """The guard of the group led by `leader` (its process group id), which SIGKILLs the
    group `grace` seconds after its SIGTERM; OSError or SubprocessError when it cannot start."""
    return subprocess.Popen(
        [sys.executable, "-c", _GUARD, str(os.getpid()), str(leader), str(grace)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
        process_group=leader,
    )  # fmt: skip


def kill_group(proc: subprocess.Popen, grace: float, spare: Optional[int] = None) -> None:
    """SIGTERM the group led by `proc`, wait for every member (an engine's schedulers
    and workers hold GPU memory until they exit, not just the leader), SIGKILL whatever
    is left after `grace`, wait until it is gone, then reap the leader. `spare`: a
    member that ignores SIGTERM by design (the guard), not waited for before SIGKILL.

    The leader is not reaped until after the final SIGKILL, so its pid (the group id)
    cannot be reused by an unrelated process in between.
    """
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    end = time.monotonic() + grace
    while time.monotonic() < end and _group_alive(proc, spare):
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    end = time.monotonic() + 10
    while _group_alive(proc, None):
        if time.monotonic() > end:  # pragma: no cover - a process stuck in the kernel
            log.error("process group %d still has live members 10 s after SIGKILL", pgid)
            break
        time.sleep(0.05)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail
        log.error("pid %d did not exit after SIGKILL", proc.pid)


def _group_alive(proc: subprocess.Popen, spare: Optional[int]) -> bool:
    """Whether a member of `proc`'s group other than `spare` is still running."""
    members = _group_members(proc.pid)
    if members is None:  # no /proc: the leader stands for the group
        return not _exited(proc)
    members.discard(spare)
    return bool(members)


def _group_members(pgid: int) -> Optional[set[int]]:
    """Pids of the live (not zombie) processes in group `pgid`, from /proc; None without it."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    members = set()
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            members.add(int(name))
    return members


def _exited(proc: subprocess.Popen) -> bool:
    if proc.returncode is not None:
        return True
    if hasattr(os, "waitid"):
        try:  # look without reaping
            return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True
    return proc.poll() is not None

