"""specforge: train.jsonl as SpecForge's prompt builder reads it, and DFlash's rule."""

from __future__ import annotations

import json

from stages.trainers.specforge import JSONL, RECORD_KEYS, SpecForge
from stages.trainers.vocab import VOCAB_MAPPING, VocabCounts
from tests.helpers.trainerparts import part

ROWS = [("a", [1, 2, 3], [0, 1, 1]), ("b", [4, 5], [1, 0]), ("ü", [6], [0])]


def test_one_record_a_line_in_dataset_order(tmp_path):
    writer = SpecForge().writer(tmp_path, None)
    writer.begin(0, 1)
    writer.write(part(ROWS[:2]))
    writer.write(part(ROWS[2:]))
    writer.end()
    assert writer.finish() == {"files": [JSONL], "record_keys": RECORD_KEYS}
    lines = (tmp_path / JSONL).read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 4
    assert [json.loads(line) for line in lines[:-1]] == [
        {"input_ids": ids, "loss_mask": mask, "id": rid} for rid, ids, mask in ROWS]


def test_with_a_draft_vocabulary_the_mapping_is_written_beside_it(tmp_path):
    writer = SpecForge().writer(tmp_path, VocabCounts(2, 10))
    writer.write(part(ROWS))
    facts = writer.finish()
    assert facts["files"] == [JSONL, VOCAB_MAPPING] and (tmp_path / VOCAB_MAPPING).is_file()
    assert facts["vocab_mapping"]["distinct_supervised_tokens"] == 3


def test_dflash_needs_two_adjacent_supervised_tokens_eagle3_one():
    rules = {r.key: r for r in SpecForge.rules}
    p = part(ROWS, 2)
    assert rules["dflash_no_two_adjacent_supervised"].rows(p, 2).tolist() == [True, True, True]
    assert rules["eagle3_no_supervised_token"].rows(p, 2).tolist() == [False, False, True]
    assert rules["dflash_no_two_adjacent_supervised"].rows(part(ROWS), 3).tolist() == [
        False, True, True]
