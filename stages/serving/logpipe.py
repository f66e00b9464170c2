"""A child process's output, copied into a log file with every secret masked.

A launched engine writes what it likes to stdout and stderr: its arguments, its
environment, the headers of a request it rejects. Handed the log file itself it would
write a secret there; handed the write end of a `LogPipe` instead, its output reaches the
file only through a `Redactor` (stages/common/secrets.py), a line at a time (a line without an
end is written once it passes `MAX_LINE` bytes).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Optional

from stages.common.secrets import Redactor

MAX_LINE = 1 << 16


class LogPipe:
    """A pipe whose reading end a thread copies, redacted, to the end of `path`.

    Give `fd` to the children as their stdout/stderr, then `close_writer()` here; the
    copy ends when the last child holding the write end has closed it (`join`)."""

    def __init__(self, path: Path, redact: Redactor):
        self.path = Path(path)
        self.redact = redact
        read_fd, self.fd = os.pipe()
        self._thread = threading.Thread(target=self._copy, args=(read_fd,), daemon=True,
                                        name=f"log {self.path.name}")
        self._thread.start()

    def close_writer(self) -> None:
        """This process's copy of the write end: the children hold theirs."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the copy to end (every writer gone); a grandchild that escaped the
        engine's group may hold the pipe for ever: then give up after `timeout`."""
        self.close_writer()
        self._thread.join(timeout)

    def _copy(self, read_fd: int) -> None:
        pending = b""
        with os.fdopen(read_fd, "rb", buffering=0) as pipe, open(self.path, "ab") as log:
            while chunk := pipe.read(MAX_LINE):
                pending += chunk
                end = pending.rfind(b"\n") + 1
                if not end and len(pending) >= MAX_LINE:
                    end = len(pending)
                if end:
                    log.write(self._masked(pending[:end]))
                    log.flush()
                    pending = pending[end:]
            if pending:
                log.write(self._masked(pending))

    def _masked(self, data: bytes) -> bytes:
        # surrogateescape: bytes that are not UTF-8 go through unchanged
        text = data.decode("utf-8", "surrogateescape")
        return self.redact(text).encode("utf-8", "surrogateescape")
