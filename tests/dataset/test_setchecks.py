"""validate's checks of the set as a whole (stages/dataset/setchecks.py): each problem a
finding, the limits taken from the fingerprint unless params set them."""

from __future__ import annotations

import faulthandler
import json
import os
import signal

import datasets
import pytest

from stages.common.errors import StageError
from stages.common.params import Validate
from stages.dataset import setchecks
from stages.dataset.rowcheck import Findings
from stages.dataset.shards import Opening
from tests.helpers.sets import ids, rows, save

FP = {"tokenizer": {"name": "tok", "vocab_sha256": "a" * 64, "vocab_size": 1000,
                    "special_tokens": {}},
      "chat_template_sha256": "c" * 64, "policy": {"max_seq_len": 64, "min_loss_tokens": 2},
      "versions": {}}


def findings() -> Findings:
    return Findings(setchecks.DATASET_CHECKS, 3)


def test_limits_come_from_the_fingerprint_unless_params_set_them(tmp_path):
    (tmp_path / "fingerprint.json").write_text(json.dumps(FP))
    found = findings()
    fp = setchecks.check_fingerprint(found, tmp_path)
    cfg, used = setchecks.limits(Validate(vocab_size=None, max_seq_len=32, min_loss_tokens=None),
                                 found, fp, tmp_path)
    assert (cfg.vocab_size, cfg.max_seq_len, cfg.min_loss_tokens) == (1000, 32, 2)
    assert used["max_seq_len"] == "params"
    assert used["vocab_size"].endswith("fingerprint.json: tokenizer.vocab_size")
    assert not found.failed()


def test_a_missing_fingerprint_is_a_finding_and_a_null_limit_an_error(tmp_path):
    found = findings()
    assert setchecks.check_fingerprint(found, tmp_path) is None
    assert found.failed() == ["fingerprint"]
    with pytest.raises(StageError, match="validate.vocab_size: null"):
        setchecks.limits(Validate(vocab_size=None), found, None, tmp_path)


@pytest.mark.parametrize("text, expected, failed", [
    ('{"merged": {"rows": 10}}', 10, False),
    ('{"merged": {"rows": 8}}', 8, True),
    ('{"merged": {"rows": -1}}', None, True),
    ("not json", None, True),
])
def test_the_row_count_is_held_to_merges_report(tmp_path, text, expected, failed):
    (tmp_path / "merge.json").write_text(text)
    found = findings()
    assert setchecks.check_row_count(found, 10, tmp_path, tmp_path / "merge.json") == expected
    assert (found.failed() == ["row_count"]) is failed


def test_an_unreadable_dataset_info_is_a_finding(tmp_path):
    found = findings()
    assert setchecks.check_info(found, tmp_path) is False  # no file at all
    (tmp_path / "dataset_info.json").write_text('{"features": {"id": 3}}')
    assert setchecks.check_info(found, tmp_path) is True  # read, its features not usable
    assert found.checks["features"]["failures"] == 2


def test_the_load_check_survives_its_process_dying_of_sigbus(tmp_path, monkeypatch):
    """datasets maps every shard; a shard cut under that map kills the process reading it
    with SIGBUS. The check runs in a worker of its own: its death is the check's finding."""
    save(tmp_path / "set", rows(ids("r", 3)))
    loaded_rows, _ = Opening(tmp_path / "set").result()
    assert loaded_rows == 3

    def killed(folder):
        faulthandler.disable()  # pytest's would print the worker's stack to the run's log
        os.kill(os.getpid(), signal.SIGBUS)

    monkeypatch.setattr(datasets, "load_from_disk", killed)
    found = findings()
    setchecks.check_loads(found, Opening(tmp_path / "set"), 3)
    (example,) = found.checks["loads"]["examples"]
    assert example.startswith("load_from_disk: ") and "killed by SIGBUS" in example, example
