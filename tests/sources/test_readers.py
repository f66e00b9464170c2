"""Readers (JSON lines/arrays, Parquet, Arrow, save_to_disk, folders, Hub ids), on sound,
damaged and hostile files."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.common import params
from stages.common.errors import StageError
from stages.sources import readers
from tests.helpers import stagecli
from tests.helpers.repo import ROOT
from tests.helpers.sources import src


def rows_of(source: params.Source, columns=("q",), check=None, **kw) -> list:
    reader = readers.Reader(source, list(columns), check or (lambda names, where: None), **kw)
    return [(pos, readers.parse_line(item) if type(item) is bytes else item) for pos, item in reader]


def test_jsonl_lines_positions_blank_lines_and_bom(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"q": "one"}\n\n   \n{"q": "two"}\n{"q": NaN}\n{"q": 1e999}')
    got = rows_of(src(path))
    assert [(p, r) for p, r in got if r is not None][:2] == [(1, {"q": "one"}), (4, {"q": "two"})]
    assert [p for p, r in got if r is None] == [2, 3]  # blank lines are not rows
    assert got[-2][1]["q"] != got[-2][1]["q"]  # NaN, via the stdlib fallback
    assert got[-1][1]["q"] == float("inf")


def test_gzip_jsonl(tmp_path):
    path = tmp_path / "a.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write('{"q": "x"}\n{"q": "y"}\n')
    assert [r["q"] for _, r in rows_of(src(path))] == ["x", "y"]


def test_parse_line_bad_rows():
    bad = readers.parse_line(b'{"q": "x",}\n')
    assert isinstance(bad, readers.BadRow) and bad.reason == "malformed_json"
    assert bad.message.startswith("malformed JSON (")
    arr = readers.parse_line(b"[1, 2]\n")
    assert arr.reason == "not_an_object" and "an array" in arr.message
    assert readers.parse_line(b"  \n") is None


def test_json_array_streams_elements_with_line_numbers(tmp_path):
    path = tmp_path / "a.json"
    data = [{"q": f"question {i}", "n": i} for i in range(5)]
    path.write_text(json.dumps(data, indent=2))
    got = rows_of(src(path))
    assert [r for _, r in got] == data
    lines = path.read_text().splitlines()
    for pos, row in got:  # each position is the line where the element starts
        assert lines[pos - 1].strip() == "{" and f'"question {row["n"]}"' in lines[pos]


def test_json_array_element_larger_than_a_read(tmp_path):
    path = tmp_path / "big.json"
    big = "x" * (3 << 20)
    path.write_text(json.dumps([{"q": "a"}, {"q": big}, {"q": "c"}]))
    assert [len(r["q"]) for _, r in rows_of(src(path))] == [1, len(big), 1]


def test_json_array_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"q": "a"},\n  {"q": "b" "c"},\n  {"q": "d"}\n]\n')
    with pytest.raises(StageError, match=r"bad\.json:3: malformed JSON \(Expecting ','"):
        rows_of(src(path))
    path.write_text('[{"q": "a"}]\n[{"q": "b"}]\n')
    with pytest.raises(StageError, match=r"bad\.json:2: malformed JSON \(data after"):
        rows_of(src(path))


def test_parquet_reads_only_needed_columns_and_checks_schema(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"q": ["a", "b", None], "other": [1, 2, 3]}), path, row_group_size=2)
    assert rows_of(src(path)) == [(0, {"q": "a"}), (1, {"q": "b"}), (2, {"q": None})]
    seen = []
    rows_of(src(path), check=lambda names, where: seen.append((names, where)))
    assert seen == [(["q", "other"], str(path))]


def test_arrow_stream_file(tmp_path):
    path = tmp_path / "data.arrow"
    table = pa.table({"q": ["a", "b"]})
    with pa.ipc.new_stream(path, table.schema) as w:
        w.write_table(table)
    assert [r["q"] for _, r in rows_of(src(path))] == ["a", "b"]
    with pa.ipc.new_file(tmp_path / "file.arrow", table.schema) as w:  # the random-access format
        w.write_table(table)
    assert [r["q"] for _, r in rows_of(src(tmp_path / "file.arrow"))] == ["a", "b"]



def _not_utf8() -> pa.Array:
    """Two strings, the second's bytes not UTF-8 (a writer that did not check)."""
    return pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(
        np.array([0, 2, 5], np.int32).tobytes()), pa.py_buffer(b"hi\xff\xfe\xfd")])


