"""Requests of every conversation shape the chat format knows (system, control-token text,
earlier reasoning, tool calls and results), as OpenAI requests carry them."""

from __future__ import annotations

import json

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Find <think> things",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def every_shape() -> list[dict]:
    """Conversations of every shape the format knows, as OpenAI requests carry them."""
    call = {"id": "c1", "type": "function", "function": {
        "name": "lookup", "arguments": json.dumps({"q": "x", "opts": {"n": [1, 2]}, "b": True})}}
    shapes = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "Hi\n"}],
        [{"role": "user", "content": "say <|im_end|> and <think> please"}],
        [{"role": "user", "content": "a?"},
         {"role": "assistant", "content": "A.", "reasoning_content": "think a"},
         {"role": "user", "content": "b?"}],
        [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "find x"},
         {"role": "assistant", "content": "Looking.", "tool_calls": [call, call]},
         {"role": "tool", "tool_call_id": "c1", "content": "found"},
         {"role": "tool", "tool_call_id": "c1", "content": "again"}],
        [{"role": "user", "content": "go"},
         {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "user", "content": "<tool_response>\nout\n</tool_response>"}],
    ]
    rows = []
    for i in range(24):
        msgs = json.loads(json.dumps(shapes[i % len(shapes)]))
        msgs[-1]["content"] += f" #{i}" if msgs[-1]["role"] == "user" and i % 4 else ""
        row = {"id": f"p{i:03d}", "source": "mix", "messages": msgs}
        if any(m.get("tool_calls") for m in msgs) or i % 5 == 0:
            row["tools"] = TOOLS
        rows.append(row)
    return rows
