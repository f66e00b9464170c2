"""How a stage's worker processes live: Ctrl-C and SIGTERM are the parent's to handle, a
worker ends, without a word, when its parent does, and the parent never waits for ever
on a worker that is gone or stopped.

A parent killed outright (SIGKILL, the OOM killer) cannot stop its workers, so each
worker watches for its parent to go, then exits at once and writes nothing more (not
PR_SET_PDEATHSIG: it follows the *thread* that forked a worker, and a Pool forks
replacements from a thread that ends before it does). A pool whose worker was killed or
stopped never delivers that worker's result: `Workers` waits for a result in slices,
says which in one line, and kills the pool's processes (terminating could wait for ever
on the task queue's lock a killed worker held).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from stages.common.errors import StageError

STOPPED_LIMIT = 60.0  # seconds a worker may stay stopped while its result is awaited
_ORPHAN_POLL = 0.1  # seconds between a worker's looks at its parent


def init_worker(parent: int) -> None:
    """A pool's initializer (`initargs=(os.getpid(),)`): Ctrl-C is ignored (the parent
    stops the pool), SIGTERM ends the worker at once whatever handler fork copied, and
    the worker ends, silent, when `parent` does."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.stderr = _SilentWhenOrphaned(sys.stderr, parent)
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True,
                     name="orphan-watch").start()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_ORPHAN_POLL)
    os._exit(0)


class _SilentWhenOrphaned:
    """A worker's stderr that drops what comes once its parent is gone (the traceback of
    a result sent into a closed pipe, before the watcher thread ends the worker)."""

    def __init__(self, stream, parent: int):
        self._stream, self._parent = stream, parent

    def write(self, text: str) -> int:
        if os.getppid() != self._parent:
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _Pool(multiprocessing.pool.Pool):
    """A pool whose worker-keeping thread sleeps while results flow. CPython's also waits
    on the results pipe, readable for as long as a result is not wholly read: it woke
    ~6,000 times in a 1.2 s tokenize run (0.05 s of CPU, and the GIL taken from the
    thread reading that result). Workers never replaces a worker, so that thread needs
    to wake only when a worker ends or the pool changes state, as ThreadPool's does."""

    def _get_sentinels(self) -> list:
        return [self._change_notifier._reader]


class Workers:
    """A multiprocessing pool of `n` workers (`context`: "fork" or "spawn") set up with
    `init_worker`, whose results are awaited with an eye on the workers."""

    def __init__(self, context: str, n: int):
        self.pool = _Pool(n, initializer=init_worker, initargs=(os.getpid(),),
                          context=multiprocessing.get_context(context))
        # the processes it started with (CPython keeps them in `_pool`): any of them
        # that ends while results are awaited is an error, so replacements need no watch
        self.procs = list(self.pool._pool)
        self.lost = False

    def submit(self, fn: Callable, *args) -> "multiprocessing.pool.AsyncResult":
        return self.pool.apply_async(fn, args)

    def result(self, job: "multiprocessing.pool.AsyncResult", stage: str) -> Any:
        """`job.get()`, or StageError once a worker has ended (its task's result will
        never come) or has been stopped for STOPPED_LIMIT seconds."""
        stopped_since = None
        while True:
            try:
                return job.get(timeout=1.0)
            except multiprocessing.TimeoutError:
                pass
            ended = [proc for proc in self.procs if proc.exitcode is not None]
            if ended:
                self._abandon()
                raise StageError(f"{stage}: worker process {ended[0].pid} ended "
                                 f"({_how(ended[0].exitcode)}) before returning its work; "
                                 "nothing partial was written")
            if any(_stopped(proc.pid) for proc in self.procs):
                stopped_since = stopped_since or time.monotonic()
                if time.monotonic() - stopped_since >= STOPPED_LIMIT:
                    self._abandon()
                    raise StageError(f"{stage}: a worker process has been stopped (SIGSTOP) "
                                     f"for {STOPPED_LIMIT:g} s; nothing partial was written")
            else:
                stopped_since = None

    def close(self) -> None:
        """All work done: the workers exit on their own."""
        if not self.lost:
            self.pool.close()
            self.pool.join()

    def terminate(self) -> None:
        """Stop the workers now (an error, Ctrl-C): killed, the pool's threads left
        waiting. Pool.terminate joins its task handler, which can be blocked putting a
        task into a queue no worker reads any more: tokenize's error path once waited
        160 s there (a test's run of a few seconds)."""
        if not self.lost:
            self._abandon()

    def _abandon(self) -> None:
        """Kill every worker (a stopped one too) and leave the pool's threads waiting:
        terminating it, at once or at exit, could wait for ever (see the module doc)."""
        self.lost = True
        pool = self.pool
        pool._terminate.cancel()  # its at-exit terminate
        # what terminate() does first: its handler thread stops replacing dead workers
        pool._worker_handler._state = multiprocessing.pool.TERMINATE
        pool._change_notifier.put(None)
        pool._worker_handler.join(5)
        procs = list(pool._pool) + self.procs
        for proc in procs:
            if proc.exitcode is None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in procs:
            proc.join(5)  # SIGKILL ends a stopped process too: reaped here


def _how(code: int) -> str:
    if code >= 0:
        return f"exit status {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
    return f"killed by {name}" + (", out of memory?" if -code == signal.SIGKILL else "")


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped, from /proc (False without it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    end = stat.rfind(b")")  # "pid (comm) state ...": comm may hold anything
    return stat[end + 2 : end + 3] in (b"T", b"t")