def _offsets_past_the_data(path: Path) -> None:
    """An Arrow stream whose string column's last offset points far past its bytes."""
    table = pa.table({"q": ["hi", "abc"]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    data = bytearray(sink.getvalue().to_pybytes())
    at = data.find(np.array([0, 2, 5], np.int32).tobytes())
    data[at + 8:at + 12] = np.array([0x7FFFFF00], np.int32).tobytes()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["offsets", "utf8-arrow", "utf8-parquet"])
def test_damaged_arrow_data_is_one_line_naming_file_and_rows_never_a_crash(tmp_path, damage):
    """Offsets past the data crashed the conversion to Python (SIGSEGV); bytes that are not
    UTF-8 ended it in a traceback. Either is a damaged file: one line, in a process of its
    own here so that a crash is a failure and not the end of the run."""
    path = tmp_path / ("data.parquet" if damage == "utf8-parquet" else "data.arrow")
    if damage == "offsets":
        _offsets_past_the_data(path)
    elif damage == "utf8-arrow":
        with pa.ipc.new_stream(path, pa.schema([("q", pa.string())])) as w:
            w.write_table(pa.table({"q": _not_utf8()}))
    else:
        pq.write_table(pa.table({"q": _not_utf8()}), path)
    (tmp_path / "params.yaml").write_text(
        f"prepare:\n  sources:\n    - {{name: s, path: {path.name}, format: columns, "
        "prompt_field: q}\n")
    line, _ = stagecli.fail("prepare", tmp_path)
    assert re.fullmatch(rf"error: {path.name}: rows 0-1: damaged Arrow data \(.+\)", line), line
    assert not (tmp_path / "data/prompts").exists()


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"q": ["a", "b", "c"]})
    ds.save_to_disk(tmp_path / "one", max_shard_size="1KB")
    assert [r["q"] for _, r in rows_of(src(tmp_path / "one"))] == ["a", "b", "c"]
    dd = datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_dict({"q": ["t"]})})
    dd.save_to_disk(tmp_path / "dict")
    assert [r["q"] for _, r in rows_of(src(tmp_path / "dict"))] == ["a", "b", "c"]
    assert [r["q"] for _, r in rows_of(src(tmp_path / "dict", split="test"))] == ["t"]
    with pytest.raises(StageError, match=r"split 'dev' not in .*\(splits: train, test\)"):
        rows_of(src(tmp_path / "dict", split="dev"))


def test_folder_of_files_with_subset_and_split(tmp_path):
    root = tmp_path / "repo"
    (root / "0625").mkdir(parents=True)
    (root / "0625" / "train-00000-of-00002.jsonl").write_text('{"q": "a"}\n')
    (root / "0625" / "train-00001-of-00002.jsonl").write_text('{"q": "b"}\n')
    (root / "0625" / "test-00000-of-00001.jsonl").write_text('{"q": "t"}\n')
    (root / "0625" / "README.md").write_text("not data")
    got = rows_of(src(root, subset="0625", split="train"))
    assert [r["q"] for _, r in got] == ["a", "b"]
    assert len(rows_of(src(root, subset="0625"))) == 3
    with pytest.raises(StageError, match="no .jsonl/.json/.parquet/.arrow files for split 'dev'"):
        rows_of(src(root, subset="0625", split="dev"))
    with pytest.raises(StageError, match="subset folder .*3M not found"):
        rows_of(src(root, subset="3M"))


