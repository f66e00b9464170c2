"""Atomic writes: a stage's outputs appear whole or not at all.

DVC links outs into its cache (read-only hardlinks under `cache.type hardlink,symlink`),
so a stage never opens an existing output for writing: it writes a new temporary path
beside the target and renames it over the old one. Temporary names carry the writer's
pid: what a killed run (SIGKILL, the OOM killer) left behind is removed by the next
writer of the same target once that pid is gone. (SIGTERM and Ctrl-C unwind normally and
remove their own; see stages/process/cli.py.)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from stages.common import reports

_UMASK = os.umask(0)
os.umask(_UMASK)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _clear_stale(target: Path) -> None:
    """Remove `.NAME.tmp-PID-*` / `.NAME.old-PID` beside `target` whose PID is gone."""
    for kind in ("tmp", "old"):
        prefix = f".{target.name}.{kind}-"
        for path in target.parent.glob(prefix + "*"):
            pid = path.name[len(prefix):].split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder that replaces `target` only if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-",
                                dir=target.parent))
    tmp.chmod(0o777 & ~_UMASK)  # mkdtemp makes it 0700; outputs are shared data
    try:
        yield tmp
        old = None
        if target.exists() or target.is_symlink():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            _remove(old)
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            _remove(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(target: str | Path, mode: str = "w") -> Iterator:
    """Open a temporary file beside `target`; on success fsync it and rename over `target`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent)
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes it 0600
    kwargs = {} if "b" in mode else {"encoding": "utf-8", "newline": "\n"}
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def scratch_dir(target: str | Path, label: str) -> Path:
    """A new empty folder beside `target` for a run's own temporary files (the caller
    removes it), named like atomic_dir's: what a run killed outright left there is
    removed by the next writer of `target`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(target)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-{label}-",
                                 dir=target.parent))


def write_json(path: str | Path, obj) -> None:
    with atomic_file(path) as f:
        json.dump(obj, f, indent=2, sort_keys=False, ensure_ascii=False)
        f.write("\n")


def write_report(folder: Path, stage: str, obj: dict) -> Path:
    """Write the stage's report under `folder` (`--reports`): its data facts to the DVC
    metrics file, which is returned, and the run's figures beside (stages/common/reports.py)."""
    facts, run = reports.split(stage, obj)
    write_json(reports.run_path(folder, stage), run)
    path = reports.facts_path(folder, stage)
    write_json(path, facts)
    return path
