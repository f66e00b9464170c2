"""How many CPUs this process may use: the one count behind every `num_proc: 0` and
`threads: 0` (each stage decides how many of them its own work can keep busy).

No byte of any output depends on it: stages write the same data whatever the count.
"""

from __future__ import annotations

import os


def usable() -> int:
    """The CPUs this process may run on: its affinity mask (a container's or `taskset`'s
    limit), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
