"""validate's checks of the set as a whole, beside the row checks (rowcheck.py): its
fingerprint and the limits it records, dataset_info.json's features, the load as training
opens it, and the row count merge reported. Each failure is a finding, never a crash."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Optional

# validate always checks dataset_info.json's features and the load with datasets: loaded
# at start, inherited by the load check's forked worker, never imported inside the scan
import datasets  # noqa: F401

from stages.common import params
from stages.common.errors import StageError
from stages.common.reading import json_file
from stages.dataset import fingerprint
from stages.dataset.rowcheck import Findings
from stages.dataset import schema
from stages.dataset.shards import INFO_FILE, Opening

log = logging.getLogger(__name__)

DATASET_CHECKS = ["fingerprint", "features", "shards_readable", "loads", "row_count",
                  "id_unique"]


def limits(cfg: params.Validate, findings: Findings, recorded_fp: Optional[dict],
            data: Path) -> tuple[params.Validate, dict]:
    """`cfg` with each null limit taken from the data's fingerprint (None: missing or
    unreadable), and where each came from ("params" or the fingerprint's path and key). A
    recorded value that is no value of the param (a string, 2**70) fails the fingerprint
    check and is not used."""
    path = data / fingerprint.FILE
    values, used = {}, {}
    for name, (section, key) in fingerprint.RECORDED.items():
        part = (recorded_fp or {}).get(section)
        recorded = part.get(key) if isinstance(part, dict) else None
        problem = (f"{path} is missing or unreadable" if recorded_fp is None
                   else f"{path} has no {section}.{key}")
        if recorded is not None:
            why = fingerprint.limit_problem(recorded, params.Validate, name)
            if why:
                findings.add("fingerprint", 1, [f"{path}: {section}.{key} {why}"])
                problem = f"{path}: {section}.{key} {why}"
                recorded = None
        value = getattr(cfg, name)
        if value is not None:
            if recorded is not None and value != recorded:
                log.warning("validate.%s %d overrides %d from %s", name, value, recorded, path)
            values[name], used[name] = value, "params"
        elif recorded is None:
            raise StageError(f"validate.{name}: null, and {problem}; set validate.{name}")
        else:
            values[name], used[name] = recorded, f"{path}: {section}.{key}"
    log.info("limits: %s", ", ".join(f"{k} {values[k]} ({used[k]})" for k in values))
    return dataclasses.replace(cfg, **values), used


def check_fingerprint(findings: Findings, data: Path) -> Optional[dict]:
    path = data / fingerprint.FILE
    try:
        doc = fingerprint.load(path)
    except FileNotFoundError:
        findings.add("fingerprint", 1, [f"{path} is missing"])
        return None
    except StageError as e:  # not a regular file, too large, not a JSON object
        findings.add("fingerprint", 1, [str(e)])
        return None
    missing = fingerprint.missing_keys(doc)
    if missing:
        findings.add("fingerprint", 1, [f"{path} lacks {', '.join(missing)}"])
    return doc


def check_info(findings: Findings, data: Path) -> bool:
    """Check dataset_info.json's features; whether the file could be read at all."""
    path = data / INFO_FILE
    try:
        doc = json_file(path)
    except (StageError, OSError) as e:
        findings.add("features", 1, [f"{path}: unreadable ({e})"])
        return False
    import datasets  # validate's alone: what datasets makes of the file is the check

    try:
        features = datasets.Features.from_dict(doc["features"])
    except Exception as e:  # noqa: BLE001 - whatever datasets makes of a hostile value
        findings.add("features", 1, [f"{path}: unreadable features ({e!r})"[:300]])
        return True
    if features != schema.FEATURES:
        findings.add("features", 1, [f"{path}: features {features} differ from the contract"])
    return True


def check_loads(findings: Findings, opening: Opening, rows: int) -> None:
    """The load as training opens it (`opening`: datasets in a worker process of its own,
    so a shard cut under its memory map is this check's failure, not the stage's death)."""
    try:
        loaded_rows, features = opening.result()
    except StageError as e:
        findings.add("loads", 1, [f"load_from_disk: {e}"[:300]])
        return
    if loaded_rows != rows or features != schema.features_of(schema.ARROW_SCHEMA):
        findings.add("loads", 1, [f"load_from_disk: {loaded_rows} rows, features {features}"])


def check_row_count(findings: Findings, rows: int, data: Path,
                     merge_report: Path) -> Optional[int]:
    try:
        merged = json_file(merge_report).get("merged")
    except (StageError, OSError) as e:
        findings.add("row_count", 1, [f"{merge_report}: unreadable ({e})"])
        return None
    expected = merged.get("rows") if isinstance(merged, dict) else None
    if type(expected) is not int or expected < 0:
        findings.add("row_count", 1, [f"{merge_report}: merged.rows is "
                                      f"{json.dumps(expected)[:60]}, not a row count"])
        return None
    if expected != rows:
        findings.add("row_count", abs(rows - expected),
                     [f"{data} has {rows} rows, {merge_report} says {expected}"])
    return expected
