"""The decontamination checker: a process of its own that checks batches of prompt texts
against the index while a single-process prepare goes on making the next batches' rows.

On a machine of two CPUs prepare runs in one process (workers would only compete with
it), which leaves one CPU idle; checking there takes most of decontamination's cost off
prepare. prepare sends each batch as its counts and one packed buffer (ngrams.pack) and
reads the answers back in the order it sent them, CHECK_AHEAD batches ahead at most.

An answer is awaited CHECK_TIMEOUT seconds at most: a checker that was stopped (SIGSTOP)
or starved gives none, and prepare then checks the batches it holds itself (their texts
are still at hand), with a warning, and stops the checker. Batches leave from a thread
of their own, so a full pipe to a checker that reads nothing never holds prepare up; and
stopping never waits on it for ever: a process deaf to SIGTERM (or stopped) is killed.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence

from stages.common.errors import StageError
from stages.sources import decontam, ngrams

log = logging.getLogger(__name__)

CHECK_AHEAD = 4  # batches sent to the checker and not yet answered, at most
# a batch is checked in milliseconds to a second; this long without an answer, the
# checker is stopped or starved of CPU
CHECK_TIMEOUT = 60.0
STOP_TIMEOUT = 5.0  # seconds a checker has to exit on SIGTERM before SIGKILL
_PIPE_BYTES = 1 << 20  # asked of the pipe to the checker: CHECK_AHEAD batches' texts fit


class Checker:
    """The checker process of one run, started on the first `ready()`; `folder()` gives
    the saved index it memory-maps. Until it has loaded the index it is not ready."""

    def __init__(self, folder: Callable[[], str], timeout: float = CHECK_TIMEOUT):
        self.folder = folder
        self.timeout = timeout
        self.proc = self.asks = self.answers = self._sender = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.loaded = False
        self.gave_up = False  # it did not answer in time: every batch is checked here

    def ready(self) -> bool:
        if self.gave_up:
            return False
        if self.proc is None:
            ctx = multiprocessing.get_context("spawn")  # as prepare's workers
            asks, self.asks = ctx.Pipe(duplex=False)
            self.answers, answers = ctx.Pipe(duplex=False)
            _widen(self.asks)
            self.proc = ctx.Process(target=_serve, args=(asks, answers, self.folder()), daemon=True)
            self.proc.start()
            asks.close()
            answers.close()
            self._outbox = queue.SimpleQueue()
            self._sender = threading.Thread(target=_send_batches, args=(self._outbox, self.asks),
                                            daemon=True, name="checker-send")
            self._sender.start()
        if not self.loaded and self.answers.poll():
            self.loaded = self._reply() == "loaded"
        return self.loaded

    def send(self, texts: Sequence[str], counts: list[int]) -> None:
        """Texts of prompts (counts[p] of them for prompt p), as Index.check takes them."""
        if self.gave_up:
            return  # hits() answers None: the caller checks them
        if not self.proc.is_alive():
            raise _gone()
        self._outbox.put((counts, ngrams.pack(texts)))

    def hits(self) -> Optional[list]:
        """Index.check's answer for the oldest batch sent and not yet answered, or None
        when the caller must check it itself: a text held \\0, which a packed buffer
        cannot tell apart, or the checker gave no answer in time."""
        if self.gave_up:
            return None
        try:
            answered = self.answers.poll(self.timeout)
        except (EOFError, OSError):
            raise _gone() from None
        if not answered:
            log.warning("decontamination checker (pid %d): no answer for %g s (stopped, or "
                        "starved of CPU): checking in this process from here on",
                        self.proc.pid, self.timeout)
            self.close()
            self.gave_up = True
            return None
        return self._reply()

    def _reply(self):
        try:
            reply = self.answers.recv()
        except (EOFError, OSError):
            raise _gone() from None
        if type(reply) is tuple:
            raise StageError(f"prepare: decontamination checker: {reply[1]}")
        return reply

    def close(self) -> None:
        if self.proc is not None:
            self._outbox.put(None)
            self.proc.terminate()
            self.proc.join(STOP_TIMEOUT)
            if self.proc.exitcode is None:  # stopped, or deaf to SIGTERM: SIGKILL ends both
                self.proc.kill()
                self.proc.join()
            # the process is gone: a send blocked on a full pipe fails and its thread ends
            self._sender.join(STOP_TIMEOUT)
            self.asks.close()
            self.answers.close()
            self.proc = self.asks = self.answers = self._sender = None
            self.loaded = False


def _send_batches(outbox: queue.SimpleQueue, asks) -> None:
    """prepare's side: send each (counts, packed texts) until None comes."""
    while (batch := outbox.get()) is not None:
        try:
            asks.send(batch[0])
            asks.send_bytes(batch[1])
        except OSError:  # the checker is gone: hits() says so
            return


def _gone() -> StageError:
    return StageError("prepare: the decontamination checker process ended unexpectedly")


def _widen(conn) -> None:
    """A pipe that holds CHECK_AHEAD batches, so that sending one does not wait for the
    checker to read (Linux; elsewhere, or past the system's limit, it stays as it is)."""
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except (ImportError, AttributeError, OSError):
        pass


def _serve(asks, answers, folder: str) -> None:
    """The checker process: load the index, then answer each (counts, packed texts) with
    their hits (None when the buffer cannot be read apart), until prepare closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is prepare's to handle: it ends us
    try:  # woken by each batch, it must not take the CPU from prepare when they share one
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        pass
    # Answers leave from a thread of their own, so this loop always goes on to read the
    # next batch: were it to wait for prepare to read an answer while prepare waits for
    # room in the pipe to send a batch, neither would move.
    out: queue.SimpleQueue = queue.SimpleQueue()
    sender = threading.Thread(target=_send_all, args=(out, answers), daemon=True)
    sender.start()
    try:
        index = decontam.Index.load(Path(folder))
        out.put("loaded")
        while True:
            try:
                counts = asks.recv()
                data = asks.recv_bytes()
            except EOFError:
                return
            try:
                out.put(index.check_packed(data, counts))
            except ngrams.Unpacked:
                out.put(None)
    except Exception as e:  # noqa: BLE001 - told to prepare, which stops with it
        out.put(("error", f"{type(e).__name__}: {e}"))
    finally:
        out.put(_send_all)  # the end
        sender.join()


def _send_all(out: queue.SimpleQueue, answers) -> None:
    while (reply := out.get()) is not _send_all:
        try:
            answers.send(reply)
        except OSError:  # prepare has gone
            return
