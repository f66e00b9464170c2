"""A chunk of completion lines made rows: filters, counts per source, the report."""

from __future__ import annotations

import json

import pytest

from stages.chat import rendercheck, tokenrows
from stages.chat.encoder import ChatEncoder
from stages.common.errors import StageError
from stages.common.params import Tokenize
from stages.dataset.schema import ARROW_SCHEMA
from stages.models.tokenizer import load_once


@pytest.fixture(scope="module")
def encoder():
    return ChatEncoder(load_once("bundled:qwen3.6"), enable_thinking=True)


def line(i: int, source: str, answer: str, **extra) -> bytes:
    row = {"id": f"r{i}", "source": source, "finish_reason": "stop", **extra,
           "messages": [{"role": "user", "content": f"question {i}"},
                        {"role": "assistant", "content": answer}]}
    return (json.dumps(row) + "\n").encode()


def chunk(cfg: Tokenize, encoder, lines: list[bytes]) -> tokenrows.ChunkResult:
    return tokenrows.tokenize_chunk((1, lines), encoder, cfg, "c.jsonl", rendercheck.NO_IDS)


def test_a_chunk_keeps_rows_of_the_contract_and_counts_each_drop(encoder):
    cfg = Tokenize(ids="render", min_loss_tokens=2)
    lines = [line(0, "a", "four"), line(1, "a", "   "), line(2, "b", "cut", truncated=True),
             b"\n", line(3, "b", "x" * 20)]
    result = chunk(cfg, encoder, lines)
    assert result.batch.schema == ARROW_SCHEMA
    assert result.batch.column("id").to_pylist() == ["r0", "r3"]
    assert result.stats["a"]["dropped"]["empty_content"] == 1
    assert result.stats["b"]["dropped"]["truncated"] == 1
    assert set(result.stats["a"]["dropped"]) == set(tokenrows.DROP_REASONS)
    assert [len(v) for v in result.lengths.values()] == [1, 1]


def test_a_line_over_max_row_bytes_is_counted_and_never_rendered(encoder, monkeypatch, caplog):
    """Encoding takes ~100 times a row's size: a huge answer is bad input, dropped before
    the template or the tokenizer sees it, so a worker's memory stays bounded."""
    big = line(1, "b", "word " * 400)
    cfg = Tokenize(ids="render", max_row_bytes=len(big) - 1)
    rendered = []
    plan = encoder.plan
    monkeypatch.setattr(encoder, "plan", lambda messages, *a, **k:
                        rendered.append(messages[-1]["content"]) or plan(messages, *a, **k))
    result = chunk(cfg, encoder, [line(0, "a", "four"), big, line(2, "b", "five")])
    assert result.batch.column("id").to_pylist() == ["r0", "r2"]
    assert rendered == ["four", "five"]
    assert result.stats["b"]["dropped"]["too_large"] == 1
    assert result.stats["b"]["conversations"] == 2
    assert f"c.jsonl:2: row 'r1' is {len(big)} bytes, over tokenize.max_row_bytes" in caplog.text
    huge_id = line(0, "a", "x").replace(b'"r0"', b'"' + b"i" * 100_000 + b'"')
    caplog.clear()
    chunk(Tokenize(ids="render", max_row_bytes=1000), encoder, [huge_id])
    assert f"row '{'i' * 80}'... is {len(huge_id)} bytes" in caplog.text
    assert len(caplog.text) < 1000  # the id cut, not written whole into the log
    # the bound goes with max_seq_len when not set: 128 bytes (Qwen's longest token) a token
    assert tokenrows.row_bytes_limit(Tokenize(max_seq_len=1000)) == 128_000
    assert tokenrows.row_bytes_limit(Tokenize(max_seq_len=1000, max_row_bytes=5)) == 5
    with pytest.raises(StageError, match=r"c\.jsonl:1: 'source' must be a non-empty string"):
        chunk(cfg, encoder, [line(0, "", "word " * 400)])  # named before it is dropped


