"""validate: each corruption injected into otherwise valid shards is caught, with its id."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from stages import validate
from stages.common import params, reports
from stages.process import cpus
from stages.common.errors import StageError
from stages.dataset import loader, rowcheck
from stages.dataset.schema import ARROW_SCHEMA, FEATURES, ROW_CHECKS
from stages.process import cli
from tests.helpers import stagecli
from tests.helpers.repo import link_caches
from tests.helpers.sets import MERGED_FP as FP, VOCAB, row, shards, write

PATHS = stagecli.paths("validate")  # where dvc.yaml has the stage read and write

ROOT = Path(__file__).resolve().parents[1]
def cfg(**kw) -> params.Validate:
    """Params for these tests; the training check only where a test turns it on."""
    off = params.TrainCheck(enabled=False)
    return params.Validate(**{"max_seq_len": 64, "min_loss_tokens": 1, "train_check": off, **kw})


def failures(**kw) -> dict:
    """Run validate, expecting failure; {check: examples} of the failed checks."""
    with pytest.raises(StageError) as e:
        validate.run(cfg(**kw), PATHS)
    report = json.loads(Path("reports/validate.json").read_text())
    assert report["passed"] is False
    failed = {k: c["examples"] for k, c in report["checks"].items() if not c["passed"]}
    message = str(e.value)
    assert "\n" not in message and all(name in message for name in failed)
    return failed


@pytest.fixture(autouse=True)
def repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_clean_data_passes_with_counts_and_plots(repo):
    parts = shards()
    write(repo, parts)
    report = validate.run(cfg(), PATHS)
    assert report["passed"] and report["rows"] == 10 == report["expected_rows"]
    assert set(report["checks"]) >= set(ROW_CHECKS) | {"features", "loads", "id_unique"}
    flat = [r for p in parts for r in p]
    assert report["sources"]["alpha"]["rows"] == sum(r["source"] == "alpha" for r in flat)
    assert report["tokens"] == sum(r["num_tokens"] for r in flat)
    assert report["supervised_tokens"] == sum(r["num_loss_tokens"] for r in flat)
    for plot in ("token_length", "supervised_fraction"):
        files = sorted(p.name for p in (repo / "reports/plots" / plot).iterdir())
        assert files == ["alpha.csv", "beta.csv"]
        with open(repo / "reports/plots" / plot / "beta.csv") as f:
            table = list(csv.DictReader(f))
        assert sum(int(r["rows"]) for r in table) == report["sources"]["beta"]["rows"]
        assert_svg(repo / "reports/plots" / f"{plot}.svg", report)


def assert_svg(path: Path, report: dict) -> None:
    """Well-formed, self-contained, a panel for all rows then each source, bars that add up."""
    import xml.etree.ElementTree as ET

    text = path.read_text()
    assert "http" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "<script" not in text and "href" not in text
    root = ET.fromstring(text)
    ns = "{http://www.w3.org/2000/svg}"
    labels = [t.text for t in root.iter(f"{ns}text")]
    panels = [("all sources", report["rows"])] + [
        (name, s["rows"]) for name, s in sorted(report["sources"].items())]
    assert [x for x in labels if x.endswith(" rows)")] == [f"{n} ({r:,} rows)" for n, r in panels]
    bars = [int(t.text.rsplit(": ", 1)[1].replace(",", "")) for t in root.iter(f"{ns}title")]
    assert sum(bars) == 2 * report["rows"]  # every row once overall, once in its source


# Each corruption: (how to damage the data, the one check that must fail). The damaged
# row sits in the second shard so dataset-wide row numbering is exercised.
def mask_two(r):
    r["loss_mask"][0] = 2


def id_over_vocab(r):
    r["input_ids"][1] = VOCAB


def id_negative(r):
    r["input_ids"][0] = -5


def length_mismatch(r):
    r["loss_mask"] = r["loss_mask"][1:]


def all_zero_mask(r):
    r["loss_mask"] = [0] * len(r["loss_mask"])
    r["num_loss_tokens"] = 0


def too_long(r):
    r.update(row(r["id"], r["source"], prompt=40, answer=30))


def no_two_in_a_row(r):
    r["loss_mask"] = [1, 0] * (len(r["loss_mask"]) // 2) + [0] * (len(r["loss_mask"]) % 2)
    r["num_loss_tokens"] = sum(r["loss_mask"])


def wrong_num_tokens(r):
    r["num_tokens"] += 1


def wrong_num_loss_tokens(r):
    r["num_loss_tokens"] -= 1


def null_id(r):
    r["id"] = None


def null_source(r):
    r["source"] = None


def null_mask(r):
    r["loss_mask"] = None


def blank_source(r):
    r["source"] = " \t"


@pytest.mark.parametrize(
    "damage, checks",
    [
        (mask_two, {"mask_binary"}),
        (id_over_vocab, {"token_id_range"}),
        (id_negative, {"token_id_range"}),
        (length_mismatch, {"lengths_equal"}),
        (all_zero_mask, {"min_loss_tokens", "supervised_run"}),
        (too_long, {"max_seq_len"}),
        (no_two_in_a_row, {"supervised_run"}),
        (wrong_num_tokens, {"num_tokens_matches"}),
        (wrong_num_loss_tokens, {"num_loss_tokens_matches"}),
        (null_source, {"source_not_null"}),
        (null_mask, {"loss_mask_not_null"}),
        (blank_source, {"source_not_empty"}),
    ],
)
def test_each_corruption_is_caught_with_its_id(repo, damage, checks):
    parts = shards()
    damage(parts[1][3])
    write(repo, parts)
    assert failures() == {name: ["s1-r3"] for name in checks}


def test_null_id_is_caught_with_its_row(repo):
    parts = shards()
    null_id(parts[1][3])
    write(repo, parts)
    assert failures() == {"id_not_null": ["row 8 (null id)"]}


@pytest.mark.parametrize("blank", ["", "  "])
def test_blank_id_is_caught_with_its_row(repo, blank):
    parts = shards()
    parts[1][3]["id"] = blank
    write(repo, parts)
    assert failures() == {"id_not_empty": [f"row 8 ({blank!r} id)"]}


def test_duplicate_id_across_shards(repo):
    parts = shards()
    parts[1][4]["id"] = "s0-r2"
    write(repo, parts)
    report_failures = failures()
    assert report_failures == {"id_unique": ["s0-r2"]}
    assert json.loads(Path("reports/validate.json").read_text())["checks"]["id_unique"][
        "failures"] == 2


def test_duplicate_ids_found_after_spilling_id_hashes_to_disk(repo, monkeypatch):
    from stages.dataset import idhashes

    monkeypatch.setattr(rowcheck, "CHUNK_ROWS", 4)
    monkeypatch.setattr(idhashes, "SPILL_ROWS", 5)
    monkeypatch.setattr(idhashes, "GROUP_ROWS", 3)
    parts = shards(4, 9)
    parts[3][8]["id"] = "s0-r0"  # first and last row
    parts[2][1]["id"] = parts[2][0]["id"]  # neighbours
    write(repo, parts)
    failed = failures(max_examples=5)
    assert sorted(failed["id_unique"]) == ["s0-r0", "s2-r0"] and len(failed) == 1
    report = json.loads(Path("reports/validate.json").read_text())
    assert report["checks"]["id_unique"]["failures"] == 4


@pytest.mark.parametrize(
    "column, type_",
    [("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.large_list(pa.int8())),
     ("num_tokens", pa.int64()), ("id", pa.large_string())],
)
def test_wrong_dtype_in_one_shard(repo, column, type_):
    schema = pa.schema([pa.field(f.name, type_) if f.name == column else f
                        for f in ARROW_SCHEMA])
    write(repo, shards(), schemas={1: schema})
    found = failures()
    assert set(found) == {"features", "loads"}  # and every row check still passes
    assert found["features"] == [
        f"data-00001-of-00002.arrow: column {column} is {type_}, expected "
        f"{ARROW_SCHEMA.field(column).type}"]


@pytest.mark.parametrize("column, type_", [("input_ids", pa.list_(pa.float32())),
                                           ("loss_mask", pa.list_(pa.float64()))])
def test_a_shard_that_cannot_be_summarised_is_a_features_failure(repo, column, type_):
    schema = pa.schema([pa.field(f.name, type_) if f.name == column else f
                        for f in ARROW_SCHEMA])
    write(repo, shards(), schemas={1: schema})
    found = failures()
    assert set(found) == {"features", "loads"}  # rows counted: no row_count failure
    assert found["features"][0] == (f"data-00001-of-00002.arrow: column {column} is "
                                    f"{type_}, expected {ARROW_SCHEMA.field(column).type}")
    assert found["features"][1].startswith("data-00001-of-00002.arrow: its rows were not")


@pytest.mark.parametrize("key, value", [("threads", -1), ("vocab_size", 0),
                                        ("max_seq_len", 0), ("min_loss_tokens", -1)])
def test_out_of_range_params_are_named(repo, key, value):
    write(repo, shards())
    with pytest.raises(params.ParamError, match=f"validate.{key}: must be >= "):
        validate.run(cfg(**{key: value}), PATHS)


def test_dataset_info_features_must_equal_the_contract(repo):
    write(repo, shards())
    info = {"features": {**FEATURES.to_dict(), "num_tokens": {"dtype": "int64",
                                                               "_type": "Value"}}}
    Path("data/merged/dataset_info.json").write_text(json.dumps(info))
    assert set(failures()) == {"features", "loads"}


def test_row_count_must_equal_the_merge_report(repo):
    write(repo, shards(), report_rows=11)
    found = failures()
    assert found == {"row_count": ["data/merged has 10 rows, reports/merge.json says 11"]}


def test_unreadable_shard_is_reported(repo):
    write(repo, shards())
    path = Path("data/merged/data-00001-of-00002.arrow")
    path.write_bytes(path.read_bytes()[:200])
    found = failures()
    assert found["shards_readable"][0].startswith(f"{path}: not a readable Arrow stream")
    assert "row_count" in found


def test_a_listed_shard_that_is_missing_is_reported(repo):
    write(repo, shards())
    Path("data/merged/data-00001-of-00002.arrow").unlink()
    found = failures()
    assert "data-00001-of-00002.arrow, which does not exist" in found["shards_readable"][0]
    assert {"loads", "row_count"} <= set(found)


def test_null_input_ids_row(repo):
    parts = shards()
    parts[0][0]["input_ids"] = None
    write(repo, parts)
    assert failures() == {"input_ids_not_null": ["s0-r0"]}


def test_missing_fingerprint_fails_unless_vocab_given(repo):
    write(repo, shards(), fingerprint=None)
    with pytest.raises(StageError, match=r"validate\.vocab_size: null, and "
                       r"data/merged/fingerprint\.json is missing or unreadable"):
        validate.run(cfg(), PATHS)
    assert failures(vocab_size=VOCAB) == {"fingerprint": ["data/merged/fingerprint.json is missing"]}


def test_vocab_size_param_overrides_the_fingerprint(repo):
    write(repo, shards())
    found = failures(vocab_size=10)
    assert "token_id_range" in found and len(found["token_id_range"]) == 10  # max_examples


def test_limits_come_from_the_data_unless_params_set_them(repo):
    parts = shards()  # rows of 5 to 10 tokens, 3 or 4 supervised
    write(repo, parts, fingerprint={**FP, "policy": {"max_seq_len": 8, "min_loss_tokens": 4}})
    found = failures(max_seq_len=None, min_loss_tokens=None)
    rows = [r for p in parts for r in p]
    assert found["max_seq_len"] == [r["id"] for r in rows if r["num_tokens"] > 8]
    assert found["min_loss_tokens"] == [r["id"] for r in rows if r["num_loss_tokens"] < 4]
    report = json.loads(Path("reports/validate.json").read_text())
    assert (report["max_seq_len"], report["min_loss_tokens"]) == (8, 4)
    assert report["limits_from"] == {
        "vocab_size": "data/merged/fingerprint.json: tokenizer.vocab_size",
        "max_seq_len": "data/merged/fingerprint.json: policy.max_seq_len",
        "min_loss_tokens": "data/merged/fingerprint.json: policy.min_loss_tokens"}

    report = validate.run(cfg(max_seq_len=64, min_loss_tokens=1), PATHS)
    assert report["passed"] and (report["max_seq_len"], report["min_loss_tokens"]) == (64, 1)
    assert report["limits_from"] == {
        "vocab_size": "data/merged/fingerprint.json: tokenizer.vocab_size",
        "max_seq_len": "params", "min_loss_tokens": "params"}


def test_many_failures_across_chunks_are_counted_and_capped(repo, monkeypatch):
    monkeypatch.setattr(rowcheck, "CHUNK_ROWS", 3)
    parts = shards(3, 7)
    bad = [r for p in parts for r in p][::4]
    for r in bad:
        mask_two(r)
    write(repo, parts)
    found = failures(max_examples=3, threads=2)
    assert found == {"mask_binary": [r["id"] for r in bad[:3]]}
    report = json.loads(Path("reports/validate.json").read_text())
    assert report["checks"]["mask_binary"]["failures"] == len(bad)


def test_the_report_is_the_same_whatever_the_threads(repo, monkeypatch):
    monkeypatch.setattr(rowcheck, "CHUNK_ROWS", 3)
    monkeypatch.setattr(cpus, "usable", lambda: 3)  # automatic: neither 1 nor 2
    parts = shards(5, 7)
    for r in [r for p in parts for r in p][::5]:
        mask_two(r)
    write(repo, parts)
    reports = []
    for threads in (1, 2, 0):
        failures(threads=threads)
        reports.append(Path("reports/validate.json").read_bytes())  # the facts: no timings
    assert reports[0] == reports[1] == reports[2]


def test_cli_exits_1_after_writing_the_report(repo):
    parts = shards()
    mask_two(parts[0][1])
    write(repo, parts)
    (repo / "params.yaml").write_text("validate:\n  max_seq_len: 64\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    proc = subprocess.run(stagecli.command("validate"), cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: validate: 1 checks failed: mask_binary (1, e.g. s0-r1)")
    assert json.loads((repo / "reports/validate.json").read_text())["passed"] is False


def test_dvc_plots_show_renders_the_declared_plots(repo):
    from tests.helpers.repo import run

    write(repo, shards())
    report = validate.run(cfg(), PATHS)
    (repo / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    run(["git", "init", "-q"], repo)
    run(["dvc", "init", "-q"], repo)
    shown = json.loads(run(["dvc", "plots", "show", "--json"], repo))["data"]
    assert sorted(shown) == sorted(
        [f"reports/plots/{plot}/{source}.csv" for plot in ("supervised_fraction", "token_length")
         for source in ("alpha", "beta")]
        + ["reports/plots/supervised_fraction.svg", "reports/plots/token_length.svg"])
    svg = shown["reports/plots/token_length.svg"][0]
    assert svg["type"] == "image" and svg["url"].endswith("token_length.svg")
    values = shown["reports/plots/token_length/alpha.csv"][0]["content"]["data"]["values"]
    assert sum(int(v["rows"]) for v in values) == report["sources"]["alpha"]["rows"] == 4


# ------------------------------------------------------------ the training check


def train_cfg(**kw) -> params.Validate:
    check = {"tokens_per_batch": 40, "batches": 2, "longest_batch_tokens": 64, **kw}
    return cfg(train_check=params.TrainCheck(**check))


@pytest.fixture
def demo_model_cache(repo):
    """The demo model built once under the project's .cache, seen from the test repo."""
    link_caches(repo)


