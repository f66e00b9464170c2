"""arrays: Arrow arrays to numpy and back through their buffers, equal to pyarrow's own
conversions, and the export kept off pyarrow's pandas bridge."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from stages.dataset import arrays
from tests.helpers.repo import ROOT
from tests.helpers.sets import EDGE_ROWS, L, write_merged

NUMERIC = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(),
           pa.uint32(), pa.uint64(), pa.float32(), pa.float64()]


@pytest.mark.parametrize("type_", NUMERIC, ids=str)
@pytest.mark.parametrize("start, stop", [(0, 13), (3, 13), (5, 5), (1, 12)])
def test_values_equal_pyarrows_own_and_follow_a_slice(type_, start, stop):
    whole = pa.array(np.arange(13) * 3 % 17, type_)
    sliced = whole.slice(start, stop - start)
    got = arrays.values(sliced)
    assert got.dtype == sliced.to_numpy().dtype
    assert got.tolist() == sliced.to_numpy().tolist()
    assert arrays.array(got).equals(sliced)


@pytest.mark.parametrize("start, stop", [(0, 0), (0, 19), (3, 19), (9, 17), (1, 2)])
def test_booleans_unpacked_from_any_bit(start, stop):
    flags = [k % 3 == 0 or k % 5 == 1 for k in range(19)]
    sliced = pa.array(flags).slice(start, stop - start)
    got = arrays.values(sliced)
    assert got.dtype == np.bool_ and got.tolist() == flags[start:stop]
    assert arrays.array(got).equals(sliced)


@pytest.mark.parametrize("chunks", [[], [[1, 2]], [[1, 2], [], [3]]])
def test_chunked_arrays_give_their_values_in_order(chunks):
    got = arrays.values(pa.chunked_array([pa.array(c, pa.int32()) for c in chunks], pa.int32()))
    assert got.dtype == np.int32 and got.tolist() == [v for c in chunks for v in c]


def test_offsets_of_a_sliced_list_array_are_its_own():
    lists = pa.array([[1], [2, 3], [], [4, 5, 6]], pa.list_(pa.int32())).slice(1, 3)
    assert arrays.offsets(lists).tolist() == lists.offsets.to_numpy().tolist() == [1, 3, 3, 6]


def test_a_strided_vector_is_copied_not_misread():
    every_other = np.arange(10, dtype=np.int64)[::2]
    assert arrays.array(every_other).to_pylist() == [0, 2, 4, 6, 8]


def test_nulls_and_other_types_are_refused_not_misread():
    with pytest.raises(ValueError, match="1 nulls"):
        arrays.values(pa.array([1, None], pa.int32()))
    with pytest.raises(TypeError, match="not a numeric type"):
        arrays.values(pa.array(["a"]))
    with pytest.raises(TypeError, match="not a numeric type"):
        arrays.array(np.array(["a"]))


# The reason arrays.py exists: pyarrow's conversions import pandas on first use (about
# 0.25 s), a third of a small export. A new pa.array or to_numpy on export's path fails here.
_EXPORT = """
import json, sys
from stages import export
code = export.main(sys.argv[2:])
print(json.dumps({"rc": code, "pandas": "pandas" in sys.modules}), file=sys.stderr)
"""


@pytest.mark.parametrize("trainer, extra", [("trl", []), ("axolotl", []),
                                            ("specforge", ["--drop-refused"])])
def test_export_never_imports_pandas(tmp_path, trainer, extra):
    merged = write_merged(tmp_path / "merged", [EDGE_ROWS[:4], EDGE_ROWS[4:]])
    argv = ["--for", trainer, "--merged", str(merged), "--out", str(tmp_path / "out"),
            "--max-length", str(L), *extra]
    proc = subprocess.run([sys.executable, "-c", _EXPORT, "-", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    got = json.loads(proc.stderr.strip().splitlines()[-1])
    assert got == {"rc": 0, "pandas": False}, proc.stderr[-2000:]


def test_stages_convert_arrow_arrays_here_only():
    """No `.to_numpy(` on an Arrow array in stages/ (polars' Series have their own)."""
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "stages").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if ".to_numpy(" in line and "get_column(" not in line
             and path.name != "arrays.py"]
    assert not found, found


@pytest.mark.parametrize("texts", [[], ["a"], ["row-1", "", "é€😀", "x" * 300]])
def test_strings_equal_pyarrows_own(texts):
    got = arrays.strings(texts)
    assert got.equals(pa.array(texts, pa.string())) and got.to_pylist() == texts


def test_a_lone_surrogate_is_refused_as_pyarrow_refuses_it():
    with pytest.raises(UnicodeEncodeError):
        arrays.strings(["ok", "\ud800"])


_TOKENIZE = """
import json, os, sys


class Spy:  # forked workers inherit it: any process of the stage that imports pandas
    def find_spec(self, name, path=None, target=None):
        if name == "pandas":
            with open(sys.argv[4], "a") as f:
                f.write(f"{os.getpid()}\\n")


sys.meta_path.insert(0, Spy())
from stages.tokenize import tokenize_file
report = tokenize_file(sys.argv[1], sys.argv[2], num_proc=int(sys.argv[3]))
print(json.dumps({"rows": report["rows"]}), file=sys.stderr)
"""


@pytest.mark.parametrize("num_proc", [1, 2])
def test_tokenize_never_imports_pandas(tmp_path, num_proc):
    """Its workers are forked fresh at every run: pyarrow's pandas bridge would cost each
    of them the import (about 0.3 s of CPU a worker, a run of a thousand rows)."""
    src = tmp_path / "completions.jsonl"
    rows = [{"id": f"r{i}", "source": "s", "messages": [
        {"role": "user", "content": f"question {i}"},
        {"role": "assistant", "content": f"an answer of some words, number {i}"}]}
        for i in range(6)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    imports = tmp_path / "imports"
    proc = subprocess.run([sys.executable, "-c", _TOKENIZE, str(src), str(tmp_path / "out"),
                           str(num_proc), str(imports)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert json.loads(proc.stderr.strip().splitlines()[-1]) == {"rows": 6}, proc.stderr[-2000:]
    assert not imports.exists(), f"pandas imported by processes {imports.read_text().split()}"
