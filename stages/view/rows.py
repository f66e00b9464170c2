"""Rows of any dataset folder this project writes, or of a trainer export, read as that
trainer reads them, and chosen by id, row number, source, seeded sample or length.

`Dataset(folder)` opens data/tokenized or data/merged (the row contract), a TRL export
(`assistant_masks`), an axolotl export (`labels`: supervised where not -100) or a
SpecForge export (`train.jsonl`: `loss_mask`). Finding rows reads only the buffers of
the columns it needs (ids, sources, list offsets), shard by shard; token columns are
read only for the record batches of the rows chosen.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from stages.common.errors import StageError
from stages.common.reading import json_file, open_regular
from stages.dataset import arrays, fingerprint, ipcstream
from stages.dataset.loader import IGNORE
from stages.dataset.shards import list_shards, open_columns, require_columns
from stages.trainers import REPORT as EXPORT_REPORT
from stages.trainers.specforge import JSONL

LINEAGE = "lineage.json"
MAX_LINE = 1 << 30  # a JSONL row past this is not one a trainer reads


@dataclasses.dataclass
class Row:
    number: int  # in dataset order, from 0
    id: Optional[str]
    source: Optional[str]
    input_ids: np.ndarray
    supervised: np.ndarray  # bool per token, as the trainer takes it
    shard: str
    notes: list[str] = dataclasses.field(default_factory=list)


class Dataset:
    """A dataset folder or export, its kind, fingerprint and lineage."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise StageError(f"{self.folder}: not a folder")
        report = self._json(EXPORT_REPORT)
        self.trainer = report.get("for") if isinstance(report.get("for"), str) else None
        self.fingerprint = (report.get("fingerprint") if self.trainer
                            else self._json(fingerprint.FILE)) or {}
        self.lineage = self._json(LINEAGE)
        if (self.folder / JSONL).is_file():
            self.kind, self.shards, self.columns = "specforge", [self.folder / JSONL], None
            return
        self.shards = list_shards(self.folder)
        if not self.shards:
            raise StageError(f"{self.folder}: no shards")
        with open_columns(self.shards[0]) as stream:
            schema = stream.schema
        names = set(schema.names)
        for kind, need, mask in (("merged", {"id", "source", "input_ids", "loss_mask"}, "loss_mask"),
                                 ("trl", {"id", "input_ids", "assistant_masks"}, "assistant_masks"),
                                 ("axolotl", {"input_ids", "labels"}, "labels")):
            if need <= names:
                self.kind, self.mask = kind, mask
                break
        else:
            raise StageError(f"{self.shards[0]}: columns {sorted(names)} are neither the row "
                             "contract nor a TRL, axolotl or SpecForge export")
        self.has_id, self.has_source = "id" in names, "source" in names
        self.read = [n for n in ("id", "source", "input_ids", mask) if n in names]
        self.types = {n: schema.field(n).type for n in self.read if schema.names.count(n) == 1}
        self._check(self.shards[0], schema)

    def _check(self, path: Path, schema: pa.Schema) -> None:
        """StageError naming the shard unless it holds the columns a row is read from, as
        the contract types them (a merged set) or as the first shard does (an export,
        its lists of integers). Asked of every shard: its schema is its own, and a
        damaged byte can rename a column or change its width."""
        if self.kind == "merged":
            return require_columns(path, schema, self.read)
        got = {f.name: f.type for f in schema}
        for name in self.read:
            want = self.types.get(name)
            if want is None or got.get(name) != want or schema.names.count(name) > 1 \
                    or not _readable(name, want):
                raise StageError(f"{path}: column {name} is {got.get(name, 'missing')}, "
                                 f"expected {want or 'one column'} as in {self.shards[0].name}")

    def _json(self, name: str) -> dict:
        path = self.folder / name
        if not path.exists():
            return {}
        doc = json_file(path)
        return doc if isinstance(doc, dict) else {}

    def describe(self) -> str:
        what = {"merged": "rows (input_ids, loss_mask)", "trl": "TRL export (assistant_masks)",
                "axolotl": "axolotl export (labels != -100)",
                "specforge": "SpecForge export (train.jsonl loss_mask)"}[self.kind]
        return f"{self.folder}: {what}"

    # ------------------------------------------------------------ scanning

    def scan(self, columns: tuple[str, ...]) -> Iterator[tuple[int, Path, int, dict]]:
        """(first row number, shard, batch index, {column: values}) per record batch,
        reading only `columns` ("id", "source", "length")."""
        if self.kind == "specforge":
            yield from self._scan_jsonl(columns)
            return
        first = 0
        for path in self.shards:
            wanted = [c for c in ("id", "source") if c in columns and self._has(c)]
            with open_columns(path) as stream:
                self._check(path, stream.schema)
                for k, batch in enumerate(stream):
                    out = {c: batch.column(c) for c in wanted}
                    out["rows"] = batch.num_rows
                    if "length" in columns:
                        out["length"] = batch.lengths("input_ids")
                    yield first, path, k, out
                    first += batch.num_rows

    def _has(self, column: str) -> bool:
        return self.has_id if column == "id" else self.has_source

    def _scan_jsonl(self, columns) -> Iterator[tuple[int, Path, int, dict]]:
        path = self.shards[0]
        for number, line in enumerate(self._lines()):
            out = {"rows": 1, "line": line}
            if "id" in columns or "length" in columns:
                doc = _jsonl_row(line, path, number)
                out["id"] = pa.array([doc.get("id") if isinstance(doc.get("id"), str) else None])
                out["length"] = np.array([len(doc.get("input_ids") or [])])
            yield number, path, number, out

    def _lines(self) -> Iterator[bytes]:
        with open_regular(self.shards[0]) as f:
            for line in iter(lambda: f.readline(MAX_LINE), b""):
                if len(line) >= MAX_LINE:
                    raise StageError(f"{self.shards[0]}: a line longer than {MAX_LINE} bytes")
                if line.strip():
                    yield line

    # ------------------------------------------------------------ choosing

    def by_ids(self, ids: list[str]) -> list[Row]:
        """The rows with these ids, in the order asked (StageError naming any not found).
        Reads each shard's id column only."""
        if self.kind in ("axolotl",):
            raise StageError(f"{self.folder}: an axolotl export has no id column; "
                             "choose rows with --row N")
        wanted = set(ids)
        found: dict[str, tuple[int, Path, int, int]] = {}
        if self.kind == "specforge":
            keys = {orjson.dumps(i): i for i in wanted}
            path = self.shards[0]
            for number, line in enumerate(self._lines()):
                for key, i in keys.items():
                    if key in line and i not in found:
                        doc = _jsonl_row(line, path, number)
                        if doc.get("id") == i:
                            found[i] = self._jsonl(number, doc, path)
                if len(found) == len(wanted):
                    break
            missing = [i for i in ids if i not in found]
            if missing:
                raise StageError(f"{self.folder}: no row with id {missing[0]!r}")
            return [found[i] for i in ids]
        else:
            for first, path, k, cols in self.scan(("id",)):
                column = cols["id"]
                hits = pc.is_in(column, value_set=pa.array(sorted(wanted), column.type))
                for j in np.flatnonzero(arrays.values(hits.fill_null(False))).tolist():
                    i = column[j].as_py()
                    found.setdefault(i, (first + j, path, k, j))
                if len(found) == len(wanted):
                    break
        missing = [i for i in ids if i not in found]
        if missing:
            raise StageError(f"{self.folder}: no row with id {missing[0]!r}")
        return [self._fetch(*found[i]) for i in ids]

    def by_numbers(self, numbers: list[int]) -> list[Row]:
        """The rows at these row numbers (dataset order, from 0)."""
        where, pending = {}, set(numbers)
        for first, path, k, cols in self.scan(()):
            n = cols["rows"]
            for m in [m for m in pending if first <= m < first + n]:
                where[m] = (self._jsonl(m, _jsonl_row(cols["line"], path, m), path)
                            if self.kind == "specforge" else self._fetch(m, path, k, m - first))
                pending.discard(m)
            if not pending:
                break
        if pending:
            raise StageError(f"{self.folder}: no row number {min(pending)} "
                             f"(rows are numbered from 0)")
        return [where[m] for m in numbers]

    def chosen(self, *, source: Optional[str] = None, sample: int = 0, seed: int = 0,
               longest: int = 0, shortest: int = 0, first: int = 0) -> list[Row]:
        """Rows by source, a seeded sample, the longest/shortest (ties: first in order)."""
        cols = ("length",) + (("source",) if source is not None else ())
        numbers, lengths = [], []
        for start, path, k, got in self.scan(cols):
            length = got["length"]
            keep = np.ones(len(length), bool)
            if source is not None:
                if self.kind != "merged":
                    raise StageError(f"{self.folder}: an export has no source column")
                keep = arrays.values(pc.equal(got["source"], source).fill_null(False))
            idx = np.flatnonzero(keep)
            numbers.append(idx + start)
            lengths.append(length[idx])
        numbers = np.concatenate(numbers) if numbers else np.zeros(0, np.int64)
        lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        if not len(numbers):
            raise StageError(f"{self.folder}: no rows" + (f" of source {source!r}" if source
                                                          is not None else ""))
        picked: list[int] = []
        if sample:
            rng = np.random.default_rng(seed)
            picked += sorted(rng.choice(numbers, min(sample, len(numbers)), replace=False).tolist())
        order = np.argsort(-lengths, kind="stable")
        picked += numbers[order[:longest]].tolist()
        picked += numbers[np.argsort(lengths, kind="stable")[:shortest]].tolist()
        picked += numbers[:first].tolist()
        picked = list(dict.fromkeys(int(n) for n in picked))
        return self.by_numbers(picked)

    def per_source(self, sample: int, seed: int, longest: int) -> list[Row]:
        """`sample` seeded rows and the `longest` longest of every source (sources in
        name order), in one pass over the source and length columns."""
        if not self.has_source:
            return self.chosen(sample=sample, seed=seed, longest=longest)
        numbers: dict[str, list] = {}
        lengths: dict[str, list] = {}
        for start, _path, _k, got in self.scan(("source", "length")):
            column = got["source"]
            for name in pc.unique(column).to_pylist():
                hit = (pc.is_null(column) if name is None else pc.equal(column, name))
                idx = np.flatnonzero(arrays.values(hit.fill_null(False)))
                numbers.setdefault(name, []).append(idx + start)
                lengths.setdefault(name, []).append(got["length"][idx])
        picked: list[int] = []
        for name in sorted(numbers, key=lambda n: (n is None, n or "")):
            nums, lens = np.concatenate(numbers[name]), np.concatenate(lengths[name])
            rng = np.random.default_rng(seed)
            picked += sorted(rng.choice(nums, min(sample, len(nums)), replace=False).tolist())
            picked += nums[np.argsort(-lens, kind="stable")[:longest]].tolist()
        return self.by_numbers(list(dict.fromkeys(int(n) for n in picked)))

    # ------------------------------------------------------------ one row

    def _fetch(self, number: int, path: Path, batch_index: int, j: int) -> Row:
        with open_columns(path) as stream:  # batches before it are skipped unread
            self._check(path, stream.schema)
            for k, batch in enumerate(stream):
                if k == batch_index:
                    return self._arrow(number, batch.read(checked=False), j, path)
        raise StageError(f"{path}: record batch {batch_index} is gone")

    def _arrow(self, number: int, batch: pa.RecordBatch, j: int, path: Path) -> Row:
        """Row `j` of `batch`, its bytes checked: the strings in full, the row's lists'
        bounds against their values (the other rows' lists unchecked)."""
        row = _row_values(batch, j, path, self.read)
        for name in ("input_ids", self.mask):
            if row[name].null_count:  # no token: named here, with its row
                where = f" ({row['id']!r})" if row.get("id") is not None else ""
                raise StageError(f"{path}: row {number}{where}: {name} holds a null value "
                                 "(run validate)")
        ids = arrays.values(row["input_ids"]).astype(np.int64)
        values = arrays.values(row[self.mask]).astype(np.int64)
        notes = []
        if len(values) != len(ids):
            notes.append(f"{self.mask} has {len(values)} values for {len(ids)} tokens")
            values = np.resize(values, len(ids)) if len(values) else np.zeros(len(ids), np.int64)
        if self.kind == "axolotl":
            supervised = values != IGNORE
            wrong = supervised & (values != ids)
            if wrong.any():
                notes.append(f"{int(wrong.sum())} labels differ from input_ids (first at "
                             f"position {int(np.flatnonzero(wrong)[0])})")
        else:
            supervised = values == 1
            if ((values != 0) & (values != 1)).any():
                notes.append(f"{self.mask} holds values other than 0 and 1")
        return Row(number, row.get("id"), row.get("source"), ids, supervised, path.name, notes)

    def _jsonl(self, number: int, doc: dict, path: Path) -> Row:
        ids = np.asarray(doc.get("input_ids") or [], np.int64)
        mask = np.asarray(doc.get("loss_mask") or [], np.int64)
        notes = []
        if len(mask) != len(ids):
            notes.append(f"loss_mask has {len(mask)} values for {len(ids)} tokens")
            mask = np.resize(mask, len(ids)) if len(mask) else np.zeros(len(ids), np.int64)
        rid = doc.get("id") if isinstance(doc.get("id"), str) else None
        return Row(number, rid, None, ids, mask == 1, path.name, notes)