@pytest.mark.parametrize("packed", [True, False])
def test_training_check_passes_on_the_demo_model(repo, demo_model_cache, packed):
    write(repo, shards(3, 8))
    report = validate.run(train_cfg(packed=packed), PATHS)
    assert report["passed"] and report["checks"]["train_step"]["passed"]
    check = report["train_check"]
    assert check["batches"] == 2 and check["layout"] == ("packed" if packed else "padded")
    assert all(np.isfinite(check["loss"])) and check["tokens_per_second"] > 0
    assert check["peak_memory_mb"] > 0 and check["longest_batch"]["tokens"] == 64
    for difference in check["max_loss_difference"].values():
        assert difference <= check["tolerance"]
    assert report["budget"]["tokens_per_batch"] == 40
    assert report["budget"]["packed"]["tokens"] == report["tokens"]
    # fed by the scan's summaries: what the loader's own pass over the counters gives
    assert report["budget"] == loader.budget(PATHS.merged, 40)


def mask_forgotten(ids, mask, starts):
    return ids.astype(np.int64)


def shifted_twice(ids, mask, starts):  # pre-shifted, and the model shifts again
    return np.roll(np.where(mask == 1, ids, -100), -1).astype(np.int64)


@pytest.mark.parametrize("broken, says", [
    (mask_forgotten, "the loss sees tokens outside loss_mask"),
    (shifted_twice, "the labels do not follow loss_mask"),
])
def test_broken_label_construction_fails_in_one_line(repo, demo_model_cache, monkeypatch,
                                                     broken, says):
    from stages.dataset import loader

    monkeypatch.setattr(loader, "labels", broken)
    write(repo, shards(3, 8))
    found = failures(train_check=train_cfg().train_check)
    assert list(found) == ["train_step"]
    assert says in found["train_step"][0]