def test_a_bad_line_names_its_file_and_line(encoder):
    with pytest.raises(StageError, match=r"c\.jsonl:2: 'source' must be a non-empty string"):
        chunk(Tokenize(ids="render"), encoder, [line(0, "a", "ok"), line(1, "", "ok")])


def test_totals_add_chunks_up_per_source_and_in_all(encoder):
    cfg = Tokenize(ids="render", min_loss_tokens=1)
    totals = tokenrows.Totals()
    for lines in ([line(0, "a", "one"), line(1, "b", "two")], [line(2, "a", "three")]):
        totals.add(chunk(cfg, encoder, lines))
    report = totals.report(cfg, shards=1, seconds=1.0)
    assert report["rows"] == 3 and report["dropped_total"] == 0
    assert {s: v["rows"] for s, v in report["sources"].items()} == {"a": 2, "b": 1}
    assert report["tokens"] == sum(v["tokens"] for v in report["sources"].values())
    assert report["length"]["max"] >= report["length"]["p50"] > 0


def test_chunks_have_bounded_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenrows, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(tokenrows, "MIN_CHUNK_BYTES", 1000)
    lines = ["x" * n + "\n" for n in (10, 2000, 10, 10, 900, 50, 5000, 1)]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(lines))
    chunks = list(tokenrows.line_chunks(path))
    assert [first for first, _ in chunks] == [1, 3, 8]
    for _, part in chunks:
        assert sum(map(len, part)) - len(part[-1]) < 1000


def test_chunks_shrink_towards_the_end_and_keep_every_line(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenrows, "CHUNK_BYTES", 4000)
    monkeypatch.setattr(tokenrows, "MIN_CHUNK_BYTES", 100)
    lines = [f"{i:099d}\n" for i in range(4000)]  # 100 bytes each
    path = tmp_path / "c.jsonl"
    path.write_text("".join(lines))
    monkeypatch.setattr(tokenrows, "TAIL_PIECES", 8)
    chunks = list(tokenrows.line_chunks(path))
    sizes = [sum(map(len, part)) for _, part in chunks]
    assert [line.decode() for _, part in chunks for line in part] == lines
    assert sizes[0] == 4000 and sizes == sorted(sizes, reverse=True)
    assert sizes[-2] == 100  # the tail comes in the smallest pieces


def regenerated_line(last_truncated: bool) -> bytes:
    """A conversation regenerated turn by turn (generate's row): three answered turns,
    the last one cut off by max_tokens when `last_truncated`."""
    turn = {"finish_reason": "stop", "truncated": False,
            "usage": {"prompt_tokens": 9, "completion_tokens": 3}}
    last = dict(turn, finish_reason="length", truncated=True) if last_truncated else turn
    msgs = []
    for k in (1, 2, 3):
        msgs += [{"role": "user", "content": f"question {k}"},
                 {"role": "assistant", "content": f"answer number {k}", "reasoning_content": "hm"}]
    row = {"id": "conv", "source": "a", "messages": msgs, "finish_reason": last["finish_reason"],
           "truncated": last_truncated, "usage": turn["usage"], "turns": [turn, turn, last]}
    return (json.dumps(row) + "\n").encode()


@pytest.mark.parametrize("policy, rows", [("expand", ["conv#1", "conv"]), ("all", ["conv"]),
                                          ("last", [])])
def test_a_regenerated_conversation_cut_off_at_its_last_turn_keeps_the_turns_before(
        encoder, policy, rows):
    # every turn before the cut-off one is a whole answer of the target's, asked with the
    # history it was served: dropping the conversation would lose them all
    result = chunk(Tokenize(ids="render", multi_turn=policy), encoder, [regenerated_line(True)])
    got = [] if result.batch is None else result.batch.column("id").to_pylist()
    assert got == rows
    assert result.stats["a"]["dropped"]["truncated"] == 1  # the answer cut off
    whole = chunk(Tokenize(ids="render", multi_turn=policy), encoder, [regenerated_line(False)])
    if policy == "expand":  # the turns kept are the same rows as in the whole conversation
        ids = whole.batch.column("input_ids").to_pylist()
        assert result.batch.column("input_ids").to_pylist() == ids[:2]
