"""A request's record in the request cache: the reply as the server sent it, or why the
request failed.

`success(reply)` and `failure(f)` make the record of a finished request;
`cached_record(js)` reads one back from the cache, None for anything else on disk (a
damaged record, or None where the cache found its checksum wrong: its request is sent
again). docs/stages.md, generate, "Resume".
"""

from __future__ import annotations

import json
from typing import Optional

from stages.common.reading import MAX_FILE_DEPTH, parse_json, writable
from stages.serving import replies
from stages.serving.client import Failure, Reply


def success(reply: Reply) -> bytes:
    """The reply cached as it came (no re-encoding): the completion row is derived from it
    when the outputs are written."""
    raw = reply.raw.strip()
    if b"\n" in raw:
        raw = json.dumps(json.loads(raw), ensure_ascii=False, separators=(",", ":")).encode()
    return b'{"ok":true,"attempts":%d,"latency":%.4f,"reply":%s}' % (
        reply.attempts, reply.latency, raw,
    )  # fmt: skip


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
