"""Build the prompt mix from the sources in params.

  python -m stages.prepare --out PATH --reports PATH [--params params.yaml]
  (the paths: dvc.yaml's cmd)

Reads each source of `prepare.sources` as a stream (stages/sources/readers.py), makes its
rows prompts (stages/sources/prompts.py: layout, cut where the model answers, id,
decontamination), drops repeats and keeps a source's `limit` (stages/sources/selection.py),
and writes data/prompts/prompts.jsonl, sources in params order and rows in source order,
with reports/prepare.json: rows read, kept and dropped by source and reason. Large
sources are made in worker processes (`num_proc`); the output does not depend on it.
Sources, cleaning, the mix and decontamination: docs/stages.md ("prepare").
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from pathlib import Path

from stages.common import outputs, params, stagefiles
from stages.common.errors import StageError
from stages.process import cli, cpus
from stages.sources import groups, layouts, prompts, readers, toolturns
from stages.sources.decontam import Match
from stages.sources.evals import Evals
from stages.sources.layouts import Dropped, FieldProbe
from stages.sources.prompts import Candidate, PromptSpec
from stages.sources.selection import LimitSampler

log = logging.getLogger("prepare")

PATHS = {"out": "folder the prompts are written to", "reports": "folder of the stage reports"}


def run(cfg: params.Prepare, paths) -> dict:
    """`paths`: the PATHS, as dvc.yaml gives them (`cli.pipeline_paths`)."""
    _check(cfg)
    outputs.check_apart(
        {f"prepare.{where}[{i}].path": d.path
         for where, sets in (("sources", cfg.sources),
                             ("decontaminate.evals", cfg.decontaminate.evals))
         for i, d in enumerate(sets)}, [("--out", paths.out)])
    started = time.monotonic()
    seen: dict[int, int] = {}  # dedup key -> index of the source it was first seen in
    per_source: dict[str, dict] = {}
    workers = groups.Workers(cfg.num_proc or cpus.workers_beside_reader())
    evals = Evals(cfg, workers.n > 1, paths.out)
    try:
        with outputs.atomic_dir(paths.out) as tmp:
            with open(tmp / stagefiles.PROMPTS_FILE, "wb", buffering=1 << 20) as out:
                for index, src in enumerate(cfg.sources):
                    per_source[src.name] = _one_source(index, src, cfg, seen, out, tmp, workers, evals)
            report = _report(cfg, per_source, len(seen), time.monotonic() - started)
            report["decontamination"] = evals.report()
            if report["totals"]["kept"] == 0:
                written = outputs.write_report(paths.reports, "prepare", report)
                raise StageError(
                    f"prepare: no prompt left after cleaning (see {written} for the reasons)"
                )
    finally:
        workers.close()
        evals.close()
    outputs.write_report(paths.reports, "prepare", report)
    t = report["totals"]
    log.info(
        "wrote %d prompts to %s (read %d, dropped %d) in %.1fs",
        t["kept"], paths.out / stagefiles.PROMPTS_FILE, t["read"], t["dropped"],
        report["seconds"],
    )
    return report


def _check(cfg: params.Prepare) -> None:
    if not cfg.sources:
        raise StageError("prepare.sources: at least one source is needed")
    params.check_ranges(cfg, "prepare")
    _check_names("prepare.sources", cfg.sources, "source")
    _check_names("prepare.decontaminate.evals", cfg.decontaminate.evals, "eval set")


def _check_names(section: str, entries: list, what: str) -> None:
    """Names unique and not empty; a layout's fields given for the layout that reads them."""
    names = set()
    for i, src in enumerate(entries):
        where = f"{section}[{i}]"
        if not src.name.strip():
            raise StageError(f"{where}.name: must not be empty")
        if src.name in names:
            raise StageError(f"{where}.name: {src.name!r} is used by an earlier {what}")
        names.add(src.name)
        if src.format == "columns":
            if not src.prompt_field:
                raise StageError(f"{where}.prompt_field: required with format columns")
            for key in ("messages_field", "role_key", "content_key"):
                if getattr(src, key):
                    raise StageError(
                        f"{where}.{key}: only for formats sharegpt/messages; "
                        "format columns reads prompt_field"
                    )
        elif src.prompt_field:
            raise StageError(
                f"{where}.prompt_field: only for format columns; "
                f"format {src.format} reads messages_field"
            )


# ------------------------------------------------------------------------ one source


