"""Worker processes end, without a word, when the stage that started them is killed
(stages/process/children.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.repo import ROOT


# a stage's pool, its workers busy with tasks whose results come back after the kill
PARENT = """
import multiprocessing, os, sys, time
from stages.process import children

def slow(x):
    time.sleep(1.5)
    return x


def pid(_):
    return os.getpid()

if __name__ == "__main__":
    ctx = multiprocessing.get_context(sys.argv[1])
    init = dict(initializer=children.init_worker, initargs=(os.getpid(),)) \\
        if sys.argv[2] == "quiet" else {}
    pool = ctx.Pool(2, **init)
    pool.map(pid, range(2), chunksize=1)  # the workers are up
    jobs = [pool.apply_async(slow, (i,)) for i in range(4)]
    print("started", flush=True)
    time.sleep(60)
"""


def killed_parent(tmp_path: Path, context: str, mode: str) -> str:
    """stderr of the parent and its workers, SIGKILLed while its workers are busy; the
    pipe closes only when every worker is gone (asserted within 20 s)."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(script), context, mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline() == "started\n"
        time.sleep(0.3)
        proc.kill()
        proc.wait()
        end = time.monotonic() + 20
        err = proc.stderr.read()  # EOF: the workers have closed it too
        assert time.monotonic() < end
        return err
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("context", ["fork", "spawn"])  # tokenize's and prepare's
def test_workers_die_quietly_with_a_killed_parent(tmp_path, context):
    started = time.monotonic()
    err = killed_parent(tmp_path, context, "quiet")
    assert "Traceback" not in err, err
    assert time.monotonic() - started < 10  # not after their tasks: at once


def test_without_it_a_worker_finishes_its_task_and_prints_a_traceback(tmp_path):
    # what the initializer prevents, seen here so that the test above means something
    err = killed_parent(tmp_path, "fork", "plain")
    assert "BrokenPipeError" in err


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_worker_killed_or_stopped_is_one_line_not_a_wait_for_ever(how, monkeypatch):
    from stages.common.errors import StageError
    from stages.process import children

    monkeypatch.setattr(children, "STOPPED_LIMIT", 2.0)
    workers = children.Workers("fork", 2)
    try:
        assert workers.result(workers.submit(_sleep, 0.01), "tokenize") == 0.01
        jobs = [workers.submit(_sleep, 30) for _ in range(3)]  # one waits in the queue
        time.sleep(0.5)
        victim = workers.procs[0]
        os.kill(victim.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        started = time.monotonic()
        word = "ended (killed by SIGKILL, out of memory?)" if how == "killed" else "stopped"
        with pytest.raises(StageError, match=rf"^tokenize: .*{re.escape(word)}"):
            workers.result(jobs[0], "tokenize")
        workers.terminate()  # what the stage does on its way out: nothing to wait for
        assert time.monotonic() - started < 10
        assert all(p.exitcode is not None for p in workers.procs + list(workers.pool._pool))
    finally:
        for proc in workers.procs:
            if proc.exitcode is None:
                os.kill(proc.pid, signal.SIGKILL)


def _bytes(n: int) -> bytes:
    return bytes(n)


def test_the_pool_keeper_sleeps_while_a_big_result_flows(monkeypatch):
    """CPython's pool thread that keeps the workers also waits on the results pipe, and
    wakes at once again and again while a result is in it (hundreds of times for this
    one); Workers' pool wakes only for a worker's end or its own state."""
    import multiprocessing.pool

    from stages.process import children

    wakes = []
    keep = multiprocessing.pool.Pool._wait_for_updates
    monkeypatch.setattr(multiprocessing.pool.Pool, "_wait_for_updates", staticmethod(
        lambda *args, **kwargs: (wakes.append(1), keep(*args, **kwargs))[1]))
    workers = children.Workers("fork", 1)
    try:
        assert len(workers.result(workers.submit(_bytes, 256 << 20), "tokenize")) == 256 << 20
        workers.close()
    finally:
        workers.terminate()
    assert 0 < len(wakes) <= 5, len(wakes)
