"""The regenerated conversation (`prepare.multi_turn: regenerate`): its prompt line, each
turn's request, and its completion row.

A prompt line of two or more turns adds `"turns"`: for each assistant turn after the
first, the messages (user turns) that follow the answer before it. The first request is
`messages`; request k+1 = request k + the target's answer k as its history keeps it
(`in_history`: content and tool calls, no reasoning, which Qwen3.6's template drops from
turns before the last user query anyway) + `turns[k-1]`. A line of one turn is a plain
prompt line. The completion row holds `messages` with every answer whole (reasoning
included) and `turns`, one entry per answered turn (finish reason, usage, engine ids).
The rules: docs/stages.md, prepare ("Regenerated conversations") and generate ("Turns").
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from stages.chat import thinking

TURNS_KEY = "turns"


class Split(NamedTuple):
    """A source conversation made ready for regeneration."""

    request: list[dict]  # the first turn's request: system and user turns up to answer 1
    turns: list[list[dict]]  # what follows each answer 1..T-1
    tool_cut: bool  # cut before the source's first tool call (or tool result)
    system_cut: bool = False  # cut before a system message that is not first


def _stop(messages: list[dict]) -> tuple[int, str]:
    """Where regeneration stops, and why: at the source's first tool call or result (its
    results answer the source's calls), or at a system message after the leading ones
    (the Qwen3 and Qwen3.6 templates take a system message only first: a request holding
    it is refused by the engine, and a line holding it by generate)."""
    leading = True
    for i, m in enumerate(messages):
        if m["role"] == "tool" or (m["role"] == "assistant" and m.get("tool_calls")):
            return i, "tool"
        if m["role"] == "system" and not leading:
            return i, "system"
        leading = leading and m["role"] == "system"
    return len(messages), ""


def split(messages: list[dict]) -> Optional[Split]:
    """The user turns of `messages` in order, the source's answers dropped; None when no
    user turn comes before the first tool call. Turns that follow one another without an
    answer between them go into one request; an answer before the first user turn (a
    greeting) is the source's like any other, dropped without starting a turn."""
    stop, why = _stop(messages)
    groups: list[list[dict]] = [[]]
    for m in messages[:stop]:
        if m["role"] == "assistant":
            if any(g["role"] == "user" for g in groups[-1]):
                groups.append([])
            continue
        groups[-1].append(m)
    if not groups[-1]:
        groups.pop()
    if not groups or not any(m["role"] == "user" for m in groups[0]):
        return None
    return Split(groups[0], groups[1:], why == "tool", why == "system")


def turn_count(prompt: dict) -> int:
    return 1 + len(prompt.get(TURNS_KEY) or ())


def in_history(answer: dict) -> dict:
    """The target's answer as the next request carries it (no reasoning). An answer whose
    content holds `</think>` keeps an empty reasoning, as its row records one
    (thinking.recorded_reasoning): without it the template would take the text before
    that `</think>` for thinking and drop it, rendering less than the model wrote."""
    kept = {"role": "assistant", "content": answer.get("content") or ""}
    if thinking.CLOSE in kept["content"]:
        kept["reasoning_content"] = ""
    if answer.get("tool_calls"):
        kept["tool_calls"] = answer["tool_calls"]
    return kept


def next_request(request: list[dict], answer: dict, prompt: dict, k: int) -> list[dict]:
    """Request k+1 (k counted from 1) after `answer`, the reply to request k."""
    return request + [in_history(answer)] + prompt[TURNS_KEY][k - 1]


def ends_conversation(row: dict) -> bool:
    """Whether a turn's completion row leaves nothing to ask after it: an answer that was
    cut off, or one that calls tools (their results would be the source's, not the
    target's, calls' answers)."""
    return bool(row["truncated"] or row["messages"][-1].get("tool_calls"))


def conversation_row(turn_rows: list[dict], prompt: dict, sample: Optional[int]) -> dict:
    """The completion row of a conversation from the rows of its answered turns, in order
    (each as generate writes a single prompt's row)."""
    last = turn_rows[-1]
    messages = list(prompt["messages"])
    for k, row in enumerate(turn_rows, 1):
        messages.append(row["messages"][-1])
        if k < len(turn_rows):
            messages.extend(prompt[TURNS_KEY][k - 1])
    row = {"id": last["id"], "source": last["source"], "messages": messages}
    if "tools" in last:
        row["tools"] = last["tools"]
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    turns = []
    for r in turn_rows:
        usage["prompt_tokens"] += r["usage"]["prompt_tokens"]
        usage["completion_tokens"] += r["usage"]["completion_tokens"]
        turn = {"finish_reason": r["finish_reason"], "truncated": r["truncated"], "usage": r["usage"]}
        if "engine_tokens" in r:
            turn["engine_tokens"] = r["engine_tokens"]
        turns.append(turn)
    row.update(finish_reason=last["finish_reason"], truncated=last["truncated"], usage=usage,
               model=last["model"], sampling=last["sampling"])
    if "engine_tokens" in last:
        row["engine_tokens"] = last["engine_tokens"]
    row[TURNS_KEY] = turns
    if sample is not None:
        row["sample"] = sample
    return row


def before_last_turn(row: dict) -> Optional[dict]:
    """A regenerated row of two or more answered turns seen as the conversation of its
    turns before the last (turn_view of the answer before it); None for any other row.
    tokenize takes it when the last answer was cut off and is not kept: every turn before
    it is a whole answer of the target's, asked with the history it was served."""
    turns = row.get(TURNS_KEY)
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    answers = [i for i, m in enumerate(row["messages"]) if m.get("role") == "assistant"]
    if len(answers) != len(turns):
        return None
    return turn_view(row, answers[-2] + 1)


def turn_view(row: dict, n_messages: int) -> Optional[dict]:
    """A regenerated row seen as the row of its turn that ends at message `n_messages`
    (that turn's request and answer, its finish reason, usage and engine ids); None for
    a row that is not regenerated, whose earlier answers the engine did not write."""
    turns = row.get(TURNS_KEY)
    if not isinstance(turns, list):
        return None
    messages = row["messages"][:n_messages]
    k = sum(m.get("role") == "assistant" for m in messages)
    if not 1 <= k <= len(turns) or not isinstance(turns[k - 1], dict):
        return None
    turn = turns[k - 1]
    view = {key: value for key, value in row.items() if key != "engine_tokens"}
    view.update(messages=messages, finish_reason=turn.get("finish_reason"),
                truncated=turn.get("truncated"), usage=turn.get("usage"))
    if "engine_tokens" in turn:
        view["engine_tokens"] = turn["engine_tokens"]
    return view
