"""Tokenize completions into input_ids and assistant-only loss masks (data/tokenized/).

`python -m stages.tokenize` streams data/completions/completions.jsonl, renders each
conversation with the tokenizer's chat template (stages/chat/encoder.py: one render, one
batch encode, the mask from the pieces), filters (truncated, empty_content, too_long,
too_few_loss_tokens, no_engine_ids), checks every row's prompt against the tokens the
engine served (stages/chat/servecheck.py), and writes a save_to_disk folder in bounded
shards, data/tokenized/fingerprint.json and reports/tokenize.json.

num_proc worker processes (0: one per usable CPU) take chunks of about equal bytes from a
shared queue; results are written in input order, so the output does not depend on
num_proc. Behaviour, params and the report: docs/stages.md, "tokenize".
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import gc
import logging
import os
import time
from array import array
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import pyarrow as pa

from stages.chat import conversation, enginerows, regenerate, servecheck
from stages.chat.encoder import ChatEncoder
from stages.chat.engineids import Served
from stages.common import cpus, outputs, params
from stages.common.errors import (StageError, absent, json_object, open_regular,
                                  read_regular)
from stages.dataset.schema import (
    ARROW_SCHEMA,
    FINGERPRINT_FILE,
    ShardFile,
    shard_name,
    write_metadata,
)
from stages.process import children, cli

log = logging.getLogger(__name__)

PATHS = {"completions": "generate's folder", "out": "folder the dataset is written to",
         "reports": "folder of the stage reports"}
COMPLETION_DROP_REASONS = ("truncated", "empty_content", "too_long", "too_few_loss_tokens",
                           "no_engine_ids", "answer_mismatch")
# A worker's unit of work: at most CHUNK_BYTES of lines, shrinking towards the end of
# the file (a quarter of each worker's share of what is left) so that the last chunks
# do not leave a worker idle while another finishes a big one; never under
# MIN_CHUNK_BYTES, where per-chunk costs (one encode call, one Arrow batch) would show.
CHUNK_BYTES = 256 << 10
MIN_CHUNK_BYTES = 16 << 10
CHUNK_ROWS = 256


def run(cfg: params.Tokenize, paths) -> dict:
    """`paths`: the PATHS, as dvc.yaml gives them (`cli.pipeline_paths`)."""
    outputs.check_apart({"--completions": paths.completions, "tokenize.tokenizer": cfg.tokenizer,
                         "tokenize.chat_template": cfg.chat_template}, [("--out", paths.out)])
    try:
        report = tokenize_file(paths.completions / conversation.COMPLETIONS_FILE, paths.out, cfg)
    except RenderMismatch as e:  # the report shows the examples; no dataset is written
        outputs.write_report(paths.reports, "tokenize", e.report)
        raise
    outputs.write_report(paths.reports, "tokenize", report)
    return report


def tokenize_file(src: str | Path, dst: str | Path, cfg: Optional[params.Tokenize] = None,
                  **overrides: Any) -> dict:
    """Tokenize the completions file `src` into the dataset folder `dst`; return the report."""
    cfg = dataclasses.replace(cfg or params.Tokenize(), **overrides)
    params.check_ranges(cfg, "tokenize")
    # 0: a worker per usable CPU (the reading and writing here take little of one)
    cfg = dataclasses.replace(cfg, num_proc=cfg.num_proc or cpus.usable())
    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise StageError(absent(src, "the completions file: run the generate stage first"))
    if not src.is_file():  # a FIFO would block the reader
        raise StageError(f"{src}: not a regular file")
    started = time.monotonic()
    generation = generation_facts(src)
    cfg = dataclasses.replace(cfg, enable_thinking=thinking_of(cfg, generation, src))
    tok, tok_id = _load_tokenizer(cfg.tokenizer, cfg.chat_template, cfg.trust_remote_code,
                                  _file_stamp(cfg.chat_template))
    encoder = ChatEncoder(tok, enable_thinking=cfg.enable_thinking, name=_template_name(cfg))
    log.info("tokenizing %s with %s (template %s), multi_turn=%s, enable_thinking=%s, "
             "ids=%s, %d process(es)", src, cfg.tokenizer, _template_name(cfg),
             cfg.multi_turn, cfg.enable_thinking, cfg.ids, cfg.num_proc)
    totals = Totals()
    why = generation.get("engine_ids_missing", servecheck.NO_IDS)
    with outputs.atomic_dir(dst) as tmp:
        writer = ShardWriter(tmp, cfg.shard_rows, cfg.shard_max_mb << 20)
        for result in _results(src, cfg, encoder, why):
            totals.add(result)
            if result.batch is not None:
                writer.write(result.batch)
            totals.progress(started)
        names = writer.close()
        problem = servecheck.failure(totals.served, cfg.max_render_mismatch) or \
            servecheck.answer_failure(totals.served, cfg.max_answer_mismatch)
        if problem:
            raise RenderMismatch(problem, totals.report(cfg, 0, time.monotonic() - started))
        outputs.write_json(tmp / FINGERPRINT_FILE, fingerprint(tok_id, tok, cfg))
        write_metadata(tmp, names)
    report = totals.report(cfg, len(names), time.monotonic() - started)
    log.info("%d rows, %d tokens (%d supervised) in %d shards -> %s", report["rows"],
             report["tokens"], report["loss_tokens"], len(names), dst)
    if report["rows"] == 0:
        log.warning("no rows left after the filters; see the drops in the report")
    if report["lookalike_rows"]:
        log.warning("%d rows spell control tokens inside message text: tokenized as text "
                    "here (a server that does not sanitize them read control tokens)",
                    report["lookalike_rows"])
    served = report["serve_check"]
    if served["unchecked"]:
        log.warning("%d rows carry no engine token counts: not checked against what was "
                    "served", served["unchecked"])
    for reason, n in served["by_count_why"].items():
        log.info("%d rows checked by token count, not by ids: %s", n, reason)
    if served["unusable_ids"]:
        log.warning("%d rows carry engine token ids that are not a list of token ids",
                    served["unusable_ids"])
    if report["engine_ids_missing"]:
        log.warning("tokenize.ids: engine: %d rows have no engine token ids (%s): %s",
                    report["engine_ids_missing"], why,
                    "dropped" if cfg.on_missing_ids == "drop" else "rendered instead")
    if served["completion"]["beyond_slack"]:
        log.warning("%d rows supervise a token count beyond the slack from the engine's "
                    "completion count (see serve_check.completion in the report)",
                    served["completion"]["beyond_slack"])
    return report


class RenderMismatch(StageError):
    """More prompts than allowed differ from what the engine served; carries the report."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report


