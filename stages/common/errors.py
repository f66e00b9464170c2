"""The one exception a stage raises for a reason the user can act on (reported as one
line naming the file, row or param, exit status 1), and how a JSON value's type reads in
such a line. Reading what a user or a server controls: common/reading.py."""

from __future__ import annotations


class StageError(Exception):
    """A failure reported as one line (file, row or param named), exit status 1."""


def json_type(value) -> str:
    """How a JSON value's type reads in an error message."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             type(None): "null"}  # fmt: skip
    return names.get(type(value), "a number")
