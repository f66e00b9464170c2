"""The prepare stage on sources in the real layouts of the reference mix's six datasets."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from stages import prepare
from stages.common import params
from stages.common.errors import StageError
from stages.process import cpus
from stages.sources import checker, groups, readers
from tests.helpers import stagecli
from tests.helpers.sources import GSM, INTL, TRIVIA, evals as eval_sets, run, write_jsonl

PATHS = stagecli.paths("prepare")  # where dvc.yaml has the stage read and write
GENERATE_PATHS = stagecli.paths("generate")

ROOT = Path(__file__).resolve().parents[1]

HERMES_TOOLS = [{"type": "function", "function": {
    "name": "get_stock_price", "description": "Latest price of a ticker.",
    "parameters": {"type": "object", "properties": {"symbol": {"type": "string"}}, "required": ["symbol"]}}}]
HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    f"<tools> </tools> XML tags.\n<tools>\n{json.dumps(HERMES_TOOLS)}\n</tools>\n"
    "For each function call return a json object within <tool_call> </tool_call> tags."
)


@pytest.fixture(autouse=True)
def _restore_cwd():
    cwd = os.getcwd()
    yield
    os.chdir(cwd)


# ------------------------------------------------------------ the six real layouts


def infinity_rows():
    return [
        {"id": 1, "conversations": [{"from": "human", "value": "Explain recursion."},
                                    {"from": "gpt", "value": "A function calling itself."}],
         "label": {"ability_en": ["coding"]}, "langdetect": "en", "source": "Subjective"},
        {"id": 2, "conversations": [{"from": "system", "value": "Be brief."},
                                    {"from": "human", "value": "Capital of Peru?"},
                                    {"from": "gpt", "value": "Lima."},
                                    {"from": "human", "value": "And its population?"},
                                    {"from": "gpt", "value": "About 10 million."}],
         "label": {}, "langdetect": "en", "source": "Subjective"},
        {"id": 3, "conversations": [{"from": "human", "value": "What is 2+2?"},
                                    {"from": "gpt", "value": "4"}], "label": {}, "langdetect": "en",
         "source": "math"},
    ]


def hermes_rows():
    return [
        {"id": "h1", "conversations": [
            {"from": "system", "value": HERMES_SYSTEM},
            {"from": "human", "value": "What's NVDA at?"},
            {"from": "gpt", "value": '<tool_call>\n{"name": "get_stock_price", "arguments": {"symbol": "NVDA"}}\n</tool_call>'},
            {"from": "tool", "value": '<tool_response>\n{"name": "get_stock_price", "content": {"price": 131.2}}\n</tool_response>'},
            {"from": "gpt", "value": "NVDA trades at $131.20."}],
         "tools": json.dumps(HERMES_TOOLS), "category": "Finance", "subcategory": "Stocks", "task": "price"},
        {"id": "h2", "conversations": [
            {"from": "system", "value": HERMES_SYSTEM},
            {"from": "human", "value": "Price of AAPL please."},
            {"from": "gpt", "value": '<tool_call>\n{"name": "get_stock_price", "arguments": {"symbol": "AAPL"}}\n</tool_call>'}],
         "tools": json.dumps(HERMES_TOOLS), "category": "Finance", "subcategory": "Stocks", "task": "price"},
    ]


def six_sources(tmp_path: Path) -> list[dict]:
    d = tmp_path / "src"
    write_jsonl(d / "infinity.jsonl", infinity_rows())
    write_jsonl(d / "webinstruct.jsonl", [
        {"question": "Why is the sky blue?", "answer": "Rayleigh scattering.", "source": "socratic", "index": 0},
        {"question": "What is 2+2?", "answer": "4", "source": "stackexchange", "index": 1},  # also in infinity
        {"question": "Define entropy.", "answer": "...", "source": "stackexchange", "index": 2},
    ])
    write_jsonl(d / "codefeedback.jsonl", [
        {"query": "Write a Python function to reverse a list.", "answer": "def r(x): return x[::-1]",
         "resource": "wizardcoder", "lang": "python"},
        {"query": "", "answer": "nothing", "resource": "wizardcoder", "lang": "python"},
    ])
    (d / "MetaMathQA-395K.json").write_text(json.dumps([
        {"query": "Tom has 3 apples and eats one. How many are left?", "response": "2", "type": "GSM_Rephrased",
         "original_question": "..."},
        {"query": "What is 5*6?", "response": "30", "type": "MATH_AnsAug", "original_question": "..."},
    ], indent=1))
    (d / "func-calling.json").write_text(json.dumps(hermes_rows()))
    pq.write_table(pa.Table.from_pylist([
        {"conversations": [
            {"from": "human", "loss": None, "value": "You are an OS agent. List files in /etc."},
            {"from": "gpt", "loss": True, "value": "Act: bash\n```bash\nls /etc\n```"},
            {"from": "human", "loss": None, "value": "The output of the OS:\npasswd hosts"},
            {"from": "gpt", "loss": True, "value": "Act: finish"}],
         "id": "os_0"},
    ]), d / "os-00000-of-00001.parquet")
    return [
        {"name": "infinity_instruct", "path": str(d / "infinity.jsonl"), "format": "sharegpt"},
        {"name": "webinstruct", "path": str(d / "webinstruct.jsonl"), "format": "columns", "prompt_field": "question"},
        {"name": "codefeedback", "path": str(d / "codefeedback.jsonl"), "format": "columns", "prompt_field": "query"},
        {"name": "metamath", "path": str(d / "MetaMathQA-395K.json"), "format": "columns", "prompt_field": "query"},
        {"name": "hermes_fc", "path": str(d / "func-calling.json"), "format": "sharegpt"},
        {"name": "agent", "path": str(d / "os-00000-of-00001.parquet"), "format": "sharegpt"},
    ]


def test_six_reference_layouts(tmp_path):
    report, rows, _ = run(tmp_path, six_sources(tmp_path))
    by = {s: [r for r in rows if r["source"] == s] for s in report["sources"]}
    kept = {s: v["kept"] for s, v in report["sources"].items()}
    assert kept == {"infinity_instruct": 3, "webinstruct": 2, "codefeedback": 1, "metamath": 2,
                    "hermes_fc": 2, "agent": 1}
    assert report["sources"]["webinstruct"]["dropped_by_reason"]["duplicate_cross_source"] == 1
    assert report["sources"]["codefeedback"]["dropped_by_reason"]["empty"] == 1
    # multi-turn: earlier turns kept with their original answers
    assert [m["role"] for m in by["infinity_instruct"][1]["messages"]] == ["system", "user", "assistant", "user"]
    # Hermes: the model answers after the tool response; the <tools> system prompt is kept as is
    h1, h2 = by["hermes_fc"]
    assert [m["role"] for m in h1["messages"]] == ["system", "user", "assistant", "tool"]
    assert h1["messages"][0]["content"] == HERMES_SYSTEM and "tools" not in h1
    assert h1["messages"][3]["tool_call_id"] == "call_3"
    assert [m["role"] for m in h2["messages"]] == ["system", "user"]
    assert by["agent"][0]["messages"][-1]["content"] == "The output of the OS:\npasswd hosts"
    assert by["metamath"][0]["messages"] == [
        {"role": "user", "content": "Tom has 3 apples and eats one. How many are left?"}]
    assert report["sources"]["hermes_fc"]["tool_prompts"] == 1
    assert report["totals"]["kept"] == len(rows) == 11
    assert all(len(r["id"]) == 32 for r in rows) and len({r["id"] for r in rows}) == len(rows)
    assert list(rows[0]) == ["id", "source", "messages"]


def test_tool_turns_get_ids_and_one_wrapper_and_keep_their_prompt_ids(tmp_path):
    import xxhash

    d = tmp_path / "src"
    call = {"type": "function", "function": {"name": "get_stock_price", "arguments": "{}"}}
    openai = [
        # calls and results without ids: both synthesized, results matched in order
        {"messages": [{"role": "user", "content": "NVDA and AAPL?"},
                      {"role": "assistant", "content": "", "tool_calls": [call, call]},
                      {"role": "tool", "content": "131.2"}, {"role": "tool", "content": "227.5"}]},
        # ids given by the source: kept as they are
        {"messages": [{"role": "user", "content": "MSFT?"},
                      {"role": "assistant", "content": "", "tool_calls": [{"id": "c9", **call}]},
                      {"role": "tool", "content": "400", "tool_call_id": "c9"}]},
    ]  # fmt: skip
    write_jsonl(d / "openai.jsonl", openai)
    hermes = hermes_rows()[:1]
    two = '<tool_response>\n{"price": 1}\n</tool_response>\n<tool_response>\n{"price": 2}\n</tool_response>'
    hermes.append({**hermes[0], "conversations": hermes[0]["conversations"][:3] + [{"from": "tool", "value": two}]})
    write_jsonl(d / "hermes.jsonl", hermes)
    _, rows, _ = run(tmp_path, [
        {"name": "oa", "path": str(d / "openai.jsonl"), "format": "messages"},
        {"name": "hermes", "path": str(d / "hermes.jsonl"), "format": "sharegpt"},
    ])  # fmt: skip
    o1, o2, h1, h2 = rows
    calls = o1["messages"][1]["tool_calls"]
    assert [c["id"] for c in calls] == ["call_1_0", "call_1_1"]
    assert [m["tool_call_id"] for m in o1["messages"][2:]] == ["call_1_0", "call_1_1"]
    assert o2["messages"] == openai[1]["messages"]
    # Hermes results lose the wrapper the template adds again; text calls give call_<turn>
    assert h1["messages"][3] == {
        "role": "tool", "content": '{"name": "get_stock_price", "content": {"price": 131.2}}',
        "tool_call_id": "call_3",
    }  # fmt: skip
    assert [(m["content"], m["tool_call_id"]) for m in h2["messages"][3:]] == [
        ('{"price": 1}', "call_3"), ('{"price": 2}', "call_4")]
    # the prompt id hashes the conversation as the source gave it: ids from before stay
    source_h1 = [{"role": r, "content": t["value"]} for r, t in zip(
        ["system", "user", "assistant", "tool"], hermes[0]["conversations"])]  # fmt: skip
    canon = json.dumps({"messages": source_h1}, separators=(",", ":"), ensure_ascii=False)
    assert h1["id"] == xxhash.xxh3_128_hexdigest(b"hermes\0" + canon.encode())
    # a rerun writes the same bytes
    before = (tmp_path / "data/prompts/prompts.jsonl").read_bytes()
    run(tmp_path, [
        {"name": "oa", "path": str(d / "openai.jsonl"), "format": "messages"},
        {"name": "hermes", "path": str(d / "hermes.jsonl"), "format": "sharegpt"},
    ])  # fmt: skip
    assert (tmp_path / "data/prompts/prompts.jsonl").read_bytes() == before


def test_tool_calls_are_settled_as_the_router_takes_them_and_bad_ones_refused(tmp_path):
    """sglang-router refuses arguments that are not a string and calls without "type";
    SGLang parses the string back, so the rendering is the same. Arguments that are not a
    JSON object, or a call without a `function` object, no template can write: refused
    (on_bad_row), never left for tokenize to fail on after generation was paid for."""
    import xxhash

    d = tmp_path / "src"

    def conv(call, *, user="Price of NVDA?"):
        return {"messages": [{"role": "user", "content": user},
                             {"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "content": "131.2"}]}

    fn = {"name": "get_stock_price", "arguments": {"symbol": "NVDA", "n": [1, 2]}}
    good = [conv({"function": fn}),
            conv({"type": "function", "function": {**fn, "arguments": None}}, user="AAPL?"),
            conv({"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                 user="as is")]
    bad = [conv({"function": {"name": "f", "arguments": "{not json"}}, user="b1"),
           conv({"function": {"name": "f", "arguments": "[1,2]"}}, user="b2"),
           conv({"type": "function", "name": "f", "arguments": "{}"}, user="b3")]
    empty_turn = {"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "?"},
                               {"role": "user", "content": "again"}]}
    write_jsonl(d / "calls.jsonl", good + bad + [empty_turn])
    source = {"name": "oa", "path": str(d / "calls.jsonl"), "format": "messages"}
    with pytest.raises(StageError, match=r"calls.jsonl:4: messages\[1\]\.tool_calls\[0\] "
                                         r"function\.arguments is not JSON: '\{not json'; set "
                                         r"prepare\.on_bad_row: skip"):
        run(tmp_path, [source])
    report, rows, _ = run(tmp_path, [source], on_bad_row="skip")
    dropped = report["sources"]["oa"]["dropped_by_reason"]
    assert dropped["bad_tool_call"] == 3 and dropped["empty_user_turn"] == 1
    assert report["sources"]["oa"]["repaired"] == report["totals"]["repaired"] == {
        "tool_call_arguments_to_string": 1, "tool_call_arguments_null": 1,
        "tool_call_type_added": 1}
    calls = [r["messages"][1]["tool_calls"][0] for r in rows]
    assert [c["type"] for c in calls] == ["function"] * 3
    assert [c["function"]["arguments"] for c in calls] == [
        '{"symbol": "NVDA", "n": [1, 2]}', "{}", '{"a": 1}']
    # the prompt id hashes the conversation as the source gave it
    canon = json.dumps({"messages": good[0]["messages"]}, separators=(",", ":"),
                       ensure_ascii=False, sort_keys=True)
    assert rows[0]["id"] == xxhash.xxh3_128_hexdigest(b"oa\0" + canon.encode())


def test_prepared_tool_prompts_pass_a_router_that_requires_tool_call_ids(tmp_path):
    # the fake server speaks sglang-router's schema here: a tool message without a
    # tool_call_id is a 400 "missing field `tool_call_id`"
    from urllib.error import HTTPError

    from stages import generate
    from tests.helpers.fakeserver import post_json, spawn

    d = tmp_path / "src"
    (d / "func-calling.json").parent.mkdir(parents=True)
    (d / "func-calling.json").write_text(json.dumps(hermes_rows()))
    run(tmp_path, [{"name": "hermes_fc", "path": str(d / "func-calling.json"), "format": "sharegpt"}])
    with spawn({"require_tool_call_id": True}) as fake:
        cfg = params.build(params.Generate, {"server": {"url": fake.url}, "concurrency": 2}, "generate")
        r = generate.run(cfg, GENERATE_PATHS)
        assert r["completed"] == 2 and r["failed"] == 0
        bare = {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]}
        with pytest.raises(HTTPError) as e:  # what today's prompts got from the router
            post_json(fake.url + "/v1/chat/completions", bare)
        assert e.value.code == 400 and "missing field `tool_call_id`" in e.value.read().decode()


def test_tools_field_is_passed_on(tmp_path):
    d = tmp_path / "src"
    (d).mkdir()
    (d / "func-calling.json").write_text(json.dumps(hermes_rows()))
    _, rows, _ = run(tmp_path, [{"name": "h", "path": str(d / "func-calling.json"), "format": "sharegpt",
                                 "tools_field": "tools"}])
    assert rows[0]["tools"] == HERMES_TOOLS and list(rows[0]) == ["id", "source", "messages", "tools"]


def test_report_counts_add_up(tmp_path):
    report, rows, _ = run(tmp_path, six_sources(tmp_path))
    totals = report["totals"]
    assert totals["read"] == totals["kept"] + totals["dropped"] == 13
    for stats in report["sources"].values():
        assert stats["read"] == stats["kept"] + sum(stats["dropped_by_reason"].values())
        assert stats["dropped"] == sum(stats["dropped_by_reason"].values())


# ------------------------------------------------------------------------- cleaning


def test_duplicates_within_and_across_sources_first_wins(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"q": "Alpha question"}, {"q": "  Alpha   question\n"},
                                           {"q": "Beta question"}, {"q": "Alpha question"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"q": "beta\tquestion"}, {"q": "Beta  question "},
                                           {"q": "Gamma"}])
    report, rows, _ = run(tmp_path, [
        {"name": "a", "path": str(a), "format": "columns", "prompt_field": "q"},
        {"name": "b", "path": str(b), "format": "columns", "prompt_field": "q"},
    ])
    assert [(r["source"], r["messages"][0]["content"]) for r in rows] == [
        ("a", "Alpha question"), ("a", "Beta question"), ("b", "beta\tquestion"), ("b", "Gamma")]
    assert report["sources"]["a"]["dropped_by_reason"]["duplicate"] == 2
    assert report["sources"]["b"]["dropped_by_reason"]["duplicate_cross_source"] == 1


def test_normalization_ignores_whitespace_and_unicode_form_only(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [
        {"q": "What is 2+2?"}, {"q": "What is 2 + 2?\n"}, {"q": "What\u00a0is 2+2?"},
        {"q": "caf\u00e9"}, {"q": "cafe\u0301"},          # NFC makes these equal
        {"q": "what is 2+2?"}, {"q": "What is 2+3?"},        # case and digits matter
    ])
    _, rows, _ = run(tmp_path, [{"name": "a", "path": str(path), "format": "columns", "prompt_field": "q"}])
    assert [r["messages"][0]["content"] for r in rows] == [
        "What is 2+2?", "caf\u00e9", "what is 2+2?", "What is 2+3?"]


def test_dedup_modes(tmp_path):
    rows = [{"q": "Same question", "s": "System one"}, {"q": "Same question", "s": "System two"}]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    source = {"name": "a", "path": str(path), "format": "columns", "prompt_field": "q", "system_field": "s"}
    assert run(tmp_path, [source])[0]["totals"]["kept"] == 2  # different system prompts
    assert run(tmp_path, [source], dedup="user")[0]["totals"]["kept"] == 1
    write_jsonl(path, [{"q": "x", "s": None}, {"q": "x", "s": None}])
    assert run(tmp_path, [source], dedup="off")[0]["totals"]["kept"] == 2


def test_empty_overlong_missing_null_and_bad_values(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [
        {"q": "fine"}, {"q": "   "}, {"q": ""}, {"q": "x" * 101}, {"q": None}, {"other": "no q here"},
        {"q": ["not", "text"]}, {"q": "ok too", "s": 7},
    ])
    report, rows, _ = run(tmp_path, [{"name": "a", "path": str(path), "format": "columns",
                                      "prompt_field": "q", "system_field": "s"}], max_prompt_chars=100)
    reasons = {k: v for k, v in report["sources"]["a"]["dropped_by_reason"].items() if v}
    assert reasons == {"empty": 2, "too_long": 1, "null_field": 1, "missing_field": 1, "bad_value": 2}
    assert [r["messages"][0]["content"] for r in rows] == ["fine"]


def test_over_long_counts_the_whole_conversation(tmp_path):
    turns = [{"from": "human", "value": "q" * 40}, {"from": "gpt", "value": "a" * 40},
             {"from": "human", "value": "q" * 40}]
    path = write_jsonl(tmp_path / "a.jsonl", [{"conversations": turns}])
    source = [{"name": "a", "path": str(path), "format": "sharegpt"}]
    assert run(tmp_path, source, max_prompt_chars=120)[0]["totals"]["kept"] == 1
    with pytest.raises(StageError, match="no prompt left"):
        run(tmp_path, source, max_prompt_chars=119)


def test_no_user_turn_and_unknown_roles_are_counted(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [
        {"conversations": [{"from": "system", "value": "S"}, {"from": "gpt", "value": "A"}]},
        {"conversations": [{"from": "narrator", "value": "N"}, {"from": "human", "value": "Q"}]},
        {"conversations": [{"from": "human", "value": "Q2"}]},
    ])
    report, rows, _ = run(tmp_path, [{"name": "a", "path": str(path), "format": "sharegpt"}])
    stats = report["sources"]["a"]
    assert stats["dropped_by_reason"]["no_user_turn"] == 1
    assert stats["dropped_by_reason"]["unknown_role"] == 1
    assert stats["unknown_roles"] == {"narrator": 1}
    assert len(rows) == 1


def test_multi_turn_policies(tmp_path):
    turns = [{"from": "system", "value": "S"}, {"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
             {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]
    path = write_jsonl(tmp_path / "a.jsonl", [{"conversations": turns}])
    source = [{"name": "a", "path": str(path), "format": "sharegpt"}]
    _, rows, _ = run(tmp_path, source, multi_turn="context")
    assert [m["content"] for m in rows[0]["messages"]] == ["S", "Q1", "A1", "Q2"]
    _, rows, _ = run(tmp_path, source, multi_turn="first_user")
    assert [m["content"] for m in rows[0]["messages"]] == ["S", "Q1"]


def test_regenerate_keeps_the_user_turns_and_drops_every_source_answer(tmp_path):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    rows_in = [
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                      {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
                      {"role": "assistant", "content": "A2"}, {"role": "user", "content": "Q3"},
                      {"role": "assistant", "content": "A3"}]},
        {"messages": [{"role": "user", "content": "T1"}, {"role": "assistant", "content": "B1"},
                      {"role": "user", "content": "T2"},
                      {"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "c1", "content": "R"},
                      {"role": "assistant", "content": "B2"}, {"role": "user", "content": "T3"},
                      {"role": "assistant", "content": "B3"}]},
        {"messages": [{"role": "user", "content": "only"}, {"role": "assistant", "content": "x"}]},
    ]
    path = write_jsonl(tmp_path / "a.jsonl", rows_in)
    source = [{"name": "a", "path": str(path), "format": "messages"}]
    report, rows, _ = run(tmp_path, source, multi_turn="regenerate")
    assert rows[0]["messages"] == [{"role": "system", "content": "S"},
                                   {"role": "user", "content": "Q1"}]
    assert rows[0]["turns"] == [[{"role": "user", "content": "Q2"}],
                                [{"role": "user", "content": "Q3"}]]
    # cut before the source's first call: turn 2 (T2) is the target's own to answer
    assert rows[1]["messages"] == [{"role": "user", "content": "T1"}]
    assert rows[1]["turns"] == [[{"role": "user", "content": "T2"}]]
    context = run(tmp_path, source)[1]
    assert rows[2] == context[2]  # a one-turn conversation is a plain prompt, id and all
    assert rows[0]["id"] != context[0]["id"]
    assert report["sources"]["a"]["regenerate"] == {
        "single_turn": 1, "regenerated": 1, "tool_cut": 1, "tool_context": 0, "system_cut": 0}
    report, rows, _ = run(tmp_path, source, multi_turn="regenerate", tool_conversations="context")
    assert rows[1] == context[1]  # kept as in context mode
    assert report["sources"]["a"]["regenerate"]["tool_context"] == 1


def test_regenerate_writes_lines_generate_takes_from_a_greeting_and_a_later_system(tmp_path):
    # an answer before the first user turn (a greeting) is the source's, dropped; a system
    # message after the first ones cannot be asked (the template takes a system message
    # only first): the conversation is regenerated up to it, counted as system_cut.
    # Written as they came, the first was dropped as no_user_turn and the second stopped
    # generate on the whole file ('turns' must be a list of lists of user messages)
    def m(role, text):
        return {"role": role, "content": text}

    rows_in = [
        {"messages": [m("system", "S"), m("assistant", "Hello!"), m("user", "Q1"),
                      m("assistant", "A1"), m("user", "Q2"), m("assistant", "A2")]},
        {"messages": [m("user", "P1"), m("assistant", "B1"), m("user", "P2"),
                      m("assistant", "B2"), m("system", "Now in French."), m("user", "P3"),
                      m("assistant", "B3")]},
    ]
    path = write_jsonl(tmp_path / "a.jsonl", rows_in)
    source = [{"name": "a", "path": str(path), "format": "messages"}]
    report, rows, _ = run(tmp_path, source, multi_turn="regenerate")
    assert rows[0]["messages"] == [m("system", "S"), m("user", "Q1")]
    assert rows[0]["turns"] == [[m("user", "Q2")]]
    assert rows[1]["messages"] == [m("user", "P1")] and rows[1]["turns"] == [[m("user", "P2")]]
    # what generate takes: every later turn is user messages only
    assert all(t["role"] == "user" for row in rows for turn in row["turns"] for t in turn)
    assert report["sources"]["a"]["regenerate"] == {
        "single_turn": 0, "regenerated": 1, "tool_cut": 0, "tool_context": 0, "system_cut": 1}


def test_text_kept_exactly_in_output(tmp_path):
    text = "<|im_start|>system\nIgnore this<|im_end|>\n\u4f60\u597d \U0001f600\t\r\n  "
    path = write_jsonl(tmp_path / "a.jsonl", [{"q": text}, '{"q": "bad \\ud800 surrogate"}'])
    report, rows, data = run(tmp_path, [{"name": "a", "path": str(path), "format": "columns", "prompt_field": "q"}])
    assert rows[0]["messages"][0]["content"] == text
    assert "\u4f60\u597d".encode() in data  # UTF-8, not \u escapes
    assert report["sources"]["a"]["dropped_by_reason"]["invalid_text"] == 1


# ---------------------------------------------------------------------- bad input


def broken_source(tmp_path):
    path = tmp_path / "src" / "broken.jsonl"
    write_jsonl(path, ['{"q": "one"}', '{"q": "two"', "", '{"q": "three"}', "[1, 2]"])
    return [{"name": "broken", "path": str(path), "format": "columns", "prompt_field": "q"}], path


def test_malformed_line_fails_naming_file_and_line(tmp_path):
    source, path = broken_source(tmp_path)
    with pytest.raises(StageError) as e:
        run(tmp_path, source)
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: malformed JSON (") and "on_bad_row: skip" in msg and "\n" not in msg
    assert not (tmp_path / "data/prompts").exists()


def test_malformed_lines_skipped_and_counted(tmp_path):
    source, _ = broken_source(tmp_path)
    report, rows, _ = run(tmp_path, source, on_bad_row="skip")
    stats = report["sources"]["broken"]
    assert [r["messages"][0]["content"] for r in rows] == ["one", "three"]
    assert stats["dropped_by_reason"]["malformed_json"] == 1
    assert stats["dropped_by_reason"]["not_an_object"] == 1
    assert stats["read"] == 4  # the blank line is not a row


def test_misnamed_field_names_source_field_and_existing_fields(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"question": "Q", "answer": "A"}] * 3)
    with pytest.raises(StageError) as e:
        run(tmp_path, [{"name": "webinstruct", "path": str(path), "format": "columns", "prompt_field": "query"}])
    msg = str(e.value)
    assert msg.startswith("source webinstruct: prompt_field 'query': no such field")
    assert "(fields: answer, question)" in msg and "\n" not in msg
    pq.write_table(pa.table({"question": ["Q"]}), tmp_path / "a.parquet")
    with pytest.raises(StageError, match=r"source p: system_field 'system': no such field in .*a\.parquet \(fields: question\)"):
        run(tmp_path, [{"name": "p", "path": str(tmp_path / "a.parquet"), "format": "columns",
                        "prompt_field": "question", "system_field": "system"}])
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "Q"}]}])
    with pytest.raises(StageError, match=r"source m: role_key 'from': no such turn key .*\(turn keys: content, role\)"):
        run(tmp_path, [{"name": "m", "path": str(path), "format": "sharegpt", "messages_field": "messages"}])


def test_field_missing_in_some_rows_is_dirty_data_not_config(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"q": "Q1"}, {"question": "Q2"}, {"q": "Q3", "s": "S"}])
    report, rows, _ = run(tmp_path, [{"name": "a", "path": str(path), "format": "columns",
                                      "prompt_field": "q", "system_field": "s"}])
    assert report["sources"]["a"]["dropped_by_reason"]["missing_field"] == 1 and len(rows) == 2


def test_param_errors(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"q": "Q"}])
    one = {"name": "a", "path": str(path), "format": "columns", "prompt_field": "q"}
    with pytest.raises(StageError, match=r"prepare.sources\[1\].name: 'a' is used by an earlier source"):
        run(tmp_path, [one, one])
    with pytest.raises(StageError, match=r"prepare.sources\[0\].prompt_field: required with format columns"):
        run(tmp_path, [{**one, "prompt_field": None}])
    with pytest.raises(StageError, match=r"prepare.sources\[0\].prompt_field: only for format columns"):
        run(tmp_path, [{**one, "format": "sharegpt"}])
    with pytest.raises(StageError, match=r"prepare.sources\[0\].limit: must be >= 0"):
        run(tmp_path, [{**one, "limit": -1}])


def test_failed_run_keeps_previous_output(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"q": "Q"}])
    _, _, before = run(tmp_path, [{"name": "a", "path": str(good), "format": "columns", "prompt_field": "q"}])
    source, _ = broken_source(tmp_path)
    with pytest.raises(StageError):
        run(tmp_path, source)
    assert (tmp_path / "data/prompts/prompts.jsonl").read_bytes() == before
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["prompts"]


# ------------------------------------------------------------ ids, order and limits


def numbered(n: int, tag: str) -> list[dict]:
    return [{"q": f"{tag} question number {i}"} for i in range(n)]


def test_ids_stable_under_row_reordering(tmp_path):
    rows = numbered(50, "x")
    a = write_jsonl(tmp_path / "a.jsonl", rows)
    source = [{"name": "s", "path": str(a), "format": "columns", "prompt_field": "q", "limit": 20}]
    _, first, _ = run(tmp_path, source)
    random.Random(3).shuffle(rows)
    write_jsonl(a, rows)
    _, second, _ = run(tmp_path, source)
    assert {r["id"]: r["messages"] for r in first} == {r["id"]: r["messages"] for r in second}
    # ... and the id depends on the source name and the prompt, nothing else
    _, renamed, _ = run(tmp_path, [{**source[0], "name": "t"}])
    assert not {r["id"] for r in renamed} & {r["id"] for r in second}


def test_same_params_byte_identical_output(tmp_path):
    sources = six_sources(tmp_path)
    sources[0]["limit"] = 2
    _, _, first = run(tmp_path, sources, seed=7)
    _, _, second = run(tmp_path, sources, seed=7)
    assert first == second


def test_limit_samples_deterministically_and_keeps_file_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", numbered(200, "a"))
    source = {"name": "a", "path": str(a), "format": "columns", "prompt_field": "q"}
    report, rows, _ = run(tmp_path, [{**source, "limit": 30}], seed=1)
    numbers = [int(r["messages"][0]["content"].rsplit(" ", 1)[1]) for r in rows]
    assert len(numbers) == 30 and numbers == sorted(numbers) and numbers != list(range(30))
    assert report["sources"]["a"]["dropped_by_reason"]["over_limit"] == 170
    _, other_seed, _ = run(tmp_path, [{**source, "limit": 30}], seed=2)
    assert other_seed != rows
    _, bigger, _ = run(tmp_path, [{**source, "limit": 60}], seed=1)
    assert {r["id"] for r in rows} < {r["id"] for r in bigger}  # a larger limit extends the sample
    assert run(tmp_path, [{**source, "limit": 500}], seed=1)[0]["totals"]["kept"] == 200
    b = write_jsonl(tmp_path / "b.jsonl", numbered(10, "a") + numbered(10, "b"))
    report = run(tmp_path, [{**source, "limit": 0}, {**source, "name": "b", "path": str(b)}])[0]
    assert report["sources"]["a"]["kept"] == 0
    # dedup comes before sampling, so a's limit cannot change b's rows
    assert report["sources"]["b"]["kept"] == 10
    assert report["sources"]["b"]["dropped_by_reason"]["duplicate_cross_source"] == 10


def test_one_source_limit_changes_only_its_rows(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", numbered(100, "a") + numbered(20, "shared"))
    b = write_jsonl(tmp_path / "b.jsonl", numbered(100, "b") + numbered(20, "shared"))
    c = write_jsonl(tmp_path / "c.jsonl", numbered(100, "c"))

    def mix(limit_a):
        return [{"name": "a", "path": str(a), "format": "columns", "prompt_field": "q", "limit": limit_a},
                {"name": "b", "path": str(b), "format": "columns", "prompt_field": "q", "limit": 50},
                {"name": "c", "path": str(c), "format": "columns", "prompt_field": "q"}]

    _, small, _ = run(tmp_path, mix(10))
    _, large, _ = run(tmp_path, mix(90))
    for name in ("b", "c"):
        assert [r for r in small if r["source"] == name] == [r for r in large if r["source"] == name]
    assert len([r for r in small if r["source"] == "a"]) == 10
    assert len([r for r in large if r["source"] == "a"]) == 90


def test_worker_processes_give_identical_output(tmp_path, monkeypatch):
    mix = six_sources(tmp_path)
    big = write_jsonl(tmp_path / "src" / "big.jsonl",
                      [{"conversations": [{"from": "human", "value": f"Question {i % 900}"},
                                          {"from": "gpt", "value": "A"}]} for i in range(1200)])
    mix.insert(1, {"name": "big", "path": str(big), "format": "sharegpt", "limit": 500})
    _, _, one = run(tmp_path, mix, num_proc=1)
    monkeypatch.setattr(groups, "LOCAL_ROWS", 100)
    monkeypatch.setattr(readers, "_LINES_BYTES", 2000)
    monkeypatch.setattr(readers, "_BATCH", 64)
    report, _, two = run(tmp_path, mix, num_proc=2)
    assert one == two
    assert report["sources"]["big"]["dropped_by_reason"]["duplicate"] == 300


# --------------------------------------------------------------------------- the CLI


def test_cli_runs_the_stage(tmp_path):
    sources = six_sources(tmp_path)
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump({"prepare": {"seed": 0, "sources": sources}}))
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    proc = subprocess.run([*stagecli.command("prepare"), "--params", str(params_file)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 11 prompts" in proc.stderr
    assert len((tmp_path / "data/prompts/prompts.jsonl").read_text().splitlines()) == 11
    assert json.loads((tmp_path / "reports/prepare.json").read_text())["totals"]["kept"] == 11


def test_shipped_demo_sources(tmp_path):
    cfg = params.load("prepare", ROOT / "params.yaml")
    os.chdir(tmp_path)
    for src in cfg.sources + cfg.decontaminate.evals:
        src.path = str(ROOT / src.path)
    report = prepare.run(cfg, PATHS)
    # the eval sample holds two demo prompts the limit would not have drawn
    assert report["totals"]["dropped_by_reason"]["contaminated"] == 2
    assert report["decontamination"]["evals"]["eval_sample"]["by_source"] == {"qa_sample": 2}
    for src in cfg.sources:  # the demo's limits bind: the sample is a real mix
        stats = report["sources"][src.name]
        assert stats["kept"] == min(src.limit or stats["cleaned"], stats["cleaned"])
        assert stats["dropped_by_reason"]["over_limit"] == stats["cleaned"] - stats["kept"]
    assert 30 <= report["totals"]["kept"] <= 60
    rows = [json.loads(x) for x in (tmp_path / "data/prompts/prompts.jsonl").read_text().splitlines()]
    roles = [[m["role"] for m in r["messages"]] for r in rows]
    assert any(r[-1] == "tool" for r in roles) and any(r.count("user") > 1 for r in roles)
    assert any("<tools>" in r["messages"][0]["content"] for r in rows)


# ------------------------------------------------------------------ decontamination



def planted_mix(tmp_path: Path) -> tuple[list[dict], dict[str, tuple[str, int]]]:
    """Sources seeded with evaluation items in disguise, and clean prompts around them;
    returns the sources and, per planted prompt text, the (eval set, item) it copies."""
    planted = {
        GSM[0]: ("gsm", 0),  # verbatim
        "  natalia SOLD clips to 48 of her friends in April ... and then she sold HALF as many "
        "clips in May.How many clips did natalia sell altogether in april & may ?!": ("gsm", 0),
        "What is 7 TIMES 8": ("gsm", 2),  # a short item, whole message
        "Please solve the following problem and explain each step carefully. " + GSM[1]
        + " Give the final answer on its own line.": ("gsm", 1),
        "Trivia time! " + TRIVIA[1].replace(" ", "\n") + " (one sentence)": ("trivia", 1),
        INTL[0].lower(): ("intl", 0),
        "请回答：" + INTL[1] + "写出过程。": ("intl", 1),
    }
    clean = [
        "In April Natalia sold clips to 48 friends; in May she sold half that many. "
        "What is the total number of clips she sold over the two months?",  # a paraphrase
        "What is 7 times 9?",
        "Explain, in two sentences, why the sky looks blue during the day.",
        "Сколько будет семь умножить на восемь?",
        "区块链是什么？请用三句话解释。",
        "Who wrote Moby-Dick?",
    ]
    texts = list(planted)
    chat = write_jsonl(tmp_path / "src/chat.jsonl", [
        {"conversations": [{"from": "system", "value": "Be helpful."}, {"from": "human", "value": t},
                           {"from": "gpt", "value": "..."}]}
        for t in texts[:4] + clean[:3]])
    qa = write_jsonl(tmp_path / "src/qa.jsonl", [{"q": t} for t in texts[4:] + clean[3:]])
    sources = [{"name": "chat", "path": str(chat), "format": "sharegpt"},
               {"name": "qa", "path": str(qa), "format": "columns", "prompt_field": "q"}]
    return sources, planted


def test_planted_eval_items_are_dropped_and_attributed(tmp_path):
    sources, planted = planted_mix(tmp_path)
    _, plain, plain_bytes = run(tmp_path, sources)
    report, rows, data = run(tmp_path, sources, decontaminate={"evals": eval_sets(tmp_path)})
    user = [r["messages"][-1]["content"] for r in rows]
    assert not set(user) & set(planted)
    assert len(rows) == len(plain) - len(planted)
    # clean prompts are written exactly as without decontamination
    kept_lines = [line for line in plain_bytes.splitlines(keepends=True)
                  if json.loads(line)["messages"][-1]["content"] not in planted]
    assert data == b"".join(kept_lines)

    assert report["sources"]["chat"]["dropped_by_reason"]["contaminated"] == 4
    assert report["sources"]["qa"]["dropped_by_reason"]["contaminated"] == 3
    assert report["totals"]["dropped_by_reason"]["contaminated"] == 7
    dc = report["decontamination"]
    assert {name: (s["contaminated"], s["by_source"]) for name, s in dc["evals"].items()} == {
        "gsm": (4, {"chat": 4}), "trivia": (1, {"qa": 1}), "intl": (2, {"qa": 2})}
    assert dc["evals"]["gsm"]["items"] == 3 and dc["evals"]["gsm"]["short"] == 1
    ids = {r["id"]: r["messages"][-1]["content"] for r in plain}
    assert len(dc["examples"]) == 3 + 1 + 2  # at most 3 per eval set
    for ex in dc["examples"]:
        assert planted[ids[ex["prompt_id"]]] == (ex["eval_set"], ex["eval_item"])
        assert ex["ngram"] in " ".join(decontam_words(ids[ex["prompt_id"]]))


def decontam_words(text: str) -> list[str]:
    from stages.sources import ngrams

    return ngrams.words(text)


def test_contaminated_prompts_leave_before_the_limit(tmp_path):
    rows = [{"q": GSM[0]}, {"q": TRIVIA[0]}] + [{"q": f"Clean question number {i}?"} for i in range(30)]
    path = write_jsonl(tmp_path / "src/a.jsonl", rows)
    src = [{"name": "a", "path": str(path), "format": "columns", "prompt_field": "q", "limit": 30}]
    report, kept, _ = run(tmp_path, src, decontaminate={"evals": eval_sets(tmp_path)})
    assert len(kept) == 30 and all(r["messages"][0]["content"].startswith("Clean") for r in kept)
    assert report["sources"]["a"]["dropped_by_reason"]["contaminated"] == 2
    assert report["sources"]["a"]["dropped_by_reason"]["over_limit"] == 0


def test_decontamination_in_worker_processes_gives_identical_output(tmp_path, monkeypatch):
    sources, planted = planted_mix(tmp_path)
    big = write_jsonl(tmp_path / "src/big.jsonl",
                      [{"q": f"Question {i}: " + (GSM[0] if i % 100 == 7 else "is this clean?")}
                       for i in range(800)])
    sources.append({"name": "big", "path": str(big), "format": "columns", "prompt_field": "q"})
    dc = {"evals": eval_sets(tmp_path)}
    one_report, _, one = run(tmp_path, sources, num_proc=1, decontaminate=dc)
    monkeypatch.setattr(groups, "LOCAL_ROWS", 100)
    monkeypatch.setattr(readers, "_LINES_BYTES", 2000)
    report, _, two = run(tmp_path, sources, num_proc=2, decontaminate=dc)
    assert one == two
    assert report["sources"]["big"]["dropped_by_reason"]["contaminated"] == 8
    assert report["decontamination"]["evals"] == one_report["decontamination"]["evals"]


def test_decontamination_in_the_checker_process_gives_identical_output(tmp_path, monkeypatch):
    sources, planted = planted_mix(tmp_path)
    rows = [{"q": f"Question {i}: " + (GSM[0] if i % 100 == 7 else "is this clean?")} for i in range(800)]
    rows[300]["q"] = "A text holding \0 " + GSM[1]  # checked here: the packed buffer cannot hold it
    rows[500]["q"] = "Überall, " + TRIVIA[1]  # a non-ASCII group, read apart in the checker
    big = write_jsonl(tmp_path / "src/big.jsonl", rows)
    sources.append({"name": "big", "path": str(big), "format": "columns", "prompt_field": "q"})
    dc = {"evals": eval_sets(tmp_path)}
    one_report, _, one = run(tmp_path, sources, num_proc=1, decontaminate=dc)
    monkeypatch.setattr(groups, "LOCAL_ROWS", 100)
    monkeypatch.setattr(cpus, "workers_beside_reader", lambda: 1)
    monkeypatch.setattr(readers, "_LINES_BYTES", 2000)
    real_ready, real_send, sent = checker.Checker.ready, checker.Checker.send, []

    def ready(c):  # wait for the checker to load, so that every group past LOCAL_ROWS goes to it
        while not real_ready(c):
            time.sleep(0.02)
        return True

    monkeypatch.setattr(checker.Checker, "ready", ready)
    monkeypatch.setattr(cpus, "idle_since", lambda since: 1.0)  # however busy the test machine
    monkeypatch.setattr(checker.Checker, "send",
                        lambda c, texts, counts: sent.append(len(counts)) or real_send(c, texts, counts))
    report, _, two = run(tmp_path, sources, num_proc=0, decontaminate=dc)
    assert sum(sent) >= 650
    assert one == two
    assert report["sources"]["big"]["dropped_by_reason"]["contaminated"] == 10
    assert report["decontamination"] == one_report["decontamination"]
    assert {k: v for k, v in report.items() if k not in ("seconds", "rows_per_second")} == {
        k: v for k, v in one_report.items() if k not in ("seconds", "rows_per_second")}


def test_the_checker_process_ends_with_a_failed_run(tmp_path, monkeypatch):
    big = write_jsonl(tmp_path / "src/big.jsonl", [{"q": f"Question {i}: is this clean?"} for i in range(800)])
    lines = big.read_text().splitlines(keepends=True)
    lines[600] = '{"q": "not JSON\n'  # a bad row, reached after the checker has taken over
    big.write_text("".join(lines))
    src = [{"name": "big", "path": str(big), "format": "columns", "prompt_field": "q"}]
    monkeypatch.setattr(groups, "LOCAL_ROWS", 100)
    monkeypatch.setattr(cpus, "workers_beside_reader", lambda: 1)
    monkeypatch.setattr(cpus, "idle_since", lambda since: 1.0)
    monkeypatch.setattr(readers, "_LINES_BYTES", 2000)
    real_ready, started = checker.Checker.ready, []

    def ready(c):
        while not real_ready(c):
            time.sleep(0.02)
        started.append(c.proc)
        return True

    monkeypatch.setattr(checker.Checker, "ready", ready)
    with pytest.raises(StageError, match=r"big.jsonl:601: "):
        run(tmp_path, src, num_proc=0, decontaminate={"evals": eval_sets(tmp_path)})
    assert started and started[0].exitcode is not None  # ended, not left behind
    assert not multiprocessing.active_children()


def test_decontamination_param_errors(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"q": "Q"}])
    one = [{"name": "a", "path": str(path), "format": "columns", "prompt_field": "q"}]
    ev = eval_sets(tmp_path)
    with pytest.raises(StageError, match=r"prepare.decontaminate.min_overlap: must be > 0 and <= 1, got"):
        run(tmp_path, one, decontaminate={"evals": ev, "min_overlap": 1.5})
    with pytest.raises(StageError, match=r"prepare.decontaminate.ngram: must be >= 1 and .*, got int 0"):
        run(tmp_path, one, decontaminate={"evals": ev, "ngram": 0})
    with pytest.raises(StageError, match=r"prepare.decontaminate.evals\[1\].name: 'gsm' is used by an earlier eval set"):
        run(tmp_path, one, decontaminate={"evals": [ev[0], ev[0]]})
    with pytest.raises(StageError, match=r"prepare.decontaminate.evals\[0\].prompt_field: required with format columns"):
        run(tmp_path, one, decontaminate={"evals": [{**ev[0], "prompt_field": None}]})
    with pytest.raises(params.ParamError, match=r"prepare.decontaminate.evals\[0\].limit: unknown key"):
        run(tmp_path, one, decontaminate={"evals": [{**ev[0], "limit": 3}]})


def test_eval_files_are_dvc_deps_of_prepare():
    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["prepare"]
    assert any(Path("stages/sources/decontam.py").is_relative_to(dep) for dep in stage["deps"])
    shipped = params.load("prepare", ROOT / "params.yaml").decontaminate
    for ev in shipped.evals:
        assert any(Path(ev.path).is_relative_to(dep) for dep in stage["deps"]), ev.path
