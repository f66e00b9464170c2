import dataclasses
import os
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import yaml

from stages.common.params import (
    Launch,
    MAX_FILE_BYTES,
    Merge,
    ParamError,
    SECTIONS,
    Server,
    Source,
    Tokenize,
    check_ranges,
    load,
)
from tests.helpers import stagecli
from tests.helpers.repo import ROOT


def write(tmp_path, doc) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def shipped() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


@pytest.mark.parametrize("section", list(SECTIONS))
def test_shipped_params_load(section):
    cfg = load(section, ROOT / "params.yaml")
    assert isinstance(cfg, SECTIONS[section])


def test_reference_example_loads():
    for section in SECTIONS:
        load(section, ROOT / "examples" / "reference.yaml")


def test_unknown_key_is_named(tmp_path):
    doc = shipped()
    doc["tokenize"]["max_seq_lenn"] = 10
    with pytest.raises(ParamError) as e:
        load("tokenize", write(tmp_path, doc))
    msg = str(e.value)
    assert "tokenize.max_seq_lenn: unknown key" in msg
    assert "max_seq_len" in msg and "\n" not in msg


def test_wrong_type_is_named(tmp_path):
    doc = shipped()
    doc["tokenize"]["max_seq_len"] = "4k"
    with pytest.raises(ParamError, match=r"tokenize\.max_seq_len: expected an integer, got str '4k'"):
        load("tokenize", write(tmp_path, doc))


def test_bool_is_not_an_int(tmp_path):
    doc = shipped()
    doc["generate"]["concurrency"] = True
    with pytest.raises(ParamError, match=r"generate\.concurrency: expected an integer"):
        load("generate", write(tmp_path, doc))


def test_int_is_accepted_as_float(tmp_path):
    doc = shipped()
    doc["generate"]["temperature"] = 1
    assert load("generate", write(tmp_path, doc)).temperature == 1.0


def test_literal_choices_listed(tmp_path):
    doc = shipped()
    doc["tokenize"]["multi_turn"] = "first"
    with pytest.raises(ParamError, match=r"tokenize\.multi_turn: expected one of 'last', 'all', 'expand'"):
        load("tokenize", write(tmp_path, doc))


def test_nested_list_item_named(tmp_path):
    doc = shipped()
    doc["prepare"]["sources"][1]["limit"] = "ten"
    with pytest.raises(ParamError, match=r"prepare\.sources\[1\]\.limit: expected an integer or null"):
        load("prepare", write(tmp_path, doc))


def test_nested_mapping_key_named(tmp_path):
    doc = shipped()
    doc["generate"]["server"]["launch"]["engine"] = "tgi"
    with pytest.raises(ParamError, match=r"generate\.server\.launch\.engine: expected one of"):
        load("generate", write(tmp_path, doc))


def test_missing_required_key(tmp_path):
    doc = shipped()
    del doc["prepare"]["sources"][0]["path"]
    with pytest.raises(ParamError, match=r"prepare\.sources\[0\]\.path: required key is missing"):
        load("prepare", write(tmp_path, doc))


def test_missing_section_and_file(tmp_path):
    with pytest.raises(ParamError, match="missing section 'merge'"):
        load("merge", write(tmp_path, {"prepare": {}}))
    with pytest.raises(ParamError, match="params file not found"):
        load("merge", tmp_path / "nope.yaml")


def test_url_may_be_a_list(tmp_path):
    doc = shipped()
    doc["generate"]["server"] = {"url": ["http://a:1", "http://b:2"]}
    assert load("generate", write(tmp_path, doc)).server.url == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize("stage", list(SECTIONS))
