"""What every benchmark shares about running things: the size switch, its scratch folder,
and the environment and shell of the stage, `dvc` and Python commands it starts."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20


def quick() -> bool:
    """Smaller inputs (`BENCH_QUICK=1` or `--quick`): a quick look, fixed costs weigh more."""
    return os.environ.get("BENCH_QUICK") == "1" or "--quick" in sys.argv


def settle_disk() -> None:
    """Write every dirty page out before a timed side starts: the kernel throttles a
    writer by the dirty pages the one before it left (a 2 GB copy leaves 2 GB), so
    without this the side that runs second pays for the first one's writes."""
    os.sync()


def copy_seconds(files: list[Path], dest: Path) -> float:
    """Seconds to copy `files` into the new folder `dest` (removed again), the disk
    settled first: the copy baseline of the stages that place shards."""
    dest.mkdir()
    settle_disk()
    start = time.perf_counter()
    for path in files:
        shutil.copyfile(path, dest / path.name)
    seconds = time.perf_counter() - start
    shutil.rmtree(dest)
    return seconds


def set_bytes(quick: bool, full_mb: int) -> tuple[int, int]:
    """(bytes of the set, bytes per shard) a set-sized benchmark writes: 256 MB in 64 MB
    shards when quick, else `full_mb` in 256 MB shards."""
    return (256 if quick else full_mb) * MB, (64 if quick else 256) * MB


@contextlib.contextmanager
def scratch(work: Path) -> Iterator[Path]:
    """`work`, empty, removed again whatever happens: a benchmark's sets can be gigabytes."""
    shutil.rmtree(work, ignore_errors=True)
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def env() -> dict:
    """This interpreter's bin first on PATH (dvc.yaml's commands run `python`), offline,
    the project importable."""
    out = dict(os.environ)
    out["PATH"] = str(Path(sys.executable).parent) + os.pathsep + out.get("PATH", "")
    out.update(DVC_NO_ANALYTICS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return out


def sh(cmd: list[str], cwd: Path) -> str:
    """Run `cmd` in `cwd`; its stdout, or RuntimeError with the end of its stderr."""
    proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{cmd} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def python_json(code: str, *args: str) -> dict:
    """Run `python -c code args` in its own process (its peak RSS is its own) and read the
    JSON object its last line prints; RuntimeError if it failed or says `rc`."""
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines else {}
    if proc.returncode or result.get("rc"):
        raise RuntimeError(f"exited {proc.returncode}: {proc.stderr[-2000:]}")
    return result
