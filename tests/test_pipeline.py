"""End to end: the real `dvc repro` on the demo data in a throwaway clone of the repo."""

import json
import sys

import datasets
import pytest

from stages.dataset.schema import FEATURES
from tests.helpers.repo import demo_clone, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    return demo_clone(tmp_path_factory.mktemp("pipeline"))


def test_demo_runs_every_stage_then_nothing(clone):
    out = run([sys.executable, "-m", "stages.demo"], clone)
    for stage in ("prepare", "generate", "tokenize", "merge", "validate"):
        assert f"Running stage '{stage}'" in out
    assert "=== demo summary ===" in out

    prompts = sum(1 for _ in open(clone / "data/prompts/prompts.jsonl"))
    completions = sum(1 for _ in open(clone / "data/completions/completions.jsonl"))
    failures = sum(1 for _ in open(clone / "data/completions/failures.jsonl"))
    assert prompts > 0 and completions + failures == prompts

    merged = datasets.load_from_disk(str(clone / "data/merged"))
    report = json.loads((clone / "reports/merge.json").read_text())
    base = datasets.load_from_disk(str(clone / "data/base"))
    tokenized = datasets.load_from_disk(str(clone / "data/tokenized"))
    assert merged.features == FEATURES
    assert len(merged) == len(base) + len(tokenized) == report["merged"]["rows"]
    assert len(tokenized) > 0
    assert json.loads((clone / "reports/validate.json").read_text())["passed"] is True
    assert "its lineage card (version 1): data/merged/README.md" in out
    lin = json.loads((clone / "data/merged/lineage.json").read_text())
    assert lin["rows"] == len(merged) and lin["model"]["engine"] == "transformers"

    again = run([sys.executable, "-m", "stages.demo"], clone)
    assert "Running stage" not in again
    assert "nothing changed" in again
    status = run(["dvc", "status"], clone)
    assert "up to date" in status


def test_dvc_dag_shows_the_chain(clone):
    dag = run(["dvc", "dag", "--dot"], clone)
    edges = {tuple(x.strip('"') for x in line.rstrip(";").split(" -> "))
             for line in dag.splitlines() if " -> " in line}
    # merge also reads the prepare and generate reports, for the lineage card
    assert edges == {("prepare", "generate"), ("generate", "tokenize"), ("tokenize", "merge"),
                     ("merge", "validate"), ("prepare", "merge"), ("generate", "merge")}