def test_rows_attending_across_a_pack_are_caught(repo, demo_model_cache, monkeypatch):
    from stages.dataset import loader

    real = loader.collate_packed

    def no_restart(batch):  # positions run on: the model sees one long row
        out = real(batch)
        out["position_ids"] = np.arange(out["input_ids"].shape[1])[None]
        return out

    monkeypatch.setattr(loader, "collate_packed", no_restart)
    write(repo, shards(3, 8))
    found = failures(train_check=train_cfg().train_check)
    assert list(found) == ["train_step"]
    assert "rows attend across their boundaries" in found["train_step"][0]


def test_without_torch_the_check_says_so_and_validate_passes(repo):
    write(repo, shards())
    (repo / "params.yaml").write_text("validate:\n  max_seq_len: 64\n")
    blocked = ("import sys; sys.modules['torch'] = None; from stages import validate; "
               "from stages.process import cli; "
               "sys.exit(cli.main('validate', '', validate.run, validate.PATHS, sys.argv[1:]))")
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    argv = cli.pipeline_command("validate")[3:]  # dvc.yaml's paths
    proc = subprocess.run([sys.executable, "-c", blocked, *argv], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "training check" in line]
    assert len(said) == 1 and said[0].endswith("training check skipped: torch is not installed")
    report = json.loads((repo / "reports/validate.json").read_text())
    assert report["passed"] and report["train_check"] == {"skipped": "torch is not installed"}
    assert "train_step" not in report["checks"] and report["budget"]["rows"] == 10


