"""A child's output reaches its log only through the redactor (stages/serving/logpipe.py)."""

from __future__ import annotations

import subprocess
import sys

from stages.common.secrets import Redactor
from stages.serving.logpipe import LogPipe, MAX_LINE

KEY = "sk-logpipe-5e2b8c01d9"


def test_a_childs_output_is_written_with_the_key_masked(tmp_path):
    log = tmp_path / "engine.log"
    log.write_bytes(b"=== earlier\n")
    pipe = LogPipe(log, Redactor([KEY]))
    code = ("import sys, base64\n"
            f"print('args: --api-key {KEY}', flush=True)\n"
            f"sys.stderr.write('no newline ' + {KEY!r}[3:])\n"
            f"sys.stdout.buffer.write(b'\\xff raw bytes ' + base64.b64encode(b'Bearer {KEY}') + b'\\n')\n"
            f"print('x' * {2 * MAX_LINE})\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=pipe.fd, stderr=pipe.fd)
    pipe.close_writer()
    child.wait(30)
    pipe.join(10)
    data = log.read_bytes()
    assert data.startswith(b"=== earlier\nargs: --api-key ***\n")
    assert b"\xff raw bytes " in data  # bytes that are not UTF-8 pass unchanged
    assert KEY[3:11].encode() not in data and b"x" * (2 * MAX_LINE) in data
    assert data.count(b"***") >= 3


def test_join_gives_up_on_a_writer_that_never_closes(tmp_path):
    pipe = LogPipe(tmp_path / "e.log", Redactor([KEY]))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             stdout=pipe.fd)
    try:
        pipe.join(0.5)  # returns: the copy goes on while the child lives
    finally:
        child.kill()
        child.wait()
    pipe.join(10)
