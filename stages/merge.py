"""Append data/tokenized to a base training set without rewriting the base.

  python -m stages.merge --tokenized PATH --out PATH ... [--params params.yaml]
  (the paths: dvc.yaml's cmd)

Writes data/merged: every shard of `merge.base` byte-identical (hardlinked, else copied),
then the new rows as the next shards, the metadata `datasets.load_from_disk` reads, the
new fingerprint.json (its limits widened to the base's) and the lineage card
(dataset/lineage.py), opened with `load_from_disk` before it replaces data/merged; and
reports/merge.json. The base is only read. A base whose columns are the contract's in
other types is refused (`merge.allow_cast` converts it), one in another tool's layout
too (`merge.adopt` converts it once: dataset/adopt.py), and one whose fingerprint names
another tokenizer or chat template. Ids in both: `merge.on_duplicate` (keep-base,
keep-new, error). The rules in full: docs/stages.md, "merge".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.compute as pc

from stages.common import outputs, params
from stages.common.errors import StageError, existing_folder, json_file, json_type, writable
from stages.dataset import adopt, lineage
from stages.dataset.schema import (
    ARROW_SCHEMA,
    FEATURES,
    FINGERPRINT_FILE,
    ShardFile,
    castable,
    list_shards,
    loaded_rows_and_features,
    open_shard,
    read_schema,
    schema_differences,
    shard_name,
    state_hash,
    write_metadata,
)
from stages.process import cli

log = logging.getLogger("merge")

PATHS = {"tokenized": "tokenize's dataset (the new rows)",
         "out": "folder the merged set is written to",
         "reports": "folder of the stage reports (the earlier stages' are read for the card)",
         "prompts": "prepare's folder (for its dvc.lock hash)",
         "completions": "generate's folder (for its dvc.lock hash)"}
FINGERPRINT_KEYS = ("tokenizer", "chat_template_sha256")
# the tokenize limits a merged fingerprint widens to cover the base rows too
POLICY_LIMITS = {"max_seq_len": max, "min_loss_tokens": min}


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


def run(cfg: params.Merge, paths) -> dict:
    """`paths`: the PATHS, as dvc.yaml gives them (`cli.pipeline_paths`)."""
    start = time.perf_counter()
    base = Path(cfg.base) if cfg.base else None
    _check_paths(base, paths, cfg.adopt)
    new_fp_path = paths.tokenized / FINGERPRINT_FILE
    new_fp, base_fp = _fingerprints(new_fp_path, base)

    new = [Shard(p) for p in list_shards(paths.tokenized)]
    for shard in new:
        diffs = schema_differences(read_schema(shard.path))
        if diffs:
            raise StageError(f"{shard.path}: {'; '.join(diffs)} (re-run the tokenize stage)")
    base_files = adopt.base_files(base) if base and base.is_dir() else []
    foreign = adopt.plan(cfg, base, base_files, paths.out)
    base_shards = [] if foreign else [Shard(p) for p in base_files]
    for shard in base_shards:
        shard.cast = _check_base_schema(shard.path, cfg.allow_cast, paths.tokenized)

    new_ids = _scan_new(new, paths.tokenized)
    with outputs.atomic_dir(paths.out) as tmp:
        adopted = None
        if foreign:
            adopted = adopt.convert(foreign, tmp, _vocab_size(new_fp, new_fp_path))
            base_shards = [Shard(p, adopted=True) for p in adopted.shards]
            base_fp = {"policy": adopted.policy}  # widens the limits validate checks
        dup_ids = _scan_base(base_shards, new_ids)
        duplicates = _apply_policy(cfg.on_duplicate, dup_ids, base_shards, new, paths.tokenized)
        if sum(s.rows - s.dropped for s in base_shards + new) == 0:
            raise StageError(
                f"merge: no rows to write: the base is empty and {paths.tokenized} has 0 rows")

        placed = _write(tmp, base_shards, new, cfg.link)
        fingerprint = _merged_fingerprint(base_fp, new_fp)
        if fingerprint == new_fp:
            shutil.copyfile(new_fp_path, tmp / FINGERPRINT_FILE)
        else:
            outputs.write_json(tmp / FINGERPRINT_FILE, fingerprint)
        names = [name for name, _, _ in placed if name is not None]
        content = state_hash(tmp, names)
        write_metadata(tmp, names, content)
        report = _report(cfg, base, base_shards, new, placed, duplicates, paths.tokenized)
        report["adopted"] = adopted.report if adopted else None
        lin = lineage.build(report, fingerprint, base, content, paths)
        lineage.write(tmp, lin, paths)
        _check_loads(tmp, report["merged"]["rows"])
    report["version"] = lin["version"]
    report["seconds"] = round(time.perf_counter() - start, 3)
    outputs.write_report(paths.reports, "merge", report)
    log.info(
        "merged %d base + %d new rows -> %d rows in %d shards (%s)",
        report["base"]["rows"], report["new"]["rows"], report["merged"]["rows"],
        report["merged"]["shards"],
        ", ".join(f"{k} {v}" for k, v in report["shards"].items() if v),
    )
    log.info("lineage card: %s (version %d; %s for machines)", paths.out / lineage.CARD_FILE,
             lin["version"], paths.out / lineage.LINEAGE_FILE)
    return report


def _report(cfg: params.Merge, base: Optional[Path], base_shards: list[Shard], new: list[Shard],
            placed: list, duplicates: dict, new_dir: Path) -> dict:
    how = {}
    for _, action, _ in placed:
        how[action] = how.get(action, 0) + 1
    return {
        "base": {"path": cfg.base, "present": bool(base and base.is_dir()),
                 **_totals(base_shards)},
        "new": {"path": str(new_dir), **_totals(new)},
        "merged": _totals([shard for _, _, shard in placed]),
        "duplicates": duplicates,
        "shards": {key: how.get(key, 0) for key in (
            "base_linked", "base_copied", "base_cast", "base_adopted", "base_filtered",
            "base_emptied", "new_linked", "new_copied", "new_filtered")},
        "bytes_written": sum(s.bytes for _, a, s in placed if not a.endswith("linked")),
    }


# ------------------------------------------------------------------------ checks


def _check_paths(base: Optional[Path], paths, adopting: bool) -> None:
    outputs.check_apart({"merge.base": base, "--tokenized": paths.tokenized},
                        [("--out", paths.out)])
    existing_folder(paths.tokenized, "run the tokenize stage first")
    if adopting and (base is None or not base.exists()):
        # a mistyped base would otherwise become a first version without the user's rows
        raise StageError(f"merge.base {base}: not found, and merge.adopt is true: there is "
                         "no base to adopt (fix the path, or set merge.adopt: false for a "
                         "first version)")
    if base is None:
        return
    if base.is_symlink() and not base.exists():  # not "no base yet": a link gone wrong
        raise StageError(f"merge.base {base}: links to {os.readlink(base)}, which does not exist")
    if base.exists() and not base.is_dir():
        raise StageError(f"merge.base {base}: is a file, expected a dataset folder")
    new = paths.tokenized
    if base.exists() and new.exists() and base.resolve() == new.resolve():
        raise StageError(f"merge.base {base}: must not be {paths.tokenized}")


def _fingerprints(new_path: Path, base: Optional[Path]) -> tuple[dict, Optional[dict]]:
    """The new rows' fingerprint.json and the base's (None when it has none); StageError
    when they name another tokenizer or chat template."""
    new = _read_fingerprint(new_path, required=True)
    if base is None or not base.is_dir():
        if base is not None:
            log.warning("merge.base %s does not exist: writing a first version", base)
        return new, None
    found = _read_fingerprint(base / FINGERPRINT_FILE, required=False)
    if found is None:
        log.warning("%s has no %s: tokenizer match not checked", base, FINGERPRINT_FILE)
    else:
        _compare_fingerprints(base / FINGERPRINT_FILE, found, new_path, new)
    return new, found


def _vocab_size(fingerprint: dict, path: Path) -> int:
    """The new rows' vocabulary size, which every adopted token id must fall inside."""
    size = (fingerprint.get("tokenizer") or {}).get("vocab_size")
    if type(size) is not int or size < 1:
        raise StageError(f"{path}: no tokenizer.vocab_size, which merge.adopt checks the "
                         "base's token ids against (re-run the tokenize stage)")
    return size


