"""A stage's report in two files: the data facts DVC compares, and how the run went.

A stage builds one report dict and hands it to outputs.write_report, which writes
`reports/<stage>.json`, its DVC metrics file (what the data and the params determine),
and `reports/runs/<stage>.json`, how this run went (timings, throughput, memory, the
request cache, the host: a plain out of the stage, never compared). A rerun that changes
no data therefore writes the same metrics file (docs/versions.md, "Compare runs").

RUN names, per stage, the keys that go to the run file (dotted: a key inside a section);
every other key is a fact. A key a stage adds is a fact until it is listed here.
"""

from __future__ import annotations

import copy
import platform
from pathlib import Path
from typing import Optional

from stages.common import reading

from stages.process import cpus
from stages.common.errors import StageError
from stages.common.reading import json_file

RUN_FOLDER = "runs"

_GENERATE_SPEED = ("wall_time_s", "duration_s", "request_throughput", "input_throughput",
                   "output_throughput", "mean_e2e_latency_ms", "median_e2e_latency_ms",
                   "p90_e2e_latency_ms", "p99_e2e_latency_ms", "concurrency")
# how this run reached the answers: a rerun reads from the request cache what the first
# one sent, for the same completions
_GENERATE_TRAFFIC = ("from_cache", "sent", "retries", "clamped", "context", "cache_damaged",
                     "cache_unverified")
# where and how the engine ran on this host (the card keeps engine, version, model, args)
_GENERATE_HOST = ("server.url", "server.python", "server.model_path", "server.served_model",
                  "server.restarts", "server.restart_reasons", "server.log")

RUN: dict[str, tuple[str, ...]] = {
    "prepare": ("seconds", "rows_per_second", "decontamination.index_mb"),
    "generate": _GENERATE_SPEED + _GENERATE_TRAFFIC + _GENERATE_HOST,
    "tokenize": ("seconds", "tokens_per_second"),
    # linked or copied depends on the filesystems, not on the data
    "merge": ("seconds", "created", "bytes_written", "shards.base_linked", "shards.base_copied",
              "shards.new_linked", "shards.new_copied"),
    "validate": ("seconds", "samples_page_seconds", "train_check.tokens_per_second", "train_check.batches_per_second",
                 "train_check.peak_memory_mb", "train_check.peak_memory_mb_per_step",
                 "train_check.process_peak_rss_mb", "train_check.memory",
                 "train_check.seconds", "train_check.longest_batch.peak_memory_mb",
                 "train_check.longest_batch.seconds",
                 "train_check.longest_batch.full_logits_mb"),
}


def facts_path(folder: Path, stage: str) -> Path:
    """The stage's DVC metrics file."""
    return Path(folder) / f"{stage}.json"


def run_path(folder: Path, stage: str) -> Path:
    """The stage's report of its run (not a metric)."""
    return Path(folder) / RUN_FOLDER / f"{stage}.json"


def split(stage: str, report: dict) -> tuple[dict, dict]:
    """(facts, run) of a stage's report; the run part gains the host it ran on."""
    facts, run = copy.deepcopy(report), {}
    for key in RUN.get(stage, ()):
        *parents, last = key.split(".")
        section = facts
        for name in parents:
            section = section.get(name) if isinstance(section, dict) else None
        if isinstance(section, dict) and last in section:
            target = run
            for name in parents:
                target = target.setdefault(name, {})
            target[last] = section.pop(last)
    run["host"] = host()
    return facts, run


def host() -> dict:
    """What the timings and memory figures of a run depend on besides the data."""
    return {"cpus": cpus.usable(), "machine": platform.machine(), "system": platform.system(),
            "python": platform.python_version()}


def read(folder: Path, stage: str) -> dict:
    """The whole report of the stage's last run: its facts with the run's figures put back
    in place ({} when the stage has not written one)."""
    facts = _load(facts_path(folder, stage)) or {}
    return _overlay(facts, _load(run_path(folder, stage)) or {})


def _load(path: Path) -> Optional[dict]:
    """The report at `path`, None when it is missing or not a JSON object; a FIFO or a
    device in its place is a StageError naming it (reading.json_file, the one reader)."""
    try:
        return json_file(path)
    except (FileNotFoundError, IsADirectoryError):
        return None
    except StageError:
        if reading.regular(path):  # unreadable JSON: as no report; anything else: raised
            return None
        raise


def _overlay(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _overlay(out[k], v)
        else:
            out[k] = v
    return out
