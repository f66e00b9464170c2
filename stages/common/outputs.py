"""Atomic writes: a stage's outputs appear whole or not at all, text and JSON through the
one redactor, and the one rule for where they may go (`check_apart`).

DVC links outs into its cache (read-only hardlinks under `cache.type hardlink,symlink`),
so a stage never opens an existing output for writing: it writes a new temporary path
beside the target and renames it over the old one. Temporary names carry the writer's
pid: what a killed run (SIGKILL, the OOM killer) left behind is removed by the next
writer of the same target once that pid is gone. (SIGTERM and Ctrl-C unwind normally and
remove their own; see stages/process/cli.py.)
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Optional

from stages.common import reports, secrets
from stages.common.errors import StageError

_UMASK = os.umask(0)
os.umask(_UMASK)

# a write that failed for want of room: a full disk, a quota, a file-size limit
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# pyarrow's write errors ("[errno 28]") and Rust libraries' (tokenizers: a plain
# Exception, "(os error 28)") carry the errno only in their text
_NO_ROOM_TEXT = re.compile(r"(\[errno|\(os error) (%s)\b" % "|".join(map(str, sorted(_NO_ROOM))))


class NoRoom(StageError):
    """A write of an output failed for want of room (the output's disk, not an input)."""


def no_room(e: BaseException) -> bool:
    """Whether `e` is a write that failed for want of room."""
    if isinstance(e, NoRoom) or isinstance(e, OSError) and e.errno in _NO_ROOM:
        return True
    return not isinstance(e, StageError) and bool(_NO_ROOM_TEXT.search(str(e)))


@contextlib.contextmanager
def room_named(target: Path) -> Iterator[None]:
    """A write failing for want of room inside the block, reported as `target`'s (the
    output the user named), never as the input being read at the time."""
    try:
        yield
    except Exception as e:
        if not no_room(e):
            raise
        code = getattr(e, "errno", None)
        if code not in _NO_ROOM:
            told = _NO_ROOM_TEXT.search(str(e))
            code = int(told.group(2)) if told else errno.ENOSPC
        why = os.strerror(code)
        raise NoRoom(f"{target}: no room to write this output ({why}); nothing of it was "
                     "written, what was there is kept; free space there or name another "
                     "place") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _clear_stale(target: Path) -> None:
    """Remove `.NAME.tmp-PID-*` / `.NAME.old-PID` beside `target` whose PID is gone; an
    old one with no `target` is put back: its run was killed between atomic_dir's two
    renames, and it is the last version the user had."""
    for kind in ("old", "tmp"):
        prefix = f".{target.name}.{kind}-"
        for path in sorted(target.parent.glob(prefix + "*")):
            pid = path.name[len(prefix):].split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                if kind == "old" and not (target.exists() or target.is_symlink()):
                    os.replace(path, target)
                else:
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
        with room_named(target):
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
        with room_named(target), os.fdopen(fd, mode, **kwargs) as f:
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
    """`obj` as indented JSON, every string through the one redactor (secrets.WRITTEN)."""
    with atomic_file(path) as f:
        json.dump(secrets.WRITTEN.scrub(obj), f, indent=2, sort_keys=False, ensure_ascii=False)
        f.write("\n")


def write_text(path: str | Path, text: str) -> None:
    """`text` through the one redactor (secrets.WRITTEN), written atomically."""
    with atomic_file(path) as f:
        f.write(secrets.WRITTEN(text))


def write_report(folder: Path, stage: str, obj: dict) -> Path:
    """Write the stage's report under `folder` (`--reports`): its data facts to the DVC
    metrics file, which is returned, and the run's figures beside (stages/common/reports.py)."""
    facts, run = reports.split(stage, obj)
    write_json(reports.run_path(folder, stage), run)
    path = reports.facts_path(folder, stage)
    write_json(path, facts)
    return path



def _real(path: str | Path, name: str) -> Path:
    """Where `path` points once every link is followed (a path not there yet included)."""
    try:
        return Path(os.path.realpath(os.fspath(path), strict=False))
    except (OSError, RuntimeError, ValueError) as e:  # a link loop, a NUL byte
        raise StageError(f"{name} {path}: cannot be resolved ({e})") from None


def check_apart(inputs: dict[str, Optional[str | Path]],
                replaced: Iterable[tuple[str, str | Path]]) -> None:
    """The one rule for where a stage writes: StageError when an input (`name: path`, None
    skipped) is, is inside or holds a folder the stage replaces whole (`(name, path)`
    pairs): replacing it would remove that input or change it under the stage."""
    outs = [(name, path, _real(path, name)) for name, path in replaced]
    for in_name, in_path in inputs.items():
        if in_path is None or str(in_path) == "":
            continue
        given = _real(in_path, in_name)
        for out_name, out_path, out in outs:
            if given == out or given.is_relative_to(out):
                raise StageError(
                    f"{in_name}: {in_path} is inside {out_name} {out_path}, which this stage "
                    "replaces whole: it would be removed; keep every input outside it")
            if out.is_relative_to(given):
                raise StageError(
                    f"{out_name} {out_path} is inside {in_name} {in_path}: replacing it "
                    "would change that input; name folders apart from each other")
        for link, real in _links(given):
            for out_name, out_path, out in outs:
                if real == out or real.is_relative_to(out):
                    raise StageError(
                        f"{in_name}: {Path(in_path) / link.relative_to(given)} links into "
                        f"{out_name} {out_path}, which this "
                        "stage replaces whole: the input would change with it; copy the "
                        "file instead")


def _links(folder: Path) -> Iterator[tuple[Path, Path]]:
    """(link, where it resolves) for each link under `folder`, links not followed."""
    if not folder.is_dir():
        return
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root, name)
            if path.is_symlink():
                yield path, _real(path, str(path))
