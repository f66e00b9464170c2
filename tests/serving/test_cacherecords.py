"""The request cache's records: what success and failure write reads back, and anything
else on disk reads as damaged (None), so its request is sent again."""

from __future__ import annotations

import json

from stages.serving.cacherecords import cached_record, failure, success
from stages.serving.client import Failure, Reply

BODY = {"choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1}}


def test_a_success_is_the_reply_as_it_came_on_one_line():
    raw = json.dumps(BODY, indent=2).encode()  # a server's pretty-printed body
    rec = success(Reply("hi", None, None, "stop", 1, 1, attempts=2, latency=0.5, raw=raw))
    assert b"\n" not in rec
    back = cached_record(rec)
    assert back["ok"] is True and back["attempts"] == 2 and back["reply"] == BODY


def test_a_failure_reads_back_as_written():
    rec = failure(Failure("timeout", None, "no answer in 10 s", 3, False))
    assert cached_record(json.dumps(rec).encode()) == rec


def test_anything_else_on_disk_is_damaged():
    good = json.loads(success(Reply("hi", None, None, "stop", 1, 1, 1, 0.1, json.dumps(BODY).encode())))
    bad_reply = dict(good, reply={"choices": []})
    missing = {"ok": False, "kind": "timeout", "message": "m"}  # no attempts
    for js in [b"not json", b"[1, 2]", b'{"ok": "yes"}', json.dumps(bad_reply).encode(),
               json.dumps(missing).encode(), b'{"ok": true, "reply": "\xff"}',
               json.dumps(dict(failure(Failure("t", None, "m", 1, True)), status="500")).encode()]:
        assert cached_record(js) is None, js