GENERATION_MAX_BYTES = 1 << 20  # generate writes a few hundred bytes


def generation_facts(src: Path) -> dict:
    """What generate recorded beside the completions (stages/generate.py write_outputs:
    model, sampling params, why rows may lack engine ids); {} when there is no such file."""
    path = src.parent / conversation.GENERATION_FILE
    if not os.path.lexists(path):
        return {}
    try:
        raw = read_regular(path, GENERATION_MAX_BYTES)
    except OSError as e:  # a folder, or gone since
        raise StageError(f"{path}: cannot read ({e.strerror}; the generate stage writes it)") from None
    facts = json_object(raw, str(path))
    sampling = facts.get("sampling")
    if not isinstance(sampling, dict) or not isinstance(sampling.get("enable_thinking"), bool):
        raise StageError(f"{path}: 'sampling.enable_thinking' must be true or false "
                         "(the generate stage writes it)")
    if not isinstance(facts.get("engine_ids_missing", ""), str):
        raise StageError(f"{path}: 'engine_ids_missing' must be a string")
    return facts


def thinking_of(cfg: params.Tokenize, generation: dict, src: Path) -> bool:
    """tokenize.enable_thinking, or when null what generate recorded: one fact, kept once.
    Completions that came without generate's record (written by hand or another tool) are
    taken as generated with generate's default, and the serve-render check tells."""
    recorded = generation["sampling"]["enable_thinking"] if generation else None
    if cfg.enable_thinking is None:
        if recorded is None:
            recorded = params.Generate.enable_thinking
            log.warning("%s is missing: tokenize.enable_thinking is null, so the completions "
                        "are taken as generated with generate's default, enable_thinking=%s",
                        src.parent / conversation.GENERATION_FILE, recorded)
        return recorded
    if recorded is not None and recorded != cfg.enable_thinking:
        log.warning("tokenize.enable_thinking=%s, but the completions were generated with "
                    "enable_thinking=%s (set it to null to follow generate)",
                    cfg.enable_thinking, recorded)
    return cfg.enable_thinking


