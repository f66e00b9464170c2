"""The regenerated conversation's contract: its prompt line, each turn's request, its row."""

from __future__ import annotations

from stages.chat import regenerate
from stages.chat.encoder import ChatEncoder


def user(text):
    return {"role": "user", "content": text}


def answer(text, reasoning=None, calls=None):
    m = {"role": "assistant", "content": text}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    if calls:
        m["tool_calls"] = calls
    return m


CALL = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]


def test_split_keeps_user_turns_in_order_and_drops_every_answer():
    msgs = [{"role": "system", "content": "S"}, user("a"), answer("A"), user("b"), user("b2"),
            answer("B"), user("c"), answer("C")]
    parts = regenerate.split(msgs)
    assert parts.request == [{"role": "system", "content": "S"}, user("a")]
    assert parts.turns == [[user("b"), user("b2")], [user("c")]]  # b, b2: one request
    assert not parts.tool_cut


def test_split_stops_before_the_first_tool_call_or_result():
    msgs = [user("a"), answer("A"), user("b"), answer("", calls=CALL),
            {"role": "tool", "tool_call_id": "c", "content": "r"}, answer("B"), user("c")]
    parts = regenerate.split(msgs)
    assert parts.request == [user("a")] and parts.turns == [[user("b")]] and parts.tool_cut
    assert regenerate.split([answer("", calls=CALL), user("x")]) is None


def test_split_stops_before_a_system_message_that_is_not_first():
    system = {"role": "system", "content": "S2"}
    parts = regenerate.split([{"role": "system", "content": "S"}, user("a"), answer("A"),
                              user("b"), answer("B"), system, user("c"), answer("C")])
    assert parts.turns == [[user("b")]] and parts.system_cut and not parts.tool_cut
    parts = regenerate.split([user("a"), system, user("b"), answer("B")])
    assert parts.request == [user("a")] and parts.turns == [] and parts.system_cut


def test_split_drops_an_answer_before_the_first_user_turn():
    parts = regenerate.split([{"role": "system", "content": "S"}, answer("Hello!"), user("a"),
                              answer("A"), user("b")])
    assert parts.request == [{"role": "system", "content": "S"}, user("a")]
    assert parts.turns == [[user("b")]] and not parts.system_cut


def test_a_request_carries_earlier_answers_without_their_reasoning():
    prompt = {"messages": [user("a")], "turns": [[user("b")]]}
    nxt = regenerate.next_request(prompt["messages"], answer("A", "why"), prompt, 1)
    assert nxt == [user("a"), {"role": "assistant", "content": "A"}, user("b")]


def test_the_request_renders_as_the_template_renders_the_row_up_to_that_turn():
    """What lets expand's rows equal the requests: the template drops reasoning of turns
    before the last user query, so the row (reasoning kept) renders each turn's prompt
    exactly as its request (reasoning left out)."""
    from stages.models.tokenizer import load_once  # the per-process cache the stage uses

    enc = ChatEncoder(load_once("bundled:qwen3.6"))
    prompt = {"messages": [user("a")], "turns": [[user("b")], [user("c")]]}
    row_msgs = [user("a"), answer("A", "r1"), user("b"), answer("B", "r2"), user("c")]
    request = regenerate.next_request(prompt["messages"], answer("A", "r1"), prompt, 1)
    request = regenerate.next_request(request, answer("B", "r2"), prompt, 2)
    assert enc.prompt_ids(request, None).tolist() == enc.prompt_ids(row_msgs, None).tolist()


def test_an_answer_that_writes_think_close_again_renders_whole_in_the_next_request():
    """An answer may write `</think>` into its content (real SGLang: again after its
    thinking, or thinking off); its row records a reasoning string for it ("" when the
    engine gave none: thinking.recorded_reasoning), so the row renders that content whole,
    and the next request carries an empty reasoning to render it whole too, as the engine
    encodes it (control tokens parsed). Content alone, the template would take the text
    before that `</think>` for thinking and drop it."""
    from stages.chat import thinking
    from stages.models.tokenizer import load_once

    enc = ChatEncoder(load_once("bundled:qwen3.6"))
    prompt = {"messages": [user("a")], "turns": [[user("b")]]}
    content = "early </think> late"
    for reasoning in ("r1", thinking.recorded_reasoning(None, content)):
        said = answer(content, reasoning)
        request = regenerate.next_request(prompt["messages"], said, prompt, 1)
        assert request[1]["reasoning_content"] == ""
        row_msgs = [user("a"), said, user("b")]
        ours = enc.prompt_ids(row_msgs, None, engine_style=True).tolist()
        assert enc.prompt_ids(request, None, engine_style=True).tolist() == ours
        assert "early" in enc.engine_prompt(row_msgs)
    split = [user("a"), answer(content, None), user("b")]
    assert "early" not in enc.engine_prompt(split)  # what the empty reasoning prevents
    plain = regenerate.in_history(answer("no close here", "r"))
    assert plain == {"role": "assistant", "content": "no close here"}  # requests as before


def test_turn_view_is_the_row_of_one_turn():
    row = {"id": "x", "source": "s", "messages": [user("a"), answer("A"), user("b"), answer("B")],
           "truncated": False, "usage": {"prompt_tokens": 9, "completion_tokens": 9},
           "engine_tokens": {"prompt_ids": [3], "completion_ids": [4]},
           "turns": [{"finish_reason": "stop", "truncated": True,
                      "usage": {"prompt_tokens": 1, "completion_tokens": 2},
                      "engine_tokens": {"prompt_ids": [1], "completion_ids": [2]}},
                     {"finish_reason": "stop", "truncated": False,
                      "usage": {"prompt_tokens": 3, "completion_tokens": 4}}]}
    first = regenerate.turn_view(row, 2)
    assert first["messages"] == row["messages"][:2] and first["truncated"] is True
    assert first["engine_tokens"] == {"prompt_ids": [1], "completion_ids": [2]}
    assert "engine_tokens" not in regenerate.turn_view(row, 4)  # that turn kept none
    assert regenerate.turn_view({k: v for k, v in row.items() if k != "turns"}, 2) is None


def test_before_last_turn_is_the_row_up_to_the_answer_before_the_last():
    turn = {"finish_reason": "stop", "truncated": False, "usage": {"prompt_tokens": 1,
                                                                   "completion_tokens": 2}}
    cut = dict(turn, finish_reason="length", truncated=True)
    msgs = [user("a"), answer("A", "r"), user("b"), user("b2"), answer("B")]
    row = {"id": "x", "source": "s", "messages": msgs, "truncated": True, "turns": [turn, cut]}
    kept = regenerate.before_last_turn(row)
    assert kept["messages"] == msgs[:2] and kept["truncated"] is False
    assert regenerate.before_last_turn(dict(row, turns=[cut], messages=msgs[:2])) is None
    assert regenerate.before_last_turn({k: v for k, v in row.items() if k != "turns"}) is None
