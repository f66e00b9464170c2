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


# ------------------------------------------------------------------ checksums


def test_a_record_edited_into_other_valid_json_is_not_used_and_named(tmp_path, caplog):
    """An edit that keeps the line valid JSON (what a person or a tool may do) fails the
    record's checksum: not used (its request is sent again), one line names the segment."""
    with RequestCache(tmp_path, "ns", {}) as c:
        where = [c.append(digest(i), {"ok": True, "text": f"answer {i}"}) for i in range(3)]
        seg = c.segments[0]
    seg.write_bytes(seg.read_bytes().replace(b"answer 1", b"answer 7"))
    with caplog.at_level("INFO"), RequestCache(tmp_path, "ns", {}) as c:
        found = {k: json.loads(js) for k, _, _, js in c.scan()}
        assert c.read_json(*where[1]) is None and c.read_json(*where[0]) == b'{"ok":true,"text":"answer 0"}'
        assert c.damaged == 1 and c.unverified == 0
    assert found == {digest(0): {"ok": True, "text": "answer 0"},
                     digest(2): {"ok": True, "text": "answer 2"}}
    (line,) = [r.getMessage() for r in caplog.records if "checksum" in r.getMessage()]
    assert str(seg) in line and "1 record(s) fail their checksum" in line


def test_a_record_moved_under_another_key_or_stripped_of_its_sum_is_not_used(tmp_path):
    with RequestCache(tmp_path, "ns", {}) as c:
        for i in range(3):
            c.append(digest(i), {"ok": True, "i": i})
        seg = c.segments[0]
    a, b, rest = seg.read_bytes().splitlines(keepends=True)
    moved = b[:65] + a[65:]  # line 0's record under line 1's key
    stripped = rest[:65] + b"{" + rest[65 + len('{"sum":"') + 16 + 2:]  # its sum removed
    assert json.loads(stripped[65:]) == {"ok": True, "i": 2}
    seg.write_bytes(a + moved + stripped)
    with RequestCache(tmp_path, "ns", {}) as c:
        assert [k for k, *_ in c.scan()] == [digest(0)] and c.damaged == 2


def test_a_checksummed_segment_renamed_as_an_older_one_is_still_checked(tmp_path):
    """A record that carries a sum is checked whatever its segment is named: renaming a
    segment to an older release's name (`seg-*.log`) does not make an edit pass."""
    with RequestCache(tmp_path, "ns", {}) as c:
        for i in range(3):
            c.append(digest(i), {"ok": True, "text": f"answer {i}"})
        seg = c.segments[0]
    older = seg.with_name(seg.name.replace(".sum.log", ".log"))
    older.write_bytes(seg.read_bytes().replace(b"answer 1", b"answer 7"))
    seg.unlink()
    with RequestCache(tmp_path, "ns", {}) as c:
        assert [json.loads(js)["text"] for *_, js in c.scan()] == ["answer 0", "answer 2"]
        assert c.damaged == 1 and c.unverified == 0


def test_segments_from_before_checksums_are_read_counted_and_logged_once(tmp_path, caplog):
    """The paid-for answers of an earlier release stay usable; that they cannot be checked
    is said once a segment, and counted."""
    folder = tmp_path / "ns"
    folder.mkdir()
    old = folder / "seg-00000000000000000001-42.log"  # the name and lines that release wrote
    old.write_bytes(b"".join(digest(i).hex().encode() + b' {"ok":true,"i":%d}\n' % i
                             for i in range(3)))
    with caplog.at_level("INFO"), RequestCache(tmp_path, "ns", {}) as c:
        for _ in range(2):  # a turn-by-turn run scans twice
            assert [json.loads(js)["i"] for *_, js in c.scan()] == [0, 1, 2]
        assert c.read(0, 0) == {"ok": True, "i": 0}
        assert c.unverified == 3 and c.damaged == 0
        c.append(digest(5), {"ok": True, "i": 5})
        assert c.segments[1].name.endswith(".sum.log")  # new answers carry their checksum
    told = [r.getMessage() for r in caplog.records if "before records carried" in r.getMessage()]
    assert told == [f"{old}: 3 record(s) written before records carried a checksum: used as "
                    "they are (an edit to them cannot be detected)"]


def test_an_earlier_release_reads_checksummed_records_as_its_own(tmp_path):
    """The checksum is a JSON member, so a checkout of an older version reuses the cache:
    its reader took `<key> <JSON object>` and looked only at the members it knows."""
    with RequestCache(tmp_path, "ns", {}) as c:
        c.append(digest(1), {"ok": True, "reply": {"id": "x"}})
        seg = c.segments[0]
    (line,) = seg.read_bytes().splitlines(keepends=True)
    assert line[64:66] == b" {" and line.endswith(b"}\n")  # that release's framing
    rec = json.loads(line[65:])
    assert rec["ok"] is True and rec["reply"] == {"id": "x"} and len(rec["sum"]) == 16