def _readable(name: str, type_: pa.DataType) -> bool:
    """Whether a column of `type_` is one a row is read from: strings for id and
    source, lists of integers for the tokens and the mask."""
    t = pa.types
    if name in ("id", "source"):
        return t.is_string(type_) or t.is_large_string(type_)
    return (t.is_list(type_) or t.is_large_list(type_)) and t.is_integer(type_.value_type)


def _row_values(batch: pa.RecordBatch, j: int, path: Path, names: list[str]) -> dict:
    """Row `j`'s values of columns `names`, its bytes checked: the strings in full, the
    row's lists and the buffers under them (the other rows' lists unchecked)."""
    row = {}
    try:
        for name in names:
            column = batch.column(name)
            if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
                row[name] = _list_row(column, j)
            else:
                column.validate(full=True)
                row[name] = column[j].as_py()
    except ipcstream.BAD_BYTES as e:
        raise StageError(f"{path}: damaged record batch ({e})") from None
    return row


def _list_row(column: pa.Array, j: int) -> pa.Array:
    """Row `j` of a list column (empty when null), its offsets and the buffers they
    point into checked; pyarrow's error when they do not hold."""
    one = column.slice(j, 1)
    one.validate(full=True)  # this row's two offsets, and the child's length and buffers
    return one.flatten()


def _jsonl_row(line: bytes, path: Path, number: int) -> dict:
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise StageError(f"{path}:{number + 1}: not a JSON line ({e})") from None
    if not isinstance(doc, dict):
        raise StageError(f"{path}:{number + 1}: not a JSON object")
    return doc
