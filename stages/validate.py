"""Prove data/merged well-formed before a training run starts on it.

  python -m stages.validate --merged PATH --reports PATH [--params params.yaml]
  (the paths: dvc.yaml's cmd)

Every row is summarised shard by shard (stages/dataset/rowsummary.py) and the summaries
are checked against the row rules of stages/dataset/schema.py, in chunks of CHUNK_ROWS;
then the dataset: types and features equal the contract, `load_from_disk` opens it, ids
are unique (stages/dataset/idhashes.py), the row count is merge's. When every check
passes, real training steps run on it (stages/dataset/traincheck.py). Writes
reports/validate.json and the plots under reports/plots/; any failed check exits 1 after
writing them, so `dvc repro` stops here. The checks, the limits each param sets and the
memory bound: docs/stages.md ("validate") and docs/params.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import datasets

from stages.common import outputs, params

from stages.process import cpus
from stages.common.errors import StageError, existing_folder, json_file
from stages.dataset import (charts, fingerprint, histograms, loader, rowcheck, rowsummary,
                            traincheck)
from stages.dataset.idhashes import IdHashes
from stages.dataset.rowsummary import ROWS, SUPERVISED, TOKENS
from stages.dataset.schema import FEATURES, ROW_CHECKS
from stages.dataset.shards import INFO_FILE, list_shards, loaded_rows_and_features
from stages.process import cli
from stages.view import page

log = logging.getLogger("validate")

PATHS = {"merged": "merge's dataset", "reports": "folder of the stage reports (merge's is read, "
         "this stage's and its plots are written)"}
DATASET_CHECKS = ["fingerprint", "features", "shards_readable", "loads", "row_count",
                  "id_unique"]


def run(cfg: params.Validate, paths) -> dict:
    """`paths`: the PATHS, as dvc.yaml gives them (`cli.pipeline_paths`)."""
    start = time.perf_counter()
    params.check_ranges(cfg, "validate")
    data = paths.merged
    outputs.check_apart({"--merged": data}, [("the plots folder", charts.plots(paths.reports))])
    existing_folder(data, "run the merge stage first")
    findings = rowcheck.Findings(DATASET_CHECKS + ROW_CHECKS, cfg.max_examples)
    read = _fingerprint(findings, data)
    cfg, used = _limits(cfg, findings, read, data)  # vocab_size, limits resolved here
    try:
        shards = list_shards(data)
    except StageError as e:  # e.g. state.json lists a missing shard: report it, go on
        findings.add("shards_readable", 1, [str(e)])
        shards, listed = [], False
    else:
        listed = True
    info_read = _check_info(findings, data)

    # datasets opens state.json, dataset_info.json and every shard without asking what
    # they are: it is let loose only on files already read as regular ones
    scan = _scan(cfg, findings, shards, data, loadable=listed and info_read)
    expected = _check_row_count(findings, scan.rows, data, paths.reports / "merge.json")
    budget, train_check = _training(cfg, findings, data)

    histograms.write_plots(scan.stats, scan.width, paths.reports)
    _write_samples(data, paths.reports)
    report = _report(cfg, findings, scan, shards, expected, used, budget, train_check)
    report["seconds"] = round(time.perf_counter() - start, 3)
    written = outputs.write_report(paths.reports, "validate", report)
    failed = findings.failed()
    if failed:
        raise StageError(_failure_message(findings, failed, written))
    log.info("all %d checks passed on %d rows in %d shards", len(findings.checks),
             scan.rows, len(shards))
    return report


def _scan(cfg: params.Validate, findings: rowcheck.Findings, shards: list, data: Path,
          loadable: bool) -> rowcheck.Scanner:
    """Every row check over every shard, and the `datasets` load beside it (if
    `loadable`: else that check fails, not tried)."""
    vocab = cfg.vocab_size
    threads = cfg.threads or _idle_cpus()
    log.info("%d shards, vocabulary %d, %d threads", len(shards), vocab, threads)
    with IdHashes() as ids, \
            ThreadPoolExecutor(1, thread_name_prefix="load") as side, \
            ThreadPoolExecutor(threads, thread_name_prefix="validate") as pool:
        scan = rowcheck.Scanner(cfg, vocab, findings, ids)
        # mostly waiting on files: beside the scan
        loads = side.submit(_load, data) if loadable else None
        # numpy and Arrow release the GIL: shards are summarised `threads` at a time,
        # a bounded window ahead, and checked in order here
        queue: deque = deque()
        for path in shards:
            queue.append((path, pool.submit(rowsummary.summarize_shard, path, vocab,
                                            scan.width)))
            if len(queue) > threads:
                scan.add(*queue.popleft())
        while queue:
            scan.add(*queue.popleft())
        scan.flush()
        scan.check_unique_ids(shards)
        if loads is None:
            findings.add("loads", 1, ["load_from_disk not tried: the folder's state.json, "
                                      "dataset_info.json or shards are unusable"])
        else:
            _check_loads(findings, loads.result(), scan.rows)
    return scan


def _report(cfg: params.Validate, findings: rowcheck.Findings, scan: rowcheck.Scanner, shards: list, expected,
            used: dict, budget, train_check) -> dict:
    """reports/validate.json, but for `seconds`."""
    sources = {
        name: {"rows": int(v[ROWS]), "tokens": int(v[TOKENS]),
               "supervised_tokens": int(v[SUPERVISED])}
        for name, v in sorted(scan.stats.items())
    }
    failed = findings.failed()
    return {
        "passed": not failed,
        "rows": scan.rows,
        "expected_rows": expected,
        "shards": len(shards),
        "tokens": sum(s["tokens"] for s in sources.values()),
        "supervised_tokens": sum(s["supervised_tokens"] for s in sources.values()),
        "vocab_size": cfg.vocab_size,
        "max_seq_len": cfg.max_seq_len,
        "min_loss_tokens": cfg.min_loss_tokens,
        "limits_from": used,
        "failed_checks": len(failed),
        "checks": findings.checks,
        "sources": sources,
        "budget": budget,
        "train_check": train_check,
    }


def _failure_message(findings: rowcheck.Findings, failed: list, report: Path) -> str:
    parts = []
    for name in failed:
        c = findings.checks[name]
        example = f", e.g. {c['examples'][0]}" if c["examples"] else ""
        parts.append(f"{name} ({c['failures']}{example})")
    return (f"validate: {len(failed)} checks failed: {'; '.join(parts)} "
            f"(see {report})")


def _limits(cfg: params.Validate, findings: rowcheck.Findings, recorded_fp: Optional[dict],
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


def _idle_cpus() -> int:
    """Threads for `validate.threads: 0`: CPUs not already busy (1-minute load), 1 to 4.

    Summaries are memory-bound numpy work: a second thread on a CPU someone else keeps
    busy only adds hand-offs.
    """
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, min(4, int(cpus.usable() - busy + 0.5)))


# ---------------------------------------------------------------- dataset checks


def _training(cfg: params.Validate, findings: rowcheck.Findings, data: Path) -> tuple[Optional[dict], dict]:
    """The token budget (dataset/loader.py) and the training check (dataset/traincheck.py), on
    data that passed every other check: a trainer would stop at a broken row first."""
    tc = cfg.train_check
    if findings.failed():
        return None, {"skipped": "other checks failed"}
    budget = loader.budget(data, tc.tokens_per_batch, tc.batches_per_step)
    if not tc.enabled:
        return budget, {"skipped": "validate.train_check.enabled is false"}
    missing = traincheck.missing_torch()
    if missing:
        log.warning("training check skipped: %s", missing)
        return budget, {"skipped": missing}
    try:
        result = traincheck.run(tc, data, cfg.max_seq_len)
    except traincheck.TrainCheckFailed as e:
        findings.expect("train_step")
        findings.add("train_step", 1, [str(e)])
        return budget, {"failed": str(e)}
    if "skipped" in result:
        log.warning("training check skipped: %s", result["skipped"])
        return budget, result
    findings.expect("train_step")
    longest = result["longest_batch"] or {}
    log.info("training check: %d steps of %s batches on %s (%d longer rows skipped), "
             "%.0f tokens/s, peak %.0f MB; longest batch %s; process peak RSS %.0f MB",
             result["batches"], result["layout"], result["device"],
             result["longer_than_batch"]["rows"], result["tokens_per_second"],
             result["peak_memory_mb"],
             f"{longest['tokens']} tokens, peak {longest['peak_memory_mb']:.0f} MB"
             if "tokens" in longest else longest.get("skipped", "off"),
             result["process_peak_rss_mb"])
    return budget, result



def _fingerprint(findings: rowcheck.Findings, data: Path) -> Optional[dict]:
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


def _check_info(findings: rowcheck.Findings, data: Path) -> bool:
    """Check dataset_info.json's features; whether the file could be read at all."""
    path = data / INFO_FILE
    try:
        doc = json_file(path)
    except (StageError, OSError) as e:
        findings.add("features", 1, [f"{path}: unreadable ({e})"])
        return False
    try:
        features = datasets.Features.from_dict(doc["features"])
    except Exception as e:  # noqa: BLE001 - whatever datasets makes of a hostile value
        findings.add("features", 1, [f"{path}: unreadable features ({e!r})"[:300]])
        return True
    if features != FEATURES:
        findings.add("features", 1, [f"{path}: features {features} differ from the contract"])
    return True


