"""Source rows made into prompt lines (stages/sources/prompts.py)."""

from __future__ import annotations

import itertools
import json
import pickle

import orjson
import xxhash

from stages.common import params
from stages.sources import decontam, prompts, readers
from stages.sources.layouts import Dropped
from stages.sources.prompts import Candidate, PromptSpec
from tests.helpers.sources import GSM, evals


SPECS = itertools.count()  # a spec's token: workers make one maker per token


def spec(fmt: str = "messages", name: str = "s", evals=None, **kw) -> PromptSpec:
    fields = {"prompt_field": "q"} if fmt == "columns" else {"tools_field": "tools"}
    source = params.Source(name=name, path="unused", format=fmt, **fields)
    values = dict(token=f"test-{next(SPECS)}", index=0, src=source, multi_turn="context",
                  dedup="prompt", max_chars=200, seed=0, sampled=True, evals=evals)
    return PromptSpec(**{**values, **kw})


def line(*messages, **extra) -> bytes:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in messages], **extra}).encode()


def test_a_candidate_is_the_line_and_what_selection_reads():
    made = prompts.work(spec(), [line(("system", "Be brief."), ("user", "Hi")), b"  \n"])
    first, blank = made.results
    assert blank is None and made.unknown_roles == {}
    assert type(first) is Candidate
    row = orjson.loads(first.line)
    assert first.line.endswith(b"\n") and row["source"] == "s" and row["id"] == first.id.decode()
    assert first.id == xxhash.xxh3_128_hexdigest(
        b"s\0" + orjson.dumps({"messages": row["messages"]})).encode()
    assert first.sample == xxhash.xxh3_64_intdigest(first.id, seed=0)
    assert (first.chars, first.multi_turn, first.has_tools, first.repairs) == (len("Be brief.Hi"),
                                                                               False, False, ())
    assert first.key is not None
    assert prompts.work(spec(dedup="off", sampled=False), [line(("user", "Hi"))]).results[0].key \
        is None


def test_the_id_does_not_depend_on_how_the_source_ordered_tool_keys():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    shuffled = [{"function": {"parameters": {"a": 2, "b": 1}, "name": "f"}, "type": "function"}]
    made = prompts.work(spec(), [line(("user", "Q"), tools=tools), line(("user", "Q"), tools=shuffled)])
    one, two = made.results
    assert one.id == two.id and one.has_tools


def test_every_other_outcome_is_named():
    made = prompts.work(spec(), [b"{not json", b"[1]", line(("user", "x" * 201)),
                                 line(("narrator", "x"), ("user", "Q")), line(("user", "\ud800"))])
    bad, array, long, unknown, surrogate = made.results
    assert type(bad) is readers.BadRow and bad.reason == "malformed_json"
    assert type(array) is readers.BadRow and array.reason == "not_an_object"
    assert long == Dropped("too_long") and unknown == Dropped("unknown_role")
    assert surrogate == Dropped("invalid_text")
    assert made.unknown_roles == {"narrator": 1}


def test_a_candidate_comes_back_whole_from_a_worker():
    made = prompts.work(spec(), [line(("user", "Q"), ("assistant", "A"), ("user", "Q2"))])
    again = pickle.loads(pickle.dumps(made))
    assert again.results == made.results and type(again.results[0]) is Candidate


def test_a_contaminated_candidate_becomes_a_match(tmp_path):
    cfg = params.build(params.Decontaminate, {"evals": evals(tmp_path)},
                       "prepare.decontaminate")
    decontam.register("test-prompts", decontam.build(cfg, "error").index)
    try:
        made = prompts.work(spec("columns", evals="test-prompts"),
                            [orjson.dumps({"q": "Clean question?"}), orjson.dumps({"q": GSM[0]})])
    finally:
        decontam.forget("test-prompts")
    clean, match = made.results
    assert type(clean) is Candidate and type(match) is decontam.Match
    assert (match.eval_set, match.eval_item) == ("gsm", 0)
    row = orjson.loads(prompts.work(spec("columns"), [orjson.dumps({"q": GSM[0]})])
                       .results[0].line)
    assert match.prompt_id == row["id"]  # the id the prompt would have had
