"""The tools of a request as an engine's API hands them to its chat template.

An engine parses a request's `tools` into its own model and renders that model's dump,
not the JSON it was sent, so the prompt it serves holds the dump. SGLang 0.5.23 (its
`Tool` and `Function` models) writes each tool as `type` (default "function"),
`function`, then `defer_loading` (null unless sent); the function keeps the keys it
was sent, in their order, less those its model does not know, and gains `description`
and `parameters` as null where they were not sent (`strict` and `defer_loading` only
where set; a tool's `defer_loading` is copied into a function that has none). vLLM and
`transformers serve` are taken to render tools as sent (their tests: no difference).
generate writes a completion's tools in the shape its engine served them, so tokenize
renders what the model was served; the serve check compares the result by ids.
"""

from __future__ import annotations

from typing import Any, Optional

FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")
DUMPED_ONLY_WHEN_SET = ("strict", "defer_loading")


def served_tools(engine: Optional[str], tools: Any) -> Any:
    """`tools` as `engine` (a `server.engine` value) renders them into its prompt."""
    if engine != "sglang" or not isinstance(tools, list):
        return tools
    return [_sglang_tool(t) for t in tools]


def _sglang_tool(tool: Any) -> Any:
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        return tool  # SGLang refuses the request (400): it never becomes a row
    sent = tool["function"]
    defer = tool.get("defer_loading")
    fields = {k: sent.get(k) for k in FUNCTION_FIELDS}
    if defer is not None and fields["defer_loading"] is None:
        fields["defer_loading"] = defer
    for k in DUMPED_ONLY_WHEN_SET:
        if fields[k] is None:
            del fields[k]
    order = [k for k in sent if k in fields] + [k for k in fields if k not in sent]
    return {"type": tool.get("type", "function"), "function": {k: fields[k] for k in order},
            "defer_loading": defer}
