"""A request's record in the request cache: the reply as the server sent it, or why the
request failed.

`success(reply)` and `failure(f)` make the record of a finished request
(`reasoning_split(rec)`: whether the engine cut its thinking out); `cached_record(js)`
reads one back from the cache, None for anything else on disk (a damaged record, or None
where the cache found its checksum wrong: its request is sent again). docs/stages.md,
generate, "Resume".
"""

from __future__ import annotations

import json
from typing import Optional

from stages.common.reading import MAX_FILE_DEPTH, parse_json, writable
from stages.serving import replies
from stages.serving.client import Failure, Reply


# in the record of a reply whose thinking the engine cut out itself: the row is derived
# from the reply as that engine meant it, whichever server a later run talks to
SPLIT_KEY = "reasoning_split"


def success(reply: Reply) -> bytes:
    """The reply cached as it came (no re-encoding): the completion row is derived from it
    when the outputs are written."""
    raw = reply.raw.strip()
    if b"\n" in raw:
        raw = json.dumps(json.loads(raw), ensure_ascii=False, separators=(",", ":")).encode()
    split = b'"%s":true,' % SPLIT_KEY.encode() if reply.reasoning_split else b""
    return b'{"ok":true,"attempts":%d,"latency":%.4f,%s"reply":%s}' % (
        reply.attempts, reply.latency, split, raw,
    )  # fmt: skip


def reasoning_split(rec: dict) -> bool:
    """Whether a success record's reply had its thinking cut out by the engine."""
    return rec.get(SPLIT_KEY) is True


def failure(f: Failure) -> dict:
    return {
        "ok": False, "kind": f.kind, "status": f.status,
        "message": f.message, "attempts": f.attempts,
    }  # fmt: skip


def cached_record(js: Optional[bytes]) -> Optional[dict]:
    """A cache record as `success` or `failure` wrote it, or None for anything else on disk
    (`js` None: the request cache found the line damaged, requestcache.read_json)."""
    if js is None:
        return None
    try:  # the record is one object around a reply the client read to MAX_FILE_DEPTH
        rec = parse_json(js, MAX_FILE_DEPTH + 1)
    except ValueError:  # UnicodeDecodeError included
        return None
    if not isinstance(rec, dict):
        return None
    if rec.get("ok") is True:
        return rec if replies.problem(rec.get("reply")) is None else None
    fields = (
        rec.get("ok") is False
        and isinstance(rec.get("kind"), str)
        and isinstance(rec.get("message"), str)
        and isinstance(rec.get("attempts"), int)
        and (rec.get("status") is None or isinstance(rec.get("status"), int))
    )
    return rec if fields and writable(rec) else None