def test_path_errors(tmp_path):
    with pytest.raises(StageError, match=r"source s: path 'nope/x.jsonl' not found"):
        rows_of(src("nope/x.jsonl"))
    (tmp_path / "a.jsonl").write_text('{"q": "a"}\n')
    with pytest.raises(StageError, match="subset applies to folders and Hugging Face datasets"):
        rows_of(src(tmp_path / "a.jsonl", subset="x"))
    (tmp_path / "a.csv").write_text("q\na\n")
    with pytest.raises(StageError, match="cannot tell the format"):
        rows_of(src(tmp_path / "a.csv"))
    (tmp_path / "a.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(StageError, match=r"a\.parquet: cannot read Parquet \("):
        rows_of(src(tmp_path / "a.parquet"))
    with pytest.raises(StageError, match="revision applies to Hugging Face datasets"):
        rows_of(src(tmp_path / "a.jsonl", revision="main"))


def test_hub_id_offline_fails_with_one_line(tmp_path):
    code = (
        "from stages.common.errors import StageError\n"
        "from stages.common.params import Source\n"
        "from stages.sources import readers\n"
        "s = Source(name='hub', path='nobody-here/no-such-dataset', format='columns', prompt_field='q')\n"
        "try:\n"
        "    list(readers.Reader(s, ['q'], lambda n, w: None))\n"
        "except StageError as e:\n"
        "    print('ERR', e)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout.strip()
    assert out.startswith("ERR source hub: cannot load Hugging Face dataset nobody-here/no-such-dataset"), (
        out, proc.stderr[-2000:])
    assert "HF_HUB_OFFLINE" in out and "\n" not in out


# ------------------------------------------------------------------ damaged and hostile files

ROWS = b"".join(b'{"q": "row %d"}\n' % i for i in range(20000))
PACK = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}


def damaged_files(folder: Path) -> dict[str, bytes]:
    """name -> bytes of every kind of damaged compressed source."""
    files = {"plain.jsonl.gz": ROWS,  # not gzip at all
             "array.json.gz": gzip.compress(b"[" + ROWS.replace(b"\n", b",") + b"{}]")[:-4000]}
    for ext, pack in PACK.items():
        whole = pack(ROWS)
        files[f"truncated.jsonl{ext}"] = whole[: len(whole) // 2]
        mid = len(whole) // 2
        files[f"corrupt.jsonl{ext}"] = whole[:mid] + b"\0" * 64 + whole[mid + 64:]
    return files


@pytest.mark.parametrize("name", list(damaged_files(Path())))
def test_a_damaged_compressed_file_is_one_error_naming_it(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(damaged_files(tmp_path)[name])
    with pytest.raises(StageError) as e:
        rows_of(src(path))
    text = str(e.value)
    assert text.startswith(f"{path}:") and "cannot read (" in text and "\n" not in text
    if name.startswith("truncated"):
        assert "ends early" in text


def bomb(path: Path, megabytes: int) -> Path:
    """A .gz of one `megabytes`-long line without a newline: a few hundred KiB on disk."""
    pack = zlib.compressobj(1, zlib.DEFLATED, 31)  # 31: the gzip container
    block = b"x" * (1 << 20)
    with open(path, "wb") as f:
        f.write(pack.compress(b'{"q": "'))
        for _ in range(megabytes):
            f.write(pack.compress(block))
        f.write(pack.flush())
    return path


def test_one_endless_line_stops_at_max_record_bytes(tmp_path):
    path = bomb(tmp_path / "bomb.jsonl.gz", 8)
    with pytest.raises(StageError, match=rf"^{path}:1: a line longer than "
                                         r"prepare.max_record_bytes \(1048576 bytes\)"):
        rows_of(src(path), max_record_bytes=1 << 20)
    long_line = tmp_path / "long.jsonl"
    long_line.write_bytes(b'{"q": "a"}\n' * 3 + b'{"q": "' + b"y" * (3 << 20) + b'"}\n{"q": "b"}\n')
    with pytest.raises(StageError, match=rf"^{long_line}:4: a line longer"):
        rows_of(src(long_line), max_record_bytes=1 << 20)
    assert len(rows_of(src(long_line), max_record_bytes=4 << 20)) == 5  # under the cap: read
    array = tmp_path / "long.json"
    array.write_bytes(b'[{"q": "a"},\n{"q": "' + b"y" * (3 << 20) + b'"}]')
    with pytest.raises(StageError, match=rf"^{array}:2: a JSON array element longer"):
        rows_of(src(array), max_record_bytes=1 << 20)


def test_lines_split_across_reads_are_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "_LINES_BYTES", 7)  # every line spans several reads
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"q": "one"}\n\n{"q": "two"}\r\n{"q": "three"}')
    got = [(p, r) for p, r in rows_of(src(path)) if r is not None]
    assert got == [(1, {"q": "one"}), (3, {"q": "two"}), (4, {"q": "three"})]


def test_a_decompression_bomb_stops_early_with_flat_memory(tmp_path):
    """prepare on a 256 MiB one-line .gz stops at max_record_bytes, and its peak RSS is
    that of a run on a tiny file plus about the cap, not the line's size."""
    (tmp_path / "small").mkdir()
    (tmp_path / "small/a.jsonl").write_bytes(b'{"q": 5}\n')  # bad_value: no prompt, exit 1
    bomb(tmp_path / "bomb.jsonl.gz", 256)
    for name, path in (("small", "small/a.jsonl"), ("bomb", "bomb.jsonl.gz")):
        (tmp_path / f"{name}.yaml").write_text(
            f"prepare:\n  max_record_bytes: 4194304\n  num_proc: 1\n"
            f"  sources:\n    - {{name: s, path: {path}, format: columns, prompt_field: q}}\n")
    started = time.monotonic()
    line, bomb_kib = stagecli.fail("prepare", tmp_path, "bomb.yaml")
    seconds = time.monotonic() - started
    assert line == ("error: bomb.jsonl.gz:1: a line longer than prepare.max_record_bytes "
                    "(4194304 bytes); raise it if such records are real")
    assert not (tmp_path / "data/prompts").exists()
    _, small_kib = stagecli.fail("prepare", tmp_path, "small.yaml")
    print(f"peak RSS: tiny source {small_kib} KiB, 256 MiB bomb {bomb_kib} KiB; "
          f"bomb run {seconds:.1f}s")
    assert bomb_kib - small_kib < 32 * 1024  # a 4 MiB cap, never the 256 MiB line


def test_links_fifos_and_bad_dataset_dicts_are_one_line(tmp_path):
    (tmp_path / "loop.jsonl").symlink_to("loop.jsonl")
    with pytest.raises(StageError, match=r"path '.*loop.jsonl' is a link that leads nowhere"):
        rows_of(src(tmp_path / "loop.jsonl"))
    os.mkfifo(tmp_path / "fifo.jsonl")
    with pytest.raises(StageError, match=r"path '.*fifo.jsonl' is neither a file nor a folder"):
        rows_of(src(tmp_path / "fifo.jsonl"))
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd/dataset_dict.json").write_text('{"splits": "train"}')
    with pytest.raises(StageError, match=r"dd/dataset_dict.json: 'splits' must be a list of names"):
        rows_of(src(tmp_path / "dd"))
    (tmp_path / "dd/dataset_dict.json").write_text('{"splits": ["train"')
    with pytest.raises(StageError, match=r"dd/dataset_dict.json: not valid JSON"):
        rows_of(src(tmp_path / "dd"))
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved/state.json").write_text('{"_data_files": [{"filename": "../x.arrow"}]}')
    with pytest.raises(StageError, match=r"saved/state.json: lists '../x.arrow', which is not a file"):
        rows_of(src(tmp_path / "saved"))


def test_cli_damaged_source_is_one_line_and_writes_nothing(tmp_path):
    whole = gzip.compress(ROWS)
    (tmp_path / "a.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "params.yaml").write_text(
        "prepare:\n  sources:\n    - {name: s, path: a.jsonl.gz, format: columns, prompt_field: q}\n")
    line, _ = stagecli.fail("prepare", tmp_path)
    reached = re.fullmatch(r"error: a\.jsonl\.gz:(\d+): cannot read \(the compressed data ends "
                           r"early; is the file truncated\?\)", line)
    assert reached and 2000 < int(reached[1]) < 20000  # the line it was reading, mid-file
    assert not (tmp_path / "data/prompts").exists() and not (tmp_path / "reports").exists()


def test_a_one_row_parquet_bomb_is_refused_from_its_footer(tmp_path):
    path = tmp_path / "bomb.parquet"
    pq.write_table(pa.table({"q": ["x" * (8 << 20)], "other": [1]}), path, compression="zstd")
    assert path.stat().st_size < 100_000
    with pytest.raises(StageError, match=rf"^{path}: row group 0: column q holds \d+ bytes for 1 "
                                         r"rows, over prepare.max_record_bytes \(1048576 bytes\)"):
        rows_of(src(path), max_record_bytes=1 << 20)
    assert len(rows_of(src(path), max_record_bytes=16 << 20)) == 1


def test_a_run_length_encoded_parquet_bomb_is_refused_by_its_value_count(tmp_path):
    """Zeros in one row: dictionary and run-length encoding keep even the uncompressed
    page a few bytes; the footer's value count still says what decoding would fill."""
    path = tmp_path / "zeros.parquet"
    n = 1 << 20
    zeros = pa.ListArray.from_arrays(pa.array([0, n], pa.int32()), pa.array(np.zeros(n, np.int64)))
    pq.write_table(pa.table({"q": ["x"], "z": zeros}), path, compression="zstd")
    assert pq.ParquetFile(path).metadata.row_group(0).column(1).total_uncompressed_size < 4096
    with pytest.raises(StageError, match=rf"^{path}: row group 0: column z holds {8 * n} bytes "
                                         r"for 1 rows, over prepare.max_record_bytes \(1048576 "
                                         r"bytes\) a row"):
        rows_of(src(path), columns=("q", "z"), max_record_bytes=1 << 20)
