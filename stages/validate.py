"""Prove data/merged well-formed before a training run starts on it.

  python -m stages.validate --merged PATH --reports PATH [--params params.yaml]
  (the paths: dvc.yaml's cmd)

Shard by shard, every row is reduced to a summary computed with columnar operations on
the flattened Arrow lists (lengths, token ids outside [0, vocab), mask values outside
{0, 1}, supervised count, longest supervised run, stored counters); the summaries are
checked against the row rules in stages/dataset/schema.py, in one polars pass, and only when a
rule fails does its pandera schema name the rows. Then dataset checks: each shard's
Arrow types and dataset_info.json equal the contract, `datasets.load_from_disk` opens
the folder, ids are unique across all shards, the row count equals reports/merge.json.

Writes reports/validate.json (pass/fail, failures and up to `validate.max_examples`
offending ids per check, rows/tokens per source) and the plots under reports/plots/
(token-length and supervised-fraction histograms, one CSV per source). Any failed check
exits with status 1 after writing them, so `dvc repro` stops here.

The vocabulary size, the length limit and the supervision floor are `validate.vocab_size`,
`max_seq_len` and `min_loss_tokens`; each one left null is what tokenize recorded with the
data (tokenizer.vocab_size, policy.max_seq_len, policy.min_loss_tokens in
data/merged/fingerprint.json). The report says which was used (`limits_from`).

Memory does not grow with the dataset: shards are read through memory maps whose pages
are dropped behind the reader, summaries (one shard's at a time) are checked in chunks of
about CHUNK_ROWS rows, and the id hashes for the uniqueness check spill to temporary
files past a bound (stages/dataset/idhashes.py).
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

from stages.common import outputs, params
from stages.common.errors import StageError, json_file, json_type
from stages.dataset import charts, loader, traincheck
from stages.dataset.idhashes import IdHashes
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
    schema_differences,
)
from stages.process import cli, cpus

log = logging.getLogger("validate")

PATHS = {"merged": "merge's dataset", "reports": "folder of the stage reports (merge's is read, "
         "this stage's and its plots are written)"}
DATASET_CHECKS = ["fingerprint", "features", "shards_readable", "loads", "row_count",
                  "id_unique"]
CHUNK_ROWS = 65536  # summary rows checked at once: bounds memory, amortises per-call costs
LENGTH_BINS = 64
FRACTION_BINS = 20


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
    if not data.is_dir():
        raise StageError(f"{data}: not found (run the merge stage first)")
    findings = Findings(DATASET_CHECKS + ROW_CHECKS, cfg.max_examples)
    fingerprint = _fingerprint(findings, data) or {}
    cfg, used = _limits(cfg, findings, fingerprint, data)  # vocab_size, limits resolved here
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
            queue.append((path, pool.submit(summarize_shard, path, vocab, scan.width)))
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
        name: {"rows": int(v[0]), "tokens": int(v[1]), "supervised_tokens": int(v[2])}
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


def _limits(cfg: params.Validate, findings: Findings, fingerprint: dict,
            data: Path) -> tuple[params.Validate, dict]:
    """`cfg` with each null limit taken from the data's fingerprint, and where each came
    from ("params" or the fingerprint's path and key). A recorded value that is no
    value of the param (a string, 2**70) fails the fingerprint check and is not used."""
    path = data / FINGERPRINT_FILE
    values, used = {}, {}
    for name, (section, key) in RECORDED.items():
        part = fingerprint.get(section)
        recorded = part.get(key) if isinstance(part, dict) else None
        if recorded is not None:
            why = (f"is {json_type(recorded)}, not a whole number" if type(recorded) is not int
                   else params.range_problem(params.Validate, name, recorded))
            if why:
                findings.add("fingerprint", 1, [f"{path}: {section}.{key} {why}"])
                recorded = None
        value = getattr(cfg, name)
        if value is not None:
            if recorded is not None and value != recorded:
                log.warning("validate.%s %d overrides %d from %s", name, value, recorded, path)
            values[name], used[name] = value, "params"
        elif recorded is None:
            raise StageError(f"validate.{name}: null, and {path} has no "
                             f"{section}.{key}; set validate.{name}")
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
    elif loaded[0] != rows or loaded[1] != FEATURES:
        findings.add("loads", 1, [f"load_from_disk: {loaded[0]} rows, features {loaded[1]}"])


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
        self.width = bin_width(cfg.max_seq_len)
        self.rows = 0
        self.pending: list[pa.RecordBatch] = []
        self.pending_rows = 0
        self.ids = ids  # 64-bit id hashes and row numbers, dataset-wide
        self.shard_rows: list[int] = []
        self.stats: dict[str, np.ndarray] = {}  # per source: see source_stats()

    def add(self, path: Path, future: Future) -> None:
        """Take one shard's summaries (in dataset order) and check them chunk by chunk."""
        try:
            diffs, summaries, rows, stats = future.result()
        except StageError as e:
            self.findings.add("shards_readable", 1, [str(e)[:300]])
            self.shard_rows.append(0)
            return
        if diffs:
            self.findings.add("features", len(diffs), [f"{path.name}: {d}" for d in diffs])
        for summary in summaries:
            first = pc.add(summary.column("row"), self.rows)
            self.pending.append(summary.set_column(0, "row", first))
            self.pending_rows += summary.num_rows
            if self.pending_rows >= CHUNK_ROWS:
                self.flush()
        self.rows += rows
        self.shard_rows.append(rows)
        _add_stats(self.stats, stats)
        log.info("shard %d %s: %d rows, %d in all", len(self.shard_rows), path.name, rows,
                 self.rows)

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


# what summarising a readable shard of the wrong types raises
_SUMMARY_ERRORS = (StageError, pa.ArrowException, KeyError, ValueError, TypeError)


def summarize_shard(path: Path, vocab: int, width: int):
    """(schema differences, summary batches, rows, per-source stats) of one shard.

    Runs in a worker thread; summary rows are numbered from 0 within the shard. A shard
    whose columns cannot be summarised (a list of floats, say) is only counted: its
    schema differences say what is wrong with it. StageError if it cannot be read.
    """
    summaries, rows, failure = [], 0, None
    with open_shard(path, drop_behind=True) as reader:
        diffs = schema_differences(reader.schema)
        for batch in reader:
            if failure is None:
                try:
                    summaries.append(summarize(batch, vocab, rows))
                except _SUMMARY_ERRORS as e:
                    failure = e
            rows += batch.num_rows
    summary = None
    if summaries and failure is None:
        # one batch per shard: few large batches are cheap to convert and count, many
        # small not; the casts to one schema for all shards are done here, once, too
        summary = pa.concat_batches(summaries)
        try:
            summary = pa.RecordBatch.from_arrays(
                [pc.cast(c, SUMMARY_TYPES[name])
                 for c, name in zip(summary.columns, summary.schema.names)],
                names=summary.schema.names,
            )
        except _SUMMARY_ERRORS as e:
            failure = e
    if failure is not None:
        if not diffs:
            raise StageError(f"{path}: cannot summarise its rows ({failure})")
        return diffs + [f"its rows were not checked ({failure})"], [], rows, {}
    if summary is None:
        return diffs, [], rows, {}
    return diffs, [summary], rows, source_stats(summary, width)


def bin_width(max_seq_len: int) -> int:
    return max(1, -(-max_seq_len // LENGTH_BINS))


def source_stats(summary: pa.RecordBatch, width: int) -> dict[str, np.ndarray]:
    """Per source, one int64 vector: rows, tokens, supervised tokens, then the token-length
    histogram (LENGTH_BINS bins of `width` + one past), then the supervised-fraction one."""
    lengths = pc.fill_null(summary.column("input_ids_len"), 0).to_numpy()
    supervised = pc.fill_null(summary.column("supervised"), 0).to_numpy()
    encoded = pc.dictionary_encode(pc.fill_null(summary.column("source"), "(null)"))
    codes = encoded.indices.to_numpy()
    names = encoded.dictionary.to_pylist()
    k, lb, fb = len(names), LENGTH_BINS + 1, FRACTION_BINS
    length_bin = np.minimum(lengths // width, LENGTH_BINS)
    fraction_bin = np.minimum(supervised * fb // np.maximum(lengths, 1), fb - 1)
    out = np.empty((k, 3 + lb + fb), np.int64)
    out[:, 0] = np.bincount(codes, minlength=k)
    out[:, 1] = np.bincount(codes, weights=lengths, minlength=k)
    out[:, 2] = np.bincount(codes, weights=supervised, minlength=k)
    out[:, 3 : 3 + lb] = np.bincount(codes * lb + length_bin, minlength=k * lb).reshape(k, lb)
    out[:, 3 + lb :] = np.bincount(codes * fb + fraction_bin, minlength=k * fb).reshape(k, fb)
    return {name: out[i] for i, name in enumerate(names)}


def _add_stats(into: dict[str, np.ndarray], stats: dict[str, np.ndarray]) -> None:
    for name, vector in stats.items():
        if name in into:
            into[name] = into[name] + vector
        else:
            into[name] = vector.copy()


SUMMARY_TYPES = {
    name: pa.large_string() if name in ("id", "source") else pa.int64()
    for name in ["row", "id", "source", "input_ids_len", "loss_mask_len", "ids_out_of_range",
                 "mask_not_binary", "supervised", "longest_run", "num_tokens",
                 "num_loss_tokens"]
}


def summarize(batch: pa.RecordBatch, vocab: int, first_row: int) -> pa.RecordBatch:
    """One summary row per row of `batch`, from the flattened lists (no per-row loop).

    id, source and the stored counters keep the shard's own types (summarize_shard casts
    them to SUMMARY_TYPES): a compute call costs about as much as the numpy work on a
    1000-row batch, so per-batch calls are kept few.
    """
    n = batch.num_rows
    ids_col = batch.column("input_ids")
    mask_col = batch.column("loss_mask")
    id_off, id_vals = _flat(ids_col)
    mask_off, mask_vals = _flat(mask_col)

    out_of_range = _count_from(id_vals, id_off, vocab)  # negatives too: compared unsigned
    not_binary, ones = _binary(mask_vals, mask_off)
    supervised, longest = _runs(ones, mask_off, n)

    id_nulls, mask_nulls = _null_mask(ids_col), _null_mask(mask_col)

    def ints(values: np.ndarray, nulls: Optional[np.ndarray]) -> pa.Array:
        return pa.array(values, pa.int64(), mask=nulls)

    return pa.RecordBatch.from_arrays(
        [
            pa.array(np.arange(first_row, first_row + n, dtype=np.int64)),
            batch.column("id"),
            batch.column("source"),
            ints(np.diff(id_off), id_nulls),
            ints(np.diff(mask_off), mask_nulls),
            ints(out_of_range, id_nulls),
            ints(not_binary, mask_nulls),
            ints(supervised, mask_nulls),
            ints(longest, mask_nulls),
            batch.column("num_tokens"),
            batch.column("num_loss_tokens"),
        ],
        names=list(SUMMARY_TYPES),
    )


def _flat(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Row offsets (from 0) and the flattened values of a list column; null items -> -1."""
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        raise StageError(f"column is {column.type}, not a list")
    if not pa.types.is_integer(column.type.value_type):
        raise StageError(f"column holds {column.type.value_type}, not integers")
    offsets = column.offsets.to_numpy().astype(np.int64, copy=False)
    if len(offsets) == 0:  # an empty array may come without its single 0 offset
        offsets = np.zeros(1, np.int64)
    values = column.values.slice(offsets[0], offsets[-1] - offsets[0])
    if values.null_count:
        values = pc.fill_null(values, -1)
    return offsets - offsets[0], values.to_numpy()


def _null_mask(column: pa.Array) -> Optional[np.ndarray]:
    if not column.null_count:
        return None
    return pc.is_null(column).to_numpy(zero_copy_only=False)


def _count_from(values: np.ndarray, offsets: np.ndarray, limit: int) -> np.ndarray:
    """Per-row count of values outside [0, limit).

    Viewed as unsigned, a negative value is huge, so one max() pass clears clean data;
    only a batch holding a bad value pays for the per-row counts.
    """
    n = len(offsets) - 1
    unsigned = values.view(np.dtype(f"u{values.itemsize}"))
    if len(values) == 0 or unsigned.max() < limit:
        return np.zeros(n, np.int64)
    cumulative = np.concatenate(([0], np.cumsum(unsigned >= limit, dtype=np.int64)))
    return cumulative[offsets[1:]] - cumulative[offsets[:-1]]


def _binary(values: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row count of mask values outside {0, 1}, and the mask as 0/1 bytes.

    The contract's int8 mask is read as 64-bit words: one OR over them shows that no
    byte holds more than its low bit, so clean data costs one pass over an eighth of the
    elements and is used as is. Anything else pays for the per-row counts.
    """
    if values.itemsize == 1:
        data = values.view(np.uint8)
        words, tail = _words(data)
        high = np.bitwise_or.reduce(words) if len(words) else np.uint64(0)
        if not high & ~_LOW_BITS and not (tail > 1).any():
            return np.zeros(len(offsets) - 1, np.int64), data
    return _count_from(values, offsets, 2), (values == 1).view(np.uint8)


_LOW_BITS = np.uint64(0x0101010101010101)  # a word of eight 1 bytes


def _words(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A uint8 array as whole uint64 words (native order: byte k stays byte k), and the
    bytes left over."""
    whole = len(data) // 8 * 8
    return data[:whole].view(np.uint64), data[whole:]


def _changes(ones: np.ndarray) -> np.ndarray:
    """Sorted positions p (0 < p < len) where the 0/1 bytes differ from the byte before.

    Eight bytes are compared in one step, as a 64-bit word against the word one byte
    further on; the XOR of the few words that differ then has a 1 byte exactly where a
    change is. (A compare byte by byte, then np.flatnonzero over its result, or any
    per-position fancy indexing, costs several times more.)
    """
    size = len(ones)
    whole = max(size - 1, 0) // 8
    here = ones[: whole * 8].view(np.uint64)
    ahead = ones[1 : whole * 8 + 1].view(np.uint64)
    hits = np.flatnonzero(here != ahead)
    flips = np.flatnonzero((here[hits] ^ ahead[hits]).view(np.uint8))
    inside = hits[flips >> 3] * 8 + (flips & 7) + 1
    tail = whole * 8 + np.flatnonzero(ones[whole * 8 + 1 :] != ones[whole * 8 : -1]) + 1
    return np.concatenate((inside, tail))


def _runs(ones: np.ndarray, offsets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row: number of supervised tokens and the longest run of consecutive ones.

    Runs come from the positions where the 0/1 mask changes (see _changes); their
    number is small next to the token count.
    """
    size = len(ones)
    change = _changes(ones)
    rising = ones[change] == 1
    starts, ends = change[rising], change[~rising]
    if size and ones[0] == 1:
        starts = np.concatenate(([0], starts))
    if size and ones[-1] == 1:
        ends = np.concatenate((ends, [size]))
    # a run that continues across a row boundary is two runs: split it there
    inner = offsets[1:-1]
    inner = inner[(inner > 0) & (inner < size)]
    split = inner[(ones[inner - 1] == 1) & (ones[inner] == 1)]
    if len(split):
        starts = np.sort(np.concatenate((starts, split)))
        ends = np.sort(np.concatenate((ends, split)))
    lengths = ends - starts
    row = np.searchsorted(offsets, starts, side="right") - 1
    supervised = np.bincount(row, weights=lengths, minlength=n).astype(np.int64)[:n]
    longest = np.zeros(n, np.int64)
    np.maximum.at(longest, row, lengths)
    return supervised, longest


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
    lb = LENGTH_BINS + 1
    lengths = [(b + 1) * width for b in range(lb)]
    fractions = [round((b + 1) / FRACTION_BINS, 4) for b in range(FRACTION_BINS)]
    for folder, column, edges, part in (
        ("token_length", "tokens", lengths, slice(3, 3 + lb)),
        ("supervised_fraction", "supervised_fraction", fractions, slice(3 + lb, None)),
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
