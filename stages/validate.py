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

import csv
import dataclasses
import json
import logging
import os
import re
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import datasets
import numpy as np
import pandera.errors
import pandera.polars  # noqa: F401 - imported here, not on the clock inside run()
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from stages.common import cpus, outputs, params
from stages.common.errors import StageError, existing_folder, json_file, json_type
from stages.dataset import charts, loader, rowsummary, traincheck
from stages.dataset.idhashes import IdHashes
from stages.dataset.rowsummary import (
    FRACTION_BINS,
    FRACTIONS,
    LENGTH_BINS,
    LENGTHS,
    ROWS,
    SUPERVISED,
    TOKENS,
)
from stages.dataset.schema import (
    FEATURES,
    FINGERPRINT_FILE,
    INFO_FILE,
    NOT_NULL_CHECKS,
    ROW_CHECKS,
    list_shards,
    loaded_rows_and_features,
    open_shard,
    row_rules,
    row_schema,
    rows_pass,
)
from stages.process import cli
from stages.view import page

log = logging.getLogger("validate")

PATHS = {"merged": "merge's dataset", "reports": "folder of the stage reports (merge's is read, "
         "this stage's and its plots are written)"}
DATASET_CHECKS = ["fingerprint", "features", "shards_readable", "loads", "row_count",
                  "id_unique"]
CHUNK_ROWS = 65536  # summary rows checked at once: bounds memory, amortises per-call costs


class Findings:
    """Failures per check: a count and the first few examples."""

    def __init__(self, names: list[str], max_examples: int):
        self.max_examples = max_examples
        self.checks: dict[str, dict] = {}
        for name in names:
            self.expect(name)

    def expect(self, name: str) -> None:
        self.checks[name] = {"passed": True, "failures": 0, "examples": []}

    def add(self, name: str, count: int, examples: list[str]) -> None:
        check = self.checks[name]
        check["passed"] = False
        check["failures"] += count
        room = max(self.max_examples - len(check["examples"]), 0)
        # one line each: library messages (load_from_disk's) span several
        check["examples"].extend(re.sub(r"\s*\n\s*", " ", str(e)) for e in examples[:room])

    def failed(self) -> list[str]:
        return [name for name, c in self.checks.items() if not c["passed"]]


def run(cfg: params.Validate, paths) -> dict:
    """`paths`: the PATHS, as dvc.yaml gives them (`cli.pipeline_paths`)."""
    start = time.perf_counter()
    params.check_ranges(cfg, "validate")
    data = paths.merged
    outputs.check_apart({"--merged": data}, [("the plots folder", charts.plots(paths.reports))])
    existing_folder(data, "run the merge stage first")
    findings = Findings(DATASET_CHECKS + ROW_CHECKS, cfg.max_examples)
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

    _write_plots(scan.stats, scan.width, paths.reports)
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


def _scan(cfg: params.Validate, findings: Findings, shards: list, data: Path,
          loadable: bool) -> "Scanner":
    """Every row check over every shard, and the `datasets` load beside it (if
    `loadable`: else that check fails, not tried)."""
    vocab = cfg.vocab_size
    threads = cfg.threads or _idle_cpus()
    log.info("%d shards, vocabulary %d, %d threads", len(shards), vocab, threads)
    with IdHashes() as ids, \
            ThreadPoolExecutor(1, thread_name_prefix="load") as side, \
            ThreadPoolExecutor(threads, thread_name_prefix="validate") as pool:
        scan = Scanner(cfg, vocab, findings, ids)
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