def _read_fingerprint(path: Path, required: bool) -> Optional[dict]:
    """fingerprint.json, its policy limits checked: they are carried into the merged one."""
    try:
        doc = json_file(path)
    except FileNotFoundError:
        if required:
            raise StageError(f"{path}: not found (the tokenize stage writes it)") from None
        return None
    if not writable(doc):  # it is carried into the merged fingerprint and the card
        raise StageError(f"{path}: holds a lone surrogate, which cannot be written as UTF-8")
    policy = doc.get("policy")
    for key in POLICY_LIMITS:
        value = policy.get(key) if isinstance(policy, dict) else None
        if value is None:
            continue
        why = (f"is {json_type(value)}, not a whole number" if type(value) is not int
               else params.range_problem(params.Tokenize, key, value))
        if why:
            raise StageError(f"{path}: policy.{key} {why}")
    return doc


def _compare_fingerprints(base_path: Path, base: dict, new_path: Path, new: dict) -> None:
    for key in FINGERPRINT_KEYS:
        diff = _first_difference(base.get(key), new.get(key), key)
        if diff:
            where, a, b = diff
            raise StageError(
                f"fingerprint mismatch: {where} is {_short(a)} in {base_path} but "
                f"{_short(b)} in {new_path} (the base was tokenized differently)"
            )