def _load(folder: Path):
    """(rows, features) of the dataset as training opens it, or the exception that stops it."""
    try:
        return loaded_rows_and_features(folder)
    except Exception as e:  # noqa: BLE001 - whatever stops training from opening it
        return e


def _check_loads(findings: rowcheck.Findings, loaded, rows: int) -> None:
    if isinstance(loaded, Exception):
        findings.add("loads", 1, [f"load_from_disk: {type(loaded).__name__}: {loaded}"[:300]])
        return
    loaded_rows, features = loaded
    if loaded_rows != rows or features != FEATURES:
        findings.add("loads", 1, [f"load_from_disk: {loaded_rows} rows, features {features}"])


def _check_row_count(findings: rowcheck.Findings, rows: int, data: Path,
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


def _write_samples(data: Path, reports: Path) -> None:
    """reports/samples.html: seeded rows of every source, supervised tokens marked (a
    view, not a check: when rows cannot be drawn the page says why)."""
    target = charts.samples(reports)
    try:
        rows = page.write_samples(data, target)
    except StageError as e:
        log.warning("%s: no sample rows (%s)", target, e)
        with outputs.atomic_file(target) as f:
            f.write(page.page(f"Sample rows of {data}", [], f"No sample rows: {e}"))
        return
    log.info("%s: %d sample rows", target, rows)


if __name__ == "__main__":
    cli.entry("validate", __doc__, run, PATHS)
