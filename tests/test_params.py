import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stages import params as P

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, doc) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def shipped() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


@pytest.mark.parametrize("section", list(P.SECTIONS))
def test_shipped_params_load(section):
    cfg = P.load(section, ROOT / "params.yaml")
    assert isinstance(cfg, P.SECTIONS[section])


def test_reference_example_loads():
    for section in P.SECTIONS:
        P.load(section, ROOT / "examples" / "reference.yaml")


def test_unknown_key_is_named(tmp_path):
    doc = shipped()
    doc["tokenize"]["max_seq_lenn"] = 10
    with pytest.raises(P.ParamError) as e:
        P.load("tokenize", write(tmp_path, doc))
    msg = str(e.value)
    assert "tokenize.max_seq_lenn: unknown key" in msg
    assert "max_seq_len" in msg and "\n" not in msg


def test_wrong_type_is_named(tmp_path):
    doc = shipped()
    doc["tokenize"]["max_seq_len"] = "4k"
    with pytest.raises(P.ParamError, match=r"tokenize\.max_seq_len: expected an integer, got str '4k'"):
        P.load("tokenize", write(tmp_path, doc))


def test_bool_is_not_an_int(tmp_path):
    doc = shipped()
    doc["generate"]["concurrency"] = True
    with pytest.raises(P.ParamError, match=r"generate\.concurrency: expected an integer"):
        P.load("generate", write(tmp_path, doc))


def test_int_is_accepted_as_float(tmp_path):
    doc = shipped()
    doc["generate"]["temperature"] = 1
    assert P.load("generate", write(tmp_path, doc)).temperature == 1.0


def test_literal_choices_listed(tmp_path):
    doc = shipped()
    doc["tokenize"]["multi_turn"] = "first"
    with pytest.raises(P.ParamError, match=r"tokenize\.multi_turn: expected one of 'last', 'all', 'expand'"):
        P.load("tokenize", write(tmp_path, doc))


def test_nested_list_item_named(tmp_path):
    doc = shipped()
    doc["prepare"]["sources"][1]["limit"] = "ten"
    with pytest.raises(P.ParamError, match=r"prepare\.sources\[1\]\.limit: expected an integer or null"):
        P.load("prepare", write(tmp_path, doc))


def test_nested_mapping_key_named(tmp_path):
    doc = shipped()
    doc["generate"]["server"]["launch"]["engine"] = "tgi"
    with pytest.raises(P.ParamError, match=r"generate\.server\.launch\.engine: expected one of"):
        P.load("generate", write(tmp_path, doc))


def test_missing_required_key(tmp_path):
    doc = shipped()
    del doc["prepare"]["sources"][0]["path"]
    with pytest.raises(P.ParamError, match=r"prepare\.sources\[0\]\.path: required key is missing"):
        P.load("prepare", write(tmp_path, doc))


def test_missing_section_and_file(tmp_path):
    with pytest.raises(P.ParamError, match="missing section 'merge'"):
        P.load("merge", write(tmp_path, {"prepare": {}}))
    with pytest.raises(P.ParamError, match="params file not found"):
        P.load("merge", tmp_path / "nope.yaml")


def test_url_may_be_a_list(tmp_path):
    doc = shipped()
    doc["generate"]["server"] = {"url": ["http://a:1", "http://b:2"]}
    assert P.load("generate", write(tmp_path, doc)).server.url == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize("stage", list(P.SECTIONS))
def test_cli_rejects_bad_params_with_one_line(tmp_path, stage):
    doc = shipped()
    doc[stage]["no_such_key"] = 1
    path = write(tmp_path, doc)
    proc = subprocess.run(
        [sys.executable, "-m", f"stages.{stage}", "--params", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == f"error: {path}: {stage}.no_such_key: unknown key " + lines[-1].split("unknown key ", 1)[1]
    assert len([l for l in lines if l.startswith("error:")]) == 1


@pytest.mark.parametrize("stage", list(P.SECTIONS))
def test_cli_help_describes_stage(stage):
    proc = subprocess.run(
        [sys.executable, "-m", f"stages.{stage}", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0
    assert "--params FILE" in proc.stdout
    assert len(proc.stdout.splitlines()) > 4
