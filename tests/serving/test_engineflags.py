"""What a run's serving setup needs (stages/serving/engineflags.py): the tool-call parser of a
launched SGLang, and one warning line per param a run behind sglang-router misses."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from stages.common import params
from stages.serving import engineflags
from tests.helpers.fakeserver import FakeServer
from tests.helpers.generation import here, launch_server, url_server, write_params

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def launch(model: str, *args: str, engine: str = "sglang") -> params.Launch:
    return params.build(params.Launch, {"engine": engine, "model": model, "args": list(args)}, "test")


@pytest.mark.parametrize("model, parser", [
    ("Qwen/Qwen3.6-35B-A3B", "qwen3_coder"), ("Qwen/Qwen3.5-397B-A17B", "qwen3_coder"),
    ("/models/qwen3_6-27b", "qwen3_coder"), ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "qwen3_coder"),
    ("Qwen/Qwen3-8B", "qwen25"), ("Qwen/Qwen2.5-7B-Instruct", "qwen25"),
])  # fmt: skip
def test_a_launched_sglang_gets_its_formats_tool_call_parser_when_prompts_carry_tools(model, parser):
    given = launch(model, "--reasoning-parser", "qwen3")
    assert engineflags.launch_for(given, tools=True).args == [
        "--reasoning-parser", "qwen3", "--tool-call-parser", parser]
    assert engineflags.launch_for(given, tools=False) is given


def test_the_users_own_parser_and_other_engines_are_left_alone(caplog):
    mine = launch("Qwen/Qwen3.6-35B-A3B", "--tool-call-parser=qwen25")
    assert engineflags.launch_for(mine, tools=True) is mine
    vllm = launch("Qwen/Qwen3.6-35B-A3B", engine="vllm")
    assert engineflags.launch_for(vllm, tools=True) is vllm
    other = launch("meta-llama/Llama-3.1-8B-Instruct")
    with caplog.at_level(logging.WARNING, "stages.serving.engineflags"):
        assert engineflags.launch_for(other, tools=True) is other
    warning, = [r.getMessage() for r in caplog.records]
    assert "--tool-call-parser" in warning and "Llama-3.1-8B" in warning


def write_prompts(wd: Path, tools: bool) -> None:
    path = wd / "data/prompts/prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"p{i}", "source": "s", "messages": [{"role": "user", "content": f"q{i}"}],
             **({"tools": TOOLS} if tools else {})} for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_the_stage_launches_sglang_with_the_parser(tmp_path):
    write_prompts(tmp_path, tools=True)
    server = launch_server(tmp_path, {})
    server["launch"]["model"] = "Qwen/Qwen3.6-35B-A3B"
    write_params(tmp_path, server=server)
    report = here(tmp_path)
    assert report["completed"] == 3
    log = (tmp_path / ".cache/logs/generate-server.log").read_text()
    assert "ignoring ['--tool-call-parser', 'qwen3_coder']" in log  # what the fake was given


def test_behind_a_router_each_missing_param_is_one_warning(tmp_path, caplog):
    write_prompts(tmp_path, tools=False)
    with FakeServer({"router": True}).start() as router:
        write_params(tmp_path, server=url_server(router.url), request_timeout=3600)
        with caplog.at_level(logging.WARNING, "stages.serving.engineflags"):
            here(tmp_path)
        said = [r.getMessage() for r in caplog.records if "sglang-router" in r.getMessage()]
        assert len(said) == 4 and all("\n" not in line for line in said)
        for needed in ("--request-timeout-secs", "generate.context_length",
                       "generate.server.model", "return_token_ids"):
            assert sum(needed in line for line in said) == 1, needed
        caplog.clear()
        write_params(tmp_path, server=url_server(router.url, model="fake-model",
                                                 router_timeout=3700),
                     request_timeout=3600, context_length=4096)
        with caplog.at_level(logging.WARNING, "stages.serving.engineflags"):
            here(tmp_path)
        said = [r.getMessage() for r in caplog.records if "sglang-router" in r.getMessage()]
        assert len(said) == 1 and "return_token_ids" in said[0]
    # the report says which checks fell back to counts, and why
    assert json.loads((tmp_path / "reports/generate.json").read_text())["engine_ids"] == {
        "rows_with_ids": 0, "rows_unusable_ids": 0, "rows_without_ids": 3,
        "why_without": engineflags.engineids.ROUTER_WHY}
