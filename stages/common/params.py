"""Typed params: one dataclass per params.yaml section, checked when a stage starts.

Each stage reads only its own section (`load("tokenize", path)`), so `dvc.yaml` can
declare exactly the keys a stage depends on. Validation is strict: an unknown key or a
value of the wrong type stops the stage with one line naming the key and what was
expected, before any work is done.

Hand-written rather than pydantic (not one of our declared dependencies): the dataclasses double as the
documented defaults `params.yaml` must equal (tests/common/test_params.py), and every error must
be one line naming the yaml key, which pydantic's multi-line reports would need rewriting
for anyway.
"""

from __future__ import annotations

import dataclasses
import math
import os
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from stages.common.errors import StageError

from stages.common.reading import MAX_DEPTH, open_regular


class ParamError(StageError):
    pass


# Natural ranges: every int and float param declares one (tests/common/test_params.py checks),
# so a typo like `num_proc: 1000` or a value like 2**70 stops the stage in one line.
INT32 = 2**31 - 1  # lengths and counts stored as Arrow int32
INT64 = 2**63 - 1
MAX_PROCS = 256  # worker processes
MAX_PATH = 4096  # characters in a path or a model name (Linux PATH_MAX)
MAX_SECONDS = 30 * 86400.0  # any timeout or interval; longer overflows some event loops


def ranged(default: Any = dataclasses.MISSING, *, ge=None, gt=None, le=None):
    """A numeric field that must be >= ge, > gt and <= le (None: no such bound)."""
    return field(default=default, metadata={"range": (ge, gt, le)})


def path_field(default: Any = dataclasses.MISSING):
    """A str field that may name a local path: a leading ~ or ~user is expanded."""
    return field(default=default, metadata={"path": True})