def test_an_empty_set_is_not_ready_to_train_on(repo, demo_model_cache):
    write(repo, [[]])
    found = failures(train_check=train_cfg().train_check)
    assert found == {"train_step": ["train step: data/merged has no rows to train on"]}


@pytest.mark.parametrize("model, says", [
    ("/nonexistent/model", "/nonexistent/model is not a local model folder"),
    ("demo:nope", "unknown demo model 'demo:nope'"),
])
def test_a_model_that_cannot_be_used_is_named(repo, model, says):
    write(repo, shards())
    with pytest.raises(StageError, match=f"validate.train_check.model: {says}"):
        validate.run(train_cfg(model=model), PATHS)


@pytest.mark.parametrize("key, value", [("batches", 0), ("tokens_per_batch", 0),
                                        ("batches_per_step", 0), ("longest_batch_tokens", -1)])
def test_out_of_range_train_check_params_are_named(repo, key, value):
    write(repo, shards())
    with pytest.raises(params.ParamError, match=f"validate.train_check.{key}: must be >= "):
        validate.run(train_cfg(**{key: value}), PATHS)


def rows_of_lengths(lengths: list[int]) -> list[list[dict]]:
    return [[row(f"r{k}", prompt=2, answer=n - 2) for k, n in enumerate(lengths)]]