def _report(cfg: params.Validate, findings: Findings, scan: "Scanner", shards: list, expected,
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


def _failure_message(findings: Findings, failed: list, report: Path) -> str:
    parts = []
    for name in failed:
        c = findings.checks[name]
        example = f", e.g. {c['examples'][0]}" if c["examples"] else ""
        parts.append(f"{name} ({c['failures']}{example})")
    return (f"validate: {len(failed)} checks failed: {'; '.join(parts)} "
            f"(see {report})")


# validate param -> where tokenize recorded it in fingerprint.json
RECORDED = {"vocab_size": ("tokenizer", "vocab_size"),
            "max_seq_len": ("policy", "max_seq_len"),
            "min_loss_tokens": ("policy", "min_loss_tokens")}


def _limits(cfg: params.Validate, findings: Findings, fingerprint: Optional[dict],
            data: Path) -> tuple[params.Validate, dict]:
    """`cfg` with each null limit taken from the data's fingerprint (None: missing or
    unreadable), and where each came from ("params" or the fingerprint's path and key). A
    recorded value that is no value of the param (a string, 2**70) fails the fingerprint
    check and is not used."""
    path = data / FINGERPRINT_FILE
    values, used = {}, {}
    for name, (section, key) in RECORDED.items():
        part = (fingerprint or {}).get(section)
        recorded = part.get(key) if isinstance(part, dict) else None
        problem = (f"{path} is missing or unreadable" if fingerprint is None
                   else f"{path} has no {section}.{key}")
        if recorded is not None:
            why = (f"is {json_type(recorded)}, not a whole number" if type(recorded) is not int
                   else params.range_problem(params.Validate, name, recorded))
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


def _training(cfg: params.Validate, findings: Findings, data: Path) -> tuple[Optional[dict], dict]:
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



def _fingerprint(findings: Findings, data: Path) -> Optional[dict]:
    path = data / FINGERPRINT_FILE
    try:
        doc = json_file(path)
    except FileNotFoundError:
        findings.add("fingerprint", 1, [f"{path} is missing"])
        return None
    except StageError as e:  # not a regular file, too large, not a JSON object
        findings.add("fingerprint", 1, [str(e)])
        return None
    missing = [k for k in ("tokenizer", "chat_template_sha256") if k not in doc]
    if missing:
        findings.add("fingerprint", 1, [f"{path} lacks {', '.join(missing)}"])
    return doc


def _check_info(findings: Findings, data: Path) -> bool:
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


def _check_loads(findings: Findings, loaded, rows: int) -> None:
    if isinstance(loaded, Exception):
        findings.add("loads", 1, [f"load_from_disk: {type(loaded).__name__}: {loaded}"[:300]])
        return
    loaded_rows, features = loaded
    if loaded_rows != rows or features != FEATURES:
        findings.add("loads", 1, [f"load_from_disk: {loaded_rows} rows, features {features}"])


def _check_row_count(findings: Findings, rows: int, data: Path,
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


# ------------------------------------------------------------------ row summary


class Scanner:
    """Summarises rows batch by batch and checks the summaries chunk by chunk."""

    def __init__(self, cfg: params.Validate, vocab: int, findings: Findings, ids: IdHashes):
        self.vocab = vocab
        self.findings = findings
        self.rules = row_rules(cfg.max_seq_len, cfg.min_loss_tokens)
        self.schema = row_schema(self.rules)
        self.width = rowsummary.bin_width(cfg.max_seq_len)
        self.rows = 0
        self.pending: list[pa.RecordBatch] = []
        self.pending_rows = 0
        self.ids = ids  # 64-bit id hashes and row numbers, dataset-wide
        self.shard_rows: list[int] = []
        self.stats: dict[str, np.ndarray] = {}  # per source: see rowsummary.source_stats

    def add(self, path: Path, future: Future) -> None:
        """Take one shard's summaries (in dataset order) and check them chunk by chunk."""
        try:
            shard = future.result()
        except StageError as e:
            self.findings.add("shards_readable", 1, [str(e)[:300]])
            self.shard_rows.append(0)
            return
        if shard.diffs:
            self.findings.add("features", len(shard.diffs),
                              [f"{path.name}: {d}" for d in shard.diffs])
        for summary in shard.summaries:
            first = pc.add(summary.column("row"), self.rows)
            self.pending.append(summary.set_column(0, "row", first))
            self.pending_rows += summary.num_rows
            if self.pending_rows >= CHUNK_ROWS:
                self.flush()
        self.rows += shard.rows
        self.shard_rows.append(shard.rows)
        rowsummary.add_stats(self.stats, shard.stats)
        log.info("shard %d %s: %d rows, %d in all", len(self.shard_rows), path.name,
                 shard.rows, self.rows)

    def flush(self) -> None:
        if not self.pending:
            return
        frame = pl.from_arrow(pa.Table.from_batches(self.pending))
        self.pending, self.pending_rows = [], 0
        if not rows_pass(frame, self.rules):
            try:
                self.schema.validate(frame, lazy=True)
            except pandera.errors.SchemaErrors as e:
                self._record(frame, e.failure_cases)
        ids = frame.filter(pl.col("id").is_not_null())
        self.ids.add(ids.get_column("id").hash(seed=0).to_numpy(),
                     ids.get_column("row").to_numpy())

    def _record(self, frame, failures) -> None:
        names = pl.col("column").replace_strict(NOT_NULL_CHECKS, default=None)
        failures = failures.with_columns(
            name=pl.when(pl.col("check") == "not_nullable").then(names)
            .otherwise(pl.col("check"))
        )
        for (name,), group in failures.group_by(["name"], maintain_order=True):
            if name not in self.findings.checks:  # a schema-level error: our own bug
                raise StageError(f"validate: summary schema error: {group.row(0)}")
            index = group.get_column("index").unique(maintain_order=True)
            rows = frame[index.head(self.findings.max_examples).to_list()]
            examples = [
                i if i is not None and i.strip() else
                f"row {r} ({'null' if i is None else repr(i)} id)"
                for i, r in zip(rows.get_column("id"), rows.get_column("row"))
            ]
            self.findings.add(name, len(index), examples)

    def check_unique_ids(self, shards: list[Path]) -> None:
        """Hash-level duplicates (stages/dataset/idhashes.py), then confirmed on the id strings."""
        suspects = self.ids.repeated_rows()
        if not len(suspects):
            return
        ids = _ids_at(shards, self.shard_rows, suspects)
        counts = pc.value_counts(ids)
        repeated = counts.filter(pc.greater(counts.field("counts"), 1))
        if len(repeated):
            total = pc.sum(repeated.field("counts")).as_py()
            self.findings.add("id_unique", total, repeated.field("values").to_pylist())


def _ids_at(shards: list[Path], shard_rows: list[int], rows: np.ndarray) -> pa.Array:
    """The ids at dataset-wide row numbers `rows` (sorted), reading only those shards."""
    starts = np.concatenate(([0], np.cumsum(shard_rows)))
    out = []
    for i, path in enumerate(shards):
        lo, hi = np.searchsorted(rows, [starts[i], starts[i + 1]])
        if lo == hi:
            continue
        with open_shard(path) as reader:
            ids = pa.chunked_array([pc.cast(b.column("id"), pa.large_string()) for b in reader],
                                   pa.large_string())
        out.append(ids.take(pa.array(rows[lo:hi] - starts[i])).combine_chunks())
    return pa.concat_arrays(out) if out else pa.array([], pa.large_string())


# ------------------------------------------------------------------------- plots


def _write_plots(stats: dict[str, np.ndarray], width: int, reports: Path) -> None:
    """One CSV per source and plot, under reports/plots/ (declared as DVC plots), and
    one SVG per plot beside them, all rows then each source (stages/dataset/charts.py).

    token_length: rows per bin of `width` = max_seq_len / 64 tokens, x = the bin's upper
    edge (one more bin past max_seq_len when any row is longer); supervised_fraction: rows
    per 0.05 of supervised tokens / tokens, x = the bin's upper edge.
    """
    names = _file_names(sorted(stats))
    lengths = [(b + 1) * width for b in range(LENGTH_BINS + 1)]
    fractions = [round((b + 1) / FRACTION_BINS, 4) for b in range(FRACTION_BINS)]
    for folder, column, edges, part in (
        ("token_length", "tokens", lengths, LENGTHS),
        ("supervised_fraction", "supervised_fraction", fractions, FRACTIONS),
    ):
        _write_svg(reports, folder, [0] + edges,
                   {s: stats[s][part].tolist() for s in sorted(stats)})
        with outputs.atomic_dir(charts.plots(reports) / folder) as tmp:
            for source, file in names.items():
                counts = stats[source][part].tolist()
                if folder == "token_length" and counts[-1] == 0:
                    counts = counts[:-1]  # nobody over max_seq_len: no overflow bin
                with (tmp / file).open("w", newline="", encoding="utf-8") as f:
                    w = csv.writer(f, lineterminator="\n")
                    w.writerow([column, "rows"])
                    w.writerows(zip(edges, counts))


def _write_svg(reports: Path, name: str, edges: list, counts: dict[str, list[int]]) -> None:
    """reports/plots/NAME.svg: a panel for all rows, then one per source."""
    overall = [sum(column) for column in zip(*counts.values())]
    if name == "token_length":  # up to the longest rows, not max_seq_len: readable bars
        keep = max([8] + [b + 1 for b, n in enumerate(overall) if n])
        overall, edges = overall[:keep], edges[: keep + 1]
        counts = {s: c[:keep] for s, c in counts.items()}
    panels = [("all sources", overall)] + list(counts.items())
    title, x_label = charts.PICTURES[name]
    with outputs.atomic_file(charts.picture(reports, name)) as f:
        f.write(charts.histogram_svg(title, x_label, edges, panels))


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


def _file_names(sources: list[str]) -> dict[str, str]:
    out, taken = {}, set()
    for source in sources:
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", source).strip("._") or "source"
        name, k = f"{stem}.csv", 1
        while name in taken:
            k += 1
            name = f"{stem}-{k}.csv"
        taken.add(name)
        out[source] = name
    return out


if __name__ == "__main__":
    cli.entry("validate", __doc__, run, PATHS)
