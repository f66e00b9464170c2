"""The lineage card merge writes: its facts, its history across merges, no secrets."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import datasets
import pytest
import yaml
from huggingface_hub import DatasetCard

from stages import merge, validate
from stages.common import params
from stages.dataset import lineage
from tests.helpers.fakeserver import spawn
from tests.helpers.repo import demo_clone, git_commit, run, small_training_check
from tests.helpers.stagecli import covers
from tests.helpers.sets import BASE_FP as FP, ids, rows, save
from tests.helpers import stagecli

MERGE_PATHS = stagecli.paths("merge")  # where dvc.yaml has the stage read and write
VALIDATE_PATHS = stagecli.paths("validate")

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
        report = merge.run(params.Merge(base=base), MERGE_PATHS)
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



def test_a_rerun_writes_the_same_bytes_the_time_only_in_the_run_report(repo):
    """The card and lineage.json are the data's and the code's facts: a merge run again
    later (or after a kill) writes every file of data/merged byte for byte as before."""
    def files() -> dict[str, bytes]:
        out = repo / "data/merged"
        return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
                if p.is_file()}

    new_version(repo, "n", 4)
    merge.run(params.Merge(base="data/base"), MERGE_PATHS)
    first = files()
    time.sleep(1.1)  # a time to the second would differ now
    report = merge.run(params.Merge(base="data/base"), MERGE_PATHS)
    assert files() == first
    lin = json.loads(first["lineage.json"])
    assert "created" not in lin and "created" not in lin["history"][-1]
    assert lin["format"] == 3 and b"created" not in first["README.md"]
    run = json.loads((repo / "reports/runs/merge.json").read_text())
    assert run["created"] == report["created"] and run["created"].endswith("Z")
    assert "created" not in json.loads((repo / "reports/merge.json").read_text())

def test_card_holds_sources_model_sampling_tokenizer(repo):
    new_version(repo, "n", 6)
    merge.run(params.Merge(base="data/base"), MERGE_PATHS)
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
    merge.run(params.Merge(base="data/base"), MERGE_PATHS)
    written = [p for p in list((repo / "data").rglob("*")) + [repo / "reports/merge.json"]
               if p.is_file() and "reports" not in p.parts[:-1]]
    assert any(p.name == "README.md" for p in written)
    for path in written:
        data = path.read_bytes()
        assert PASSWORD.encode() not in data and KEY.encode() not in data, path
    assert "http://gpu-host:30000" in (repo / "data/merged/lineage.json").read_text()


def test_merge_without_reports_still_writes_a_card(repo):
    save(repo / "data/tokenized", rows(ids("n", 3), "new", tag=1))
    merge.run(params.Merge(base=None), MERGE_PATHS)
    card = DatasetCard.load(repo / "data/merged/README.md")
    assert card.data.to_dict()["distill_data"]["history"][0]["rows"] == 3
    assert card.data.to_dict()["size_categories"] == ["n<1K"]


def test_the_card_links_what_validate_writes(repo):
    import re

    from stages.dataset import charts

    save(repo / "data/tokenized", rows(ids("n", 3), "new", tag=1))
    merge.run(params.Merge(base=None), MERGE_PATHS)
    text = (repo / "data/merged/README.md").read_text()
    targets = {(repo / "data/merged" / t).resolve() for t in re.findall(r"\]\(([^)]+)\)", text)}
    reports = MERGE_PATHS.reports
    assert targets == {(repo / reports / "validate.json").resolve(),
                       (repo / charts.samples(reports)).resolve()} | {
        (repo / charts.picture(reports, name)).resolve() for name in charts.PICTURES}


def test_a_damaged_base_history_is_refused_in_one_line(repo):
    (repo / "data/base/lineage.json").write_text(json.dumps({"history": "v1"}))
    new_version(repo, "n", 2)
    with pytest.raises(merge.StageError, match=r"data/base/lineage\.json: history is not"):
        merge.run(params.Merge(base="data/base"), MERGE_PATHS)
    assert not (repo / "data/merged").exists()


@pytest.mark.parametrize("written", [lineage.FORMAT + 1, "3"])
def test_a_base_lineage_of_a_format_this_release_does_not_know_is_said(repo, caplog, written):
    (repo / "data/base/lineage.json").write_text(json.dumps(
        {"format": written, "history": [{"version": 4, "rows": 30}]}))
    new_version(repo, "n", 2)
    with caplog.at_level("WARNING"):
        merge.run(params.Merge(base="data/base"), MERGE_PATHS)
    (line,) = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert line.startswith(f"data/base/lineage.json: format {json.dumps(written)}, ")
    lin = json.loads((repo / "data/merged/lineage.json").read_text())
    assert [(v["version"], v["rows"]) for v in lin["history"]] == [(4, 30), (5, 32)]


def test_history_is_read_from_the_card_when_lineage_json_is_gone(repo):
    new_version(repo, "x", 3)
    merge.run(params.Merge(base="data/base"), MERGE_PATHS)
    base = keep(repo, "v1")
    (repo / base / "lineage.json").unlink()
    new_version(repo, "y", 2)
    merge.run(params.Merge(base=base), MERGE_PATHS)
    lin = json.loads((repo / "data/merged/lineage.json").read_text())
    assert [(v["version"], v["rows"]) for v in lin["history"]] == [(0, 30), (1, 33), (2, 35)]


@pytest.mark.slow  # validate's training check loads the demo model
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
    merge.run(params.Merge(base="data/base"), MERGE_PATHS)
    fp = json.loads((repo / "data/merged/fingerprint.json").read_text())
    assert fp["policy"] == {"max_seq_len": 32, "min_loss_tokens": 1}
    report = validate.run(params.Validate(), VALIDATE_PATHS)
    assert report["passed"] and report["max_seq_len"] == 32
    assert report["limits_from"]["max_seq_len"].endswith("policy.max_seq_len")


# ------------------------------------------------------- the real pipeline, dvc and git


@dataclasses.dataclass
class Runs:
    repo: Path
    demo: str  # `python -m stages.demo` output (an API key in use)
    key_leaks: list[str]  # files under data/ and reports/ holding the key after the demo
    knob: str  # `dvc repro` output after tokenize.shard_rows changed
    knob_params: dict  # `dvc params diff --json` before that commit
    password_leaks: list[str]  # the same after generating through a URL with a password
    lock: dict  # dvc.lock after the last run


def leaks(repo: Path, secret: str) -> list[str]:
    """Every file under data/ and reports/ whose bytes hold `secret`."""
    found = []
    for top in ("data", "reports"):
        for path in (repo / top).rglob("*"):
            if path.is_file() and secret.encode() in path.read_bytes():
                found.append(str(path.relative_to(repo)))
    return found


def set_params(repo: Path, section: str, **values) -> None:
    path = repo / "params.yaml"
    doc = yaml.safe_load(path.read_text())
    doc[section].update(values)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def set_server(repo: Path, url: str, api_key_env) -> None:
    path = repo / "params.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["generate"]["server"].update(url=url, api_key_env=api_key_env, launch=None,
                                     unreachable_deadline=20)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    """The demo against the fake server (with an API key), then a default-only knob, then
    the same answers through a URL carrying a password."""
    repo = demo_clone(tmp_path_factory.mktemp("lineage"))
    small_training_check(repo)
    # well under generate.max_tokens; token counts as the bundled tokenizer and template
    # give them, as a real engine reports them (tokenize checks every prompt against them)
    short = {"reasoning_tokens": 6, "reply_tokens": 6,
             "tokenizer": str(repo / ".cache/tokenizers/qwen3.6")}
    os.environ["LINEAGE_TEST_KEY"] = KEY  # tests.helpers.repo.run passes the environment on
    try:
        with spawn({**short, "api_key": KEY}) as keyed, spawn(short) as open_server:
            set_server(repo, keyed.url, "LINEAGE_TEST_KEY")
            git_commit(repo, "generate through the fake server")
            demo = run([sys.executable, "-m", "stages.demo"], repo)
            key_leaks = leaks(repo, KEY)
            git_commit(repo, "v1")

            set_params(repo, "tokenize", shard_rows=3)
            knob = run(["dvc", "repro"], repo)
            knob_params = json.loads(run(["dvc", "params", "diff", "--json"], repo))
            git_commit(repo, "v2: tokenize.shard_rows")

            url = open_server.url.replace("http://", f"http://alice:{PASSWORD}@")
            set_server(repo, url, None)
            run(["dvc", "repro"], repo)
            password_leaks = leaks(repo, PASSWORD)
            git_commit(repo, "v3: through a URL with a password")
    finally:
        del os.environ["LINEAGE_TEST_KEY"]
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return Runs(repo, demo, key_leaks, knob, knob_params, password_leaks, lock)


@pytest.mark.slow
def test_demo_prints_where_the_card_is_and_the_card_loads(runs):
    assert "its lineage card (version 1): data/merged/README.md" in runs.demo
    card = DatasetCard.load(runs.repo / "data/merged/README.md")
    lin = json.loads((runs.repo / "data/merged/lineage.json").read_text())
    merged = json.loads((runs.repo / "reports/merge.json").read_text())["merged"]
    assert card.data.to_dict()["distill_data"]["rows"] == lin["rows"] == merged["rows"]
    assert len(datasets.load_from_disk(str(runs.repo / "data/merged"))) == merged["rows"]
    prepare = json.loads((runs.repo / "reports/prepare.json").read_text())["sources"]
    assert set(lin["sources"]) == set(prepare)
    for name, counts in prepare.items():
        assert lin["sources"][name]["prepare"]["kept"] == counts["kept"]
        assert f"| {name} | {counts['read']} | {counts['kept']} |" in card.text


@pytest.mark.slow
def test_card_hashes_are_those_in_dvc_lock(runs):
    lin = json.loads((runs.repo / "data/merged/lineage.json").read_text())
    for stage, out in lineage.upstream(MERGE_PATHS).items():
        (locked,) = [o for o in runs.lock["stages"][stage]["outs"] if o["path"] == out]
        assert lin["dvc"][out] == {"stage": stage, "md5": locked["md5"], "from": "dvc.lock"}
    assert lin["git_commit"] == run(["git", "rev-parse", "HEAD~1"], runs.repo).strip()


@pytest.mark.slow
def test_a_default_only_knob_reruns_what_it_shapes_and_diff_names_it(runs):
    ran = re.findall(r"Running stage '([^']+)'", runs.knob)
    assert ran == ["tokenize", "merge", "validate"], runs.knob
    assert runs.knob_params == {"params.yaml": {"tokenize.shard_rows": {
        "old": 20000, "new": 3, "diff": -19997}}}


@pytest.mark.slow
def test_the_card_of_an_older_version_is_read_with_dvc_get(runs, tmp_path):
    first = run(["git", "rev-parse", "HEAD~2"], runs.repo).strip()  # v1
    run(["dvc", "get", "--rev", first, str(runs.repo), "data/merged/lineage.json",
         "-o", str(tmp_path / "old.json")], tmp_path)
    old = json.loads((tmp_path / "old.json").read_text())
    now = json.loads((runs.repo / "data/merged/lineage.json").read_text())
    assert old["dvc"]["data/tokenized"] != now["dvc"]["data/tokenized"]
    assert old["rows"] == now["rows"]  # shard_rows changes the layout, not the rows


@pytest.mark.slow
def test_no_key_or_password_anywhere_under_data_or_reports(runs):
    assert runs.key_leaks == []
    assert runs.password_leaks == []
    gen = json.loads((runs.repo / "reports/generate.json").read_text())
    assert gen["server"]["urls"] == [gen["server"]["urls"][0].replace(f"alice:{PASSWORD}@", "")]
    assert "127.0.0.1" in json.loads(
        (runs.repo / "data/merged/lineage.json").read_text())["model"]["urls"][0]


# the stages whose output each shared module can change (docs/versions.md, "Rerun only what changed")
SHAPED_BY = {
    "stages/common/params.py": {"prepare", "generate", "tokenize", "merge", "validate"},
    "stages/common/outputs.py": {"prepare", "generate", "tokenize", "merge", "validate"},
    "stages/common/reports.py": {"prepare", "generate", "tokenize", "merge", "validate"},
    "stages/common/errors.py": {"prepare", "generate", "tokenize", "merge", "validate"},
    "stages/common/reading.py": {"prepare", "generate", "tokenize", "merge", "validate"},
    "stages/chat/conversation.py": {"prepare", "generate", "tokenize"},
    "stages/common/secrets.py": {"prepare", "generate", "tokenize", "merge", "validate"},
    "stages/dataset/schema.py": {"prepare", "tokenize", "merge", "validate"},
    "stages/dataset/lineage.py": {"merge"},
    "stages/dataset/adopt.py": {"merge"},
    "stages/dataset/idhashes.py": {"merge", "validate"},
    "stages/dataset/charts.py": {"merge", "validate"},  # the card links the pictures validate draws
    "stages/models/tinymodel.py": {"validate"},  # the training check's model; never generate's
    "stages/models/tokenizer.py": {"generate", "tokenize", "validate"},  # validate: the demo model's
    "stages/process/cli.py": set(),
    "stages/process/cpus.py": set(),  # how many processes: the output is the same for any count
    "stages/dataset/chunkedloss.py": {"validate"},
    "stages/dataset/rowsummary.py": {"validate"},
    "stages/sources/decontam.py": {"prepare"},
    "stages/sources/ngrams.py": {"prepare"},
    "stages/sources/checker.py": {"prepare"},
    "stages/process/children.py": set(),  # how workers live and end: results come in order
    "stages/serving/logpipe.py": {"generate"},
    "stages/dataset/markdown.py": {"merge"},
    "stages/chat/encoder.py": {"generate", "tokenize"},  # generate counts prompts with it
    "stages/chat/controltext.py": {"generate", "tokenize"},  # the encoder's
    # the demo model carries the template, but no byte validate writes depends on it
    "stages/models/templates/qwen3.6.jinja": {"generate", "tokenize"},
}


@pytest.mark.slow
@pytest.mark.parametrize("module", list(SHAPED_BY))
def test_an_edited_shared_module_outdates_the_stages_it_shapes(runs, module):
    status = status_after_appending(runs.repo, module, b"\n# edited\n")
    changed = {stage for stage, entries in status.items()
               if any(covers(dep, module) for e in entries if isinstance(e, dict)
                      for dep in e.get("changed deps") or {})}
    assert changed == SHAPED_BY[module], status


@pytest.mark.slow
def test_an_edited_eval_set_outdates_prepare_only(runs):
    status = status_after_appending(runs.repo, "data/evals/eval_sample.jsonl",
                                    b'{"question": "What is the tallest mountain in Africa?"}\n')
    assert status == {"prepare": [{"changed deps": {"data/evals": "modified"}}]}


def status_after_appending(repo: Path, name: str, data: bytes) -> dict:
    """`dvc status --json` of `repo` with `data` appended to its file `name` (restored after)."""
    path = repo / name
    original = path.read_bytes()
    try:
        path.write_bytes(original + data)
        return json.loads(run(["dvc", "status", "--json"], repo))
    finally:
        path.write_bytes(original)


@pytest.mark.parametrize("entry, message", [
    ({"version": True}, r"history\[0\]\.version is a boolean, not a count"),
    ({"version": 2**70}, r"history\[0\]\.version is a number, not a count"),
    ({"version": 2**63 - 1}, r"history\[0\]\.version is 9223372036854775807: the next "
                            r"version would not be a count"),  # version 2**63 unreadable
    ({"version": 1, "git_commit": 5}, r"history\[0\]\.git_commit is a number, not a string"),
    ({"version": 1, "created": {"a": 1}}, r"history\[0\]\.created is an object, not a string"),
    ({"version": 1, "rows": float("nan")}, r"history\[0\]\.rows is a number, not a count"),
    ({"rows": 3}, r"history\[0\]\.version is missing"),
    ({"version": 1, "model": "\ud800"}, r"history\[0\]\.model holds a lone surrogate"),
    ({"version": 0, "adopted": {"rows": float("nan"), "tokens": float("inf")}},
     r"history\[0\]\.adopted\.rows is nan, not a finite number"),
    ({"version": 0, "adopted": {"files": [{"rows": 1}, {"rows": float("-inf")}]}},
     r"history\[0\]\.adopted\.files\[1\]\.rows is -inf, not a finite number"),
])  # fmt: skip
def test_a_base_history_with_a_field_of_the_wrong_type_is_one_line(repo, entry, message):
    (repo / "data/base/lineage.json").write_text(json.dumps({"history": [entry]}))
    new_version(repo, "n", 2)
    with pytest.raises(merge.StageError, match=r"^data/base/lineage\.json: " + message):
        merge.run(params.Merge(base="data/base"), MERGE_PATHS)
    assert not (repo / "data/merged").exists()


BOMB = "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 12))


@pytest.mark.parametrize("header", [
    BOMB + "distill_data:\n  history:\n    - {version: 1, model: *a11}\n",  # 9**12 strings
    "distill_data: " + "[" * 100_000 + "]" * 100_000 + "\n",
    "distill_data: [1, 2]\n",
    "distill_data: {history: [{version: 1, version: 2}]}\n",
])  # fmt: skip
def test_a_base_card_header_that_is_not_plain_data_is_passed_over_quickly(repo, header, caplog):
    (repo / "data/base/README.md").write_text("---\n" + header + "---\nbody\n")
    new_version(repo, "n", 2)
    started = time.monotonic()
    merge.run(params.Merge(base="data/base"), MERGE_PATHS)
    assert time.monotonic() - started < 60  # expanded, it would never end
    lin = json.loads((repo / "data/merged/lineage.json").read_text())
    assert [(v["version"], v["rows"]) for v in lin["history"]] == [(0, 30), (1, 32)]


def test_history_cells_stay_in_their_table_column(repo):
    entry = {"version": 1, "rows": 30, "model": "a | b\n---\nc", "git_commit": "x|y",
             "created": "a time an earlier release wrote"}
    (repo / "data/base/lineage.json").write_text(json.dumps({"history": [entry]}))
    new_version(repo, "n", 2)
    merge.run(params.Merge(base="data/base"), MERGE_PATHS)
    text = (repo / "data/merged/README.md").read_text()
    assert "| 1 | x\\|y | 30 | – | – | a \\| b --- c |" in text
    # an earlier version's time is carried forward in its history, not shown
    assert json.loads((repo / "data/merged/lineage.json").read_text())["history"][0][
        "created"] == "a time an earlier release wrote"
    card = DatasetCard.load(repo / "data/merged/README.md")
    assert card.data.to_dict()["distill_data"]["history"][0]["model"] == "a | b\n---\nc"


def test_a_card_saved_with_crlf_and_a_bom_still_carries_its_history(repo):
    new_version(repo, "x", 3)
    merge.run(params.Merge(base="data/base"), MERGE_PATHS)
    base = keep(repo, "v1")
    (repo / base / "lineage.json").unlink()
    card = repo / base / "README.md"
    card.write_bytes(b"\xef\xbb\xbf" + card.read_bytes().replace(b"\n", b"\r\n"))
    new_version(repo, "y", 2)
    merge.run(params.Merge(base=base), MERGE_PATHS)
    lin = json.loads((repo / "data/merged/lineage.json").read_text())
    assert [(v["version"], v["rows"]) for v in lin["history"]] == [(0, 30), (1, 33), (2, 35)]


def test_a_run_asked_by_turn_records_its_samples_and_turns_a_plain_run_nothing():
    from stages.dataset import lineage as lin

    turns = {"asked": 9, "answered": 8, "cut_by_failure": 1}
    assert lin.turn_facts({"turns": turns, "samples_per_prompt": 3}) == {
        "samples_per_prompt": 3, "turns": turns}
    assert lin.turn_facts({"completed": 5}) == {}