def test_rows_longer_than_a_batch_are_skipped_and_counted(repo, demo_model_cache):
    lengths = [30, 9, 12, 40, 7, 11, 25, 10, 8]
    write(repo, rows_of_lengths(lengths))
    report = validate.run(train_cfg(tokens_per_batch=12, batches=100), PATHS)
    check = report["train_check"]
    assert report["passed"] and report["checks"]["train_step"]["passed"]
    longer = sum(n > 12 for n in lengths)
    assert check["longer_than_batch"] == {"rows": longer, "of_rows_read": len(lengths)}
    assert check["rows"] == len(lengths) - longer
    assert check["tokens"] == sum(n for n in lengths if n <= 12)
    assert len(check["peak_memory_mb_per_step"]) == check["batches"]


def test_when_no_row_fits_a_batch_the_check_says_so_and_validate_passes(repo, demo_model_cache):
    write(repo, rows_of_lengths([30, 9, 12]))
    report = validate.run(train_cfg(tokens_per_batch=8), PATHS)
    assert report["passed"] and "train_step" not in report["checks"]
    assert report["train_check"] == {
        "skipped": "no row of data/merged fits in validate.train_check.tokens_per_batch 8: "
                   "all 3 rows are longer (the shortest has 9 tokens)",
        "longer_than_batch": {"rows": 3, "of_rows_read": 3}}


