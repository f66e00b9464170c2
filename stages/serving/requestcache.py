"""Crash-safe, content-addressed cache of chat-completion replies.

    <cache_dir>/<namespace>/meta.json                model + sampling params of this key space
    <cache_dir>/<namespace>/seg-<ns>-<pid>.sum.log   one append-only segment per run

The namespace is a hash of the model name and every sampling param; a key is the sha256
of the request payload that decides the reply (messages + tools + namespace). Each
segment line, `<64 hex key> {"sum":"<16 hex>",<record's members>}`, is one `os.write`
(a SIGKILL leaves at most a torn last line, skipped), fsync'd about once a second; nothing
is rewritten in place. `sum` (sha256 of key + record, 64 bits) fails for a record edited,
damaged or moved: not used, its request sent again. Older segments (`seg-*.log`) carry
none: used unchecked, counted. The in-memory index is a few numpy arrays over the run's
prompts (about 50 bytes a prompt), never a dict of replies.
What it means for a run (resume, key spaces, checksums): docs/stages.md, generate.
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
SUM_HEX = 16  # 64 bits: an accidental edit passes once in 2**64; scan cost stays small
SUMMED = ".sum.log"  # the name's end of a segment every record of which carries its sum
_SUM_OPEN = b'{"sum":"'
_SUM_END = len(_SUM_OPEN) + SUM_HEX


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


def record_sum(key: bytes, record: bytes) -> bytes:
    """The checksum of a record under its key (the key included: a line moved under
    another key fails it)."""
    h = hashlib.sha256(key)
    h.update(record)
    return h.hexdigest()[:SUM_HEX].encode()


def summed(key: bytes, record: bytes) -> bytes:
    """A record as a line holds it: its checksum first, then the record's own members."""
    return b"".join((_SUM_OPEN, record_sum(key, record), b'",', record[1:]))


def unsummed(key: bytes, stored: bytes) -> Optional[bytes]:
    """The record a line holds with its checksum, or None when the checksum is missing
    or does not match (the line was edited or damaged)."""
    if not stored.startswith(_SUM_OPEN) or stored[_SUM_END : _SUM_END + 2] != b'",':
        return None
    record = b"{" + stored[_SUM_END + 2 :]
    return record if record_sum(key, record) == stored[len(_SUM_OPEN) : _SUM_END] else None


def _record(checked: bool, key: bytes, line: bytes) -> Optional[bytes]:
    """The record of a framed line once its sum matches, else None. A record with no sum
    is taken as it is only in an older segment (not `checked`); one that carries a sum is
    checked wherever it is, so a segment renamed to an older segment's name still is."""
    stored = line[KEY_HEX + 1 : -1]
    return unsummed(key, stored) if checked or _carries_sum(line) else stored


def _carries_sum(line: bytes) -> bool:
    """Whether a framed line's record starts with its checksum member."""
    return line.startswith(_SUM_OPEN, KEY_HEX + 1)


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
        self.damaged = 0  # lines scan() skipped as damaged (checksum failures included)
        self.unverified = 0  # records scan() read from segments written without checksums
        self._told: set[tuple[Path, str]] = set()  # what _tell logged, by segment

    # ------------------------------------------------------------------ reading

    def scan(self) -> Iterator[tuple[bytes, int, int, bytes]]:
        """Yield (key, segment number, offset, record JSON bytes) for every intact line.

        Any bytes at all may be on disk: a line that is not `<hex key> {...}`, or whose
        checksum is missing or wrong, is skipped and counted in `self.damaged` (a torn
        last line, what a killed run leaves, is expected and only logged). Whether the
        JSON inside parses is the caller's check.
        """
        for seg_no, path in enumerate(self.segments):
            checked = path.name.endswith(SUMMED)
            torn = failed = unverified = 0
            with open_regular(path) as f:
                offset = 0
                for line in f:
                    start = offset
                    offset += len(line)
                    if not line.endswith(b"\n"):
                        torn += 1
                        continue
                    key = _key_of(line)
                    record = None if key is None else _record(checked, key, line)
                    if record is None:
                        self.damaged += 1
                        failed += key is not None
                        continue
                    unverified += not (checked or _carries_sum(line))
                    yield key, seg_no, start, record
            self._tell(path, torn, failed, unverified)

    def _tell(self, path: Path, torn: int, failed: int, unverified: int) -> None:
        """One log line a segment for what its scan found beside intact records, once a
        run (a turn-by-turn run scans twice)."""
        if torn:
            log.info("%s: skipped a torn last line (a killed run)", path)
        if failed and (path, "failed") not in self._told:
            self._told.add((path, "failed"))
            log.warning("%s: %d record(s) fail their checksum (edited or damaged on disk): "
                        "not used, their requests are sent again", path, failed)
        if unverified and (path, "unverified") not in self._told:
            self._told.add((path, "unverified"))
            self.unverified += unverified  # an older segment is never appended to
            log.info("%s: %d record(s) written before records carried a checksum: used as "
                     "they are (an edit to them cannot be detected)", path, unverified)

    def read(self, seg_no: int, offset: int) -> dict:
        """The record at a location found by scan() or returned by append()."""
        record = self.read_json(seg_no, offset)
        if record is None:
            raise ValueError(f"{self.segments[seg_no]}: the record at {offset} is damaged")
        return json.loads(record)

    def read_json(self, seg_no: int, offset: int) -> Optional[bytes]:
        """The JSON bytes of the record at a location (unparsed: the caller checks them);
        None when the line there is no longer intact (changed since it was found)."""
        f = self._readers.get(seg_no)
        if f is None:
            f = self._readers[seg_no] = open_regular(self.segments[seg_no])
        f.seek(offset)
        line = f.readline()
        key = _key_of(line)
        return None if key is None else _record(self.segments[seg_no].name.endswith(SUMMED),
                                                key, line)

    # ------------------------------------------------------------------ writing

    def _open_segment(self) -> None:
        name = f"seg-{time.time_ns():020d}-{os.getpid()}{SUMMED}"
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
        if b"\n" in record or not record.startswith(b'{"') or not record.endswith(b"}"):
            raise ValueError("a cache record must be one JSON object of members on one line")
        if self._fd is None:
            self._open_segment()
        data = b"".join((key.hex().encode(), b" ", summed(key, record), b"\n"))
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
