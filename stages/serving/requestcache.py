"""Crash-safe, content-addressed cache of chat-completion replies.

    <cache_dir>/<namespace>/meta.json            model + sampling params of this key space
    <cache_dir>/<namespace>/seg-<ns>-<pid>.log   one append-only segment per run

The namespace is a hash of the model name and every sampling param; a key is the sha256
of the request payload that decides the reply (messages + tools + namespace). Each
segment line, `<64 hex key> <JSON record>`, is written with one `os.write`, so a SIGKILL
leaves at most one torn last line, which the reader skips; segments are fsync'd about
once a second and on close; nothing is rewritten in place. The in-memory index is a few
numpy arrays over the run's prompts (about 50 bytes a prompt), never a dict of replies.
What it means for a run (resume, key spaces): docs/stages.md, generate, "Resume".
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from stages.common import outputs
from stages.common.errors import StageError
from stages.common.reading import open_regular

log = logging.getLogger(__name__)

KEY_HEX = 64
FSYNC_EVERY_S = 1.0


def canonical(obj: Any) -> bytes:
    """The one byte form a JSON value is hashed in (key order and spacing fixed)."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def short_hash(obj: Any, length: int = 16) -> str:
    return hashlib.sha256(canonical(obj)).hexdigest()[:length]


def request_key(namespace: str, messages: Any, tools: Any) -> bytes:
    """sha256 over what decides a reply besides the namespace: messages and tools."""
    h = hashlib.sha256(namespace.encode())
    h.update(b"\0")
    h.update(canonical({"messages": messages, "tools": tools}))
    return h.digest()


def _key_of(line: bytes) -> Optional[bytes]:
    """The key of a `<64 hex> {...}\\n` cache line, or None for anything else."""
    if len(line) < KEY_HEX + 4 or line[KEY_HEX : KEY_HEX + 2] != b" {":
        return None
    if not line.endswith(b"}\n"):
        return None
    try:
        return bytes.fromhex(line[:KEY_HEX].decode("ascii"))
    except ValueError:  # UnicodeDecodeError included
        return None


class KeyIndex:
    """Maps a 32-byte key to the prompt positions that carry it, in ~49 bytes/prompt
    (the key, its 8-byte prefix sorted, an 8-byte position, a flag).

    Keys are held once, in prompt order, in one bytes buffer; a sorted array of their
    first 8 bytes finds candidates and the full key confirms them.
    """

    def __init__(self, digests: bytes):
        self.digests = digests
        n = len(digests) // 32
        words = np.frombuffer(digests, dtype="<u8") if n else np.zeros(0, "<u8")
        prefixes = words.reshape(n, 4)[:, 0]
        self._order = np.argsort(prefixes, kind="stable").astype(np.int64)
        self._sorted = prefixes[self._order]
        self.size = n
        # prompts whose key prefix is shared: only those need a lookup to find their twins
        shared = np.zeros(n, dtype=bool)
        if n > 1:
            same = self._sorted[1:] == self._sorted[:-1]
            shared[self._order[1:][same]] = True
            shared[self._order[:-1][same]] = True
        self.shared = shared

    def key(self, i: int) -> bytes:
        return self.digests[32 * i : 32 * i + 32]

    def twins(self, i: int) -> list[int]:
        """Every prompt position whose key equals prompt i's (i included), ascending."""
        return self.find(self.key(i)) if self.shared[i] else [i]

    def find(self, digest: bytes) -> list[int]:
        p = np.uint64(int.from_bytes(digest[:8], "little"))
        lo = int(np.searchsorted(self._sorted, p, "left"))
        hi = int(np.searchsorted(self._sorted, p, "right"))
        return [int(i) for i in self._order[lo:hi] if self.key(int(i)) == digest]