def test_the_longest_batch_is_off_on_a_cpu_unless_asked_for(repo, demo_model_cache):
    write(repo, shards(3, 8))
    check = validate.run(train_cfg(longest_batch_tokens=None, device="cpu"), PATHS)["train_check"]
    assert check["longest_batch"]["skipped"].startswith(
        "off on cpu: longest_batch_tokens null means max_seq_len (64 tokens)")
    check = validate.run(train_cfg(longest_batch_tokens=64, device="cpu"), PATHS)["train_check"]
    longest = check["longest_batch"]
    assert longest["tokens"] == 64
    assert longest["full_logits_mb"] == round(64 * 248077 * 4 / 2**20, 1)
    prefix = "train_check.longest_batch."
    run_keys = [k[len(prefix):] for k in reports.RUN["validate"] if k.startswith(prefix)]
    assert run_keys and all(k in longest for k in run_keys), (run_keys, longest)


def test_the_process_peak_survives_the_steps_resets(repo, demo_model_cache):
    """Each step resets the process's high-water mark (VmHWM); the report keeps the
    process's own peak, here one set before the check by 1.5 GB touched and let go
    (RSS counters are synced in batches of pages: a MB of slack)."""
    write(repo, shards(3, 8))
    block = np.ones(1536 << 20, np.uint8)
    peak_before = status_mb("VmHWM")
    del block
    check = validate.run(train_cfg(), PATHS)["train_check"]
    assert check["process_peak_rss_mb"] >= peak_before - 1
    assert max(check["peak_memory_mb_per_step"]) == check["peak_memory_mb"] < peak_before - 500
    assert status_mb("VmHWM") < peak_before - 500  # what /usr/bin/time would report


def status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return int(status[key].split()[0]) / 1024


def test_a_model_whose_logits_are_not_its_output_layer_is_named(repo, tmp_path):
    """Gemma 2 soft-caps its logits: the chunked loss would not be its loss."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, final_logit_softcapping=1.0, initializer_range=1.0,
                          pad_token_id=0)
    Gemma2ForCausalLM(config).save_pretrained(tmp_path / "gemma2")
    write(repo, shards(3, 8))
    with pytest.raises(StageError) as e:
        validate.run(train_cfg(model=str(tmp_path / "gemma2")), PATHS)
    assert str(e.value).startswith(f"validate.train_check.model: {tmp_path / 'gemma2'}: its own "
                                   "loss (")
    assert "the check's chunked loss cannot stand for this model's" in str(e.value)
