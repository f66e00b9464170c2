"""Decontamination: the n-gram index built from evaluation files, and the check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stages.common import params
from stages.common.errors import StageError
from stages.sources import decontam
from stages.sources.ngrams import words
from tests.helpers.sources import GSM, INTL, TRIVIA, evals, write_jsonl

def index(tmp_path: Path, **policy) -> decontam.Index:
    cfg = params.build(params.Decontaminate, {"evals": evals(tmp_path), **policy}, "prepare.decontaminate")
    return decontam.build(cfg, "error").index


def verdicts(idx: decontam.Index, prompts: list[list[str]]) -> list:
    """Per prompt None or (eval set, item index, shared n-gram)."""
    hits = idx.check([t for p in prompts for t in p], [len(p) for p in prompts])
    return [None if h is None else (*idx.where(h.item), h.ngram) for h in hits]


# ------------------------------------------------------------------------- the check


def test_copies_in_disguise_are_caught_and_attributed(tmp_path):
    idx = index(tmp_path)
    disguised = ("natalia SOLD clips to 48 of her friends in april -- and then she sold half "
                 "as many clips in may!!! how many clips did natalia sell altogether")
    embedded = ("You are a careful tutor. Read the question below, think step by step, and put "
                "the final answer in a box.\n\nQuestion: " + TRIVIA[1] + "\n\nAnswer:")
    cyrillic = INTL[0].upper().replace(",", " ;")
    chinese = "请回答下面的问题并给出步骤：" + INTL[1].replace("，", ",") + "谢谢"
    got = verdicts(idx, [[GSM[0]], [disguised], ["Be brief.", embedded], [cyrillic], [chinese],
                         [GSM[1]]])
    assert [g[:2] for g in got] == [("gsm", 0), ("gsm", 0), ("trivia", 1), ("intl", 0),
                                    ("intl", 1), ("gsm", 1)]
    assert got[2][2] == " ".join(words(TRIVIA[1])[:13])  # the first shared n-gram
    assert len(got[4][2].split()) == 13


def test_near_misses_and_clean_prompts_are_kept(tmp_path):
    idx = index(tmp_path)
    paraphrase = ("In April Natalia sold clips to 48 friends; in May she sold half that many. "
                  "What is the total number of clips she sold over the two months?")
    twelve_words = " ".join(words(GSM[0])[:12])  # one word short of an n-gram
    # every run of 13 words broken by a changed word
    broken = " ".join(w if i % 6 != 5 else "XX" for i, w in enumerate(words(TRIVIA[0])))
    clean = ["Explain recursion to a new programmer.", "Write a haiku about autumn rain.",
             "What is 7 times 9?", "Сколько будет семь умножить на восемь?", "区块链是什么？"]
    got = verdicts(idx, [[paraphrase], [twelve_words + " and more unrelated words here"],
                         [broken]] + [[c] for c in clean])
    assert got == [None] * (3 + len(clean))


def test_short_items_match_whole_messages_only(tmp_path):
    idx = index(tmp_path)
    got = verdicts(idx, [["WHAT is 7 times 8"], ["Be brief.", "what is 7 × 8?"],
                         ["What is 7 times 8? Also, what is 9 times 9?"]])
    assert got[0] == ("gsm", 2, "what is 7 times 8")
    assert got[1] is None  # "×" is a different word from "times"
    assert got[2] is None  # embedded in a longer message: only n-grams count there
    off = index(tmp_path / "off", short_exact=False)
    assert verdicts(off, [["What is 7 times 8?"]]) == [None]


def test_min_overlap_is_a_fraction_of_the_prompts_ngrams(tmp_path):
    long_instruction = " ".join(f"word{i}" for i in range(60))
    prompts = [[GSM[0]], [long_instruction + " " + GSM[0]]]
    assert [v is not None for v in verdicts(index(tmp_path / "a"), prompts)] == [True, True]
    half = index(tmp_path / "b", min_overlap=0.5)
    assert [v is not None for v in verdicts(half, prompts)] == [True, False]


def test_the_item_sharing_most_ngrams_wins(tmp_path):
    base = " ".join(f"w{i}" for i in range(30))
    rows = [{"q": base[: len(base) // 2]}, {"q": base}]  # item 1 holds all of item 0
    path = write_jsonl(tmp_path / "e.jsonl", rows)
    cfg = params.Decontaminate(evals=[params.EvalSet("e", str(path), "columns", prompt_field="q")])
    idx = decontam.build(cfg, "error").index
    assert verdicts(idx, [[base]])[0][:2] == ("e", 1)


def test_long_words_are_hashed_whole(tmp_path):
    # words longer than 8 bytes are hashed 8 bytes at a time: a difference at any byte counts
    a = " ".join(f"supercalifragilistic{i}expialidocious" for i in range(14))
    b = a.replace("expialidocious", "expialidociouz")
    cfg = params.Decontaminate(evals=[params.EvalSet("e", str(write_jsonl(tmp_path / "e.jsonl", [{"q": a}])),
                                           "columns", prompt_field="q")])
    idx = decontam.build(cfg, "error").index
    assert [v is not None for v in verdicts(idx, [[a.upper()], [b]])] == [True, False]


def test_the_lookup_finds_what_a_binary_search_finds(tmp_path):
    # one block read per key beside the fences: every answer a full binary search gives,
    # at block edges, before the first hash, past the last and among repeated hashes
    rng = np.random.default_rng(0)
    for size in (1, decontam.BLOCK - 1, decontam.BLOCK, decontam.BLOCK + 1, 1000):
        hashes = np.sort(rng.integers(0, 2**64 - 1, size, dtype=np.uint64, endpoint=True))
        hashes = np.sort(np.concatenate([hashes, hashes[: size // 2], hashes[:1]]))
        idx = index(tmp_path)
        idx.hashes, idx.fences = hashes, hashes[:: decontam.BLOCK].copy()
        keys = np.concatenate([rng.integers(0, 2**64 - 1, 300, dtype=np.uint64, endpoint=True),
                               hashes, hashes - np.uint64(1), np.array([0, 2**64 - 1], np.uint64)])
        assert (idx._lower_bound(keys) == np.searchsorted(hashes, keys)).all(), size


def test_saved_index_gives_the_same_answers(tmp_path):
    idx = index(tmp_path)
    folder = tmp_path / "saved"
    folder.mkdir()
    idx.save(folder)
    again = decontam.Index.load(folder)
    prompts = [[GSM[0]], ["clean"], ["What is 7 times 8?"], [TRIVIA[0]]]
    assert verdicts(again, prompts) == verdicts(idx, prompts)
    assert verdicts(again, prompts)[3][:2] == ("trivia", 0)


def test_index_memory_is_a_few_bytes_per_ngram(tmp_path):
    rows = [{"q": " ".join(f"t{i}x{j}" for j in range(40))} for i in range(500)]
    cfg = params.Decontaminate(evals=[params.EvalSet("e", str(write_jsonl(tmp_path / "e.jsonl", rows)),
                                           "columns", prompt_field="q")])
    built = decontam.build(cfg, "error")
    idx, stats = built.index, built.stats
    assert len(idx.hashes) == 500 * 28
    assert idx.nbytes() <= 24 * len(idx.hashes)
    assert stats["e"]["indexed"] == 500


# ------------------------------------------------------------------------ bad input


def test_a_misnamed_field_stops_with_one_line(tmp_path):
    parquet = evals(tmp_path)[1]
    cfg = params.Decontaminate(evals=[params.EvalSet("trivia", parquet["path"], "columns", prompt_field="question")])
    with pytest.raises(StageError, match=r"eval set trivia: field 'question': not in .*trivia.parquet \(fields: id, problem\)"):
        decontam.build(cfg, "error")


def test_an_eval_set_with_nothing_to_index_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", [{"question": "   "}, {"other": "x"}])
    cfg = params.Decontaminate(evals=[params.EvalSet("e", str(path), "columns", prompt_field="question")])
    with pytest.raises(StageError, match=r"eval set e: no item to index \(empty: 1, missing_field: 1\)"):
        decontam.build(cfg, "error")


def test_malformed_eval_lines_follow_on_bad_row(tmp_path):
    path = tmp_path / "e.jsonl"
    path.write_text('{"question": "' + GSM[0] + '"}\n{not json\n')
    cfg = params.Decontaminate(evals=[params.EvalSet("e", str(path), "columns", prompt_field="question")])
    with pytest.raises(StageError, match=r"eval set e: .*e.jsonl:2: malformed JSON"):
        decontam.build(cfg, "error")
    stats = decontam.build(cfg, "skip").stats
    assert stats["e"]["items"] == 2 and stats["e"]["skipped"] == {"malformed_json": 1}


def test_an_eval_text_with_a_lone_surrogate_follows_on_bad_row(tmp_path):
    path = tmp_path / "e.jsonl"  # "\ud800" parses to a lone surrogate, which has no UTF-8
    path.write_text('{"question": "' + GSM[0] + '"}\n{"question": "broken \\ud800 ' + GSM[1] + '"}\n')
    cfg = params.Decontaminate(evals=[params.EvalSet("e", str(path), "columns", prompt_field="question")])
    with pytest.raises(StageError, match=r"eval set e: .*e\.jsonl:2: text that is not valid Unicode"):
        decontam.build(cfg, "error")
    built = decontam.build(cfg, "skip")
    index, stats = built.index, built.stats
    assert stats["e"]["items"] == 2 and stats["e"]["skipped"] == {"invalid_text": 1}
    assert index.check([GSM[0]], [1])[0] is not None


def test_an_eval_tool_call_no_template_can_write_follows_on_bad_row(tmp_path):
    call = {"type": "function", "function": {"name": "f", "arguments": "{not json"}}
    path = write_jsonl(tmp_path / "e.jsonl", [
        {"messages": [{"role": "user", "content": GSM[0]},
                      {"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "content": "r", "tool_call_id": "c"}]},
        {"messages": [{"role": "user", "content": GSM[1]}]}])
    cfg = params.Decontaminate(evals=[params.EvalSet("e", str(path), "messages")])
    with pytest.raises(StageError, match=r"eval set e: .*e\.jsonl:1: messages\[1\]\.tool_calls\[0\]"):
        decontam.build(cfg, "error")
    built = decontam.build(cfg, "skip")
    assert built.stats["e"]["items"] == 2 and built.stats["e"]["skipped"] == {"bad_tool_call": 1}
    assert built.index.check([GSM[1]], [1])[0].item == 1
