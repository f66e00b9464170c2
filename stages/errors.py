"""The one exception type a stage raises for a reason the user can act on, and the one
reading of a JSON object (a JSONL line, a metadata file) that every stage shares."""

from __future__ import annotations

import json


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