def _template_name(cfg: params.Tokenize) -> str:
    return cfg.chat_template or f"{cfg.tokenizer} (its own template)"


@functools.lru_cache(maxsize=2)
def _load_tokenizer(spec: str, chat_template: Optional[str], trust_remote_code: bool,
                    stamp: Any):
    """The tokenizer and its identity, once per process (loading takes seconds)."""
    from stages.models import tokenizer

    tok = tokenizer.load_tokenizer(spec, chat_template, trust_remote_code)
    identity = tokenizer.identity(tok)
    _release_free_heap()
    return tok, identity


def _release_free_heap() -> None:
    """Give back the free pages that loading left in the C heap (glibc only).

    Loading a large tokenizer parses its JSON into temporaries that are freed, leaving
    hundreds of MB of free but resident pages between the tokenizer's own data. Forked
    workers inherit them; each page a worker's allocator then writes to is copied, so
    the workers' private memory crept up with the rows they processed. A full garbage
    collection first: it also empties the interpreter's free lists, which a worker's
    first full collection would otherwise free into inherited pages."""
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def _file_stamp(path: Optional[str]) -> Any:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def fingerprint(tok_id: dict, tok, cfg: params.Tokenize) -> dict:
    """The dataset's fingerprint.json: what made its tokens (merge refuses to mix others)."""
    import datasets
    import tokenizers
    import transformers

    from stages.models import tokenizer

    return {
        "tokenizer": tok_id,
        "chat_template_sha256": tokenizer.template_sha256(tok),
        # num_proc and the mismatch limits do not change a byte of the output
        "policy": {k: v for k, v in dataclasses.asdict(cfg).items()
                   if k not in ("num_proc", "max_render_mismatch", "max_answer_mismatch")},
        "versions": {
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "datasets": datasets.__version__,
            "pyarrow": pa.__version__,
        },
    }


# ---------------------------------------------------------------- reading


