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

import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from stages.common import outputs, params
from stages.common.errors import StageError
from stages.common.reading import existing_folder
from stages.dataset import (charts, histograms, loader, rowcheck, rowsummary, setchecks,
                            traincheck)
from stages.dataset.idhashes import IdHashes
from stages.dataset.rowsummary import ROWS, SUPERVISED, TOKENS
from stages.dataset.schema import ROW_CHECKS
from stages.dataset.shards import Opening, list_shards
from stages.process import cli, cpus
from stages.view import page

log = logging.getLogger("validate")

PATHS = {"merged": "merge's dataset", "reports": "folder of the stage reports (merge's is read, "
         "this stage's and its plots are written)"}


def run(cfg: params.Validate, paths) -> dict:
    """`paths`: the PATHS, as dvc.yaml gives them (`cli.pipeline_paths`)."""
    start = time.perf_counter()
    params.check_ranges(cfg, "validate")
    data = paths.merged
    outputs.check_apart({"--merged": data}, [("the plots folder", charts.plots(paths.reports))])
    existing_folder(data, "run the merge stage first")
    findings = rowcheck.Findings(setchecks.DATASET_CHECKS + ROW_CHECKS, cfg.max_examples)
    read = setchecks.check_fingerprint(findings, data)
    cfg, used = setchecks.limits(cfg, findings, read, data)  # vocab_size, limits resolved here
    try:
        shards = list_shards(data)
    except StageError as e:  # e.g. state.json lists a missing shard: report it, go on
        findings.add("shards_readable", 1, [str(e)])
        shards, listed = [], False
    else:
        listed = True
    info_read = setchecks.check_info(findings, data)

    # datasets opens state.json, dataset_info.json and every shard without asking what
    # they are: it is let loose only on files already read as regular ones
    tc = cfg.train_check
    tokens = loader.TokenBudget(tc.tokens_per_batch, tc.batches_per_step)  # fed by the scan
    scan = _scan(cfg, findings, shards, data, loadable=listed and info_read, budget=tokens)
    expected = setchecks.check_row_count(findings, scan.rows, data, paths.reports / "merge.json")
    budget, train_check = _training(cfg, findings, data, tokens)

    histograms.write_plots(scan.stats, scan.width, paths.reports)
    samples_start = time.perf_counter()
    _write_samples(data, paths.reports)
    samples_seconds = time.perf_counter() - samples_start
    report = _report(cfg, findings, scan, shards, expected, used, budget, train_check)
    report["seconds"] = round(time.perf_counter() - start, 3)
    report["samples_page_seconds"] = round(samples_seconds, 3)  # a tokenizer load, mostly
    written = outputs.write_report(paths.reports, "validate", report)
    failed = findings.failed()
    if failed:
        raise StageError(_failure_message(findings, failed, written))
    log.info("all %d checks passed on %d rows in %d shards", len(findings.checks),
             scan.rows, len(shards))
    return report


def _scan(cfg: params.Validate, findings: rowcheck.Findings, shards: list, data: Path,
          loadable: bool, budget: loader.TokenBudget) -> rowcheck.Scanner:
    """Every row check over every shard, and the `datasets` load beside it (if
    `loadable`: else that check fails, not tried); every row fed to `budget` too."""
    vocab = cfg.vocab_size
    # memory-bound numpy: past 4 threads nothing is gained. Not fewer on a busy machine:
    # the load average lags (a run just before reads as load), and on a shared CPU
    # more threads get a larger share of it, not a smaller one
    threads = cfg.threads or min(4, cpus.usable())
    log.info("%d shards, vocabulary %d, %d threads", len(shards), vocab, threads)
    # beside the scan, in a process forked before the scan starts its threads
    loads = Opening(data) if loadable else None
    with IdHashes() as ids, \
            ThreadPoolExecutor(threads, thread_name_prefix="validate") as pool:
        scan = rowcheck.Scanner(cfg, vocab, findings, ids, budget=budget)
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
            setchecks.check_loads(findings, loads, scan.rows)
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


def _training(cfg: params.Validate, findings: rowcheck.Findings, data: Path,
              tokens: loader.TokenBudget) -> tuple[Optional[dict], dict]:
    """The token budget (dataset/loader.py, fed by the scan) and the training check
    (dataset/traincheck.py), on data that passed every other check: a trainer would stop
    at a broken row first."""
    tc = cfg.train_check
    if findings.failed():
        return None, {"skipped": "other checks failed"}
    budget = tokens.result()
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
