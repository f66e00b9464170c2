"""The decontamination checker: a process of its own that checks batches of prompt texts
against the index while a single-process prepare goes on making the next batches' rows.

On a machine of two CPUs prepare runs in one process (workers would only compete with
it), which leaves one CPU idle; checking there takes most of decontamination's cost off
prepare. prepare sends each batch as its counts and one packed buffer (decontam.pack) and
reads the answers back in the order it sent them, CHECK_AHEAD batches ahead at most.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence

from stages import decontam
from stages.errors import StageError

CHECK_AHEAD = 4  # batches sent to the checker and not yet answered, at most
_PIPE_BYTES = 1 << 20  # asked of the pipe to the checker: CHECK_AHEAD batches' texts fit


class Checker:
    """The checker process of one run, started on the first `ready()`; `folder()` gives
    the saved index it memory-maps. Until it has loaded the index it is not ready."""

    def __init__(self, folder: Callable[[], str]):
        self.folder = folder
        self.proc = self.asks = self.answers = None
        self.loaded = False

    def ready(self) -> bool:
        if self.proc is None:
            ctx = multiprocessing.get_context("spawn")  # as prepare's workers
            asks, self.asks = ctx.Pipe(duplex=False)
            self.answers, answers = ctx.Pipe(duplex=False)
            _widen(self.asks)
            self.proc = ctx.Process(target=_serve, args=(asks, answers, self.folder()), daemon=True)
            self.proc.start()
            asks.close()
            answers.close()
        if not self.loaded and self.answers.poll():
            self.loaded = self._reply() == "loaded"
        return self.loaded

    def send(self, texts: Sequence[str], counts: list[int]) -> None:
        """Texts of prompts (counts[p] of them for prompt p), as Index.check takes them."""
        try:
            self.asks.send(counts)
            self.asks.send_bytes(decontam.pack(texts))
        except OSError:  # a broken pipe
            raise _gone() from None

    def hits(self) -> Optional[list]:
        """Index.check's answer for the oldest batch sent and not yet answered, or None
        when a text held \\0, which a packed buffer cannot tell apart: check it here."""
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
            self.asks.close()
            self.answers.close()
            self.proc.terminate()
            self.proc.join()
            self.proc = self.asks = self.answers = None
            self.loaded = False


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
            except decontam.Unpacked:
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