def _line_chunks(src: Path, num_proc: int = 1) -> Iterator[tuple[int, list[bytes]]]:
    """(first line number, lines) groups of lines, by bytes (see CHUNK_BYTES)."""

    def limit(left: int) -> int:
        return min(CHUNK_BYTES, max(MIN_CHUNK_BYTES, left // (4 * num_proc)))

    left = src.stat().st_size
    cap = limit(left)
    lines: list[bytes] = []
    size = 0
    first = 1
    with open_regular(src) as f:
        for no, line in enumerate(f, 1):
            if not lines:
                first = no
            lines.append(line)
            size += len(line)
            if size >= cap or len(lines) >= CHUNK_ROWS:
                yield first, lines
                left -= size
                cap = limit(left)
                lines, size = [], 0
    if lines:
        yield first, lines


def _results(src: Path, cfg: params.Tokenize, encoder: ChatEncoder,
             why_without: str = servecheck.NO_IDS) -> Iterator["ChunkResult"]:
    """Chunk results in input order, computed here or by `num_proc` forked workers."""
    global _STATE
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    # one encoding thread per process: num_proc processes use num_proc cores
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _STATE = (encoder, cfg, str(src), why_without)
    try:
        if cfg.num_proc == 1:
            for chunk in _line_chunks(src, 1):
                yield work(chunk)
            return
        # Workers share the parent's objects copy-on-write; a full garbage collection (in
        # any of the processes, once a run is long enough to trigger one) writes to every
        # tracked object and so copies the pages they sit on, ~40 MB per process. Frozen
        # objects are never scanned: they stay frozen while the workers live.
        gc.freeze()
        try:
            yield from _pooled(src, cfg)
        finally:
            gc.unfreeze()
    finally:
        _STATE = None
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _pooled(src: Path, cfg: params.Tokenize) -> Iterator["ChunkResult"]:
    """Chunk results in input order from `num_proc` forked workers (forked: they
    inherit the loaded tokenizer instead of loading it again)."""
    window = collections.deque()
    workers = children.Workers("fork", cfg.num_proc)
    try:
        for chunk in _line_chunks(src, cfg.num_proc):
            window.append(workers.submit(work, chunk))
            if len(window) >= 3 * cfg.num_proc:
                yield workers.result(window.popleft(), "tokenize")
        while window:
            yield workers.result(window.popleft(), "tokenize")
        # all done: workers exit on their own (terminate() kills them mid-queue, where
        # one holding the queue's lock can leave another waiting on it for ever)
        workers.close()
    except BaseException:
        workers.terminate()
        raise


# ---------------------------------------------------------------- one chunk

_STATE: Optional[tuple] = None


def _new_stats() -> dict:
    return {"conversations": 0, "rows": 0, "tokens": 0, "loss_tokens": 0,
            "dropped": dict.fromkeys(COMPLETION_DROP_REASONS, 0), "cut_to_max_seq_len": 0,
            "lookalike_rows": 0, "engine_rows": 0, "engine_ids_missing": 0,
            "engine_history_unsupervised": 0}


def _add_counts(into: dict, st: dict) -> None:
    """Add one source's counts `st` (as _new_stats makes them) into `into`."""
    for key, value in st.items():
        if key == "dropped":
            for reason, n in value.items():
                into["dropped"][reason] += n
        else:
            into[key] += value


@dataclasses.dataclass
class ChunkResult:
    batch: Optional[pa.RecordBatch]
    stats: dict  # source -> counters
    lengths: dict  # source -> array('i') of kept row lengths
    served: dict  # servecheck stats


def work(chunk: tuple[int, list[bytes]]) -> ChunkResult:
    """Parse, filter, render, encode and check one chunk of completion lines."""
    encoder, cfg, path, why_without = _STATE
    stats: dict = collections.defaultdict(_new_stats)
    plans, meta = _plan_chunk(chunk, encoder, cfg, path, stats)
    check = servecheck.ServeCheck(encoder, why_without)
    if not plans:
        return ChunkResult(None, dict(stats), {}, check.stats)
    batch = encoder.encode_plans(plans)
    record, lengths = _kept_rows(plans, meta, batch, check, cfg, path, stats)
    return ChunkResult(record, dict(stats), lengths, check.stats)


def _plan_chunk(chunk: tuple[int, list[bytes]], encoder: ChatEncoder, cfg: params.Tokenize,
                path: str, stats: dict) -> tuple[list, list]:
    """The render plans of a chunk's rows that are kept, and (row id, source, line, row
    when the plan ends with the engine's answer) for each; drops counted in `stats`."""
    first, lines = chunk
    plans, meta = [], []
    for no, raw in enumerate(lines, first):
        if not raw.strip():
            continue
        row = _parse(raw, path, no)
        src = row["source"]
        st = stats[src]
        st["conversations"] += 1
        final = row["messages"][-1]
        truncated = row["truncated"]
        if truncated and not cfg.keep_truncated:
            st["dropped"]["truncated"] += 1
            continue
        if not _has_answer(final, allow_reasoning=truncated):
            st["dropped"]["empty_content"] += 1
            continue
        try:
            row_plans = encoder.plan(row["messages"], row.get("tools"),
                                     policy=cfg.multi_turn, truncated=truncated,
                                     lookalikes=None if encoder.codec.json_may_spell(raw) else False)
        except StageError as e:
            raise StageError(f"{path}:{no}: row {row['id']!r}: {e}") from None
        for p in row_plans:
            if p.n_messages < len(row["messages"]) and not _has_answer(
                    row["messages"][p.n_messages - 1], allow_reasoning=False):
                st["dropped"]["empty_content"] += 1
                continue
            plans.append(p)
            whole = p.n_messages == len(row["messages"])
            rid = row["id"] if whole else f"{row['id']}#{p.turn}"
            # only the final answer came from the engine, unless every turn did
            meta.append((rid, src, no, row if whole else regenerate.turn_view(row, p.n_messages)))
    return plans, meta


def _kept_rows(plans: list, meta: list, batch, check: "servecheck.ServeCheck",
               cfg: params.Tokenize, path: str, stats: dict
               ) -> tuple[Optional[pa.RecordBatch], dict]:
    """The encoded rows within the length and supervision limits, as one record batch,
    and their lengths per source; each answer checked against the engine's tokens."""
    keep_ids, keep_src, pieces_ids, pieces_mask, lens, losses = [], [], [], [], [], []
    lengths: dict = collections.defaultdict(lambda: array("i"))
    control = set(check.encoder.control.values())
    vocab_size = len(check.encoder.tok)  # as the fingerprint records it
    for i, (p, (rid, src, no, row)) in enumerate(zip(plans, meta)):
        ids, mask = batch.row(i)
        st = stats[src]
        if row is not None:
            served = Served(row)
            check.row(row, served, p, ids, mask, batch.prompt_lens[i], f"{path}:{no}", rid)
            if cfg.ids == "engine":
                bad = enginerows.out_of_vocab(served, vocab_size)
                if bad is not None:
                    raise StageError(f"{path}:{no}: row {rid!r}: engine token id {bad} is "
                                     f"outside the vocabulary [0, {vocab_size}) (tokenize.ids: "
                                     "engine; the completions name another model's tokens)")
                n = batch.prompt_lens[i]
                exact = enginerows.engine_row(served, ids, mask, n, row["truncated"], control)
                differs = exact and enginerows.answer_check(
                    served.completion_ids, ids[n:][mask[n:] == 1], control,
                    check.encoder.tok.decode)
                if differs:
                    servecheck.answer_differs(check.stats, differs, rid, f"{path}:{no}")
                    log.warning("%s:%d: row %r: the engine's answer ids %s", path, no, rid,
                                "decode to other text than the recorded answer: dropped"
                                if differs == "text" else "hold a control token the "
                                "recorded text spells: tokenized as text, as rendered")
                    if differs == "text":
                        st["dropped"]["answer_mismatch"] += 1
                        continue
                    exact = None  # the text path's ids: the spelling stays text
                if exact is not None:
                    ids, mask, unsupervised = exact
                    st["engine_rows"] += 1
                    st["engine_history_unsupervised"] += unsupervised
                elif not differs:
                    st["engine_ids_missing"] += 1
                    if cfg.on_missing_ids == "drop":
                        st["dropped"]["no_engine_ids"] += 1
                        continue
        st["lookalike_rows"] += p.lookalikes
        if len(ids) > cfg.max_seq_len:
            if cfg.on_too_long == "drop":
                st["dropped"]["too_long"] += 1
                continue
            ids, mask = ids[: cfg.max_seq_len], mask[: cfg.max_seq_len]
            st["cut_to_max_seq_len"] += 1
        n_loss = int(np.count_nonzero(mask))
        if n_loss < cfg.min_loss_tokens:
            st["dropped"]["too_few_loss_tokens"] += 1
            continue
        st["rows"] += 1
        st["tokens"] += len(ids)
        st["loss_tokens"] += n_loss
        lengths[src].append(len(ids))
        keep_ids.append(rid)
        keep_src.append(src)
        pieces_ids.append(ids)
        pieces_mask.append(mask)
        lens.append(len(ids))
        losses.append(n_loss)
    return _record_batch(keep_ids, keep_src, pieces_ids, pieces_mask, lens, losses), dict(lengths)


def _record_batch(ids_col, src_col, pieces_ids, pieces_mask, lens, losses):
    if not ids_col:
        return None
    offsets = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=offsets[1:])
    off = pa.array(offsets, type=pa.int32())
    return pa.RecordBatch.from_arrays(
        [
            pa.array(ids_col, type=pa.string()),
            pa.array(src_col, type=pa.string()),
            pa.ListArray.from_arrays(off, pa.array(np.concatenate(pieces_ids), pa.int32())),
            pa.ListArray.from_arrays(off, pa.array(np.concatenate(pieces_mask), pa.int8())),
            pa.array(np.asarray(lens, dtype=np.int32), type=pa.int32()),
            pa.array(np.asarray(losses, dtype=np.int32), type=pa.int32()),
        ],
        schema=ARROW_SCHEMA,
    )


def _has_answer(message: dict, allow_reasoning: bool) -> bool:
    if message.get("tool_calls"):
        return True
    if _text(message.get("content")).strip():
        return True
    return allow_reasoning and bool(_text(message.get("reasoning_content")).strip())


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in value if isinstance(p, dict))
    return ""


