"""The same rows in another version of the set, and the tokens that differ.

`at_revision(folder, rev)` gives a local folder holding `folder` as it was at git
revision `rev`, read through DVC without checking anything out: files in the local DVC
cache are linked from there (read-only, never copied), others fetched through
`DVCFileSystem` (a remote, or git itself) into a temporary folder removed afterwards.
`differences(old, new)` aligns two token sequences (difflib, no junk heuristic) and
flags, on each side, the tokens that are not in the other or whose supervision changed.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from stages.common.errors import StageError


@contextlib.contextmanager
def at_revision(folder: str | Path, rev: str) -> Iterator[Path]:
    """`folder` (inside the current repo) as it was at `rev`, as a local folder."""
    try:
        from dvc.api import DVCFileSystem
        from dvc.repo import Repo
    except ImportError:
        raise StageError("--rev needs dvc (pip install the project)") from None
    root = Path(_git_root())
    try:
        rel = Path(folder).resolve().relative_to(root).as_posix()
    except ValueError:
        raise StageError(f"--rev: {folder} is not inside the git repository {root}") from None
    tmp = Path(tempfile.mkdtemp(prefix="show-rev-"))
    try:
        try:
            fs = DVCFileSystem(str(root), rev=rev)
            entries = fs.ls(rel, detail=True)
            cache = Repo(str(root)).cache.local
        except Exception as e:  # noqa: BLE001 - dvc and scmrepo raise many kinds
            raise StageError(f"--rev {rev}: cannot read {rel} at that revision "
                             f"({type(e).__name__}: {str(e)[:200]})") from None
        for entry in entries:
            if entry.get("type") != "file" or entry["name"].rstrip("/") == rel:
                continue  # a folder, or the out itself where the revision has no version
            name = Path(entry["name"]).name
            md5 = entry.get("md5") or (entry.get("dvc_info") or {}).get("md5")
            cached = cache.oid_to_path(md5) if md5 else None
            if cached and os.path.isfile(cached):
                os.symlink(cached, tmp / name)
            else:
                try:
                    fs.get_file(entry["name"], str(tmp / name))
                except Exception as e:  # noqa: BLE001
                    raise StageError(f"--rev {rev}: cannot fetch {entry['name']} "
                                     f"({type(e).__name__}: {str(e)[:200]})") from None
        if not any(tmp.iterdir()):
            raise StageError(f"--rev {rev}: {rel} holds no files at that revision (a "
                             "version is in git once dvc.lock is committed after dvc repro)")
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _git_root() -> str:
    import subprocess

    proc = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                          text=True, timeout=60)
    if proc.returncode != 0:
        raise StageError("--rev: not inside a git repository")
    return proc.stdout.strip()


def differences(old_ids: np.ndarray, old_sup: np.ndarray, new_ids: np.ndarray,
                new_sup: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token of each side: True where it differs from the other side (inserted,
    deleted, replaced, or the same token with its supervision changed)."""
    a, b = np.asarray(old_ids).tolist(), np.asarray(new_ids).tolist()
    old, new = np.ones(len(a), bool), np.ones(len(b), bool)
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            same = np.asarray(old_sup[i1:i2], bool) == np.asarray(new_sup[j1:j2], bool)
            old[i1:i2] = ~same
            new[j1:j2] = ~same
    return old, new
