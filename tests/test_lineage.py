"""The lineage card merge writes: its facts, its history across merges, no secrets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import pytest
from huggingface_hub import DatasetCard

from stages import lineage, merge, validate
from stages import params as P
from tests.repo import run
from tests.test_merge import FP, ids, rows, save

PASSWORD = "hunter2-not-for-cards"
KEY = "sk-lineage-DO-NOT-LEAK-41b7"
URL = f"http://alice:{PASSWORD}@gpu-host:30000"


def reports(root: Path, new_ids: list[str]) -> None:
    """reports/{prepare,generate,tokenize}.json shaped as those stages write them."""
    n = len(new_ids)
    folder = root / "reports"
    folder.mkdir(exist_ok=True)
    prepare = {"sources": {"new": {"read": n + 3, "kept": n + 1, "dropped": 2,
                                   "dropped_by_reason": {"empty": 1, "duplicate": 1,
                                                         "too_long": 0}}}}
    generate = {
        "requests": n + 1, "completed": n, "failed": 1, "truncated": 2,
        "failed_by_kind": {"timeout": 1}, "output_tokens": 40 * n,
        "sources": {"new": {"completed": n, "truncated": 2, "failed": 1,
                            "failed_by_kind": {"timeout": 1}}},
        "model": "Qwen/Qwen3.6-35B-A3B", "sampling": "f00d",
        "sampling_params": {"temperature": 0.6, "top_p": 0.95, "max_tokens": 4096},
        # an older generate, or a hand-edited report: secrets that must not travel on
        "server": {"engine": "sglang", "version": "0.5.9", "model": "Qwen/Qwen3.6-35B-A3B",
                   "args": ["--tp", "8", "--api-key", KEY, f"--token={KEY}"],
                   "command": None, "url": URL},
    }
    tokenize = {"sources": {"new": {"conversations": n, "rows": n, "tokens": 5 * n,
                                    "loss_tokens": 3 * n,
                                    "dropped": {"truncated": 0, "too_long": 0}}}}
    for stage, doc in (("prepare", prepare), ("generate", generate), ("tokenize", tokenize)):
        (folder / f"{stage}.json").write_text(json.dumps(doc))


def new_version(root: Path, prefix: str, n: int) -> None:
    """data/tokenized holding n new rows, and the reports of the run that made them."""
    shutil.rmtree(root / "data/tokenized", ignore_errors=True)
    save(root / "data/tokenized", rows(ids(prefix, n), "new", tag=1))
    reports(root, ids(prefix, n))


def keep(root: Path, name: str) -> str:
    """Copy data/merged aside, as a user keeps a version to merge onto next time."""
    shutil.copytree(root / "data/merged", root / "data" / name)
    return f"data/{name}"


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save(tmp_path / "data/base", rows(ids("b", 30), "base"), shards=2)
    return tmp_path


def test_three_merges_list_every_version_with_its_counts(repo):
    base = "data/base"
    added = [("x", 7), ("y", 5), ("z", 11)]
    for i, (prefix, n) in enumerate(added, 1):
        new_version(repo, prefix, n)
        report = merge.run(P.Merge(base=base))
        assert report["version"] == i
        base = keep(repo, f"v{i}")

    card = DatasetCard.load(repo / "data/merged/README.md")
    history = card.data.to_dict()["distill_data"]["history"]
    assert [(v["version"], v["rows"], v["new_rows"]) for v in history] == [
        (0, 30, None), (1, 37, 7), (2, 42, 5), (3, 53, 11)]
    assert [v["base_rows"] for v in history[1:]] == [30, 37, 42]
    assert card.data.to_dict()["distill_data"]["rows"] == 53
    assert len(datasets.load_from_disk("data/merged")) == 53

    lin = json.loads((repo / "data/merged/lineage.json").read_text())
    assert lin["history"] == history and lin["version"] == 3 and lin["rows"] == 53
    # the body a person reads: one history line per version, the counts in it
    body = card.text
    for v in history:
        assert f"| {v['version']} |" in body
    assert "| 3 | " in body and "| 53 | 42 | 11 |" in body
    assert "data/base had no lineage card" in body


def test_card_holds_sources_model_sampling_tokenizer(repo):
    new_version(repo, "n", 6)
    merge.run(P.Merge(base="data/base"))
    lin = json.loads((repo / "data/merged/lineage.json").read_text())
    assert lin["sources"]["new"] == {
        "prepare": {"read": 9, "kept": 7, "dropped": {"empty": 1, "duplicate": 1}},
        "generate": {"completed": 6, "truncated": 2, "failed": 1,
                     "failed_by_kind": {"timeout": 1}},
        "tokenize": {"conversations": 6, "rows": 6, "tokens": 30, "loss_tokens": 18,
                     "dropped": {}}}
    assert (lin["rows"], lin["tokens"], lin["supervised_tokens"]) == (36, 180, 108)
    assert lin["model"]["name"] == "Qwen/Qwen3.6-35B-A3B"
    assert (lin["model"]["engine"], lin["model"]["engine_version"]) == ("sglang", "0.5.9")
    assert lin["model"]["launch_args"] == ["--tp", "8", "--api-key", "***", "--token=***"]
    assert lin["sampling"]["params"]["temperature"] == 0.6
    assert lin["tokenizer"]["tokenizer"] == FP["tokenizer"]
    assert lin["tokenizer"]["chat_template_sha256"] == FP["chat_template_sha256"]

    text = (repo / "data/merged/README.md").read_text()
    assert "| new | 9 | 7 | empty 1, duplicate 1 | 6 | 2 | 1 (timeout 1) | 6 | – |" in text
    assert "sglang 0.5.9" in text and "--tp 8 --api-key ***" in text
    assert FP["chat_template_sha256"] in text and "temperature 0.6" in text


def test_no_secret_reaches_the_card_the_lineage_or_the_report(repo):
    new_version(repo, "n", 4)
    merge.run(P.Merge(base="data/base"))
    written = [p for p in list((repo / "data").rglob("*")) + [repo / "reports/merge.json"]
               if p.is_file() and "reports" not in p.parts[:-1]]
    assert any(p.name == "README.md" for p in written)
    for path in written:
        data = path.read_bytes()
        assert PASSWORD.encode() not in data and KEY.encode() not in data, path
    assert "http://gpu-host:30000" in (repo / "data/merged/lineage.json").read_text()


def test_merge_without_reports_still_writes_a_card(repo):
    save(repo / "data/tokenized", rows(ids("n", 3), "new", tag=1))
    merge.run(P.Merge(base=None))
    card = DatasetCard.load(repo / "data/merged/README.md")
    assert card.data.to_dict()["distill_data"]["history"][0]["rows"] == 3
    assert card.data.to_dict()["size_categories"] == ["n<1K"]


def test_a_damaged_base_history_is_refused_in_one_line(repo):
    (repo / "data/base/lineage.json").write_text(json.dumps({"history": "v1"}))
    new_version(repo, "n", 2)
    with pytest.raises(merge.StageError, match=r"data/base/lineage\.json: history is not"):
        merge.run(P.Merge(base="data/base"))
    assert not (repo / "data/merged").exists()


def test_history_is_read_from_the_card_when_lineage_json_is_gone(repo):
    new_version(repo, "x", 3)
    merge.run(P.Merge(base="data/base"))
    base = keep(repo, "v1")
    (repo / base / "lineage.json").unlink()
    new_version(repo, "y", 2)
    merge.run(P.Merge(base=base))
    lin = json.loads((repo / "data/merged/lineage.json").read_text())
    assert [(v["version"], v["rows"]) for v in lin["history"]] == [(0, 30), (1, 33), (2, 35)]


def test_dvc_hash_computed_the_way_dvc_does(tmp_path):
    repo = tmp_path / "r"
    (repo / "data/out/sub").mkdir(parents=True)
    (repo / "data/out/a.jsonl").write_text("one\ntwo\n")
    (repo / "data/out/sub/b.bin").write_bytes(bytes(range(256)) * 9)
    (repo / "data/out/empty").write_text("")
    run(["git", "init", "-q"], repo)
    run(["dvc", "init", "-q"], repo)
    ours = lineage.dir_md5(repo / "data/out")
    run(["dvc", "add", "-q", "data/out"], repo)
    theirs = (repo / "data/out.dvc").read_text()
    assert f"md5: {ours}" in theirs


def test_validate_checks_the_whole_set_against_the_widened_limits(repo):
    """A base tokenized with longer rows allowed: the merged fingerprint allows them."""
    long_rows = rows(ids("b", 4), "base")
    long_rows["input_ids"] = [[0] * 20 for _ in range(4)]
    long_rows["loss_mask"] = [[0] * 17 + [1] * 3 for _ in range(4)]
    long_rows["num_tokens"] = [20] * 4
    shutil.rmtree(repo / "data/base")
    save(repo / "data/base", long_rows,
         fingerprint={**FP, "policy": {"max_seq_len": 32, "min_loss_tokens": 1}})
    save(repo / "data/tokenized", rows(ids("n", 3), "new", tag=1),
         fingerprint={**FP, "policy": {"max_seq_len": 8, "min_loss_tokens": 2}})
    merge.run(P.Merge(base="data/base"))
    fp = json.loads((repo / "data/merged/fingerprint.json").read_text())
    assert fp["policy"] == {"max_seq_len": 32, "min_loss_tokens": 1}
    report = validate.run(P.Validate())
    assert report["passed"] and report["max_seq_len"] == 32
    assert report["limits_from"]["max_seq_len"].endswith("policy.max_seq_len")