def _parse(raw: bytes, path: str, no: int) -> dict:
    """One completion line, checked enough that rendering cannot misread it."""
    where = f"{path}:{no}"
    row = json_object(raw, where)
    for key in ("id", "source"):
        if not isinstance(row.get(key), str) or not row[key]:
            raise StageError(f"{where}: '{key}' must be a non-empty string")
    bad = conversation.problem(row.get("messages"), row.get("tools")) or \
        conversation.unicode_problem(raw, row)
    if bad:
        raise StageError(f"{where}: {bad}")
    msgs = row["messages"]
    if msgs[-1]["role"] != "assistant":
        raise StageError(f"{where}: the last message must be the assistant's answer, "
                         f"got role {msgs[-1]['role']!r}")
    truncated = row.get("truncated")
    if truncated is None:
        truncated = row.get("finish_reason") == "length"
    elif not isinstance(truncated, bool):
        raise StageError(f"{where}: 'truncated' must be true or false")
    row["truncated"] = truncated
    return row


# ---------------------------------------------------------------- writing


class ShardWriter:
    """Arrow stream shards of at most `max_rows` rows and about `max_bytes` bytes."""

    def __init__(self, folder: Path, max_rows: int, max_bytes: int):
        self.folder = folder
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.paths: list[Path] = []
        self._shard: Optional[ShardFile] = None
        self._rows = 0
        self._bytes = 0

    def _open(self) -> None:
        path = self.folder / f".shard-{len(self.paths):05d}.arrow"
        self.paths.append(path)
        self._shard = ShardFile(path)
        self._rows = self._bytes = 0

    def _close_current(self) -> None:
        if self._shard is not None:
            self._shard.close()
            self._shard = None

    def write(self, batch: pa.RecordBatch) -> None:
        while batch.num_rows:
            if self._shard is None:
                self._open()
            per_row = max(1, batch.nbytes // batch.num_rows)
            fit = (self.max_bytes - self._bytes) // per_row
            # an empty shard takes at least one row, whatever its size
            take = min(self.max_rows - self._rows, batch.num_rows, max(fit, 0 if self._rows else 1))
            if take <= 0:
                self._close_current()
                continue
            part = batch.slice(0, take)
            self._shard.write(part)
            self._rows += take
            self._bytes += part.nbytes
            batch = batch.slice(take)
            if self._rows >= self.max_rows or self._bytes >= self.max_bytes:
                self._close_current()

    def close(self) -> list[str]:
        """Finish the last shard and give the shards their final names."""
        if not self.paths:  # no rows: one empty shard, so the folder still loads
            self._open()
        self._close_current()
        n = len(self.paths)
        names = []
        for i, path in enumerate(self.paths):
            name = shard_name(i, n)
            os.replace(path, self.folder / name)
            names.append(name)
        return names


# ---------------------------------------------------------------- report


class Totals:
    """Counters merged from chunk results, and the report made from them."""

    def __init__(self) -> None:
        self.stats: dict = collections.defaultdict(_new_stats)
        self.lengths: dict = collections.defaultdict(lambda: array("i"))
        self.served = servecheck.new_stats()
        self._last_log = time.monotonic()

    def add(self, r: ChunkResult) -> None:
        for src, st in r.stats.items():
            _add_counts(self.stats[src], st)
        for src, values in r.lengths.items():
            self.lengths[src].extend(values)
        servecheck.merge(self.served, r.served)

    def progress(self, started: float) -> None:
        now = time.monotonic()
        if now - self._last_log >= 30:
            self._last_log = now
            conv = sum(s["conversations"] for s in self.stats.values())
            tokens = sum(s["tokens"] for s in self.stats.values())
            log.info("%d conversations, %d tokens, %.0f tokens/s", conv, tokens,
                     tokens / max(now - started, 1e-9))

    def report(self, cfg: params.Tokenize, shards: int, seconds: float) -> dict:
        sources = {}
        for src in sorted(self.stats):
            st = self.stats[src]
            sources[src] = {**st, "dropped": dict(st["dropped"]),
                            "length": _percentiles(self.lengths.get(src))}
        total = _new_stats()
        for st in self.stats.values():
            _add_counts(total, st)
        all_lengths = array("i")
        for values in self.lengths.values():
            all_lengths.extend(values)
        return {
            **total,
            "dropped_total": sum(total["dropped"].values()),
            "length": _percentiles(all_lengths),
            "shards": shards,
            "serve_check": servecheck.summary(self.served),
            "multi_turn": cfg.multi_turn,
            "seconds": round(seconds, 2),
            "tokens_per_second": round(total["tokens"] / max(seconds, 1e-9)),
            "sources": sources,
        }


def _percentiles(values) -> dict:
    if not values:
        return {"mean": 0, "p50": 0, "p90": 0, "p99": 0, "max": 0}
    a = np.frombuffer(values, dtype=np.int32) if isinstance(values, array) else np.asarray(values)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": round(float(a.mean()), 1), "p50": int(p50), "p90": int(p90),
            "p99": int(p99), "max": int(a.max())}


if __name__ == "__main__":
    cli.entry("tokenize", __doc__, run, PATHS)
