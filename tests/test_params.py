import dataclasses
import subprocess
import sys
import typing
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


# Keys whose shipped value is the demo's own choice, not the code's default. Every other
# key in params.yaml must equal its default in stages/params.py, so that a default moved
# in the code without params.yaml is caught here (DVC sees only params.yaml).
DEMO_CHOICES = {
    "prepare.sources[].path", "prepare.sources[].name", "prepare.sources[].format",
    "prepare.sources[].limit", "prepare.sources[].prompt_field",
    "prepare.sources[].system_field",
    "generate.server.launch.engine", "generate.server.launch.model",
    "generate.server.launch.startup_timeout", "generate.concurrency",
    "generate.max_tokens", "generate.temperature", "generate.seed",
    "generate.request_timeout",
    "tokenize.max_seq_len", "merge.base",
}


def _field_problems(cls, data: dict, where: str) -> list[str]:
    """Keys of dataclass `cls` missing from `data`, or off their default; recursively."""
    problems = []
    for f in dataclasses.fields(cls):
        key = f"{where}.{f.name}"
        if f.name not in data:
            problems.append(f"{key}: missing")
            continue
        value = data[f.name]
        nested = _dataclass_in(typing.get_type_hints(cls)[f.name])
        if nested is not None and isinstance(value, dict):
            problems += _field_problems(nested, value, key)
        elif nested is not None and isinstance(value, list):
            for item in value:
                problems += _field_problems(nested, item, f"{key}[]")
        if key in DEMO_CHOICES or (nested is not None and value is not None):
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            problems.append(f"{key}: required, so it must be listed in DEMO_CHOICES")
            continue
        if value != default or isinstance(value, bool) != isinstance(default, bool):
            problems.append(f"{key}: {value!r} in params.yaml, default {default!r}")
    return problems


def _dataclass_in(tp):
    """The dataclass inside Optional[...] or list[...], if any."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        found = _dataclass_in(arg)
        if found is not None:
            return found
    return None


def test_params_yaml_carries_every_key_with_its_default():
    doc = shipped()
    problems = []
    for section, cls in P.SECTIONS.items():
        problems += _field_problems(cls, doc[section], section)
    assert not problems, "params.yaml must carry every key (DVC sees only it):\n" + \
        "\n".join(problems)


def test_the_check_catches_a_missing_key_and_a_moved_default(monkeypatch):
    doc = shipped()
    del doc["tokenize"]["shard_rows"]
    assert _field_problems(P.Tokenize, doc["tokenize"], "tokenize") == \
        ["tokenize.shard_rows: missing"]
    fields = {f.name: f for f in dataclasses.fields(P.Merge)}
    monkeypatch.setattr(fields["link"], "default", False)
    assert _field_problems(P.Merge, shipped()["merge"], "merge") == \
        ["merge.link: True in params.yaml, default False"]
