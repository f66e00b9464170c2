"""What a completion row keeps of the engine's token ids (stages/serving/engineids.py)."""

from __future__ import annotations

import numpy as np
import pytest

from stages.serving import engineids
from stages.chat.conversation import token_ids_digest
from stages.serving.engineids import Served, from_reply

SGLANG = {"choices": [{"message": {}, "prompt_token_ids": [248045, 846, 198],
                       "response_token_ids": [5, 6, 248046]}]}
VLLM = {"prompt_token_ids": [248045, 846, 198], "choices": [{"token_ids": [5, 6, 248046]}]}
KEPT = {"prompt_ids": [248045, 846, 198], "completion_ids": [5, 6, 248046]}


def test_both_engines_placements_are_read_into_one_form():
    assert from_reply(SGLANG) == from_reply(VLLM) == KEPT
    only_prompt = {"choices": [{"prompt_token_ids": [1, 2]}]}  # return_prompt_token_ids alone
    assert from_reply(only_prompt) == {"prompt_ids": [1, 2], "completion_ids": None}
    assert from_reply({"choices": [{}]}) is None  # an engine (or router) that sent none


@pytest.mark.parametrize("bad, why", [
    ([], "prompt_token_ids is empty"), ("abc", "is not a list"), ([[1, 2]], "not a list of token ids"),
    ([1, True], "not a list of token ids"), ([1, "2"], "not a list of token ids"),
    ([1.0], "not a list of token ids"), ([1, -2], "not a token id"), ([2 ** 40], "not a token id"),
    ([2 ** 70], "not a token id"), ({"a": 1}, "is not a list"),
])  # fmt: skip
def test_ids_that_are_not_token_ids_are_kept_as_unusable(bad, why):
    """Counted as such by the serve-render check, never silently 'unchecked'."""
    kept = from_reply({"choices": [{"prompt_token_ids": bad, "response_token_ids": [5]}]})
    assert set(kept) == {"unusable", "problem"} and why in kept["unusable"]
    assert from_reply({"choices": [{"prompt_token_ids": [1], "response_token_ids": []}]}) == {
        "prompt_ids": [1], "completion_ids": []}  # an empty answer is an answer


def test_whether_ids_are_refused_is_their_problem_never_the_phrase():
    """tokenize refuses ids holding values no engine serves, and only counts an empty or
    absent list: it asks the kind the row records, never the wording of its reason."""
    def read(prompt_ids):
        kept = from_reply({"choices": [{"prompt_token_ids": prompt_ids}]})
        return kept, Served({"engine_tokens": kept}).unusable

    for bad, problem in [([1, True], "not_ids"), ([1.0], "not_ids"), ([-1], "not_an_id")]:
        kept, unusable = read(bad)
        assert kept["problem"] == problem and unusable.bad_values, bad
        assert str(unusable) == kept["unusable"]  # the phrase the report and errors show
    for bad, problem in [([], "empty"), ("abc", "not_a_list")]:
        kept, unusable = read(bad)
        assert kept["problem"] == problem and not unusable.bad_values, bad
    reworded = {"unusable": "prompt_ids: numbers out of range", "problem": "not_an_id"}
    assert Served({"engine_tokens": reworded}).unusable.bad_values
    for unnamed in ({"unusable": "prompt_ids holds a number that is not a token id"},
                    {"unusable": "x", "problem": "no such kind"}):
        unusable = Served({"engine_tokens": unnamed}).unusable
        assert unusable.problem is engineids.Problem.UNNAMED and not unusable.bad_values
    digest = Served({"engine_tokens": {"prompt": 1}}).unusable
    assert digest.problem is engineids.Problem.MALFORMED_DIGEST and not digest.bad_values


def test_a_row_says_what_was_served():
    row = {"engine_tokens": KEPT, "usage": {"prompt_tokens": 99, "completion_tokens": 99}}
    s = Served(row)
    assert s.by_ids and s.n_prompt == 3 and s.n_completion == 3 and s.unusable is None
    assert s.prompt_agrees(np.array([248045, 846, 198])) and not s.prompt_agrees(np.array([248045, 846, 197]))
    counted = Served({"usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    assert not counted.by_ids and counted.n_prompt == 3 and counted.prompt_agrees(np.array([7, 8, 9]))
    unusable = Served({"engine_tokens": {"unusable": "prompt_token_ids is empty"},
                       "usage": {"prompt_tokens": 3}})
    assert unusable.unusable and not unusable.by_ids and unusable.n_prompt == 3


def test_digests_cached_by_earlier_runs_are_still_checked_by_ids():
    ids = np.array([248045, 846, 198])
    legacy = {"prompt_sha256": token_ids_digest(ids), "prompt": 3, "completion": 2}
    assert from_reply({"choices": [{}], "engine_tokens": legacy}) == legacy
    s = Served({"engine_tokens": legacy})
    assert s.by_ids and s.prompt_ids is None and s.n_completion == 2
    assert s.prompt_agrees(ids) and not s.prompt_agrees(ids[::-1].copy())
    for bad in ({"prompt": 1}, {**legacy, "prompt": "3"}, {**legacy, "completion": 1.5}, [1]):
        assert "unusable" in from_reply({"choices": [{}], "engine_tokens": bad}), bad
        assert Served({"engine_tokens": bad}).unusable


def test_why_rows_lack_ids_names_the_router():
    assert "sglang-router" in engineids.why_without("sglang", router=True)
    assert "transformers returns no token ids" in engineids.why_without("transformers", False)


def test_the_engine_a_reply_came_from_is_where_its_ids_are():
    """A row written from a cached reply takes the tool shape of the engine that served it
    (serving/toolshape.py), whatever engine a later run names."""
    sglang = {"choices": [{"message": {}, "prompt_token_ids": [1], "response_token_ids": [2]}]}
    vllm = {"prompt_token_ids": [1], "choices": [{"message": {}, "token_ids": [2]}]}
    bare = {"choices": [{"message": {"content": "x"}}]}
    assert engineids.engine_of(sglang, "vllm") == "sglang"
    assert engineids.engine_of(vllm, "sglang") == "vllm"
    assert engineids.engine_of(bare, "transformers") == "transformers"
    assert engineids.engine_of({"choices": ["odd"]}, "sglang") == "sglang"
