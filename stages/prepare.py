"""Prepare: build the prompt mix (data/prompts/prompts.jsonl) from the sources in params.

Each source in `prepare.sources` is read as a stream (JSON lines, JSON array, Parquet,
Arrow / save_to_disk folders, or a Hugging Face dataset id), mapped from its layout
(sharegpt, messages or columns) to chat messages, and cut where the model must answer:
after the last user or tool turn (`multi_turn: context`, earlier turns kept with their
original answers) or after the first user turn (`multi_turn: first_user`).

Rows are dropped, and counted by source and reason in reports/prepare.json, when a field
is missing/null/mistyped, a role is unknown, there is no user turn, the turn to answer is
blank, the prompt is over `max_prompt_chars`, or it duplicates an earlier prompt
(same text after NFC and removing all whitespace; first occurrence wins, sources in
params order). A source's
`limit` then keeps the rows whose ids hash lowest under the seed, so the same params give
byte-identical output and changing one source's limit changes only that source's rows.

Output, one JSON object per line, sources in params order, rows in source order:
  {"id": "<32 hex>", "source": "<name>", "messages": [{"role", "content", ...}],
   "tools": [...]}            (tools only when the source has them)
`id` is XXH3-128 of the source name and the compact JSON of the messages (+ tools) as
converted from the source row, before tool turns are settled. Converted turns always have
the same key order, so keys are sorted only in rows with tools or tool calls (whose
structures come as the source wrote them): the same prompt keeps its id in every run,
whatever the row order.
Tool turns and calls are then settled for engines and routers (stages/sources/toolturns.py).
"""

from __future__ import annotations

import heapq
import logging
import operator
import os
import shutil
import time
import unicodedata
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import orjson
import xxhash

from stages.chat import conversation
from stages.common import outputs, params
from stages.common.errors import StageError, json_type
from stages.process import children, cli, cpus
from stages.sources import decontam, layouts, readers, toolturns
from stages.sources.checker import CHECK_AHEAD, Checker

log = logging.getLogger("prepare")

PATHS = {"out": "folder the prompts are written to", "reports": "folder of the stage reports"}
PROBE_ROWS = 1000  # rows of a schemaless source checked for the configured fields
LOCAL_ROWS = 20000  # rows of each source prepared in-process before workers (or the checker) take over
_SEQ_BITS = 40  # sample entries pack (hash << 40 | candidate number) into one int
_SEQ_MASK = (1 << _SEQ_BITS) - 1


def run(cfg: params.Prepare, paths) -> dict:
    """`paths`: the PATHS, as dvc.yaml gives them (`cli.pipeline_paths`)."""
    _check(cfg)
    started = time.monotonic()
    seen: dict[int, int] = {}  # dedup key -> index of the source it was first seen in
    per_source: dict[str, dict] = {}
    workers = _Workers(cfg.num_proc or _auto_workers())
    evals = _Evals(cfg, workers.n > 1, paths.out)
    try:
        with outputs.atomic_dir(paths.out) as tmp:
            with open(tmp / conversation.PROMPTS_FILE, "wb", buffering=1 << 20) as out:
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
        t["kept"], paths.out / conversation.PROMPTS_FILE, t["read"], t["dropped"],
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


# ------------------------------------------------------------------------ one row


@dataclass(frozen=True)
class _Spec:
    """What it takes to turn raw rows of one source into output lines (sent to workers)."""

    token: str  # unique per source per run: workers cache their row maker by it
    index: int
    src: params.Source
    multi_turn: str
    dedup: str
    max_chars: int
    seed: int
    sampled: bool
    evals: Optional[str]  # key of the decontamination index (decontam.opened)


