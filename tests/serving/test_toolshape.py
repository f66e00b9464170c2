"""The tools as each engine renders them (real SGLang's own dump: tests/test_real_sglang.py)."""

from __future__ import annotations

import json

from stages.serving.toolshape import served_tools

WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Weather now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_sglang_adds_a_null_defer_loading_to_each_tool():
    got = served_tools("sglang", [WEATHER])
    assert got == [{**WEATHER, "defer_loading": None}]
    # the order the template's tojson writes: type, function, defer_loading
    assert json.dumps(got[0]).endswith(', "defer_loading": null}')
    assert served_tools("sglang", [WEATHER]) == got and WEATHER.get("defer_loading") is None


def test_sglang_keeps_the_functions_key_order_and_nulls_what_was_not_sent():
    tool = {"function": {"parameters": {"type": "object"}, "name": "f", "x": 1},
            "extra": 2}
    got = served_tools("sglang", [tool])[0]
    assert list(got) == ["type", "function", "defer_loading"] and got["type"] == "function"
    assert list(got["function"].items()) == [("parameters", {"type": "object"}), ("name", "f"),
                                             ("description", None)]
    strict = served_tools("sglang", [{"type": "function", "function": {
        "name": "g", "description": "d", "strict": True}}])[0]
    assert list(strict["function"].items()) == [("name", "g"), ("description", "d"),
                                                ("strict", True), ("parameters", None)]


def test_sglang_copies_a_tools_defer_loading_into_its_function():
    got = served_tools("sglang", [{"type": "function", "defer_loading": True,
                                   "function": {"name": "h", "description": "d",
                                                "parameters": {}}}])[0]
    assert got["defer_loading"] is True and got["function"]["defer_loading"] is True
    assert list(got["function"]) == ["name", "description", "parameters", "defer_loading"]


def test_other_engines_and_no_tools_are_left_as_sent():
    for engine in ("vllm", "transformers"):
        assert served_tools(engine, [WEATHER]) == [WEATHER]
    assert served_tools("sglang", None) is None
    assert served_tools("sglang", ["not a tool"]) == ["not a tool"]
