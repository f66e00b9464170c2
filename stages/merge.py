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

import datetime
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Optional

# loaded at start, not first by the load check's forked worker: merge always runs that
# check, and there the import (about 0.5 s) would be inside the stage's own time
import datasets  # noqa: F401

from stages.common import outputs, params
from stages.common.errors import StageError
from stages.common.reading import existing_folder
from stages.dataset import adopt, fingerprint, lineage, mergeshards
from stages.dataset.schema import ARROW_SCHEMA, features_of, schema_differences
from stages.dataset.shards import (
    list_shards,
    loaded_rows_and_features,
    read_schema,
    write_metadata,
)
from stages.process import cli

log = logging.getLogger("merge")

PATHS = {"tokenized": "tokenize's dataset (the new rows)",
         "out": "folder the merged set is written to",
         "reports": "folder of the stage reports (the earlier stages' are read for the card)",
         "prompts": "prepare's folder (for its dvc.lock hash)",
         "completions": "generate's folder (for its dvc.lock hash)"}


def run(cfg: params.Merge, paths) -> dict:
    """`paths`: the PATHS, as dvc.yaml gives them (`cli.pipeline_paths`)."""
    start = time.perf_counter()
    base = Path(cfg.base) if cfg.base else None
    _check_paths(base, paths, cfg.adopt)
    new_fp_path = paths.tokenized / fingerprint.FILE
    new_fp, base_fp = _fingerprints(new_fp_path, base)

    new = [mergeshards.Shard(p) for p in list_shards(paths.tokenized)]
    for shard in new:
        diffs = schema_differences(read_schema(shard.path))
        if diffs:
            raise StageError(f"{shard.path}: {'; '.join(diffs)} (re-run the tokenize stage)")
    base_files = adopt.base_files(base) if base and base.is_dir() else []
    foreign = adopt.plan(cfg, base, base_files, paths.out)
    base_shards = [] if foreign else [mergeshards.Shard(p) for p in base_files]
    for shard in base_shards:
        shard.cast = mergeshards.check_base_schema(shard.path, cfg.allow_cast, paths.tokenized)

    new_ids = mergeshards.scan_new(new, paths.tokenized)
    with outputs.atomic_dir(paths.out) as tmp:
        adopted = None
        if foreign:
            adopted = adopt.convert(foreign, tmp, fingerprint.vocab_size(new_fp, new_fp_path))
            base_shards = [mergeshards.Shard(p, adopted=True) for p in adopted.shards]
            base_fp = {"policy": adopted.policy}  # widens the limits validate checks
        dup_ids = mergeshards.scan_base(base_shards, new_ids)
        duplicates = mergeshards.apply_duplicates(cfg.on_duplicate, dup_ids, base_shards, new, paths.tokenized)
        if sum(s.rows - s.dropped for s in base_shards + new) == 0:
            raise StageError(
                f"merge: no rows to write: the base is empty and {paths.tokenized} has 0 rows")

        placed = mergeshards.place_all(tmp, base_shards, new, cfg.link)
        merged_fp = fingerprint.widened(base_fp, new_fp)
        if merged_fp == new_fp:
            shutil.copyfile(new_fp_path, tmp / fingerprint.FILE)
        else:
            outputs.write_json(tmp / fingerprint.FILE, merged_fp)
        names = [name for name, _, _ in placed if name is not None]
        content = fingerprint.state_hash(tmp, names)
        write_metadata(tmp, names, content)
        report = _report(cfg, base, base_shards, new, placed, duplicates, paths.tokenized)
        report["adopted"] = adopted.report if adopted else None
        lin = lineage.build(report, merged_fp, base, content, paths)
        lineage.write(tmp, lin, paths)
        _check_loads(tmp, report["merged"]["rows"])
    report["version"] = lin["version"]
    report["seconds"] = round(time.perf_counter() - start, 3)
    # when this version was written: a run figure, never in data/merged (a rerun would
    # differ from a clean run by it)
    report["created"] = datetime.datetime.now(datetime.timezone.utc).replace(
        microsecond=0).isoformat().replace("+00:00", "Z")
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


def _report(cfg: params.Merge, base: Optional[Path], base_shards: list[mergeshards.Shard], new: list[mergeshards.Shard],
            placed: list, duplicates: dict, new_dir: Path) -> dict:
    how = {}
    for _, action, _ in placed:
        how[action] = how.get(action, 0) + 1
    return {
        "base": {"path": cfg.base, "present": bool(base and base.is_dir()),
                 **mergeshards.totals(base_shards)},
        "new": {"path": str(new_dir), **mergeshards.totals(new)},
        "merged": mergeshards.totals([shard for _, _, shard in placed]),
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
    new = fingerprint.read(new_path, required=True)
    if base is None or not base.is_dir():
        if base is not None:
            log.warning("merge.base %s does not exist: writing a first version", base)
        return new, None
    found = fingerprint.read(base / fingerprint.FILE, required=False)
    if found is None:
        log.warning("%s has no %s: tokenizer match not checked", base, fingerprint.FILE)
    else:
        fingerprint.check_match(base / fingerprint.FILE, found, new_path, new)
    return new, found


def _check_loads(folder: Path, rows: int) -> None:
    """Prove the folder opens with datasets before it replaces data/merged."""
    try:
        loaded_rows, features = loaded_rows_and_features(folder)
    except Exception as e:  # noqa: BLE001 - any failure here is ours to report
        raise StageError(f"merge: the merged folder does not load with datasets: {e}") from None
    if loaded_rows != rows or features != features_of(ARROW_SCHEMA):
        raise StageError(
            f"merge: the merged folder loads with {loaded_rows} rows and {features}, "
            f"expected {rows} rows and the contract features"
        )


if __name__ == "__main__":
    cli.entry("merge", __doc__, run, PATHS)
