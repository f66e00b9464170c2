"""How many CPUs this process may use: the one count behind every `num_proc: 0` and
`threads: 0` (each stage decides how many of them its own work can keep busy); and how
many of them sat idle since a `times()` reading (`idle_since`).

No byte of any output depends on it: stages write the same data whatever the count.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional


def usable() -> int:
    """The CPUs this process may run on: its affinity mask (a container's or `taskset`'s
    limit), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class CpuTimes(NamedTuple):
    """CPU time so far, in ticks, of the CPUs this process may run on."""

    idle: int  # idle and waiting on I/O
    total: int


def times() -> Optional[CpuTimes]:
    """The CpuTimes of now, from /proc/stat; None where there is none."""
    try:
        mine = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        with open("/proc/stat", "rb") as f:
            lines = f.read().decode("ascii", "replace").splitlines()
    except (AttributeError, OSError):  # not Linux
        return None
    idle = total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name in mine:
            ticks = [int(x) for x in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
            idle += ticks[3] + ticks[4]
            total += sum(ticks)
    return CpuTimes(idle, total) if total else None


def idle_since(since: Optional[CpuTimes]) -> float:
    """How many of this process's CPUs sat idle on average since the reading `since`
    (0 when it cannot be told). Not the load average: that of the minute before counts
    what ran before the reading."""
    now = times()
    if since is None or now is None or now.total <= since.total:
        return 0.0
    return (now.idle - since.idle) / (now.total - since.total) * usable()


def workers_beside_reader() -> int:
    """One worker per CPU but one (left to the reading process), at most 8; on two CPUs
    or fewer that is a single process, because workers would only compete with it (a
    decontamination checker, which takes less of a core, may run beside it)."""
    n = min(usable() - 1, 8)
    return n if n >= 2 else 1

