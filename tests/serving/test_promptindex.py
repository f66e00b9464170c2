"""Where each prompt of a run is: read once and checked line by line, each distinct
request pending once, a prompt's line read again by its offsets."""

from __future__ import annotations

import json
import os

import pytest

from stages.common.errors import StageError
from stages.serving.promptindex import PromptLocations


def prompt(pid: str, text: str, **extra) -> str:
    return json.dumps({"id": pid, "messages": [{"role": "user", "content": text}], **extra}) + "\n"


def test_each_distinct_request_is_pending_once_and_each_line_reads_back(tmp_path):
    lines = [prompt("a", "same"), prompt("b", "other"), prompt("c", "same"), prompt("d", "last")]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    where = PromptLocations(path, None, "ns")
    assert where.n == 4 and not where.tools
    assert list(where.pending()) == [0, 1, 3]  # c asks what a asks: sent once
    fd = os.open(path, os.O_RDONLY)
    try:
        assert [where.line(fd, i).decode() for i in range(4)] == lines
    finally:
        os.close(fd)
    assert PromptLocations(path, 2, "ns").n == 2  # generate.limit


def test_tools_are_noticed_and_a_bad_line_is_named(tmp_path):
    path = tmp_path / "prompts.jsonl"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    path.write_text(prompt("a", "q") + prompt("b", "q", tools=tools))
    assert PromptLocations(path, None, "ns").tools
    path.write_text(prompt("a", "q") + json.dumps({"messages": []}) + "\n")
    with pytest.raises(StageError, match=rf"^{path}:2: missing string 'id'$"):
        PromptLocations(path, None, "ns")
    path.write_text(prompt("a", "q") + prompt("b~1.0123456789abcdef", "q"))
    with pytest.raises(StageError, match=rf"^{path}:2: id 'b~1.0123456789abcdef' holds '~', "
                                         "which the request ids sent to the engine reserve"):
        PromptLocations(path, None, "ns")  # client.with_attempt_id
    with pytest.raises(StageError, match="not found .run the prepare stage first"):
        PromptLocations(tmp_path / "absent.jsonl", None, "ns")
