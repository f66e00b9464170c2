"""What a run's serving setup needs that the params may not say: the flags a launched
engine needs for these prompts, and what a URL that is an sglang-router lacks.

Tools: SGLang returns structured `tool_calls` only when it runs a tool-call parser, so a
launched SGLang gets the parser of its model's format when the prompts carry tools
(`qwen3_coder` for the Qwen3.5/3.6 family and Qwen3-Coder, `qwen25` for the other Qwen3
and Qwen2.5 models), unless its `launch.args` or `launch.command` name one; another model
gets a warning. Router: sglang-router 0.3.2 (read from its source and binary) answers
/v1/models without `max_model_len` and may name the model `unknown`, drops the token-id
switches, retries a failed request itself and cuts requests after
`--request-timeout-secs`: each param a run behind it misses is one warning line.
docs/stages.md, generate, "Server" and "Router".
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Optional

from stages.serving import engineids
from stages.common import params
from stages.serving import probes

log = logging.getLogger(__name__)

ROUTER_DEFAULT_TIMEOUT = 1800  # sglang-router's --request-timeout-secs default
TOOL_PARSER_FLAG = "--tool-call-parser"
# model name -> SGLang 0.5.23's tool-call parser for its format, first match wins
TOOL_PARSERS = (
    (re.compile(r"qwen3[._-]?[56]|qwen3[._-]?coder", re.I), "qwen3_coder"),
    (re.compile(r"qwen[._-]?(3|2\.?5)", re.I), "qwen25"),
)


def tool_parser(model: str) -> Optional[str]:
    """SGLang's tool-call parser for `model`'s format, or None when not known here."""
    return next((name for pattern, name in TOOL_PARSERS if pattern.search(model)), None)


def launch_for(launch: params.Launch, tools: bool) -> params.Launch:
    """`launch` with the flags these prompts need: a tool-call parser for an SGLang
    serving prompts with tools (see the module docstring)."""
    if not tools or launch.engine != "sglang":
        return launch
    given = list(launch.args) + list(launch.command or [])
    if any(a == TOOL_PARSER_FLAG or a.startswith(TOOL_PARSER_FLAG + "=") for a in given):
        return launch
    parser = tool_parser(launch.model)
    if parser is None:
        log.warning(
            "the prompts carry tools and SGLang has no %s for %s: its tool calls come back "
            "as text in content; add the parser of its format to generate.server.launch.args",
            TOOL_PARSER_FLAG, launch.model,
        )  # fmt: skip
        return launch
    log.info("the prompts carry tools: SGLang is launched with %s %s", TOOL_PARSER_FLAG, parser)
    return dataclasses.replace(launch, args=[*launch.args, TOOL_PARSER_FLAG, parser])


def router_timeout_advice(request_timeout: float, router_timeout: float) -> str:
    return (
        f"generate.request_timeout ({request_timeout:g} s) is longer than the router's "
        f"--request-timeout-secs ({router_timeout:g} s, generate.server.router_timeout): the "
        "router would cut long generations and they would start over; set "
        f"generate.request_timeout <= {router_timeout:g} or start the router with "
        f"--request-timeout-secs {int(request_timeout) + 60} and set "
        "generate.server.router_timeout to match"
    )


def behind_router(cfg: params.Generate, urls: list[str], shown: list[str],
                  key: Optional[str]) -> bool:
    """Whether a URL server is an sglang-router (it lists its workers at /workers); if
    so, one warning line per param the run misses behind it."""
    if not any(probes.is_router(u, key) for u in urls):
        return False
    where = f"{', '.join(shown)} is an sglang-router"
    if cfg.server.router_timeout is None and cfg.request_timeout > ROUTER_DEFAULT_TIMEOUT:
        log.warning("%s (default --request-timeout-secs %d). %s", where, ROUTER_DEFAULT_TIMEOUT,
                    router_timeout_advice(cfg.request_timeout, ROUTER_DEFAULT_TIMEOUT))
    if cfg.context_length is None:
        log.warning(
            "%s: its /v1/models gives no context length, so no request is fitted to the "
            "context and each long prompt costs a rejected request; set "
            "generate.context_length to the workers' --context-length", where,
        )  # fmt: skip
    if cfg.server.model is None:
        log.warning(
            "%s: the model name comes from the router's own /v1/models; set "
            "generate.server.model to the served model (it keys the request cache)", where,
        )  # fmt: skip
    if engineids.request_fields(cfg.server.engine or "sglang"):
        log.warning("%s: %s; start the workers' URLs in generate.server.url (a list) to "
                    "check by ids", where, engineids.ROUTER_WHY)
    return True
