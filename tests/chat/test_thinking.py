"""Thinking cut from a content: the templates' rule and an engine parser's."""

from __future__ import annotations

from stages.chat.thinking import inline_parts, recorded_reasoning, split_inline, split_reply


def test_split_reply_for_servers_without_a_reasoning_parser():
    assert split_reply("<think>\nhmm\n</think>\n\nYes.") == ("hmm", "Yes.")
    assert split_reply("hmm\n</think>\n\nYes.") == ("hmm", "Yes.")  # <think> was in the prompt
    assert split_reply("<think>\nstill going") == ("still going", None)
    assert split_reply("Plain answer.") == (None, "Plain answer.")
    assert split_reply("") == (None, "")


def test_split_inline_takes_the_templates_rule():
    assert split_inline("  <think>\nhmm\n</think>\n\n Yes.") == ("hmm", " Yes.")
    assert split_inline("a</think>b</think>c") == ("a", "c")  # first and last close
    assert split_inline("<think>x<think>y</think>z") == ("y", "z")  # the last open
    assert split_inline("no block") is None


def test_inline_parts_only_for_messages_without_a_reasoning_field():
    messages = [{"role": "assistant", "content": "r</think>c"},
                {"role": "assistant", "content": "r</think>c", "reasoning_content": "x"},
                {"role": "user", "content": "r</think>c"}]
    assert inline_parts(messages) == {0: ("r", "c")}


def test_a_recorded_answer_holding_think_close_keeps_a_reasoning_string():
    assert recorded_reasoning(None, "a </think> b") == ""  # thinking off, or none given
    assert recorded_reasoning("r", "a </think> b") == "r"
    assert recorded_reasoning(None, "plain") is None and recorded_reasoning(None, None) is None
