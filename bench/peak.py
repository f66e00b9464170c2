"""Peak memory of a stage run in a process of its own.

Not ru_maxrss: Linux carries the high-water mark of the address space a process had
before exec (its parent's, after fork or vfork) into the child's ru_maxrss, so a stage
started from a bench that holds gigabytes of mapped shards reports the bench's peak.
VmHWM in /proc/self/status belongs to the address space exec gave the stage.
"""

from __future__ import annotations

import json
import sys

STAGE = """
import json, sys
from stages.process import cli
name = sys.argv[1]
stage = __import__("stages." + name, fromlist=["run"])
code = cli.main(name, "", stage.run, stage.PATHS, sys.argv[2:])
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"rc": code, "peak_mb": int(status["VmHWM"].split()[0]) / 1024}))
"""


def stage_command(name: str, *args: str) -> list[str]:
    """dvc.yaml's `python -m stages.NAME PATHS` + ARGS, as a command that prints its own
    peak at the end."""
    from stages.process import cli

    return [sys.executable, "-c", STAGE, name, *cli.pipeline_command(name)[3:], *args]


def outcome(stdout: str) -> tuple[int, float]:
    """(exit status, peak RSS in MB) from the last line the command printed."""
    child = json.loads(stdout.strip().splitlines()[-1])
    return child["rc"], child["peak_mb"]
