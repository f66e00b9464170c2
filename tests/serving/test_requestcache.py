"""The request cache: append-only segments that survive SIGKILL, and the prompt index."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from stages.common.errors import StageError
from stages.serving.requestcache import KeyIndex, RequestCache, request_key, short_hash


def digest(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_append_then_scan_and_read_back(tmp_path):
    with RequestCache(tmp_path, "ns", {"model": "m"}) as c:
        where = [c.append(digest(i), {"ok": True, "i": i, "text": "é" * i}) for i in range(5)]
    assert json.loads((tmp_path / "ns" / "meta.json").read_text()) == {"model": "m"}
    with RequestCache(tmp_path, "ns", {"model": "other"}) as c:
        found = list(c.scan())
        assert [k for k, *_ in found] == [digest(i) for i in range(5)]
        assert [(s, o) for _, s, o, _ in found] == where
        assert c.read(*where[3]) == {"ok": True, "i": 3, "text": "ééé"}
        c.append(digest(9), {"ok": True})
    # meta.json describes the key space and is never rewritten
    assert json.loads((tmp_path / "ns" / "meta.json").read_text()) == {"model": "m"}
    # every run writes its own segment; nothing is rewritten in place
    assert len(list((tmp_path / "ns").glob("seg-*.log"))) == 2


def test_torn_and_damaged_lines_are_skipped(tmp_path):
    with RequestCache(tmp_path, "ns", {}) as c:
        c.append(digest(1), {"ok": True})
        c.append(digest(2), {"ok": True})
        seg = c.segments[0]
    data = seg.read_bytes()
    # a power cut can leave zeros; a kill can leave half a line
    torn = digest(3).hex().encode() + b' {"ok":true,"cut'
    seg.write_bytes(data + b"\0" * 40 + b"\n" + b"zz" * 40 + b' {"ok":true}\n' + torn)
    with RequestCache(tmp_path, "ns", {}) as c:
        keys = [k for k, *_ in c.scan()]
        assert c.damaged == 2  # the torn last line is what a kill leaves: not counted
    assert keys == [digest(1), digest(2)]


@pytest.mark.parametrize("blob", [
    "a whole segment in UTF-16\n".encode("utf-16") * 3,
    bytes(range(256)) * 40,
    b"\n" * 10 + b"\xff" * 5000,
    (("f" * 64) + " {\u00e9}\n").encode("utf-32"),
    b"",
], ids=["utf16", "random", "blank-then-binary", "utf32", "empty"])  # fmt: skip
def test_a_segment_of_any_bytes_is_read_without_error(tmp_path, blob):
    """Whatever a disk, a tool or a person left in a segment: scan skips it, never raises;
    intact lines of the same segment are still found."""
    with RequestCache(tmp_path, "ns", {}) as c:
        c.append(digest(1), {"ok": True})
        seg = c.segments[0]
    seg.write_bytes(blob + b"\n" + seg.read_bytes() + blob)
    with RequestCache(tmp_path, "ns", {}) as c:
        found = [(k, c.read_json(s, o)) for k, s, o, _ in c.scan()]
    assert found == [(digest(1), b'{"ok":true}')]


def test_a_second_run_on_the_same_key_space_is_refused(tmp_path):
    with RequestCache(tmp_path, "ns", {}):
        with pytest.raises(StageError, match="another generate run"):
            RequestCache(tmp_path, "ns", {})
    RequestCache(tmp_path, "ns", {}).close()  # free again once the first is closed


WRITER = r"""
import sys, hashlib
from stages.serving.requestcache import RequestCache
c = RequestCache(sys.argv[1], "ns", {})
i = 0
while True:
    c.append(hashlib.sha256(str(i).encode()).digest(), {"ok": True, "i": i, "pad": "x" * (i % 5000)})
    i += 1
    if i == 50:
        print("ready", flush=True)
"""


def test_sigkill_at_random_moments_loses_nothing_written(tmp_path):
    for round_ in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, cwd=os.getcwd()
        )
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.05 * round_)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with RequestCache(tmp_path, "ns", {}) as c:
        entries = list(c.scan())
        assert len(c.segments) == 4
        per_segment: dict[int, list[int]] = {}
        for key, seg, off, js in entries:
            rec = json.loads(js)
            assert key == digest(rec["i"])
            assert c.read(seg, off) == rec
            per_segment.setdefault(seg, []).append(rec["i"])
    # each killed writer left a gap-free prefix 0..k
    for seq in per_segment.values():
        assert seq == list(range(len(seq))) and len(seq) >= 50


def test_key_index_finds_every_copy_and_survives_prefix_collisions():
    keys = [digest(i) for i in range(1000)]
    keys[500] = keys[7]  # the same request twice
    twin = keys[3][:8] + bytes(24)  # same 8-byte prefix, different key
    keys[900] = twin
    index = KeyIndex(b"".join(keys))
    assert index.find(keys[7]) == [7, 500]
    assert index.find(keys[3]) == [3]
    assert index.find(twin) == [900]
    assert index.find(digest(5000)) == []
    assert index.key(42) == keys[42]
    assert index.twins(7) == index.twins(500) == [7, 500]
    assert index.twins(3) == [3] and index.twins(900) == [900] and index.twins(42) == [42]
    assert index.shared.sum() == 4  # only keys sharing a prefix pay for a lookup
    assert KeyIndex(b"").find(digest(1)) == []


def test_keys_depend_on_payload_and_namespace_only():
    msgs = [{"role": "user", "content": "hi"}]
    assert request_key("a", msgs, None) == request_key("a", [{"content": "hi", "role": "user"}], None)
    assert request_key("a", msgs, None) != request_key("b", msgs, None)
    assert request_key("a", msgs, None) != request_key("a", msgs, [{"type": "function"}])
    assert short_hash({"t": 0.6, "k": 20}) == short_hash({"k": 20, "t": 0.6})
    assert short_hash({"t": 0.6}) != short_hash({"t": 0.7})
