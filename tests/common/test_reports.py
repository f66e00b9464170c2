"""A stage's report split in two files: the data facts (its DVC metrics file) and the
run's own figures (reports/runs/, not a metric). The real pipeline under `dvc exp`:
tests/test_versioning.py::test_an_experiment_shows_only_what_changed_in_the_data."""

from __future__ import annotations

import json

from stages.common import outputs, reports

VALIDATE = {
    "passed": True,
    "rows": 39,
    "train_check": {
        "loss": [12.38, 12.37],
        "tokens_per_second": 204.3,
        "peak_memory_mb": 1475.4,
        "memory": "process peak RSS (VmHWM)",
        "longest_batch": {"tokens": 512, "peak_memory_mb": 2568.3, "seconds": 3.9},
    },
    "seconds": 12.8,
}


def test_the_listed_keys_go_to_the_run_file_and_the_rest_stays_a_fact(tmp_path):
    path = outputs.write_report(tmp_path, "validate", VALIDATE)
    assert path == tmp_path / "validate.json"
    facts = json.loads(path.read_text())
    run = json.loads((tmp_path / "runs" / "validate.json").read_text())
    assert facts == {"passed": True, "rows": 39,
                     "train_check": {"loss": [12.38, 12.37], "longest_batch": {"tokens": 512}}}
    assert run == {
        "train_check": {"tokens_per_second": 204.3, "peak_memory_mb": 1475.4,
                        "memory": "process peak RSS (VmHWM)",
                        "longest_batch": {"peak_memory_mb": 2568.3, "seconds": 3.9}},
        "seconds": 12.8,
        "host": reports.host(),
    }
    assert list(facts) == ["passed", "rows", "train_check"]  # the stage's order kept
    assert reports.read(tmp_path, "validate") == {**VALIDATE, "host": reports.host()}


def test_the_facts_of_two_runs_that_differ_only_in_speed_are_the_same_bytes(tmp_path):
    slower = {**VALIDATE, "seconds": 99.0,
              "train_check": {**VALIDATE["train_check"], "tokens_per_second": 1.5}}
    outputs.write_report(tmp_path / "a", "validate", VALIDATE)
    outputs.write_report(tmp_path / "b", "validate", slower)
    assert (tmp_path / "a/validate.json").read_bytes() == (tmp_path / "b/validate.json").read_bytes()
    assert (tmp_path / "a/runs/validate.json").read_bytes() != \
           (tmp_path / "b/runs/validate.json").read_bytes()


def test_keys_a_report_lacks_or_holds_in_another_shape_are_skipped():
    # a skipped training check is a string where the listed keys would be a section
    facts, run = reports.split("validate", {"rows": 3, "train_check": {"skipped": "no torch"}})
    assert facts == {"rows": 3, "train_check": {"skipped": "no torch"}}
    assert run == {"host": reports.host()}
    facts, run = reports.split("validate", {"rows": 3, "train_check": None, "seconds": 1.0})
    assert facts == {"rows": 3, "train_check": None} and run["seconds"] == 1.0


def test_a_stage_without_listed_keys_keeps_every_key_a_fact():
    report = {"rows": 1, "seconds": 2.0}
    assert reports.split("not-a-stage", report) == (report, {"host": reports.host()})


def test_the_split_leaves_the_stages_report_as_it_was():
    report = json.loads(json.dumps(VALIDATE))
    reports.split("validate", report)
    assert report == VALIDATE


def test_reading_a_stage_that_wrote_nothing_or_only_facts(tmp_path):
    assert reports.read(tmp_path, "merge") == {}
    (tmp_path / "merge.json").write_text('{"merged": {"rows": 4}}')
    assert reports.read(tmp_path, "merge") == {"merged": {"rows": 4}}
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "merge.json").write_text("[not an object]")
    assert reports.read(tmp_path, "merge") == {"merged": {"rows": 4}}


def test_the_host_says_what_the_figures_depend_on():
    host = reports.host()
    assert host["cpus"] >= 1 and host["python"].count(".") == 2 and host["machine"]