def test_cli_rejects_bad_params_with_one_line(tmp_path, stage):
    doc = shipped()
    doc[stage]["no_such_key"] = 1
    path = write(tmp_path, doc)
    proc = subprocess.run(
        [*stagecli.command(stage), "--params", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == f"error: {path}: {stage}.no_such_key: unknown key " + lines[-1].split("unknown key ", 1)[1]
    assert len([l for l in lines if l.startswith("error:")]) == 1


@pytest.mark.parametrize("stage", list(SECTIONS))
def test_cli_help_describes_stage(stage):
    proc = subprocess.run(
        [sys.executable, "-m", f"stages.{stage}", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0
    assert "--params FILE" in proc.stdout
    assert len(proc.stdout.splitlines()) > 4


# Keys whose shipped value is the demo's own choice, not the code's default. Every other
# key in params.yaml must equal its default in stages/common/params.py, so that a default moved
# in the code without params.yaml is caught here (DVC sees only params.yaml).
DEMO_CHOICES = {
    "prepare.sources[].path", "prepare.sources[].name", "prepare.sources[].format",
    "prepare.sources[].limit", "prepare.sources[].prompt_field",
    "prepare.sources[].system_field",
    "prepare.decontaminate.evals[].name", "prepare.decontaminate.evals[].path",
    "prepare.decontaminate.evals[].format", "prepare.decontaminate.evals[].prompt_field",
    "generate.server.launch.engine", "generate.server.launch.model",
    "generate.server.launch.startup_timeout", "generate.concurrency",
    "generate.max_tokens", "generate.temperature", "generate.seed",
    "generate.request_timeout",
    # the random demo model answers without thinking (it never closes a thinking block)
    "generate.enable_thinking",
    "tokenize.max_seq_len", "merge.base",
    # the demo model's 248K-entry output layer costs milliseconds a token on a CPU:
    # demo-sized steps
    "validate.train_check.tokens_per_batch", "validate.train_check.longest_batch_tokens",
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
    for section, cls in SECTIONS.items():
        problems += _field_problems(cls, doc[section], section)
    assert not problems, "params.yaml must carry every key (DVC sees only it):\n" + \
        "\n".join(problems)


def test_the_check_catches_a_missing_key_and_a_moved_default(monkeypatch):
    doc = shipped()
    del doc["tokenize"]["shard_rows"]
    assert _field_problems(Tokenize, doc["tokenize"], "tokenize") == \
        ["tokenize.shard_rows: missing"]
    fields = {f.name: f for f in dataclasses.fields(Merge)}
    monkeypatch.setattr(fields["link"], "default", False)
    assert _field_problems(Merge, shipped()["merge"], "merge") == \
        ["merge.link: True in params.yaml, default False"]


# ------------------------------------------------------------ hostile and careless files


def write_text(tmp_path, text: str) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


def numeric_fields():
    for cls in [*SECTIONS.values(), Source, Server, Launch]:
        for f in dataclasses.fields(cls):
            if f.type in ("int", "float", "Optional[int]", "Optional[float]"):
                yield cls, f


def test_every_numeric_param_declares_its_range():
    fields = list(numeric_fields())
    assert len(fields) > 30
    for cls, f in fields:
        ge, gt, le = f.metadata["range"]  # KeyError: a number param without ranged(...)
        assert le is not None and (ge is not None or gt is not None), (cls.__name__, f.name)


@pytest.mark.parametrize("section, key, value, message", [
    ("prepare", "seed", 2**64, "must be >= 0 and <= 18446744073709551615, got int 18446744073709551616"),
    ("prepare", "seed", -1, "must be >= 0 and <= 18446744073709551615, got int -1"),
    ("prepare", "num_proc", 1000, "must be >= 0 and <= 256, got int 1000"),
    ("tokenize", "num_proc", -1, "must be >= 0 and <= 256, got int -1"),
    ("tokenize", "max_seq_len", 2**70, "must be >= 1 and <= 2147483647, got int 1180591620717411303424"),
    ("validate", "threads", 2**70, "must be >= 0 and <= 256"),
    ("generate", "top_p", 0, "must be > 0 and <= 1, got float 0.0"),
    ("generate", "temperature", float("nan"), "expected a finite number, got nan"),
    ("generate", "request_timeout", float("inf"), "expected a finite number, got inf"),
    ("generate", "backoff_max", 2**70, "int 1180591620717411303424 is too large"),
])
def test_a_number_outside_its_range_is_one_line(tmp_path, section, key, value, message):
    doc = shipped()
    doc[section][key] = value
    with pytest.raises(ParamError) as e:
        load(section, write(tmp_path, doc))
    assert str(e.value).startswith(f"{tmp_path / 'params.yaml'}: {section}.{key}: {message}")


def test_nested_ranges_are_checked_too(tmp_path):
    doc = shipped()
    doc["prepare"]["sources"][1]["limit"] = -1
    doc["generate"]["server"]["launch"]["port"] = 70000
    with pytest.raises(ParamError, match=r"prepare\.sources\[1\]\.limit: must be >= 0 and"):
        load("prepare", write(tmp_path, doc))
    with pytest.raises(ParamError, match=r"generate\.server\.launch\.port: must be >= 1 and <= 65535"):
        load("generate", write(tmp_path, doc))
    # a dataclass made in code is checked by the stage with the same rule
    with pytest.raises(ParamError, match=r"^tokenize\.shard_rows: must be >= 1"):
        check_ranges(Tokenize(shard_rows=0), "tokenize")


def test_a_yaml_alias_bomb_is_refused_fast_with_a_short_message(tmp_path):
    # 9**14 (2e13) strings if expanded: the full repr would never finish
    chain = "anchors:\n  a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 15))
    for tail, key in [("tokenize:\n  num_proc: *a14\n", "tokenize.num_proc"),
                      ("tokenize:\n  chat_template: *a14\n", "tokenize.chat_template"),
                      ("prepare:\n  sources: *a14\n", r"prepare.sources\[0\]"),
                      ("generate:\n  server: {launch: {engine: sglang, model: m, args: *a14}}\n",
                       r"generate.server.launch.args\[0\]")]:
        path = write_text(tmp_path, chain + tail)
        started = time.monotonic()
        with pytest.raises(ParamError, match=rf"{key}: expected .*, got list \[\[") as e:
            load(tail.split(":")[0], path)
        assert time.monotonic() - started < 10 and len(str(e.value)) < 300  # never, expanded


@pytest.mark.parametrize("text, message", [
    ("tokenize:\n  num_proc: " + "[" * 100_000 + "]" * 100_000 + "\n", ":2: nested deeper than 64 levels"),
    ("tokenize:\n  chat_template: " + "{a: " * 100_000 + "1" + "}" * 100_000 + "\n",
     ":2: nested deeper than 64 levels"),
    ("tokenize:\n  num_proc: 1\n  max_seq_len: 8\n  num_proc: 4\n", ":4: not valid YAML: key 'num_proc' given twice"),
    ("tokenize:\n  num_proc: [1\n", ":3: not valid YAML: expected ',' or ']'"),
    ("prepare:\n  seed: " + "9" * 5000 + "\n", ": cannot read a value: Exceeds the limit"),
    ("tokenize:\n  tokenizer: '" + "x" * 200_000 + "\n", ":3: not valid YAML: found unexpected end"),
    ("tokenize:\n  num_proc: '" + "x" * 500_000 + "'\n", ": tokenize.num_proc: expected an integer, got str 'xxx"),
])
def test_a_hostile_params_file_is_one_short_line(tmp_path, text, message):
    path = write_text(tmp_path, text)
    with pytest.raises(ParamError) as e:
        load(text.split(":")[0], path)
    assert str(e.value).startswith(f"{path}{message}") and len(str(e.value)) < 400


def test_yaml_merge_keys_may_be_overridden(tmp_path):
    path = write_text(tmp_path, "defaults: &d {num_proc: 2, max_seq_len: 9}\n"
                                "tokenize:\n  <<: *d\n  num_proc: 4\n")
    cfg = load("tokenize", path)
    assert (cfg.num_proc, cfg.max_seq_len) == (4, 9)


def test_files_that_are_not_params_files(tmp_path):
    (tmp_path / "big.yaml").write_text("# " + "x" * MAX_FILE_BYTES + "\n")
    (tmp_path / "latin1.yaml").write_bytes(b"tokenize:\n  tokenizer: caf\xe9\n")
    os.mkfifo(tmp_path / "fifo.yaml")
    for path, message in [("/dev/zero", "not a regular file"),
                          (tmp_path / "fifo.yaml", "not a regular file"),
                          (tmp_path, "is a folder, not a params file"),
                          (tmp_path / "big.yaml", f"larger than {MAX_FILE_BYTES} bytes"),
                          (tmp_path / "latin1.yaml", "not UTF-8 text (byte 26)")]:
        with pytest.raises(ParamError) as e:
            load("tokenize", path)
        assert str(e.value).startswith(f"{path}: {message}")


def test_home_folders_in_paths(tmp_path):
    doc = shipped()
    doc["prepare"]["sources"][0]["path"] = "~/x.jsonl"
    doc["merge"]["base"] = "~"
    assert load("prepare", write(tmp_path, doc)).sources[0].path == str(Path.home() / "x.jsonl")
    assert load("merge", write(tmp_path, doc)).base == str(Path.home())
    doc["prepare"]["sources"][0]["path"] = "~no-such-user-13/x.jsonl"
    with pytest.raises(ParamError) as e:
        load("prepare", write(tmp_path, doc))
    assert str(e.value).endswith("prepare.sources[0].path: cannot expand str '~no-such-user-13/x.jsonl': "
                                 "no home folder for user 'no-such-user-13'")


@pytest.mark.parametrize("stage", ["prepare", "tokenize"])
def test_cli_hostile_params_are_one_line(tmp_path, stage):
    for params, message in [("/dev/zero", "error: /dev/zero: not a regular file"),
                            ("deep.yaml", "error: deep.yaml:2: nested deeper than 64 levels"),
                            ("big.yaml", f"error: big.yaml: {stage}.num_proc: must be >= ")]:
        (tmp_path / "deep.yaml").write_text(f"{stage}:\n  x: " + "[" * 100_000 + "]" * 100_000)
        sources = "  sources: []\n" if stage == "prepare" else ""
        (tmp_path / "big.yaml").write_text(f"{stage}:\n{sources}  num_proc: {2**70}\n")
        line, _ = stagecli.fail(stage, tmp_path, params)
        assert line.startswith(message), line


def test_cli_error_quoting_a_line_break_or_surrogate_stays_one_line(tmp_path):
    (tmp_path / "params.yaml").write_text(
        'prepare:\n  sources:\n    - {name: "a\\nb\\u2028c\\ud800", path: nowhere.jsonl, format: columns, '
        'prompt_field: q}\n')
    line, _ = stagecli.fail("prepare", tmp_path)
    assert line == r"error: source a\nb\u2028c\ud800: path 'nowhere.jsonl' not found"


@pytest.mark.parametrize("section, keys, name", [
    ("prepare", ("sources", 0, "path"), r"prepare\.sources\[0\]\.path"),
    ("merge", ("base",), r"merge\.base"), ("generate", ("cache_dir",), r"generate\.cache_dir"),
    ("tokenize", ("tokenizer",), r"tokenize\.tokenizer")])  # fmt: skip
def test_an_empty_path_is_refused_not_read_as_the_project_folder(tmp_path, section, keys, name):
    doc = shipped()
    node = doc[section]
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = " "
    with pytest.raises(ParamError, match=name + ": an empty path names no file"):
        load(section, write(tmp_path, doc))
