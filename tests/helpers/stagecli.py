"""Run a stage's command line as a user would (its paths from dvc.yaml), and read how it
failed."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

from stages.process import cli

ROOT = Path(__file__).resolve().parents[2]

# `python -m stages.<stage>` that also writes its own peak RSS (VmHWM, KiB) on the way
# out: the rusage of a child counts the forking parent's RSS, this does not
_RUN = """
import atexit, os, runpy, sys
def _peak():
    with open("/proc/self/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(os.environ["PEAK_RSS_FILE"], "w") as out:
        out.write(kib)
atexit.register(_peak)
stage = sys.argv.pop(1)
runpy.run_module("stages." + stage, run_name="__main__", alter_sys=True)
"""


def command(stage: str) -> list[str]:
    """dvc.yaml's cmd for `stage`, run by this interpreter."""
    return [sys.executable, *cli.pipeline_command(stage)[1:]]


def paths(stage: str):
    """The paths dvc.yaml's cmd gives `stage`, for calling its `run(cfg, paths)` directly."""
    return cli.pipeline_paths(stage, importlib.import_module(f"stages.{stage}").PATHS)


def measured(stage: str, argv: list[str], cwd: Path,
             timeout: float = 300) -> tuple[subprocess.CompletedProcess, int]:
    """Run `python -m stages.<stage> ARGV` in `cwd`: the finished process (text output)
    and its peak RSS in KiB."""
    peak = Path(cwd) / ".peak-rss"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", PEAK_RSS_FILE=str(peak))
    proc = subprocess.run([sys.executable, "-c", _RUN, stage, *map(str, argv)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    kib = int(peak.read_text())
    peak.unlink()
    return proc, kib


def fail(stage: str, cwd: Path, params: str | Path = "params.yaml",
         timeout: float = 300) -> tuple[str, int]:
    """Run `python -m stages.<stage>` in `cwd`; it must exit 1 with exactly one `error:`
    line and no traceback. Returns that line and the run's peak RSS in KiB."""
    argv = [*cli.pipeline_command(stage)[3:], "--params", str(params)]  # dvc.yaml's paths
    proc, kib = measured(stage, argv, cwd, timeout)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0], kib


def covers(dep: str, path: str) -> bool:
    """Whether a dvc.yaml dep (a file or a folder) covers `path`, both relative to the repo."""
    return path == dep or path.startswith(dep.rstrip("/") + "/")


def export_fails(*argv, cwd: Path) -> str:
    """The command's one `error:` line (exit 1, no traceback)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "stages.export", *map(str, argv)], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]
