"""Fitting max_tokens into the context (stages/serving/fitting.py): the byte bound never
undercounts, the count is what transformers' own chat template path gives, and each
prompt gets the same answer every time. The server's context: tests/helpers/fakeserver.py."""

from __future__ import annotations

import pytest

from stages.serving.fitting import ContextBudget, PromptCounter, TooLong, Unrenderable


@pytest.fixture(scope="module")
def counters() -> dict[bool, PromptCounter]:
    return {on: PromptCounter("bundled:qwen3.6", enable_thinking=on) for on in (True, False)}


@pytest.fixture(scope="module")
def counter(counters) -> PromptCounter:
    return counters[True]


TEXTS = [
    "Hello world, what is 2 + 2?",
    "日本語のテキストはトークンが多い。" * 20,
    "emoji 🧪🚀 " * 30,
    "\u0958\u0959\u095a" * 50,  # NFC turns each into two code points: more bytes
    "code: for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }\n" * 10,
    "a <|im_start|>user spelled in text <think> and </think>",
]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_the_byte_bound_is_never_below_the_engine_style_count(counter, text):
    prompt = {"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": text}]}  # fmt: skip
    rendered = counter.render(prompt)
    n = counter.count(rendered)
    tok = counter.encoder.tok
    assert n == len(tok.apply_chat_template(prompt["messages"], add_generation_prompt=True,
                                            tokenize=True, return_dict=False,
                                            enable_thinking=True))  # fmt: skip
    assert counter.bound(rendered) >= n


CONVERSATIONS = [
    [{"role": "user", "content": t}] for t in TEXTS
] + [
    [{"role": "system", "content": "  padded  "}, {"role": "user", "content": TEXTS[1]},
     {"role": "assistant", "content": "ok", "reasoning_content": TEXTS[3]},
     {"role": "user", "content": TEXTS[2]}],
    # a `</think>` in an answer splits it into reasoning; a wholly tool-response user turn
    # is not a query, so the turn before it keeps its reasoning block
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r</think>answer"},
     {"role": "user", "content": "<tool_response>\n{}\n</tool_response>"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
     {"role": "tool", "content": TEXTS[0]}, {"role": "tool", "content": TEXTS[5]}],
]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_the_render_free_bound_is_never_below_the_count(counters, messages, thinking):
    counter = counters[thinking]
    prompt = {"messages": messages}
    quick = counter.quick_bound(prompt)
    assert quick is not None
    assert quick >= counter.count(counter.render(prompt))


def test_the_render_free_bound_renders_where_it_cannot_tell(counter):
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    for prompt in (
        {"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function"}]},
        {"messages": [{"role": "user", "content": "q"},
                      {"role": "assistant", "content": "", "tool_calls": [call]}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]},
    ):  # fmt: skip
        assert counter.quick_bound(prompt) is None


def test_fit_keeps_max_tokens_lowers_it_near_the_context_and_refuses_past_it(counter):
    def prompt(words: int) -> dict:
        return {"messages": [{"role": "user", "content": "w " * words}]}

    n = counter.count(counter.render(prompt(200)))
    budget = ContextBudget(n + 50, max_tokens=64, min_new_tokens=16, counter=counter)
    encoded = counter.encoded
    assert budget.fit(prompt(1)) == 64 and counter.encoded == encoded  # bound settles it
    assert budget.fit(prompt(200)) == 50 == budget.fit(prompt(200))  # the same every time
    too_long = budget.fit(prompt(240))
    assert isinstance(too_long, TooLong) and too_long.context == n + 50
    assert "generate.min_new_tokens=16" in too_long.message("bundled:qwen3.6")
    assert (budget.fitted, budget.refused) == (2, 1)


def test_tools_are_counted_as_the_engine_renders_them(counter):
    """SGLang renders each tool with `"defer_loading": null` (serving/toolshape.py): its
    count holds those tokens, a counter for another engine does not."""
    tools = [{"type": "function", "function": {"name": "lookup", "description": "d",
                                               "parameters": {"type": "object"}}}]
    prompt = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    sglang = PromptCounter("bundled:qwen3.6", enable_thinking=True, engine="sglang")
    assert '"defer_loading": null' in sglang.render(prompt)
    assert '"defer_loading"' not in counter.render(prompt)
    assert sglang.count(sglang.render(prompt)) > counter.count(counter.render(prompt))


def test_a_prompt_the_template_refuses_is_that_prompts_failure_not_the_runs(counter):
    """Qwen3.6's template raises on a system message after the first turn; SGLang would
    answer such a request with a 400: a permanent failure of that prompt alone."""
    late = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "system", "content": "Be brief."}]}  # fmt: skip
    budget = ContextBudget(4096, max_tokens=64, min_new_tokens=16, counter=counter)
    refused = budget.fit(late)
    assert isinstance(refused, Unrenderable) and refused.kind == "bad_request"
    assert "System message must be at the beginning" in refused.message("bundled:qwen3.6")
    assert budget.fit({"messages": [{"role": "user", "content": "hi"}]}) == 64
    assert budget.report()["unrenderable"] == 1
