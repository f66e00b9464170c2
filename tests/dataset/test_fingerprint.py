"""fingerprint.json read, checked, compared and widened; the state hash of a folder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stages.common import params
from stages.common.errors import StageError
from stages.dataset import fingerprint
from stages.dataset.shards import STATE_FILE, write_metadata
from tests.helpers.repo import ROOT

TOK = {"name_or_path": "bundled:qwen3.6", "vocab_size": 151669}


def _write(path, doc) -> None:
    path.write_text(json.dumps(doc))


def test_read_checks_the_limits_it_carries_into_a_merged_fingerprint(tmp_path):
    path = tmp_path / fingerprint.FILE
    assert fingerprint.read(path, required=False) is None
    with pytest.raises(StageError, match="not found"):
        fingerprint.read(path, required=True)
    _write(path, {"tokenizer": TOK, "policy": {"max_seq_len": 64, "min_loss_tokens": 1}})
    assert fingerprint.read(path, required=True)["policy"]["max_seq_len"] == 64
    for bad, why in ((64.5, "not a whole number"), (True, "not a whole number"),
                     ("64", "not a whole number"), (0, ">= ")):
        _write(path, {"tokenizer": TOK, "policy": {"max_seq_len": bad}})
        with pytest.raises(StageError, match=f"policy.max_seq_len .*{why}"):
            fingerprint.read(path, required=True)


def test_limit_problem_follows_the_params_class_range():
    assert fingerprint.limit_problem(4096, params.Validate, "max_seq_len") is None
    assert "whole number" in fingerprint.limit_problem(1.0, params.Validate, "max_seq_len")
    assert fingerprint.limit_problem(2**70, params.Validate, "vocab_size")
    assert set(fingerprint.RECORDED) <= {f for f in params.Validate.__dataclass_fields__}


def test_check_match_names_the_first_key_that_differs(tmp_path):
    base = {"tokenizer": TOK, "chat_template_sha256": "a"}
    fingerprint.check_match(tmp_path / "b", base, tmp_path / "n", dict(base))
    other = {"tokenizer": {**TOK, "vocab_size": 10}, "chat_template_sha256": "a"}
    with pytest.raises(StageError, match="tokenizer.vocab_size is 151669 in .*b but 10 in"):
        fingerprint.check_match(tmp_path / "b", base, tmp_path / "n", other)
    assert fingerprint.missing_keys({"tokenizer": TOK}) == ["chat_template_sha256"]


def test_widened_limits_hold_the_base_rows_too():
    new = {"tokenizer": TOK, "policy": {"max_seq_len": 32, "min_loss_tokens": 2, "x": 1}}
    base = {"policy": {"max_seq_len": 64, "min_loss_tokens": 1}}
    assert fingerprint.widened(base, new)["policy"] == {
        "max_seq_len": 64, "min_loss_tokens": 1, "x": 1}
    assert fingerprint.widened(None, new) is new
    assert fingerprint.widened({"policy": {"max_seq_len": 16}}, new) is new


def test_vocab_size_must_be_a_positive_whole_number(tmp_path):
    assert fingerprint.vocab_size({"tokenizer": TOK}, tmp_path) == 151669
    for bad in ({}, {"tokenizer": {"vocab_size": 0}}, {"tokenizer": {"vocab_size": 3.0}}):
        with pytest.raises(StageError, match="vocab_size"):
            fingerprint.vocab_size(bad, tmp_path)


def test_state_hash_follows_the_fingerprint_and_each_end_of_each_shard(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / fingerprint.FILE).write_text('{"a": 1}')
    data = bytearray(rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes())
    (tmp_path / "s.arrow").write_bytes(data)
    first = fingerprint.state_hash(tmp_path, ["s.arrow"])
    assert fingerprint.state_hash(tmp_path, ["s.arrow"]) == first and len(first) == 16
    write_metadata(tmp_path, ["s.arrow"])
    assert json.loads((tmp_path / STATE_FILE).read_text())[fingerprint.STATE_KEY] == first
    assert fingerprint.read_state_hash(tmp_path / STATE_FILE) == first
    seen = {first}
    for at in (0, len(data) - 1):  # a byte of the head, a byte of the tail
        changed = bytearray(data)
        changed[at] ^= 1
        (tmp_path / "s.arrow").write_bytes(changed)
        seen.add(fingerprint.state_hash(tmp_path, ["s.arrow"]))
    (tmp_path / "s.arrow").write_bytes(data)
    (tmp_path / fingerprint.FILE).write_text('{"a": 2}')
    seen.add(fingerprint.state_hash(tmp_path, ["s.arrow"]))
    assert len(seen) == 4


def test_read_state_hash_is_none_for_what_it_cannot_use(tmp_path):
    state = tmp_path / STATE_FILE
    assert fingerprint.read_state_hash(state) is None
    for doc in ('{"_fingerprint": 5}', '[1]', '{"_fingerprint": "\\ud800"}', "{"):
        state.write_text(doc)
        assert fingerprint.read_state_hash(state) is None


def test_build_records_the_installed_versions_without_importing_datasets():
    """tokenize writes the fingerprint; importing datasets for its version took about a
    second of every run."""
    import subprocess
    import sys

    code = ("import sys, json\n"
            "from stages.common import params\n"
            "from stages.dataset import fingerprint\n"
            "doc = fingerprint.build({'name': 't'}, 'x' * 64, params.Tokenize())\n"
            "print(json.dumps({'versions': doc['versions'], 'datasets': 'datasets' in sys.modules}))")
    got = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                    text=True, cwd=ROOT).stdout)
    assert got["datasets"] is False
    import datasets
    import pyarrow
    import tokenizers
    import transformers

    assert got["versions"] == {"transformers": transformers.__version__,
                               "tokenizers": tokenizers.__version__,
                               "datasets": datasets.__version__, "pyarrow": pyarrow.__version__}
