"""A dataset's fingerprint.json, and a dataset folder's state hash.

The *fingerprint* is fingerprint.json: what made a set's tokens (tokenizer, chat template,
tokenize's policy, library versions). Tokenize writes it (`build`); merge reads it
(`read`), refuses a base whose `MATCH_KEYS` differ (`check_match`) and widens the limits
in `WIDENED` to hold the base's rows (`widened`); validate takes its null limits from
`RECORDED`; the lineage card and export show it. A recorded limit is used only when it is
a whole number in the param's range (`limit_problem`).

The *state hash* is another thing: a cheap hash of a folder's fingerprint.json and shards
(`state_hash`), stored as state.json's `_fingerprint` (datasets' key: `STATE_KEY`) and read
back by `read_state_hash`. The word "fingerprint" names the file alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

from stages.common import params
from stages.common.errors import StageError, json_type
from stages.common.reading import json_file, open_regular, read_regular, writable

log = logging.getLogger(__name__)

FILE = "fingerprint.json"
STATE_KEY = "_fingerprint"  # state.json's key for the state hash (datasets' name)
# what a base must share with the new rows: they were tokenized the same way
MATCH_KEYS = ("tokenizer", "chat_template_sha256")
# the tokenize limits a merged fingerprint widens to cover the base rows too
WIDENED = {"max_seq_len": max, "min_loss_tokens": min}
# validate param -> where tokenize recorded it
RECORDED = {"vocab_size": ("tokenizer", "vocab_size"),
            "max_seq_len": ("policy", "max_seq_len"),
            "min_loss_tokens": ("policy", "min_loss_tokens")}
# tokenize params that change no byte of the output: not recorded
UNRECORDED_POLICY = ("num_proc", "max_render_mismatch", "max_answer_mismatch")


def build(tok_id: dict, template_sha256: str, cfg: params.Tokenize) -> dict:
    """The fingerprint of a set tokenized with `cfg` by the tokenizer of identity `tok_id`
    and the chat template of that hash (stages/models/tokenizer.py makes both)."""
    return {
        "tokenizer": tok_id,
        "chat_template_sha256": template_sha256,
        "policy": {k: v for k, v in dataclasses.asdict(cfg).items()
                   if k not in UNRECORDED_POLICY},
        # as installed, read without importing them (datasets alone takes about a second)
        "versions": {name: importlib.metadata.version(name)
                     for name in ("transformers", "tokenizers", "datasets", "pyarrow")},
    }


def load(path: Path) -> dict:
    """fingerprint.json as a JSON object, read bounded (reading.json_file); raises
    FileNotFoundError when missing and StageError when unreadable."""
    return json_file(path)


def missing_keys(doc: dict) -> list[str]:
    """The `MATCH_KEYS` a fingerprint lacks."""
    return [k for k in MATCH_KEYS if k not in doc]


def limit_problem(value: Any, cls, name: str) -> Optional[str]:
    """Why a recorded limit cannot be param `name` of params class `cls` (not a whole
    number, out of its range), or None."""
    if type(value) is not int:
        return f"is {json_type(value)}, not a whole number"
    return params.range_problem(cls, name, value)


def read(path: Path, required: bool) -> Optional[dict]:
    """fingerprint.json, its `WIDENED` limits checked (they are carried into a merged
    fingerprint and the card); None when missing and not `required`."""
    try:
        doc = load(path)
    except FileNotFoundError:
        if required:
            raise StageError(f"{path}: not found (the tokenize stage writes it)") from None
        return None
    if not writable(doc):
        raise StageError(f"{path}: holds a lone surrogate, which cannot be written as UTF-8")
    policy = doc.get("policy")
    for key in WIDENED:
        value = policy.get(key) if isinstance(policy, dict) else None
        why = None if value is None else limit_problem(value, params.Tokenize, key)
        if why:
            raise StageError(f"{path}: policy.{key} {why}")
    return doc


def vocab_size(doc: dict, path: Path) -> int:
    """The recorded vocabulary size, which every adopted token id must fall inside."""
    size = (doc.get("tokenizer") or {}).get("vocab_size")
    if type(size) is not int or size < 1:
        raise StageError(f"{path}: no tokenizer.vocab_size, which merge.adopt checks the "
                         "base's token ids against (re-run the tokenize stage)")
    return size


def check_match(base_path: Path, base: dict, new_path: Path, new: dict) -> None:
    """StageError when the base was tokenized otherwise than the new rows."""
    for key in MATCH_KEYS:
        diff = _first_difference(base.get(key), new.get(key), key)
        if diff:
            where, a, b = diff
            raise StageError(
                f"fingerprint mismatch: {where} is {_short(a)} in {base_path} but "
                f"{_short(b)} in {new_path} (the base was tokenized differently)"
            )


def widened(base: Optional[dict], new: dict) -> dict:
    """The new rows' fingerprint, its length and supervision limits widened to hold the
    base rows too (validate checks the whole set against them)."""
    policy, base_policy = new.get("policy"), (base or {}).get("policy")
    if not isinstance(policy, dict) or not isinstance(base_policy, dict):
        return new
    wide = dict(policy)
    for key, pick in WIDENED.items():
        values = [p.get(key) for p in (policy, base_policy)]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            wide[key] = pick(values)
    if wide == policy:
        return new
    log.info("base limits differ: the merged fingerprint records max_seq_len %s, "
             "min_loss_tokens %s", wide.get("max_seq_len"), wide.get("min_loss_tokens"))
    return {**new, "policy": wide}


def _first_difference(a: Any, b: Any, where: str):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            diff = _first_difference(a.get(key), b.get(key), f"{where}.{key}")
            if diff:
                return diff
        return None
    return None if a == b else (where, a, b)


def _short(value: Any) -> str:
    text = "missing" if value is None else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------ state hash


def state_hash(folder: str | Path, shard_names: list[str]) -> str:
    """The state hash of a folder: cheap, and the same whenever the output is: a hash of
    fingerprint.json (where the folder has one), then each shard's name, size, first and
    last 64 KiB."""
    folder = Path(folder)
    fingerprint = folder / FILE
    h = hashlib.sha256(read_regular(fingerprint) if fingerprint.exists() else b"")
    for name in shard_names:
        with open_regular(folder / name) as f:
            size = os.fstat(f.fileno()).st_size
            h.update(f"{name}\0{size}\0".encode())
            h.update(f.read(1 << 16))
            if size > 1 << 16:
                f.seek(max(1 << 16, size - (1 << 16)))
                h.update(f.read())
    return h.hexdigest()[:16]


def read_state_hash(state_file: Path) -> Optional[str]:
    """The state hash a state.json records; None when the file is missing or unreadable
    or the value no string that can be written."""
    try:
        value = json_file(state_file).get(STATE_KEY)
    except (OSError, StageError):
        return None
    return value if isinstance(value, str) and writable(value) else None
