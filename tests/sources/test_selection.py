"""Which prompts stay: the dedup key and a source's limit (stages/sources/selection.py)."""

from __future__ import annotations

import io
import random

from stages.sources.selection import LimitSampler, dedup_key


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_the_dedup_key_ignores_whitespace_and_unicode_form_only():
    same = ["What is 2+2?", "What is 2 + 2?\n", "What\u00a0is 2+2?", "What\tis\n2+2?"]
    assert len({dedup_key(user(t), None) for t in same}) == 1
    assert dedup_key(user("caf\u00e9"), None) == dedup_key(user("cafe\u0301"), None)
    different = ["What is 2+2?", "what is 2+2?", "What is 2+3?"]  # case and digits matter
    assert len({dedup_key(user(t), None) for t in different}) == 3


def test_the_dedup_key_of_each_mode():
    one = [{"role": "system", "content": "System one"}, *user("Same question")]
    two = [{"role": "system", "content": "System two"}, *user("Same question")]
    assert dedup_key(one, None) != dedup_key(two, None)  # the whole prompt
    assert dedup_key(one, None, "user") == dedup_key(two, None, "user")  # its user turns
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    shuffled = [{"function": {"parameters": {"a": 2, "b": 1}, "name": "f"}, "type": "function"}]
    assert dedup_key(one, tools) == dedup_key(one, shuffled) != dedup_key(one, None)
    assert dedup_key(one, tools, "user") == dedup_key(one, None, "user")
    # a role is part of the text: a question asked by the system is not the user's
    assert dedup_key([{"role": "system", "content": "Q"}], None) != dedup_key(user("Q"), None)


def sampled(spool, rows: int, limit: int) -> list[bytes]:
    """The lines a LimitSampler of `limit` keeps of `rows` lines with seeded random hashes."""
    rng = random.Random(0)
    sampler = LimitSampler(spool, limit)
    for i in range(rows):
        sampler.add(b"line %d\n" % i, rng.getrandbits(64))
    out = io.BytesIO()
    assert sampler.emit(out) == min(rows, limit)
    assert not spool.exists()  # the spool is gone once emitted
    return out.getvalue().splitlines()


def test_the_limit_keeps_the_lowest_hashes_in_source_order(tmp_path):
    spool = tmp_path / ".spool"
    rng = random.Random(0)
    hashes = [rng.getrandbits(64) for _ in range(200)]
    lowest = sorted(range(200), key=hashes.__getitem__)[:30]
    assert sampled(spool, 200, 30) == [b"line %d" % i for i in sorted(lowest)]
    assert set(sampled(spool, 200, 30)) < set(sampled(spool, 200, 60))  # a larger limit extends it
    assert sampled(spool, 20, 500) == [b"line %d" % i for i in range(20)]  # all, as they came
    assert sampled(spool, 20, 0) == []
