"""A completion row made from an engine's reply: the answer as the row records it, the
truncation rule, the engine's ids kept."""

from __future__ import annotations

from stages.serving.completions import completion_row, record_row

PROMPT = {"id": "p1", "source": "s", "messages": [{"role": "user", "content": "q"}]}


def reply(content, reasoning=None, finish="stop", **choice) -> dict:
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    return {"choices": [{"message": message, "finish_reason": finish, **choice}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4}}


def answer(data: dict, thinking: bool) -> dict:
    return completion_row(PROMPT, data, "m", "h", thinking)["messages"][-1]


def test_an_answer_holding_think_close_records_a_reasoning_string():
    # thinking off: what the model wrote after the closed block, `</think>` included
    assert answer(reply("a </think> b"), False) == {
        "role": "assistant", "content": "a </think> b", "reasoning_content": ""}
    assert answer(reply("plain"), False)["reasoning_content"] is None
    # thinking on, no reasoning parser: split at the first `</think>`; an empty thinking
    # is "" when the rest holds another `</think>`, so no render splits the content again
    assert answer(reply("r\n</think>\n\nyes"), True)["reasoning_content"] == "r"
    got = answer(reply("</think>x </think> y"), True)
    assert (got["reasoning_content"], got["content"]) == ("", "x </think> y")
    # the engine's own split is kept as it came
    assert answer(reply("c </think> d", "r"), True)["reasoning_content"] == "r"


def test_a_reply_the_engine_split_is_not_split_again():
    """SGLang's parser sends an empty thinking as null: the `</think>` left in the content
    is the answer's own (seen from a model that closed its thinking at once and wrote
    `</think>` again), and cutting there would drop the answer's first part."""
    said = reply("x </think> y")
    split = completion_row(PROMPT, said, "m", "h", True, reasoning_split=True)["messages"][-1]
    assert (split["reasoning_content"], split["content"]) == ("", "x </think> y")
    assert answer(said, True)["content"] == " y"  # the same text from an engine without one
    assert answer(reply("x </think> y", ""), True) == split  # an engine that says "" cut it
    rec = {"ok": True, "reasoning_split": True, "reply": said}
    meta = {"model": "m", "sampling_hash": "h", "sampling": {"enable_thinking": True}}
    assert record_row(PROMPT, rec, meta, "sglang")["messages"][-1] == split


def test_cut_off_or_empty_answers_are_truncated():
    def truncated(data: dict, thinking: bool = True) -> bool:
        return completion_row(PROMPT, data, "m", "h", thinking)["truncated"]

    assert truncated(reply("partial", finish="length"))
    assert truncated(reply(None, "thinking that never closed"))  # no answer: data, not success
    assert not truncated(reply("done"))
    calls = reply(None, finish="tool_calls")
    calls["choices"][0]["message"]["tool_calls"] = [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert not truncated(calls)


def test_the_engines_ids_are_kept_and_the_row_carries_its_facts():
    data = reply("ok", prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5])
    row = completion_row(PROMPT, data, "model-x", "hash", False, "sglang")
    assert row["engine_tokens"] == {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5]}
    assert (row["id"], row["source"], row["model"], row["sampling"]) == ("p1", "s", "model-x", "hash")
    assert row["usage"] == {"prompt_tokens": 3, "completion_tokens": 4}
    assert row["messages"][:-1] == PROMPT["messages"]
    assert "engine_tokens" not in completion_row(PROMPT, reply("ok"), "m", "h", False)
