"""The shards of a merge: the base's and the new rows', each a `Shard` (its counts, and
which rows to drop). Scanned touching only ids and offsets (`scan_new`, `scan_base`),
their duplicate ids settled by merge.on_duplicate (`apply_duplicates`), then placed in
the output: hardlinked or copied byte for byte, or rewritten converted to the contract
or without the dropped rows (`place_all`). A base's columns are checked first
(`check_base_schema`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc

from stages.common.errors import StageError
from stages.dataset.schema import ARROW_SCHEMA, castable, schema_differences
from stages.dataset.shards import ShardFile, open_columns, open_shard, read_schema, shard_name

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Shard:
    path: Path
    rows: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    bytes: int = 0
    cast: bool = False  # columns differ from the contract: written converted
    adopted: bool = False  # written into the output by merge.adopt: already in place
    drop: Optional[pa.ChunkedArray] = None  # per-row "drop this row" (duplicates)
    ids: Optional[pa.ChunkedArray] = None  # kept for new shards only (small)

    @property
    def dropped(self) -> int:
        return 0 if self.drop is None else pc.sum(self.drop).as_py() or 0


def check_base_schema(path: Path, allow_cast: bool, new_dir: Path) -> bool:
    """True when the shard must be written converted; StageError when it cannot be."""
    schema = read_schema(path)
    diffs = schema_differences(schema)
    if not diffs:
        return False
    got = {f.name: f.type for f in schema}
    fixable = set(got) == set(ARROW_SCHEMA.names) and all(
        castable(got[f.name], f.type) for f in ARROW_SCHEMA
    )
    detail = "; ".join(d.replace("expected", f"{new_dir} has") for d in diffs)
    if not allow_cast:
        hint = " (set merge.allow_cast: true to write converted copies)" if fixable else ""
        raise StageError(f"base shard {path}: {detail}{hint}")
    if not fixable:
        raise StageError(
            f"base shard {path}: {detail}; not castable (merge.allow_cast converts only "
            "integer widths, list/large_list and string/large_string)"
        )
    log.warning("base shard %s will be written converted: %s", path.name, detail)
    return True


# ------------------------------------------------------------------------- scans


def _scan(shard: Shard) -> pa.ChunkedArray:
    """Count rows and tokens and return the id column, reading only the ids, the
    token offsets and the loss counts (a base's token buffers stay unread)."""
    ids = []
    shard.rows = shard.tokens = shard.loss_tokens = 0
    try:
        with open_columns(shard.path) as stream:
            for batch in (b for b in stream if b.num_rows):
                ids.append(batch.column("id"))
                shard.rows += batch.num_rows
                shard.tokens += int(batch.lengths("input_ids").sum())
                shard.loss_tokens += pc.sum(batch.column("num_loss_tokens")).as_py() or 0
    except OSError as e:
        raise StageError(f"{shard.path}: unreadable shard ({e.strerror or e})") from None
    shard.bytes = shard.path.stat().st_size
    return _strings(ids)


def _strings(chunks: list) -> pa.ChunkedArray:
    # a base that needs a cast may hold large_string ids: compare everything as string
    return pa.chunked_array(
        [c if c.type == pa.string() else c.cast(pa.string()) for c in chunks], pa.string()
    )


def scan_new(new: list[Shard], new_dir: Path) -> pa.Array:
    ids = []
    for shard in new:
        shard_ids = shard.ids = _scan(shard)
        nulls = shard_ids.null_count
        if nulls:
            raise StageError(f"{shard.path}: {nulls} rows have a null id")
        ids.extend(shard_ids.chunks)
    all_ids = pa.chunked_array(ids, type=pa.string())
    unique = pc.unique(all_ids)
    if len(unique) != len(all_ids):
        counts = pc.value_counts(all_ids)
        repeated = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")
        raise StageError(
            f"{new_dir}: {len(repeated)} ids occur more than once, e.g. {repeated[0].as_py()!r}"
        )
    log.info("new: %d rows in %d shards", len(all_ids), len(new))
    return unique


def scan_base(base: list[Shard], new_ids: pa.Array) -> pa.Array:
    """Scan base shards (ids column only); mark rows whose id is also new."""
    found = []
    for i, shard in enumerate(base, 1):
        ids = _scan(shard)
        hit = pc.fill_null(pc.is_in(ids, value_set=new_ids), False)
        if pc.any(hit).as_py():
            shard.drop = hit
            found.append(ids.filter(hit))
        log.info("base %d/%d %s: %d rows", i, len(base), shard.path.name, shard.rows)
    if not found:
        return pa.array([], pa.string())
    return pc.unique(pa.chunked_array([c for f in found for c in f.chunks]))


def apply_duplicates(policy: str, dup_ids: pa.Array, base: list[Shard], new: list[Shard],
                  new_dir: Path) -> dict:
    base_rows = sum(s.dropped for s in base)
    counts = {"policy": policy, "ids": len(dup_ids), "base_rows": base_rows,
              "new_rows": 0, "dropped_base_rows": 0, "dropped_new_rows": 0}
    for shard in new:
        if len(dup_ids):
            hit = pc.fill_null(pc.is_in(shard.ids, value_set=dup_ids), False)
            if pc.any(hit).as_py():
                shard.drop = hit
    counts["new_rows"] = sum(s.dropped for s in new)
    if not len(dup_ids):
        for shard in base + new:
            shard.drop = None
        return counts
    examples = ", ".join(repr(v) for v in dup_ids[:3].to_pylist())
    if policy == "error":
        raise StageError(
            f"merge: {len(dup_ids)} ids are in both the base and {new_dir} (e.g. {examples}); "
            "merge.on_duplicate is 'error'"
        )
    keep, drop = (new, base) if policy == "keep-new" else (base, new)
    for shard in keep:
        shard.drop = None
    counts["dropped_base_rows" if policy == "keep-new" else "dropped_new_rows"] = sum(
        s.dropped for s in drop
    )
    log.warning("%d ids in both base and new (e.g. %s): %s", len(dup_ids), examples, policy)
    return counts


# ------------------------------------------------------------------------ output


def place_all(tmp: Path, base: list[Shard], new: list[Shard], link: bool):
    """Place every shard into `tmp`; returns [(file name, action, Shard as written)]."""
    placed = []
    names = [shard.path.name for shard in base]
    if len(set(names)) != len(names):
        raise StageError("merge.base: two base shards share a file name; rename one")
    for shard in base:
        if shard.adopted and shard.drop is None:
            placed.append((shard.path.name, "base_adopted", shard))
        elif shard.cast or shard.drop is not None:
            # an adopted shard is already in `tmp`: filtered beside it, then put in its place
            dst = tmp / (f".{shard.path.name}.filtered" if shard.adopted else shard.path.name)
            out = _rewrite(shard, dst)
            if shard.adopted and out.rows:
                out.path = dst.replace(tmp / shard.path.name)
            elif shard.adopted:
                shard.path.unlink()
            action = "base_cast" if shard.cast else "base_filtered"
            # a shard left with no rows is not written; listed without a file name
            placed.append((shard.path.name if out.rows else None,
                           action if out.rows else "base_emptied", out))
        else:
            action = _place(shard.path, tmp / shard.path.name, link)
            placed.append((shard.path.name, f"base_{action}", shard))
    kept = [s for s in new if s.rows - s.dropped > 0]
    taken = {name for name, _, _ in placed if name is not None}
    index = len(taken)
    total = len(taken) + len(kept)
    for shard in kept:
        name = shard_name(index, total)
        while name in taken:  # a base that already uses this name
            index += 1
            name = shard_name(index, total)
        taken.add(name)
        index += 1
        if shard.drop is not None:
            placed.append((name, "new_filtered", _rewrite(shard, tmp / name)))
        else:
            placed.append((name, f"new_{_place(shard.path, tmp / name, link)}", shard))
    return placed


def _place(src: Path, dst: Path, link: bool) -> str:
    """Hardlink `src` as `dst` (same bytes, no copy), or copy it when linking fails."""
    if link:
        try:
            # link() would link a symlink itself (DVC's symlink cache): link its target
            os.link(src.resolve(), dst)
            return "linked"
        except OSError as e:
            log.info("cannot hardlink %s (%s): copying", src, e.strerror or e)
    shutil.copyfile(src, dst)
    return "copied"


def _rewrite(shard: Shard, dst: Path) -> Shard:
    """Write `shard` converted to the contract and/or without its dropped rows."""
    out = Shard(dst)
    offset = 0
    try:
        with open_shard(shard.path) as reader, ShardFile(dst) as writer:
            for batch in reader:
                n = batch.num_rows
                if shard.cast:
                    batch = _convert(batch, shard.path)
                if shard.drop is not None:
                    batch = batch.filter(
                        pc.invert(shard.drop.slice(offset, n)).combine_chunks()
                    )
                offset += n
                if batch.num_rows:
                    writer.write(batch)
                    out.rows += batch.num_rows
                    ids = batch.column("input_ids")
                    out.tokens += ids.offsets[-1].as_py() - ids.offsets[0].as_py()
                    out.loss_tokens += pc.sum(batch.column("num_loss_tokens")).as_py() or 0
    except (pa.ArrowInvalid, OSError) as e:
        raise StageError(f"{shard.path}: cannot rewrite shard ({e})") from None
    if out.rows == 0:
        dst.unlink()
    else:
        out.bytes = dst.stat().st_size
    log.info("wrote %s from %s: %d rows", dst.name, shard.path, out.rows)
    return out


def _convert(batch: pa.RecordBatch, path: Path) -> pa.RecordBatch:
    arrays = []
    for field in ARROW_SCHEMA:
        column = batch.column(field.name)
        try:
            arrays.append(pc.cast(column, field.type, safe=True))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise StageError(
                f"base shard {path}: column {field.name} cannot become {field.type}: {e}"
            ) from None
    return pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA)


def totals(shards: list[Shard]) -> dict:
    return {
        "rows": sum(s.rows for s in shards),
        "tokens": sum(s.tokens for s in shards),
        "loss_tokens": sum(s.loss_tokens for s in shards),
        "shards": len(shards),
        "bytes": sum(s.bytes for s in shards),
    }
