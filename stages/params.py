"""Typed params: one dataclass per params.yaml section, checked when a stage starts.

Each stage reads only its own section (`load("tokenize", path)`), so `dvc.yaml` can
declare exactly the keys a stage depends on. Validation is strict: an unknown key or a
value of the wrong type stops the stage with one line naming the key and what was
expected, before any work is done.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from stages.errors import StageError


class ParamError(StageError):
    pass


def at_least(section: str, cfg, minimums: dict[str, int]) -> None:
    """ParamError naming the first key of `cfg` below its minimum (None: unset, allowed)."""
    for key, low in minimums.items():
        value = getattr(cfg, key)
        if value is not None and value < low:
            raise ParamError(f"{section}.{key}: must be >= {low}, got {value}")


# --------------------------------------------------------------------------- prepare


@dataclass
class Source:
    name: str
    path: str
    format: Literal["sharegpt", "messages", "columns"]
    prompt_field: Optional[str] = None
    system_field: Optional[str] = None
    subset: Optional[str] = None
    split: Optional[str] = None
    limit: Optional[int] = None
    # where the conversation lives for sharegpt/messages layouts, and its key names
    messages_field: Optional[str] = None
    tools_field: Optional[str] = None
    role_key: Optional[str] = None
    content_key: Optional[str] = None
    # extra role names as "NAME:ROLE" (ROLE: system/user/assistant/tool), e.g. "prompter:user"
    role_map: list[str] = field(default_factory=list)
    revision: Optional[str] = None  # Hugging Face datasets: a commit or tag to pin the data


@dataclass
class Prepare:
    sources: list[Source]
    seed: int = 0
    max_prompt_chars: int = 32000
    on_bad_row: Literal["error", "skip"] = "error"
    multi_turn: Literal["context", "first_user"] = "context"
    # what counts as a duplicate: the whole prompt, its user turns only, or nothing
    dedup: Literal["prompt", "user", "off"] = "prompt"
    # worker processes for large sources (0: CPUs - 1, up to 8, none on 2 CPUs; 1: none)
    num_proc: int = 0


# -------------------------------------------------------------------------- generate


@dataclass
class Launch:
    engine: Literal["sglang", "vllm", "transformers"]
    model: str
    args: list[str] = field(default_factory=list)
    startup_timeout: float = 600.0
    host: str = "127.0.0.1"
    port: Optional[int] = None
    # argv replacing the engine's own command; {model} {host} {port} {python} are filled in
    command: Optional[list[str]] = None
    # the interpreter the engine runs from (its own venv: engines pin their own
    # transformers); null = the stage's own
    python: Optional[str] = None
    stop_timeout: float = 30.0  # SIGTERM, then SIGKILL of the process group after this


@dataclass
class Server:
    url: Union[str, list[str], None] = None
    launch: Optional[Launch] = None
    model: Optional[str] = None  # the `model` field sent; default: the served model
    api_key_env: Optional[str] = None  # name of the env var holding the key, never the key
    unreachable_deadline: float = 600.0
    watchdog_seconds: float = 600.0
    max_restarts: int = 3  # watchdog restarts in a row without a completion, then give up
    # the API dialect at `url` (a launched server uses launch.engine); default sglang
    engine: Optional[Literal["sglang", "vllm", "transformers"]] = None


@dataclass
class Generate:
    server: Server
    concurrency: int = 256
    max_tokens: int = 4096
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    seed: Optional[int] = None
    enable_thinking: bool = True
    separate_reasoning: bool = True
    ignore_eos: bool = False  # SGLang/vLLM: answers run to max_tokens (benchmarks only)
    request_timeout: float = 3600.0
    limit: Optional[int] = None
    max_retries: int = 8
    max_retries_500: int = 2
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    cache_dir: str = ".cache/requests"
    progress_interval: float = 30.0
    retry_failed: bool = False  # resend prompts whose permanent failure is cached


# -------------------------------------------------------------------------- tokenize


@dataclass
class Tokenize:
    tokenizer: str = "bundled:qwen3.6"
    chat_template: Optional[str] = None
    trust_remote_code: bool = False
    multi_turn: Literal["last", "all", "expand"] = "last"
    max_seq_len: int = 32768
    on_too_long: Literal["drop", "truncate"] = "drop"
    keep_truncated: bool = False
    min_loss_tokens: int = 1
    num_proc: int = 1
    shard_rows: int = 20000
    check_sample: int = 64
    shard_max_mb: int = 512  # a shard also closes at this many MiB of Arrow data
    enable_thinking: bool = True


# ------------------------------------------------------------------ merge / validate


@dataclass
class Merge:
    base: Optional[str] = None
    on_duplicate: Literal["keep-base", "keep-new", "error"] = "keep-base"
    allow_cast: bool = False
    link: bool = True  # hardlink unchanged shards into data/merged; false: always copy


@dataclass
class Validate:
    max_seq_len: int = 32768
    min_loss_tokens: int = 1
    max_examples: int = 10
    vocab_size: Optional[int] = None  # default: data/merged/fingerprint.json tokenizer.vocab_size
    threads: int = 0  # shards summarised at once; 0: one per idle CPU, 1 to 4


SECTIONS: dict[str, type] = {
    "prepare": Prepare,
    "generate": Generate,
    "tokenize": Tokenize,
    "merge": Merge,
    "validate": Validate,
}


def load(section: str, path: str | Path = "params.yaml"):
    """Read one section of a params file into its dataclass, or raise ParamError."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ParamError(f"{path}: params file not found") from None
    except yaml.YAMLError as e:
        raise ParamError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(doc, dict) or section not in doc:
        raise ParamError(f"{path}: missing section '{section}'")
    return build(SECTIONS[section], doc[section], f"{path}: {section}")


def build(cls, data: Any, where: str):
    """Turn plain YAML data into dataclass `cls`, naming the first bad key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ParamError(f"{where}: expected a mapping, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ParamError(
            f"{where}.{unknown[0]}: unknown key (expected one of: {', '.join(fields)})"
        )
    values = {}
    for name, f in fields.items():
        key = f"{where}.{name}"
        if name in data:
            values[name] = _coerce(hints[name], data[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ParamError(f"{key}: required key is missing ({_describe(hints[name])})")
    return cls(**values)


def _coerce(tp, value, key: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        alternatives = [a for a in args if a is not type(None)]
        for arg in alternatives:
            try:
                return _coerce(arg, value, key)
            except ParamError as e:
                # a nested mapping or list: its own error names the deeper key
                if (dataclasses.is_dataclass(arg) and isinstance(value, dict)) or (
                    typing.get_origin(arg) is list and isinstance(value, list)
                ):
                    raise e from None
        raise ParamError(f"{key}: expected {_describe(tp)}, got {_show(value)}")
    if origin is Literal:
        if value in args:
            return value
        choices = ", ".join(repr(a) for a in args)
        raise ParamError(f"{key}: expected one of {choices}, got {_show(value)}")
    if origin is list:
        if not isinstance(value, list):
            raise ParamError(f"{key}: expected {_describe(tp)}, got {_show(value)}")
        (item,) = args
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a new field type must be taught here
        raise TypeError(f"params.py cannot check type {tp!r} of {key}")
    raise ParamError(f"{key}: expected {_describe(tp)}, got {_show(value)}")


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        parts = [_describe(a) for a in args if a is not type(None)]
        if type(None) in args:
            parts.append("null")
        return " or ".join(parts)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp)
    )


def _show(value) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"