class _RowMaker:
    """Raw item -> None (blank line) | BadRow | drop reason | candidate tuple
    (dedup key or None, output line, chars, is multi-turn, has tools, sample hash or None,
    repairs of its tool calls).
    Runs in the main process or in a worker; the main process does the dedup check."""

    def __init__(self, spec: _Spec):
        self.spec = spec
        self.layout = layouts.Layout(spec.src, spec.multi_turn)
        self.id_prefix = spec.src.name.encode() + b"\0"
        self.line_prefix = b'","source":' + orjson.dumps(spec.src.name) + b","
        self.seed = spec.seed  # in xxh3's range: params.Prepare.seed
        self.evals = decontam.opened(spec.evals) if spec.evals else None

    def make_all(self, items: list) -> list:
        if self.evals is None:
            make = self.make
            return [make(item) for item in items]
        results, texts, counts = self.make_unchecked(items)
        return self.drop_matches(results, self.evals.check(texts, counts))

    def make_unchecked(self, items: list) -> tuple[list, list[str], list[int]]:
        """The results of `make`, and what decontamination checks of the candidates among
        them: their message texts in a row, and how many texts each has."""
        make = self.make
        texts: list[str] = []
        counts: list[int] = []
        results = [make(item, texts, counts) for item in items]
        return results, texts, counts

    def drop_matches(self, results: list, hits: list) -> list:
        """`results` with each candidate that has a hit (one per candidate, in order)
        replaced by its decontam.Match."""
        if hits.count(None) == len(hits):
            return results
        at = [i for i, res in enumerate(results) if type(res) is tuple]
        for i, hit in zip(at, hits):
            if hit is not None:
                pid = results[i][1][7:39].decode()  # the line starts {"id":"<32 hex>"
                results[i] = decontam.Match(pid, *self.evals.where(hit[0]), hit[1])
        return results

    def make(self, item, texts: Optional[list] = None, counts: Optional[list] = None):
        if type(item) is bytes:
            try:
                item = orjson.loads(item)
            except orjson.JSONDecodeError:
                item = readers.parse_line(item)
        if type(item) is not dict:
            if item is None or type(item) is readers.BadRow:
                return item
            return readers.BadRow("not_an_object", f"expected a JSON object, got {json_type(item)}")
        res = self.layout.convert(item)
        if type(res) is str or type(res) is readers.BadRow:
            return res
        messages, tools, chars, calls = res
        spec = self.spec
        if chars > spec.max_chars:
            return "too_long"
        payload = {"messages": messages, "tools": tools} if tools else {"messages": messages}
        try:
            body = orjson.dumps(payload)
        except TypeError:  # lone surrogates cannot be written as UTF-8
            return "invalid_text"
        # messages are built with a fixed key order; only tool structures need sorting
        structured = tools or calls
        canon = orjson.dumps(payload, option=orjson.OPT_SORT_KEYS) if structured else body
        key = None if spec.dedup == "off" else dedup_key(messages, tools, spec.dedup)
        pid = xxhash.xxh3_128_hexdigest(self.id_prefix + canon).encode()
        # after the id and dedup key: adding tool_call_ids, unwrapping <tool_response> and
        # writing arguments as text keep the ids prompts had before, and depend only on
        # the conversation
        repairs = toolturns.settle_tool_calls(messages) if calls else ()
        if toolturns.settle_tool_turns(messages) or repairs:
            body = orjson.dumps(payload)
        line = b"".join((b'{"id":"', pid, self.line_prefix, memoryview(body)[1:], b"\n"))
        sample = xxhash.xxh3_64_intdigest(pid, seed=self.seed) if spec.sampled else None
        multi = len(messages) - (messages[0]["role"] == "system") > 1  # earlier turns as context
        if texts is not None:
            # what decontamination checks: all but the answers kept as context, which stay
            # as empty texts (no words) so that each candidate keeps one text per message.
            # Strings, not the messages: holding a batch of dicts alive until its check
            # made the garbage collector's passes cost ~3% of prepare's time
            if multi:
                texts.extend([m["content"] if m["role"] != "assistant" else "" for m in messages])
            else:  # a system and a user turn at most: no comprehension to run
                texts.extend(map(_CONTENT, messages))
            counts.append(len(messages))
        return (key, line, chars, multi, bool(structured or messages[-1]["role"] == "tool"),
                sample, repairs)


_CONTENT = operator.itemgetter("content")
_MAKERS: dict[str, _RowMaker] = {}


