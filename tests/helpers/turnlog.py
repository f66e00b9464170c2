"""What the regeneration tests share (tests/serving/test_turns.py against the fake server,
tests/test_real_sglang.py against SGLang): source conversations whose answers are marked
as the source's, their prompt lines as prepare writes them, and the check that every
request for turn k carries the replies seen for turns 1..k-1 and none of the source's."""

from __future__ import annotations

import json
from pathlib import Path

from stages.chat import regenerate

SOURCE = "SOURCE-ANSWER"


def conversation(i: int, users: int, tool_at: int | None = None) -> list[dict]:
    """A source conversation of `users` user turns, each answered by the source; with
    `tool_at`, the source's answer to that user turn calls a tool."""
    msgs = [{"role": "system", "content": f"Be brief {i}."}]
    for k in range(1, users + 1):
        msgs.append({"role": "user", "content": f"conversation {i} question {k}"})
        if k == tool_at:
            msgs.append({"role": "assistant", "content": "",
                         "tool_calls": [{"id": "c1", "type": "function", "function": {
                             "name": "lookup", "arguments": "{}"}}]})
            msgs.append({"role": "tool", "tool_call_id": "c1", "content": "42"})
        msgs.append({"role": "assistant", "content": f"{SOURCE} {i}.{k}",
                     "reasoning_content": f"{SOURCE} thinking {i}.{k}"})
    return msgs


def write_prompts(wd: Path, convs: list[list[dict]]) -> list[dict]:
    rows = []
    for i, msgs in enumerate(convs):
        parts = regenerate.split(msgs)
        row = {"id": f"c{i:04d}", "source": "multi", "messages": parts.request}
        if parts.turns:
            row["turns"] = parts.turns
        rows.append(row)
    path = wd / "data/prompts/prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return rows


def check_history(log: list[dict], rows: list[dict]) -> dict[str, list[dict]]:
    """Every request for turn k carries the replies seen for turns 1..k-1 of its
    conversation (content only; SGLang sends an empty one as null) and none of the source's answers; returns the log by
    conversation."""
    by_conv: dict[str, list[dict]] = {}
    for entry in log:
        conv, turn = entry["rid"].rsplit("-t", 1)
        by_conv.setdefault(conv, []).append(dict(entry, turn=int(turn)))
    prompts = {r["id"]: r for r in rows}
    for conv, entries in by_conv.items():
        entries.sort(key=lambda e: e["turn"])
        last = {}
        for e in entries:  # a turn answered as its run was killed, before the stage kept
            first = last.setdefault(e["turn"], e)  # it, is sent again: the same request;
            assert e["messages"] == first["messages"], (conv, e["turn"])
            last[e["turn"]] = e  # the answer kept is the last (an engine may answer anew)
        entries[:] = list(last.values())
        assert [e["turn"] for e in entries] == list(range(1, len(entries) + 1)), conv
        expected = list(prompts[conv]["messages"])
        for k, e in enumerate(entries, 1):
            assert SOURCE not in json.dumps(e["messages"])
            assert e["messages"] == expected, (conv, k)
            if k < len(entries):
                said = {"role": "assistant", "content": e["reply"]["content"] or ""}
                if "</think>" in said["content"]:
                    said["reasoning_content"] = ""  # kept whole, as its row renders it
                expected = expected + [said] + prompts[conv]["turns"][k - 1]
    return by_conv