class RequestCache:
    """One key space (namespace) of the cache, opened by one run at a time."""

    def __init__(self, root: str | Path, namespace: str, meta: dict):
        self.dir = Path(root) / namespace
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.dir / ".lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise StageError(
                f"{self.dir}: another generate run is using this request cache "
                "(wait for it or stop it; two runs would send the same requests twice)"
            ) from None
        meta_path = self.dir / "meta.json"
        if not meta_path.exists():
            # keys sorted at every level, as earlier caches wrote them
            outputs.write_json(meta_path, json.loads(json.dumps(meta, sort_keys=True)))
        # Older segments first: the first valid entry for a key wins, deterministically.
        # Only regular files: anything else named like one (a FIFO) would block the reader.
        found = sorted(self.dir.glob("seg-*.log"))
        self.segments: list[Path] = [path for path in found if path.is_file()]
        for path in sorted(set(found) - set(self.segments)):
            log.warning("%s: not a regular file, not read as a cache segment", path)
        self._readers: dict[int, Any] = {}
        self._fd: Optional[int] = None
        self._seg_no = -1
        self._pos = 0
        self._last_sync = time.monotonic()
        self._dirty = False
        self.damaged = 0  # lines scan() skipped as damaged

    # ------------------------------------------------------------------ reading

    def scan(self) -> Iterator[tuple[bytes, int, int, bytes]]:
        """Yield (key, segment number, offset, JSON bytes) for every intact line.

        Any bytes at all may be on disk: a line that is not `<hex key> {...}` is skipped
        and counted in `self.damaged` (a torn last line, what a killed run leaves, is
        expected and only logged). Whether the JSON inside parses is the caller's check.
        """
        for seg_no, path in enumerate(self.segments):
            torn = 0
            with open_regular(path) as f:
                offset = 0
                for line in f:
                    start = offset
                    offset += len(line)
                    if not line.endswith(b"\n"):
                        torn += 1
                        continue
                    key = _key_of(line)
                    if key is None:
                        self.damaged += 1
                        continue
                    yield key, seg_no, start, line[KEY_HEX + 1 : -1]
            if torn:
                log.info("%s: skipped a torn last line (a killed run)", path)

    def read(self, seg_no: int, offset: int) -> dict:
        """The record at a location found by scan() or returned by append()."""
        return json.loads(self.read_json(seg_no, offset))

    def read_json(self, seg_no: int, offset: int) -> bytes:
        """The JSON bytes of the record at a location (unparsed: the caller checks them)."""
        f = self._readers.get(seg_no)
        if f is None:
            f = self._readers[seg_no] = open_regular(self.segments[seg_no])
        f.seek(offset)
        return f.readline()[KEY_HEX + 1 : -1]

    # ------------------------------------------------------------------ writing

    def _open_segment(self) -> None:
        name = f"seg-{time.time_ns():020d}-{os.getpid()}.log"
        path = self.dir / name
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the new name survives a power cut
        finally:
            os.close(dfd)
        self.segments.append(path)
        self._seg_no = len(self.segments) - 1
        self._pos = 0

    def append(self, key: bytes, record: dict) -> tuple[int, int]:
        """Append one record; returns its (segment number, offset)."""
        text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        return self.append_json(key, text.encode())

    def append_json(self, key: bytes, record: bytes) -> tuple[int, int]:
        """Append one record given as the bytes of a JSON object on one line."""
        if b"\n" in record or not record.startswith(b"{") or not record.endswith(b"}"):
            raise ValueError("a cache record must be one JSON object on one line")
        if self._fd is None:
            self._open_segment()
        data = b"".join((key.hex().encode(), b" ", record, b"\n"))
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        where = (self._seg_no, self._pos)
        self._pos += len(data)
        self._dirty = True
        return where

    def sync_due(self) -> bool:
        return self._dirty and time.monotonic() - self._last_sync >= FSYNC_EVERY_S

    def sync(self) -> None:
        """fsync the open segment (safe to call from a worker thread)."""
        fd = self._fd
        if fd is not None and self._dirty:
            self._dirty = False
            self._last_sync = time.monotonic()
            os.fsync(fd)

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None
        for f in self._readers.values():
            f.close()
        self._readers.clear()
        if not self._lock.closed:
            self._lock.close()

    def __enter__(self) -> "RequestCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