def _one_source(
    index: int, src: params.Source, cfg: params.Prepare, seen: dict, out, tmp: Path,
    workers: groups.Workers, evals: Evals,
) -> dict:
    token = f"{os.getpid()}-{time.monotonic_ns()}-{index}"
    spec = PromptSpec(token, index, src, cfg.multi_turn, cfg.dedup, cfg.max_prompt_chars,
                      cfg.seed, src.limit is not None, evals.key, cfg.tool_conversations)
    layout = layouts.Layout(src, cfg.multi_turn)
    probe = FieldProbe(src, layout)
    reader = readers.Reader(src, layout.columns(), probe.check_schema, cfg.max_record_bytes)
    dropped = dict.fromkeys(layouts.SOURCE_DROP_REASONS, 0)
    repaired = dict.fromkeys(toolturns.TOOL_CALL_REPAIRS, 0)
    unknown_roles: Counter = Counter()
    skip_bad = cfg.on_bad_row == "skip"
    limit = src.limit
    sampler = LimitSampler(tmp / f".spool-{index}", limit) if limit is not None else None
    read = candidates = multi = with_tools = chars_sum = 0
    regen: Counter = Counter()  # multi_turn: regenerate, by prompts.REGEN_KINDS
    last_log = time.monotonic()
    log.info("source %s: reading %s (%s)", src.name, src.path, src.format)

    # One loop, counters in locals on purpose: its body runs once per source row, and
    # attribute or call overhead there shows in prepare_vs_read (bench/README.md)
    made = groups.prepared_groups(reader, probe, spec, workers, evals)
    for group in made:
        if group.prepared.unknown_roles:
            unknown_roles.update(group.prepared.unknown_roles)
        for pos, res in zip(group.positions, group.prepared.results):
            if res is None:
                continue  # a blank line is not a row
            read += 1
            kind = type(res)
            if kind is Candidate:
                key = res.key
                if key is not None:
                    first = seen.get(key)
                    if first is not None:
                        dropped["duplicate" if first == index else "duplicate_cross_source"] += 1
                        continue
                    seen[key] = index
                if sampler is not None:
                    sampler.add(res.line, res.sample)
                else:
                    out.write(res.line)
                candidates += 1
                chars_sum += res.chars
                multi += res.multi_turn
                with_tools += res.has_tools
                if res.regen:
                    regen[res.regen] += 1
                for reason in res.repairs:
                    repaired[reason] += 1
            elif kind is Dropped:
                dropped[res.reason] += 1
            elif kind is Match:
                dropped["contaminated"] += 1
                evals.count(src.name, res)
            elif kind is readers.BadRow:
                if not skip_bad:
                    where = (f"{group.file}:{pos}" if group.unit == "line"
                             else f"{group.file}: row {pos}")
                    raise StageError(f"{where}: {res.message}; set prepare.on_bad_row: skip "
                                     "to count and skip such rows")
                dropped[res.reason] += 1
        if time.monotonic() - last_log > 15:
            last_log = time.monotonic()
            log.info("source %s: %d rows read, %d prompts so far", src.name, read, candidates)

    kept = candidates
    if sampler is not None:
        kept = sampler.emit(out)
        dropped["over_limit"] = candidates - kept
    if unknown_roles:
        log.warning(
            "source %s: unknown roles (rows dropped): %s; map them with role_map",
            src.name, dict(unknown_roles.most_common(10)),
        )
    if read == 0:
        log.warning("source %s: no rows in %s", src.name, src.path)
    elif kept == 0:
        log.warning("source %s: all %d rows dropped", src.name, read)
    total_dropped = sum(dropped.values())
    assert read == kept + total_dropped, (src.name, read, kept, dropped)
    log.info("source %s: %d read, %d kept, %d dropped", src.name, read, kept, total_dropped)
    stats = {
        "read": read,
        "kept": kept,
        "dropped": total_dropped,
        "dropped_by_reason": dropped,
        "cleaned": candidates,
        "limit": limit,
        "multi_turn_prompts": multi,
        "tool_prompts": with_tools,
        "repaired": repaired,
        "mean_prompt_chars": round(chars_sum / candidates, 1) if candidates else 0.0,
    }
    if cfg.multi_turn == "regenerate":  # of the cleaned prompts, before the limit
        stats["regenerate"] = {kind: regen[kind] for kind in prompts.REGEN_KINDS}
    if unknown_roles:
        stats["unknown_roles"] = dict(unknown_roles.most_common(20))
    return stats


def _report(cfg: params.Prepare, per_source: dict, unique: int, seconds: float) -> dict:
    by_reason = dict.fromkeys(layouts.SOURCE_DROP_REASONS, 0)
    for stats in per_source.values():
        for reason, n in stats["dropped_by_reason"].items():
            by_reason[reason] += n
    repaired = dict.fromkeys(toolturns.TOOL_CALL_REPAIRS, 0)
    for stats in per_source.values():
        for reason, n in stats["repaired"].items():
            repaired[reason] += n
    read = sum(s["read"] for s in per_source.values())
    kept = sum(s["kept"] for s in per_source.values())
    return {
        "totals": {
            "read": read,
            "kept": kept,
            "dropped": read - kept,
            "dropped_by_reason": by_reason,
            "repaired": repaired,
            "unique_prompts_seen": unique,
        },
        "sources": per_source,
        "seed": cfg.seed,
        "multi_turn": cfg.multi_turn,
        "dedup": cfg.dedup,
        "max_prompt_chars": cfg.max_prompt_chars,
        "seconds": round(seconds, 2),
        "rows_per_second": round(read / seconds) if seconds > 0 else 0,
    }


if __name__ == "__main__":
    cli.entry("prepare", __doc__, run, PATHS)