def check_ranges(cfg, where: str) -> None:
    """ParamError naming the first field of `cfg` (nested dataclasses and lists of
    them included) outside its declared range; null values are allowed."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{where}.{f.name}"
        if "range" in f.metadata and value is not None:
            _in_range(value, f.metadata["range"], key)
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if dataclasses.is_dataclass(item):
                check_ranges(item, f"{key}[{i}]" if isinstance(value, list) else key)


def range_problem(cls, name: str, value) -> Optional[str]:
    """Why `value` cannot be field `name` of params class `cls` by its declared range
    ("must be >= 1, got 0"), or None; for a value read from data, not from params."""
    (f,) = [f for f in dataclasses.fields(cls) if f.name == name]
    return _out_of_range(value, f.metadata["range"])


def _in_range(value, bounds, key: str) -> None:
    why = _out_of_range(value, bounds)
    if why:
        raise ParamError(f"{key}: {why}")


def _out_of_range(value, bounds) -> Optional[str]:
    ge, gt, le = bounds
    if (ge is None or value >= ge) and (gt is None or value > gt) and (le is None or value <= le):
        return None
    parts = [f"{op} {_number(b)}" for op, b in ((">=", ge), (">", gt), ("<=", le)) if b is not None]
    return f"must be {' and '.join(parts)}, got {_show(value)}"


def _number(bound) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


BUNDLED_TOKENIZER = "bundled:qwen3.6"  # built offline (stages/models/tokenizer.py)


# --------------------------------------------------------------------------- prepare


@dataclass
class Dataset:
    """What a prompt source and an evaluation set share: where the rows are, their layout."""

    name: str
    path: str = path_field()
    format: Literal["sharegpt", "messages", "columns"]
    prompt_field: Optional[str] = None
    subset: Optional[str] = None
    split: Optional[str] = None
    # where the conversation lives for sharegpt/messages layouts, and its key names
    messages_field: Optional[str] = None
    role_key: Optional[str] = None
    content_key: Optional[str] = None
    # extra role names as "NAME:ROLE" (ROLE: system/user/assistant/tool), e.g. "prompter:user"
    role_map: list[str] = field(default_factory=list)
    revision: Optional[str] = None  # Hugging Face datasets: a commit or tag to pin the data


@dataclass
class Source(Dataset):
    system_field: Optional[str] = None
    limit: Optional[int] = ranged(None, ge=0, le=INT64)
    tools_field: Optional[str] = None


@dataclass
class EvalSet(Dataset):
    """An evaluation set kept out of the mix (prepare.decontaminate): its user turns count."""

    def as_source(self) -> Source:
        return Source(**dataclasses.asdict(self))


@dataclass
class Decontaminate:
    evals: list[EvalSet] = field(default_factory=list)
    ngram: int = ranged(13, ge=1, le=INT32)  # words per n-gram
    # null: one shared n-gram drops a prompt; a number in (0, 1]: the fraction of the
    # prompt's n-grams it must share with one evaluation item
    min_overlap: Optional[float] = ranged(None, gt=0.0, le=1.0)
    short_exact: bool = True  # items of fewer than `ngram` words match whole messages


@dataclass
class Prepare:
    sources: list[Source]
    seed: int = ranged(0, ge=0, le=2**64 - 1)  # xxh3's unsigned 64-bit seed
    max_prompt_chars: int = ranged(32000, ge=1, le=INT32)
    on_bad_row: Literal["error", "skip"] = "error"
    # regenerate: user turns kept, every source answer dropped (stages/chat/regenerate.py)
    multi_turn: Literal["context", "first_user", "regenerate"] = "context"
    # regenerate: a conversation with tool calls is cut before the source's first call,
    # or kept whole as in `context`
    tool_conversations: Literal["cut", "context"] = "cut"
    # what counts as a duplicate: the whole prompt, its user turns only, or nothing
    dedup: Literal["prompt", "user", "off"] = "prompt"
    # worker processes for large sources (0: CPUs - 1, up to 8, none on 2 CPUs; 1: none)
    num_proc: int = ranged(0, ge=0, le=MAX_PROCS)
    # a longer line or JSON array element stops the stage: bounds memory on a bad file
    max_record_bytes: int = ranged(64 << 20, ge=1, le=1 << 40)
    decontaminate: Decontaminate = field(default_factory=Decontaminate)


# -------------------------------------------------------------------------- generate


@dataclass
class Launch:
    engine: Literal["sglang", "vllm", "transformers"]
    model: str = path_field()
    args: list[str] = field(default_factory=list)
    startup_timeout: float = ranged(600.0, gt=0, le=MAX_SECONDS)
    host: str = "127.0.0.1"
    port: Optional[int] = ranged(None, ge=1, le=65535)
    # argv replacing the engine's own command; {model} {host} {port} {python} are filled in
    command: Optional[list[str]] = None
    # the interpreter the engine runs from (its own venv: engines pin their own
    # transformers); null = the stage's own
    python: Optional[str] = path_field(None)
    # SIGTERM, then SIGKILL of the process group after this
    stop_timeout: float = ranged(30.0, gt=0, le=MAX_SECONDS)


@dataclass
class Server:
    """The `generate.server` params section (the live handle is serving/server.py's
    ServerHandle, a launched engine process serving/engines.py's EngineProcess)."""

    url: Union[str, list[str], None] = None
    launch: Optional[Launch] = None
    model: Optional[str] = None  # the `model` field sent; default: the served model
    api_key_env: Optional[str] = None  # name of the env var holding the key, never the key
    unreachable_deadline: float = ranged(600.0, gt=0, le=MAX_SECONDS)
    watchdog_seconds: float = ranged(600.0, gt=0, le=MAX_SECONDS)
    # watchdog restarts in a row without a completion, then give up
    max_restarts: int = ranged(3, ge=0, le=1000)
    # a URL server that looks hung (watchdog_seconds, no sign of generation) this much
    # longer stops the run
    hang_timeout: float = ranged(900.0, gt=0, le=MAX_SECONDS)
    # the sglang-router's --request-timeout-secs in front of `url`; null: no router
    router_timeout: Optional[float] = ranged(None, gt=0, le=MAX_SECONDS)
    # the API dialect at `url` (a launched server uses launch.engine); default sglang
    engine: Optional[Literal["sglang", "vllm", "transformers"]] = None


@dataclass
class Generate:
    server: Server
    concurrency: int = ranged(256, ge=1, le=65536)
    max_tokens: int = ranged(4096, ge=1, le=INT32)
    # a prompt that leaves the engine fewer new tokens than this is a context_overflow
    min_new_tokens: int = ranged(256, ge=1, le=INT32)
    # the engine's context length; null: its /v1/models `max_model_len` (SGLang, vLLM)
    context_length: Optional[int] = ranged(None, ge=1, le=INT32)
    # counts each prompt as the engine will (render + encode) to fit max_tokens into the
    # context before sending; null: only the engine's context error clamps
    tokenizer: Optional[str] = path_field(BUNDLED_TOKENIZER)
    temperature: float = ranged(0.6, ge=0, le=100.0)
    top_p: float = ranged(0.95, gt=0, le=1.0)
    top_k: int = ranged(20, ge=-1, le=INT32)  # -1: no top-k (SGLang, vLLM)
    seed: Optional[int] = ranged(None, ge=0, le=INT64)
    enable_thinking: bool = True
    separate_reasoning: bool = True
    ignore_eos: bool = False  # SGLang/vLLM: answers run to max_tokens (benchmarks only)
    request_timeout: float = ranged(3600.0, gt=0, le=MAX_SECONDS)
    limit: Optional[int] = ranged(None, ge=1, le=INT64)
    max_retries: int = ranged(8, ge=0, le=1000)
    max_retries_500: int = ranged(2, ge=0, le=1000)
    backoff_base: float = ranged(1.0, gt=0, le=MAX_SECONDS)
    backoff_max: float = ranged(60.0, gt=0, le=MAX_SECONDS)
    cache_dir: str = path_field(".cache/requests")
    progress_interval: float = ranged(30.0, gt=0, le=MAX_SECONDS)
    retry_failed: bool = False  # resend prompts whose permanent failure is cached
    # failures a finished run may keep: an integer is a count, a float in [0, 1] a
    # fraction of the prompts; above either the stage exits 1 and DVC records nothing
    max_transient_failures: Union[int, float] = 0
    max_permanent_failures: Union[int, float] = 0.01
    # regenerated conversations: turns asked per conversation (null: every turn), and
    # what a turn that fails does to its conversation (ends it at the last good turn, or
    # drops it)
    max_turns: Optional[int] = ranged(None, ge=1, le=INT32)
    on_turn_failure: Literal["truncate", "drop"] = "truncate"
    # answers per prompt (or turn history), each with its own seed and row
    samples_per_prompt: int = ranged(1, ge=1, le=1 << 16)


# -------------------------------------------------------------------------- tokenize


@dataclass
class Tokenize:
    tokenizer: str = path_field(BUNDLED_TOKENIZER)
    chat_template: Optional[str] = path_field(None)
    trust_remote_code: bool = False
    multi_turn: Literal["last", "all", "expand"] = "last"
    max_seq_len: int = ranged(32768, ge=1, le=INT32)
    on_too_long: Literal["drop", "truncate"] = "drop"
    keep_truncated: bool = False
    min_loss_tokens: int = ranged(1, ge=0, le=INT32)
    num_proc: int = ranged(0, ge=0, le=MAX_PROCS)  # 0: one per usable CPU
    shard_rows: int = ranged(20000, ge=1, le=INT32)
    # rows whose prompt may differ from what the engine served before the stage fails
    max_render_mismatch: int = ranged(0, ge=0, le=INT64)
    # a shard also closes at this many MiB of Arrow data
    shard_max_mb: int = ranged(512, ge=1, le=1 << 20)
    # null: as generate recorded it (data/completions/generation.json)
    enable_thinking: Optional[bool] = None
    # render: ids of the rendered text; engine: the engine's own prompt and generated ids
    ids: Literal["render", "engine"] = "render"
    # with ids: engine, a row whose completion kept no engine ids is rendered or dropped
    on_missing_ids: Literal["render", "drop"] = "render"
    # with ids: engine, rows whose generated ids decode to other text than the recorded
    # answer (dropped, named) before the stage fails
    max_answer_mismatch: int = ranged(0, ge=0, le=INT64)
    # a completion line over this many bytes is dropped unrendered (too_large): encoding a
    # row takes ~100 times its size. null: 128 bytes a token of max_seq_len
    max_row_bytes: Optional[int] = ranged(None, ge=1, le=INT64)


# ------------------------------------------------------------------ merge / validate


@dataclass
class BaseColumns:
    """Where a base written by another tool keeps its tokens and mask (merge.adopt)."""

    input_ids: Optional[str] = None  # null: input_ids
    # null: whichever of loss_mask, labels, assistant_masks, completion_mask it has
    mask: Optional[str] = None
    # mask: 1 trained, 0 not (any integer or bool); labels: -100 not trained, else the
    # token id itself. null: labels for a column named labels, else mask
    mask_kind: Optional[Literal["mask", "labels"]] = None


@dataclass
class Merge:
    base: Optional[str] = path_field(None)
    on_duplicate: Literal["keep-base", "keep-new", "error"] = "keep-base"
    allow_cast: bool = False
    link: bool = True  # hardlink unchanged shards into data/merged; false: always copy
    # a base in another tool's layout is converted once into data/merged (stages/dataset/adopt.py)
    adopt: bool = False
    base_columns: BaseColumns = field(default_factory=BaseColumns)
    base_source: Optional[str] = None  # `source` of adopted rows; null: the base folder's name
    # adopted rows validate would refuse (empty, unsupervised, one token): false refuses the
    # base naming file and row; true drops them, counted
    adopt_drop_invalid: bool = False
    # adopted rows whose mask trains every token, the prompt included (a chat row's prompt
    # is never trained): error refuses the base naming file and row; drop drops them,
    # keep keeps them (text meant to be trained whole); both count them
    adopt_fully_supervised: Literal["error", "drop", "keep"] = "error"
    # tokens an adopted Parquet row group may average a row: more, read from its footer
    # before any page is decoded, is a decompression bomb, not a training set
    adopt_max_row_tokens: int = ranged(1 << 20, ge=1, le=INT32)


@dataclass
class TrainCheck:
    enabled: bool = True
    model: str = path_field("demo:tiny-qwen3")  # or a local causal LM folder
    # the first batches of data/merged, each one training step
    batches: int = ranged(2, ge=1, le=1_000_000)
    tokens_per_batch: int = ranged(16384, ge=1, le=INT32)  # also the token budget's
    # batches per optimizer step (gradient accumulation x data-parallel ranks)
    batches_per_step: int = ranged(1, ge=1, le=INT32)
    packed: bool = True  # the layout of the training step (both are compared either way)
    # the memory dry run on one row this long; null: max_seq_len, 0: off
    longest_batch_tokens: Optional[int] = ranged(None, ge=0, le=INT32)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


@dataclass
class Validate:
    # null: the limits tokenize recorded in data/merged/fingerprint.json (policy.*)
    max_seq_len: Optional[int] = ranged(None, ge=1, le=INT32)
    min_loss_tokens: Optional[int] = ranged(None, ge=0, le=INT32)
    max_examples: int = ranged(10, ge=0, le=1_000_000)
    # default: data/merged/fingerprint.json tokenizer.vocab_size
    vocab_size: Optional[int] = ranged(None, ge=1, le=INT32)
    # shards summarised at once; 0: one per idle CPU, 1 to 4
    threads: int = ranged(0, ge=0, le=MAX_PROCS)
    train_check: TrainCheck = field(default_factory=TrainCheck)


SECTIONS: dict[str, type] = {
    "prepare": Prepare,
    "generate": Generate,
    "tokenize": Tokenize,
    "merge": Merge,
    "validate": Validate,
}


MAX_FILE_BYTES = 1 << 20  # a params file is a few KiB; this bounds reading a wrong one


def load(section: str, path: str | Path = "params.yaml"):
    """Read one section of a params file into its dataclass, or raise ParamError."""
    path = Path(path)
    try:
        doc = yaml.load(_read(path), Loader=BoundedLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        what = e.problem or e.context or "error"
        raise ParamError(f"{where}: not valid YAML: {what.splitlines()[0][:200]}") from None
    except yaml.YAMLError as e:
        raise ParamError(f"{path}: not valid YAML: {str(e).splitlines()[0][:200]}") from None
    except TooDeep as e:
        raise ParamError(f"{path}:{e.line}: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise ParamError(f"{path}: cannot read a value: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(doc, dict) or section not in doc:
        raise ParamError(f"{path}: missing section '{section}'")
    return build(SECTIONS[section], doc[section], f"{path}: {section}")


def _read(path: Path) -> str:
    """The text of a regular params file of at most MAX_FILE_BYTES, or ParamError
    (never reads /dev/zero, a FIFO or a huge file to its end)."""
    try:
        with open_regular(path) as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except StageError as e:  # a FIFO, a device
        raise ParamError(str(e)) from None
    except FileNotFoundError:
        raise ParamError(f"{path}: params file not found") from None
    except IsADirectoryError:
        raise ParamError(f"{path}: is a folder, not a params file") from None
    except OSError as e:
        raise ParamError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(data) > MAX_FILE_BYTES:
        raise ParamError(f"{path}: larger than {MAX_FILE_BYTES} bytes; not a params file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ParamError(f"{path}: not UTF-8 text (byte {e.start})") from None


class TooDeep(Exception):
    def __init__(self, line: int):
        self.line = line


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader that stops at MAX_DEPTH levels of nesting (PyYAML recurses per level).
    Aliases stay shared references, so an alias bomb costs little until something walks
    it; nothing here does (see _show)."""

    depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise TooDeep(self.peek_event().start_mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        # a key given twice would silently keep the last value; `<<` merges may be overridden
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key_node.value[:50]!r} given twice", key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


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
            value = values[name] = _coerce(hints[name], data[name], key)
            if "range" in f.metadata and value is not None:
                _in_range(value, f.metadata["range"], key)
            if "path" in f.metadata and isinstance(value, str):
                values[name] = _expand_user(value, key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ParamError(f"{key}: required key is missing ({_describe(hints[name])})")
    return cls(**values)


def _expand_user(value: str, key: str) -> str:
    """`~/x` and `~user/x` as the shell expands them; an unknown user is an error."""
    if len(value) > MAX_PATH:  # also keeps every message naming the path short
        raise ParamError(f"{key}: longer than {MAX_PATH} characters ({_show(value)})")
    if not value.strip():  # would name the working folder: the whole project
        raise ParamError(f"{key}: an empty path names no file (null, where allowed, means none)")
    if not value.startswith("~"):
        return value
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):
        user = value[1:].split("/", 1)[0]
        raise ParamError(f"{key}: cannot expand {_show(value)}: no home folder for user "
                         f"{user[:40]!r}")
    return expanded


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
            if isinstance(value, int) and abs(value) > 2**53:  # float() would round or overflow
                raise ParamError(f"{key}: {_show(value)} is too large")
            if not math.isfinite(value):
                raise ParamError(f"{key}: expected a finite number, got {value}")
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


# reprlib bounds the work as well as the text: a YAML alias bomb (billion laughs) is a
# small graph whose full repr would take minutes and gigabytes
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxlong = 2, 3, 3, 30, 30
_SHORT.maxother = 30


def _show(value) -> str:
    text = _SHORT.repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"
