"""The shared bounded reading of JSON and of files (stages/common/reading.py)."""

from __future__ import annotations

import json
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stages.common.errors import StageError

from stages.common.reading import (

    MAX_FILE_DEPTH,

    deeper_than,

    json_file,

    json_object,

    open_regular,

    parse_json,

    read_regular,

)

FEW = settings(max_examples=60, deadline=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture])

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=20)


def nest(depth: int, leaf=0):
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def depth_of(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    return 0


@FEW
@given(values)
def test_any_value_within_the_depth_parses_as_json_loads_does(value):
    text = json.dumps(value)
    assert parse_json(text) == json.loads(text) == parse_json(text.encode())
    assert deeper_than(value, depth_of(value)) is False
    assert deeper_than(value, depth_of(value) - 1) is (depth_of(value) > 0)


@FEW
@given(st.integers(MAX_FILE_DEPTH + 1, 20_000), st.sampled_from(["[", "{\"a\":"]))
def test_anything_deeper_is_a_value_error_never_a_recursion_error(depth, opener):
    closer = "]" if opener == "[" else "}"
    text = opener * depth + "1" + closer * depth
    with pytest.raises(ValueError, match="nested too deeply"):
        parse_json(text)
    with pytest.raises(StageError, match=r"^f\.json:3: not valid JSON \(nested too deeply\)$"):
        json_object(text, "f.json:3")


def test_the_depth_limit_itself_is_accepted():
    assert parse_json(json.dumps(nest(MAX_FILE_DEPTH))) == nest(MAX_FILE_DEPTH)
    with pytest.raises(ValueError):
        parse_json(json.dumps(nest(MAX_FILE_DEPTH + 1)))


def test_a_fifo_is_refused_at_once_and_a_folder_is_a_folder(tmp_path):
    fifo = tmp_path / "state.json"
    os.mkfifo(fifo)
    started = time.monotonic()
    for read in (open_regular, read_regular, json_file):
        with pytest.raises(StageError, match=r"state\.json: not a regular file \(a FIFO\)"):
            read(fifo)
    assert time.monotonic() - started < 5
    with pytest.raises(StageError, match="/dev/null: not a regular file"):
        read_regular("/dev/null")
    with pytest.raises(StageError, match="cannot read"):
        read_regular(tmp_path)
    with pytest.raises(FileNotFoundError):
        json_file(tmp_path / "gone.json")


def test_a_file_past_the_limit_is_not_read_whole(tmp_path):
    big = tmp_path / "merge.json"
    with open(big, "wb") as f:
        f.truncate(5000)
    assert len(read_regular(big, 5000)) == 5000
    with pytest.raises(StageError, match=r"merge\.json: larger than 4999 bytes"):
        read_regular(big, 4999)
    (tmp_path / "ok.json").write_text('{"a": [1]}')
    assert json_file(tmp_path / "ok.json") == {"a": [1]}
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(StageError, match=r"list\.json: expected a JSON object, got an array"):
        json_file(tmp_path / "list.json")


def test_a_folder_a_stage_expects_says_what_is_there_instead(tmp_path):
    """A FIFO, a file, a device, a loop of links or a link to nowhere where a dataset
    folder should be: one line saying which, never "not found (run the stage first)"."""
    from stages.common.reading import existing_folder

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("")
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "nowhere").symlink_to("gone")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to("dir")
    expected = {"fifo": "is a FIFO, not a dataset folder",
                "file": "is a file, not a dataset folder",
                "loop": r"cannot be reached \(Too many levels of symbolic links\)",
                "nowhere": r"a link that leads nowhere \(a missing target or a loop of links\)",
                "missing": r"not found \(run the merge stage first\)"}
    for name, why in expected.items():
        with pytest.raises(StageError, match=rf"^{tmp_path / name}: {why}$"):
            existing_folder(tmp_path / name, "run the merge stage first")
    assert existing_folder(tmp_path / "link", "x") == tmp_path / "link"
    with pytest.raises(StageError, match="^/dev/null: is a device or a socket"):
        existing_folder("/dev/null", "x")