def _merged_fingerprint(base: Optional[dict], new: dict) -> dict:
    """The new rows' fingerprint, its length and supervision limits widened to hold the
    base rows too (validate checks the whole set against them)."""
    policy, base_policy = new.get("policy"), (base or {}).get("policy")
    if not isinstance(policy, dict) or not isinstance(base_policy, dict):
        return new
    widened = dict(policy)
    for key, pick in POLICY_LIMITS.items():
        values = [p.get(key) for p in (policy, base_policy)]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            widened[key] = pick(values)
    if widened == policy:
        return new
    log.info("base limits differ: the merged fingerprint records max_seq_len %s, "
             "min_loss_tokens %s", widened.get("max_seq_len"), widened.get("min_loss_tokens"))
    return {**new, "policy": widened}


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


def _check_base_schema(path: Path, allow_cast: bool, new_dir: Path) -> bool:
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
    """Count rows and tokens and return the id column (a copy: a batch read is held
    only while it is counted, so memory stays one batch whatever the shard size)."""
    ids = []
    shard.rows = shard.tokens = shard.loss_tokens = 0
    try:
        with open_shard(shard.path) as reader:
            for batch in (b for b in reader if b.num_rows):
                ids.append(pa.concat_arrays([batch.column("id")]))
                offsets = batch.column("input_ids").offsets
                shard.rows += batch.num_rows
                shard.tokens += offsets[-1].as_py() - offsets[0].as_py()
                shard.loss_tokens += pc.sum(batch.column("num_loss_tokens")).as_py() or 0
    except (pa.ArrowInvalid, OSError) as e:
        raise StageError(f"{shard.path}: unreadable shard ({e})") from None
    shard.bytes = shard.path.stat().st_size
    return _strings(ids)


def _strings(chunks: list) -> pa.ChunkedArray:
    # a base that needs a cast may hold large_string ids: compare everything as string
    return pa.chunked_array(
        [c if c.type == pa.string() else c.cast(pa.string()) for c in chunks], pa.string()
    )


def _scan_new(new: list[Shard], new_dir: Path) -> pa.Array:
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


def _scan_base(base: list[Shard], new_ids: pa.Array) -> pa.Array:
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


def _apply_policy(policy: str, dup_ids: pa.Array, base: list[Shard], new: list[Shard],
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


def _write(tmp: Path, base: list[Shard], new: list[Shard], link: bool):
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


def _totals(shards: list[Shard]) -> dict:
    return {
        "rows": sum(s.rows for s in shards),
        "tokens": sum(s.tokens for s in shards),
        "loss_tokens": sum(s.loss_tokens for s in shards),
        "shards": len(shards),
        "bytes": sum(s.bytes for s in shards),
    }


def _check_loads(folder: Path, rows: int) -> None:
    """Prove the folder opens with datasets before it replaces data/merged."""
    try:
        loaded_rows, features = loaded_rows_and_features(folder)
    except Exception as e:  # noqa: BLE001 - any failure here is ours to report
        raise StageError(f"merge: the merged folder does not load with datasets: {e}") from None
    if loaded_rows != rows or features != FEATURES:
        raise StageError(
            f"merge: the merged folder loads with {loaded_rows} rows and {features}, "
            f"expected {rows} rows and the contract features"
        )


if __name__ == "__main__":
    cli.entry("merge", __doc__, run, PATHS)
