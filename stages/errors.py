"""The one exception type a stage raises for a reason the user can act on, the one
reading of a JSON object (a JSONL line, a metadata file) that every stage shares, and
whether a JSON value can be written back as UTF-8."""

from __future__ import annotations

import json
from typing import Any


class StageError(Exception):
    """A failure reported as one line (file, row or param named), exit status 1."""


def json_object(text: bytes | str, where: str) -> dict:
    """`text` parsed as a JSON object, or a StageError naming `where` (file:line)."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise StageError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise StageError(f"{where}: not valid JSON (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise StageError(f"{where}: expected a JSON object, got {json_type(doc)}")
    return doc


def json_type(value) -> str:
    """How a JSON value's type reads in an error message."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             type(None): "null"}  # fmt: skip
    return names.get(type(value), "a number")


def writable(value: Any) -> bool:
    """Every string in a JSON value encodes as UTF-8."""
    if isinstance(value, str):
        if value.isascii():
            return True
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(writable(k) and writable(v) for k, v in value.items())
    if isinstance(value, list):
        return all(writable(v) for v in value)
    return True
