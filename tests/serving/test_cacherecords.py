"""The request cache's records: what success and failure write reads back, and anything
else on disk reads as damaged (None), so its request is sent again."""

from __future__ import annotations

import json

from stages.common.reading import MAX_FILE_DEPTH, deeper_than
from stages.serving.cacherecords import cached_record, failure, reasoning_split, success
from stages.serving.client import Failure, Reply, read_body

BODY = {"choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1}}


def test_a_success_is_the_reply_as_it_came_on_one_line():
    raw = json.dumps(BODY, indent=2).encode()  # a server's pretty-printed body
    rec = success(Reply("hi", None, None, "stop", 1, 1, attempts=2, latency=0.5, raw=raw))
    assert b"\n" not in rec
    back = cached_record(rec)
    assert back["ok"] is True and back["attempts"] == 2 and back["reply"] == BODY
    assert not reasoning_split(back)


def test_a_reply_the_engine_split_says_so_in_its_record():
    raw = json.dumps(BODY).encode()
    rec = cached_record(success(Reply("hi", None, None, "stop", 1, 1, 1, 0.1, raw, True)))
    assert reasoning_split(rec) and rec["reply"] == BODY


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


def test_a_reply_as_deep_as_the_client_reads_is_read_back_from_its_record():
    """The record is one level around the reply: a reply nested to the client's limit
    (read_body) read back as damaged would be sent again on every run, never cached."""
    deep: object = "x"
    for _ in range(MAX_FILE_DEPTH - 4):  # the reply's own levels: object, choices, message
        deep = [deep]
    body = json.loads(json.dumps(BODY))
    body["choices"][0]["message"]["extra"] = deep
    raw = json.dumps(body).encode()
    assert read_body(raw)[1] is None and deeper_than(body, MAX_FILE_DEPTH - 1)
    rec = success(Reply("hi", None, None, "stop", 1, 1, 1, 0.1, raw))
    assert cached_record(rec)["reply"] == body
    assert cached_record(b'{"ok":true,"attempts":1,"latency":0.1,"reply":[%s]}' % raw) is None