def _maker(spec: _Spec) -> _RowMaker:
    maker = _MAKERS.get(spec.token)
    if maker is None:
        _MAKERS.clear()
        maker = _MAKERS[spec.token] = _RowMaker(spec)
    return maker


def _unknown_roles(maker: _RowMaker) -> dict:
    unknown = dict(maker.layout.unknown_roles)
    maker.layout.unknown_roles.clear()
    return unknown


def _work(spec: _Spec, items: list) -> tuple[list, dict]:
    """Prepare one chunk of rows (in a worker process, or inline)."""
    maker = _maker(spec)
    return maker.make_all(items), _unknown_roles(maker)


class _Workers:
    """A pool of `n` worker processes, started only when a source proves large."""

    def __init__(self, n: int):
        self.n = n
        self.pool: Optional[children.Workers] = None

    def get(self) -> children.Workers:
        if self.pool is None:
            # spawn, not fork: a source read earlier may have started pyarrow/datasets threads
            self.pool = children.Workers("spawn", self.n)
            log.info("started %d worker processes", self.n)
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()


def _prepared_groups(
    reader: readers.Reader, probe: "_Probe", spec: _Spec, workers: _Workers, evals: "_Evals"
) -> Iterator[tuple]:
    """(file, unit, positions, results, unknown roles) per group of rows, in source order.

    The first LOCAL_ROWS rows are prepared here; the rest, when num_proc > 1, in worker
    processes with at most 4 groups per worker in flight, so memory stays flat however
    far the reader could run ahead; in one process with decontamination, here while the
    checker process checks the groups before (at most CHECK_AHEAD) once it is ready."""
    pending: deque = deque()
    sent = 0
    try:
        for positions, items in reader.batches():
            if probe.active:
                for pos, item in zip(positions, items):
                    if probe.active:
                        probe.see(item, reader.where(pos))
            meta = (reader.current, reader.unit, positions)
            if workers.n > 1 and sent >= LOCAL_ROWS:
                pending.append((meta, workers.get().submit(_work, spec, items)))
                while len(pending) > 4 * workers.n:
                    meta, job = pending.popleft()
                    yield meta + _result(job, workers)
            elif sent >= LOCAL_ROWS and evals.checker_ready():  # once ready, it stays ready
                pending.append((meta, _CheckJob(evals.checker, spec, items)))
                while len(pending) > CHECK_AHEAD:
                    meta, job = pending.popleft()
                    yield meta + job.get()
            else:  # `sent` only grows, so no group is pending here
                yield meta + _work(spec, items)
            sent += len(items)
        probe.finish()
        while pending:
            meta, job = pending.popleft()
            yield meta + _result(job, workers)
    finally:
        if pending and evals.checker is not None:  # left early: replies the next source must not read
            evals.checker.close()


def _result(job, workers: _Workers) -> tuple:
    """A group's result from a worker process or from the checker."""
    if isinstance(job, _CheckJob):
        return job.get()
    return workers.get().result(job, "prepare")


class _CheckJob:
    """A group whose texts went to the checker: its rows, kept here until its hits come back."""

    def __init__(self, checker: Checker, spec: _Spec, items: list):
        self.checker, self.maker = checker, _maker(spec)
        self.results, self.texts, self.counts = self.maker.make_unchecked(items)
        self.unknown = _unknown_roles(self.maker)
        checker.send(self.texts, self.counts)

    def get(self) -> tuple[list, dict]:
        hits = self.checker.hits()
        if hits is None:
            hits = self.maker.evals.check(self.texts, self.counts)
        return self.maker.drop_matches(self.results, hits), self.unknown


# ------------------------------------------------------------------------ one source


