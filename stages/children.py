"""How a stage's worker processes live: Ctrl-C and SIGTERM are the parent's to handle,
and a worker ends, without a word, when its parent does.

A parent killed outright (SIGKILL, the OOM killer) cannot stop its workers: left alone,
one busy with a task finishes it, writes its result into a pipe no one reads, and prints
a BrokenPipeError traceback into the terminal of a run that is long gone. On Linux the
kernel kills each worker instead the moment its parent goes (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def init_worker(parent: int) -> None:
    """A pool's initializer (`initargs=(os.getpid(),)`): Ctrl-C is ignored (the parent
    stops the pool), SIGTERM ends the worker at once whatever handler fork copied, and
    the worker dies with `parent`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with(parent)


def die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process when `parent` ends (Linux; elsewhere no-op)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: not Linux
        return
    if os.getppid() != parent:  # it ended before the request took effect
        os._exit(0)
