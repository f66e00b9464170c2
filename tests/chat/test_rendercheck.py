"""The serve-render check end to end: generate against our fake server acting as SGLang
0.5.23 (or vLLM): it renders each request with the bundled tokenizer's template and
returns the prompt and completion token ids where that engine puts them, then tokenize
checks every row against what was served, and trains on those ids when asked
(`tokenize.ids: engine`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages import tokenize
from stages.chat import rendercheck
from stages.common import params, stagefiles
from stages.models import tokenizer
from tests.helpers.fakeserver import FakeServer
from tests.helpers.generation import here, url_server, write_params
from tests.helpers import stagecli
from tests.helpers.shapes import every_shape

PATHS = stagecli.paths("tokenize")  # where dvc.yaml has the stage read and write

@pytest.fixture(scope="module")
def bundled() -> str:
    return str(tokenizer.ensure_bundled().resolve())


def generate(wd: Path, bundled: str, engine: str = "sglang", thinking: bool = True,
             **spec) -> Path:
    path = wd / "data/prompts/prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in every_shape()), encoding="utf-8")
    if engine == "vllm":
        spec = {"dialect": "vllm", "reasoning_field": "reasoning", **spec}
    if engine == "transformers":
        spec = {"tools_as": "transformers", **spec}
    with FakeServer({"tokenizer": bundled, **spec}).start() as fake:
        write_params(wd, server=url_server(fake.url, engine=engine), enable_thinking=thinking)
        here(wd)
    return wd / "data/completions/completions.jsonl"


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # four generations, each tokenized three ways
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("thinking", [True, False])
def test_every_row_is_checked_by_ids_with_zero_mismatches(tmp_path, bundled, engine, thinking):
    src = generate(tmp_path, bundled, engine, thinking)
    rows = read(src)
    assert len(rows) == 24
    assert all(set(r["engine_tokens"]) == {"prompt_ids", "completion_ids"} for r in rows)
    # tokenize follows the enable_thinking generate recorded (tokenize.enable_thinking null)
    assert json.loads((src.parent / "generation.json").read_text())["sampling"][
        "enable_thinking"] is thinking
    # (expand with thinking off would make rows of history turns that carry reasoning,
    # which no thinking-off prompt can precede)
    for policy in ("last", "all", "expand") if thinking else ("last", "all"):
        report = tokenize.tokenize_file(src, tmp_path / f"out-{policy}", multi_turn=policy)
        check = report["serve_check"]
        assert check["mismatches"] == 0 and check["examples"] == []
        assert check["checked"] == check["checked_by_ids"] == 24 - report["dropped_total"]
        assert check["checked_by_count"] == check["unusable_ids"] == 0
        completion = check["completion"]
        assert completion["checked"] == completion["ids_checked"] == check["checked"]
        assert completion["beyond_slack"] == 0


def test_an_engine_without_ids_is_checked_by_prompt_tokens_and_says_why(tmp_path, bundled):
    src = generate(tmp_path, bundled, engine="transformers")
    assert not any("engine_tokens" in row for row in read(src))
    check = tokenize.tokenize_file(src, tmp_path / "out")["serve_check"]
    assert check["mismatches"] == 0 and check["checked_by_count"] == check["checked"] > 20
    assert check["by_count_why"] == {
        "transformers returns no token ids: prompts are checked by token count": check["checked"]}


def test_unusable_ids_are_counted_as_such(tmp_path, bundled):
    """An engine answer with an empty prompt_token_ids is counted, not silently unchecked;
    its prompt is still checked by the count the engine reported."""
    rule = {"fault": "patch", "match": "p00[0-4]$", "set": {"choices.0.prompt_token_ids": []}}
    src = generate(tmp_path, bundled, rules=[rule])
    n = sum("unusable" in r["engine_tokens"] for r in read(src))
    assert n >= 5  # and the rows that ask the same request (it is sent once)
    report = json.loads((tmp_path / "reports/generate.json").read_text())
    assert report["engine_ids"] == {"rows_with_ids": 24 - n, "rows_unusable_ids": n,
                                    "rows_without_ids": 0}
    tokenized = tokenize.tokenize_file(src, tmp_path / "out")
    check = tokenized["serve_check"]
    assert tokenized["dropped_total"] == 0
    assert check["unusable_ids"] == check["checked_by_count"] == n
    assert check["by_count_why"] == {"unusable engine ids: prompt_token_ids is empty": n}
    assert check["mismatches"] == 0 and check["unchecked"] == 0


@pytest.mark.slow  # a generation, then tokenize
def test_wrong_template_fails_in_one_line_naming_it(tmp_path, bundled):
    """The same SGLang completions tokenized with the original Qwen3 template: every row
    fails the check by ids."""
    src = generate(tmp_path, bundled)
    out = tmp_path / "out"
    with pytest.raises(tokenize.RenderMismatch) as e:
        tokenize.tokenize_file(src, out, chat_template="bundled:qwen3")
    message = str(e.value)
    assert "\n" not in message and "different chat template" in message
    assert "24 of 24 checked rows" in message and not out.exists()
    check = e.value.report["serve_check"]
    assert check["checked_by_ids"] == 24
    assert sum(check["causes"].values()) == 24 and check["causes"]["chat_template"] > 12
    first = check["examples"][0]
    assert first["row"] == "p000" and first["engine_prompt_tokens"] != first["prompt_tokens"]
    assert first["ours_end"].endswith("<|im_start|>assistant\n")
    # tolerated when asked to
    report = tokenize.tokenize_file(src, out, chat_template="bundled:qwen3", max_render_mismatch=24)
    assert report["serve_check"]["mismatches"] == 24


def test_enable_thinking_flipped_is_named(tmp_path, bundled):
    src = generate(tmp_path, bundled, thinking=False)
    with pytest.raises(tokenize.RenderMismatch) as e:
        tokenize.tokenize_file(src, tmp_path / "out", enable_thinking=True)
    assert "\n" not in str(e.value) and "enable_thinking differs" in str(e.value)
    first = e.value.report["serve_check"]["examples"][0]
    assert first["cause"] == "enable_thinking"
    assert first["ours_at"].endswith("<think>\n") and "</think>" in first["engine_at"]
    assert tokenize.tokenize_file(src, tmp_path / "ok", enable_thinking=False)[
        "serve_check"]["mismatches"] == 0
    # null (the default) follows what generate recorded: nothing to get wrong
    assert tokenize.tokenize_file(src, tmp_path / "null")["serve_check"]["mismatches"] == 0
    assert json.loads((tmp_path / "null" / "fingerprint.json").read_text())[
        "policy"]["enable_thinking"] is False
    # the other way round: answers with reasoning cannot follow a closed thinking block
    src = generate(tmp_path / "on", bundled, thinking=True)
    with pytest.raises(tokenize.StageError, match="tokenize.enable_thinking"):
        tokenize.tokenize_file(src, tmp_path / "out2", enable_thinking=False)


@pytest.mark.slow  # a generation, then tokenize
def test_run_writes_the_report_with_examples_and_no_dataset(tmp_path, bundled, monkeypatch):
    src = generate(tmp_path, bundled)
    monkeypatch.chdir(tmp_path)
    assert src == tmp_path / PATHS.completions / stagefiles.COMPLETIONS_FILE
    cfg = params.Tokenize(chat_template=str(tokenizer.template_path("bundled:qwen3")))
    with pytest.raises(tokenize.RenderMismatch):
        tokenize.run(cfg, PATHS)
    report = json.loads((tmp_path / "reports/tokenize.json").read_text())
    assert report["serve_check"]["mismatches"] == 24 and len(
        report["serve_check"]["examples"]) == rendercheck.EXAMPLES
    assert not (tmp_path / PATHS.out).exists()


def test_rows_without_engine_counts_are_counted_unchecked(tmp_path):
    row = {"id": "a", "source": "s", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps(row) + "\n")
    check = tokenize.tokenize_file(src, tmp_path / "out")["serve_check"]
    assert check["unchecked"] == 1 and check["checked"] == 0


def test_completion_slack():
    assert rendercheck.slack(10) == rendercheck.COMPLETION_SLACK_TOKENS
    assert rendercheck.slack(1000) == 20


def test_wrong_template_first_difference_shows_both_sides(tmp_path, bundled):
    """With the engine's ids kept whole, a mismatch shows where the texts part."""
    src = generate(tmp_path, bundled)
    with pytest.raises(tokenize.RenderMismatch) as e:
        tokenize.tokenize_file(src, tmp_path / "out", chat_template="bundled:qwen3")
    for example in e.value.report["serve_check"]["examples"]:
        i = example["first_difference"]
        assert isinstance(i, int) and 0 < i <= example["prompt_tokens"]
        assert example["ours_at"] != example["engine_at"]
    # the original Qwen3 format lists tools in other words
    first = e.value.report["serve_check"]["examples"][0]
    assert "You have access to the following functions" in first["engine_at"]
    assert "You have access to the following functions" not in first["ours_at"]