def _one_source(
    index: int, src: params.Source, cfg: params.Prepare, seen: dict, out, tmp: Path,
    workers: _Workers, evals: "_Evals",
) -> dict:
    token = f"{os.getpid()}-{time.monotonic_ns()}-{index}"
    spec = _Spec(token, index, src, cfg.multi_turn, cfg.dedup, cfg.max_prompt_chars, cfg.seed,
                 src.limit is not None, evals.key)
    layout = layouts.Layout(src, cfg.multi_turn)
    probe = _Probe(src, layout)
    reader = readers.Reader(src, layout.columns(), probe.check_schema, cfg.max_record_bytes)
    dropped = dict.fromkeys(layouts.SOURCE_DROP_REASONS, 0)
    repaired = dict.fromkeys(toolturns.TOOL_CALL_REPAIRS, 0)
    unknown_roles: Counter = Counter()
    skip_bad = cfg.on_bad_row == "skip"
    limit = src.limit
    sampler = _LimitSampler(tmp / f".spool-{index}", limit) if limit is not None else None
    read = candidates = multi = with_tools = chars_sum = 0
    last_log = time.monotonic()
    log.info("source %s: reading %s (%s)", src.name, src.path, src.format)

    # One loop, counters in locals on purpose: its body runs once per source row, and
    # attribute or call overhead there shows in prepare_vs_read (bench/README.md)
    groups = _prepared_groups(reader, probe, spec, workers, evals)
    for current, unit, positions, results, unknown in groups:
        if unknown:
            unknown_roles.update(unknown)
        for pos, res in zip(positions, results):
            if res is None:
                continue  # a blank line is not a row
            read += 1
            kind = type(res)
            if kind is str:
                dropped[res] += 1
                continue
            if kind is decontam.Match:
                dropped["contaminated"] += 1
                evals.count(src.name, res)
                continue
            if kind is readers.BadRow:
                if not skip_bad:
                    where = f"{current}:{pos}" if unit == "line" else f"{current}: row {pos}"
                    raise StageError(
                        f"{where}: {res.message}; set prepare.on_bad_row: skip to count and skip such rows"
                    )
                dropped[res.reason] += 1
                continue
            key, line, chars, is_multi, has_tools, sample, repairs = res
            if key is not None:
                first = seen.get(key)
                if first is not None:
                    dropped["duplicate" if first == index else "duplicate_cross_source"] += 1
                    continue
                seen[key] = index
            if sampler is not None:
                sampler.add(line, sample)
            else:
                out.write(line)
            candidates += 1
            chars_sum += chars
            multi += is_multi
            with_tools += has_tools
            for reason in repairs:
                repaired[reason] += 1
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
    if unknown_roles:
        stats["unknown_roles"] = dict(unknown_roles.most_common(20))
    return stats


class _Evals:
    """The decontamination index of this run (none without evaluation sets), where
    worker processes find it (or the checker process, without workers), and the count of
    prompts it drops."""

    def __init__(self, cfg: params.Prepare, workers: bool, out: Path):
        self.key: Optional[str] = None
        self.out = out  # the index is saved beside it (outputs.scratch_dir)
        self.folder: Optional[str] = None
        policy = cfg.decontaminate
        self.policy = policy
        self.stats: dict[str, dict] = {}
        self.examples: list[dict] = []
        self.checker: Optional[Checker] = None
        self.cpu_times: Optional[tuple[int, int]] = None
        if not policy.evals:
            return
        self.index, self.stats = decontam.build(policy, cfg.on_bad_row, cfg.max_record_bytes)
        for st in self.stats.values():
            st.update(contaminated=0, by_source={})
        if workers:
            self.key = self.saved()
        else:
            self.key = f"inline-{os.getpid()}-{time.monotonic_ns()}"
            if cfg.num_proc == 0:  # one process chosen for a machine of <= 2 CPUs: use the second
                self.checker = Checker(self.saved)
                self.cpu_times = _cpu_times()  # how busy the machine is, from here on
        decontam.register(self.key, self.index)

    def saved(self) -> str:
        """The folder of the index, saved once for the processes that memory-map it;
        where a run killed outright left one, the next run removes it."""
        if self.folder is None:
            self.folder = str(outputs.scratch_dir(self.out, "evals"))
            self.index.save(Path(self.folder))
        return self.folder

    def checker_ready(self) -> bool:
        """Whether groups go to the checker process. It is started when a source first
        proves large, if a CPU sits idle then (else not at all this run), and takes groups
        once it has loaded the index."""
        if self.checker is None:
            return False
        if self.checker.gave_up:  # it stopped answering: this process checks from now on
            self.checker = None
            return False
        if self.checker.proc is None:
            if not _cpu_to_spare(self.cpu_times):
                log.info("decontamination checks in this process: no idle CPU for a checker")
                self.checker = None
                return False
            log.info("starting the decontamination checker process")
        return self.checker.ready()

    def count(self, source: str, match: "decontam.Match") -> None:
        st = self.stats[match.eval_set]
        st["contaminated"] += 1
        st["by_source"][source] = st["by_source"].get(source, 0) + 1
        if st["contaminated"] <= 3 and len(self.examples) < 20:
            self.examples.append(match.example(source))

    def report(self) -> dict:
        p = self.policy
        out = {"ngram": p.ngram, "min_overlap": p.min_overlap, "short_exact": p.short_exact,
               "evals": self.stats, "examples": self.examples}
        if self.key is not None:
            out["index_ngrams"] = len(self.index.hashes)
            out["index_mb"] = round(self.index.nbytes() / 2**20, 1)
        return out

    def close(self) -> None:
        if self.checker is not None:
            self.checker.close()
        if self.key is not None:
            decontam.forget(self.key)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def _auto_workers() -> int:
    """One worker per CPU but one (left to the reading process), at most 8; on two CPUs
    or fewer that is a single process, because workers would only compete with it (a
    decontamination checker, which takes less of a core, may run beside it)."""
    n = min(cpus.usable() - 1, 8)
    return n if n >= 2 else 1


def _cpu_times() -> Optional[tuple[int, int]]:
    """(idle, all) CPU time so far, in ticks, of the CPUs this process may run on, from
    /proc/stat; None where there is none."""
    try:
        mine = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        with open("/proc/stat", "rb") as f:
            lines = f.read().decode("ascii", "replace").splitlines()
    except (AttributeError, OSError):  # not Linux
        return None
    idle = total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name in mine:
            ticks = [int(x) for x in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
            idle += ticks[3] + ticks[4]
            total += sum(ticks)
    return (idle, total) if total else None


def _cpu_to_spare(since: Optional[tuple[int, int]]) -> bool:
    """Whether half a CPU or more sat idle since `since` (a _cpu_times reading), this
    process running meanwhile. On a busy machine a checker would only take CPU time from
    prepare and add its own costs (the pipe, its start), so the check stays in this process.
    Not the load average: that of the minute before counts prepare's own earlier runs."""
    now = _cpu_times()
    if since is None or now is None or now[1] <= since[1]:
        return False
    return (now[0] - since[0]) / (now[1] - since[1]) * cpus.usable() >= 0.5


class _LimitSampler:
    """A source's `limit`: the rows with the smallest sample hashes, kept in source order.

    Rows go to a spool file while a max-heap holds the best `limit` entries; `emit` then
    copies the chosen lines out, so memory holds `limit` integers, never the rows."""

    def __init__(self, path: Path, limit: int):
        self.path, self.limit = path, limit
        self.spool = open(path, "w+b", buffering=1 << 20)
        self.heap: list[int] = []  # (hash << _SEQ_BITS | row number), negated
        self.n = 0

    def add(self, line: bytes, sample: int) -> None:
        self.spool.write(line)
        entry = -((sample << _SEQ_BITS) | self.n)
        if len(self.heap) < self.limit:
            heapq.heappush(self.heap, entry)
        elif self.limit and entry > self.heap[0]:
            heapq.heapreplace(self.heap, entry)
        self.n += 1

    def emit(self, out) -> int:
        """Copy the sampled lines to `out`, in their original order; returns how many."""
        try:
            return self._copy(out)
        finally:
            self.spool.close()
            self.path.unlink()

    def _copy(self, out) -> int:
        spool = self.spool
        spool.flush()
        spool.seek(0)
        if len(self.heap) >= self.n:
            shutil.copyfileobj(spool, out, 1 << 20)
            return self.n
        chosen = sorted((-entry) & _SEQ_MASK for entry in self.heap)
        if not chosen:
            return 0
        want = iter(chosen)
        nxt = next(want)
        for seq, line in enumerate(spool):
            if seq == nxt:
                out.write(line)
                nxt = next(want, -1)
                if nxt < 0:
                    break
        return len(chosen)


# Dedup text: a role marker and the text of each message, tool calls and tools as sorted
# JSON; Unicode NFC and every whitespace character removed. So "2+2" and "2 + 2", or a
# prompt re-wrapped or with a trailing newline, are duplicates. For ASCII text that is
# one bytes.translate; only other text goes through NFC and str.split.
_MARK = {role: f"\0{role}\0" for role in conversation.ROLES}
_ASCII_WS = bytes(c for c in range(128) if chr(c).isspace())


def dedup_key(messages: list[dict], tools, mode: str = "prompt") -> int:
    """64-bit key of a prompt, equal for prompts equal after normalization."""
    parts = []
    for m in messages:
        if mode == "user" and m["role"] != "user":
            continue
        parts.append(_MARK[m["role"]])
        parts.append(m["content"])
        if mode != "user" and "tool_calls" in m:
            parts.append("\0calls\0")
            parts.append(orjson.dumps(m["tool_calls"], option=orjson.OPT_SORT_KEYS).decode())
    if tools and mode != "user":
        parts.append("\0tools\0")
        parts.append(orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode())
    text = "".join(parts)
    if text.isascii():
        data = text.encode().translate(None, _ASCII_WS)
    else:
        data = "".join(unicodedata.normalize("NFC", text).split()).encode("utf-8", "surrogatepass")
    return xxhash.xxh3_64_intdigest(data)


class _Probe:
    """Fails fast, with the fields that do exist, when a configured field is misnamed.

    Sources with a schema are checked when each file opens; JSON sources by the keys of
    their first PROBE_ROWS rows (a field may be absent from some rows, but a field absent
    from all of them is a configuration error, not dirty data).
    """

    def __init__(self, src: params.Source, layout: layouts.Layout):
        self.src = src
        self.layout = layout
        self.fields = layout.fields()
        self.keys: dict[str, None] = {}
        self.turn_keys: dict[str, None] = {}
        self.rows = 0
        self.active = True
        self.where = src.path

    def check_schema(self, names: list[str], where: str) -> None:
        self.active = False  # the schema answers for every row of this file
        for param, field, _ in self.fields:
            if field not in names:
                self._fail(param, field, names, where)

    def see(self, row, where: str) -> None:
        if type(row) is bytes:
            row = readers.parse_line(row)
        if type(row) is not dict:
            return
        self.where = where.rsplit(":", 1)[0]
        for k in row:
            self.keys[k] = None
        mf = self.layout.messages_field
        if mf is not None and type(row.get(mf)) is list:
            for turn in row[mf][:8]:
                if type(turn) is dict:
                    for k in turn:
                        self.turn_keys[k] = None
        self.rows += 1
        if self.rows >= PROBE_ROWS:
            self.finish()

    def finish(self) -> None:
        if not self.active:
            return
        self.active = False
        if not self.rows:
            return
        for param, field, _ in self.fields:
            if field not in self.keys:
                self._fail(param, field, list(self.keys), f"the first {self.rows} rows of {self.where}")
        if self.layout.messages_field is not None and self.turn_keys:
            for param, key in (("role_key", self.layout.role_key), ("content_key", self.layout.content_key)):
                if key not in self.turn_keys:
                    self._fail(param, key, list(self.turn_keys), f"the turns of {self.where}",
                               what="turn key")
        if not self.layout.tools_field:
            hint = [k for k in ("tools", "functions") if k in self.keys]
            if hint:
                log.warning(
                    "source %s: rows have a %r field but tools_field is not set, so prompts "
                    "carry no `tools` (fine when the system prompt lists them, as in Hermes)",
                    self.src.name, hint[0],
                )

    def _fail(self, param: str, field: str, names, where: str, what: str = "field") -> None:
        shown = ", ".join(sorted(names)[:40]) or "none"
        raise StageError(
            f"source {self.src.name}: {param} {field!r}: no such {what} in {where} "
            f"({what}s: {shown})"
        )


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