def test_the_request_cache_keeps_the_ids_whole_and_its_keys_do_not_change(tmp_path, bundled):
    """Asking for ids changes no request key: a rerun, even one that asks another engine
    (no ids), sends nothing; the rows it writes from the cache still hold every id."""
    src = generate(tmp_path, bundled)
    first = src.read_bytes()
    cached = b"".join(p.read_bytes() for p in (tmp_path / ".cache").rglob("*") if p.is_file())
    assert b'"prompt_token_ids"' in cached and b'"response_token_ids"' in cached
    with FakeServer({"tokenizer": bundled}).start() as fake:
        write_params(tmp_path, server=url_server(fake.url, engine="vllm"))
        here(tmp_path)
        assert fake.stats()["received"] == 0
    assert src.read_bytes() == first


@pytest.mark.slow  # a generation, then tokenize
def test_template_rewriting_history_for_the_prompt_is_caught(tmp_path, bundled):
    """Same template on both sides, but it renders the history differently when asked for
    a generation prompt: what the model saw is not what a training render shows."""
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).symlink_to(Path(bundled) / name)
    template = (Path(bundled) / "chat_template.jinja").read_text()
    rewriting = template.replace(
        "{{- '<|im_start|>system\\n' ~ first_system ~ '<|im_end|>\\n' -}}",
        "{{- '<|im_start|>system\\n' ~ first_system ~ (' [gen]' if add_generation_prompt"
        " else '') ~ '<|im_end|>\\n' -}}", 1)
    assert rewriting != template
    (folder / "chat_template.jinja").write_text(rewriting)
    src = generate(tmp_path, str(folder), engine="sglang")
    with pytest.raises(tokenize.RenderMismatch, match="different chat template") as e:
        tokenize.tokenize_file(src, tmp_path / "out", tokenizer=str(folder))
    # only the rows with a system message and no tools are rendered differently
    assert 0 < e.value.report["serve_check"]["mismatches"] < 24

# The same check against real vLLM: tests/test_real_engines.py (the engine tier).
