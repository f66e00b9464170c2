"""Completion lines made tokenized rows, a chunk at a time, and tokenize's counts.

`tokenize_chunk` parses a chunk of completion lines, drops what the filters name
(`DROP_REASONS`), renders and encodes the rest (stages/chat/encoder.py), checks each
against what the engine served (rendercheck.py; engine ids: servedrows.py) and returns the
kept rows as one record batch of the row contract with their counts per source
(`ChunkResult`). `Totals` adds the chunks' counts up into reports/tokenize.json.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from array import array
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import pyarrow as pa

from stages.chat import conversation, regenerate, rendercheck, servedrows
from stages.chat.encoder import ChatEncoder
from stages.serving.engineids import Served
from stages.common import params
from stages.common.errors import StageError
from stages.common.reading import json_object, open_regular
from stages.dataset import arrays
from stages.dataset.schema import ARROW_SCHEMA

# A worker's unit of work: at most CHUNK_BYTES of lines, shrinking over the file's last
# TAIL_PIECES x CHUNK_BYTES (what is left over TAIL_PIECES) so that the last chunks do not
# leave a worker idle while another finishes a big one; never under MIN_CHUNK_BYTES,
# where per-chunk costs (one encode call, one Arrow batch) would show. Never by num_proc:
# each chunk is one Arrow batch of the shards, whose bytes must not change with the
# machine's CPUs. A small TAIL_PIECES: a 256 KB chunk takes a worker a fraction of a
# second, so many CPUs lose little at the end, and shrinking earlier (64: over the last
# 16 MB) made every chunk of a small file small, its per-chunk costs 20% of the stage
# (BENCH_QUICK=1 bench/run.py tokenize, dev/LOG.md 2026-12-05).
CHUNK_BYTES = 256 << 10
MIN_CHUNK_BYTES = 16 << 10
CHUNK_ROWS = 256
TAIL_PIECES = 8

log = logging.getLogger(__name__)

DROP_REASONS = ("truncated", "empty_content", "too_large", "too_long", "too_few_loss_tokens",
                "no_engine_ids", "answer_mismatch")

# Qwen's longest token spells 128 bytes: a line with more bytes than that for each token
# of max_seq_len holds more tokens than max_seq_len, unless most of it is no message text
BYTES_PER_TOKEN = 128


def row_bytes_limit(cfg: params.Tokenize) -> int:
    """The longest completion line rendered (tokenize.max_row_bytes, null: BYTES_PER_TOKEN
    for each token of max_seq_len). Encoding takes ~100 times a row's size (the
    tokenizer's per-token records: 1.7 GB peak for a 10 MB answer), so a
    longer line is dropped before it is rendered, which bounds each worker's memory."""
    return cfg.max_row_bytes or BYTES_PER_TOKEN * cfg.max_seq_len


def _new_stats() -> dict:
    return {"conversations": 0, "rows": 0, "tokens": 0, "loss_tokens": 0,
            "dropped": dict.fromkeys(DROP_REASONS, 0), "cut_to_max_seq_len": 0,
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
    served: dict  # rendercheck stats


def tokenize_chunk(chunk: tuple[int, list[bytes]], encoder: ChatEncoder,
                   cfg: params.Tokenize, path: str, why_without: str) -> ChunkResult:
    """Parse, filter, render, encode and check one chunk of (first line number, lines) of
    the completions file at `path`; `why_without`: why a row may lack engine ids."""
    stats: dict = collections.defaultdict(_new_stats)
    plans, meta = _plan_chunk(chunk, encoder, cfg, path, stats)
    check = rendercheck.ServeCheck(encoder, why_without)
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
    limit = row_bytes_limit(cfg)
    for no, raw in enumerate(lines, first):
        if not raw.strip():
            continue
        if len(raw) > limit:
            _drop_too_large(raw, path, no, limit, stats)
            continue
        row = _parse(raw, path, no)
        src = row["source"]
        st = stats[src]
        st["conversations"] += 1
        final = row["messages"][-1]
        truncated = row["truncated"]
        if truncated and not cfg.keep_truncated:
            st["dropped"]["truncated"] += 1  # the answer cut off: a row, or a turn's row
            # a regenerated conversation keeps the turns before it (rows of `expand`,
            # `all`): whole answers of the target's, each asked with what it was served
            row = regenerate.before_last_turn(row) if cfg.multi_turn != "last" else None
            if row is None:
                continue
            final, truncated = row["messages"][-1], False
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


def _kept_rows(plans: list, meta: list, batch, check: "rendercheck.ServeCheck",
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
            # the engine's ids are checked in either mode: they say what was served
            if served.unusable and served.unusable.bad_values:
                raise StageError(f"{path}:{no}: row {rid!r}: its engine token ids are not "
                                 f"token ids ({served.unusable}): no engine serves those (a "
                                 "damaged completions file, or a server that is no engine)")
            bad = servedrows.out_of_vocab(served, vocab_size)
            if bad is not None:
                raise StageError(f"{path}:{no}: row {rid!r}: engine token id {bad} is "
                                 f"outside the vocabulary [0, {vocab_size}) (the completions "
                                 "name another model's tokens)")
            n = batch.prompt_lens[i]
            differs = served.completion_ids is not None and servedrows.answer_check(
                served.completion_ids, ids[n:][mask[n:] == 1], control,
                check.encoder.tok.decode)
            if differs:
                rendercheck.answer_differs(check.stats, differs, rid, f"{path}:{no}")
                log.warning("%s:%d: row %r: the engine's answer ids %s", path, no, rid,
                            "decode to other text than the recorded answer: dropped"
                            if differs == "text" else "hold a control token the "
                            "recorded text spells: tokenized as text, as rendered")
                if differs == "text":
                    st["dropped"]["answer_mismatch"] += 1
                    continue
            if cfg.ids == "engine":
                # a control token the text spells stays text: the text path's ids
                exact = None if differs else servedrows.engine_row(
                    served, ids, mask, n, row["truncated"], control)
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
    off = arrays.array(offsets)
    return pa.RecordBatch.from_arrays(
        [
            arrays.strings(ids_col),
            arrays.strings(src_col),
            pa.ListArray.from_arrays(off, arrays.array(
                np.concatenate(pieces_ids).astype(np.int32, copy=False))),
            pa.ListArray.from_arrays(off, arrays.array(
                np.concatenate(pieces_mask).astype(np.int8, copy=False))),
            arrays.array(np.asarray(lens, dtype=np.int32)),
            arrays.array(np.asarray(losses, dtype=np.int32)),
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


def _drop_too_large(raw: bytes, path: str, no: int, limit: int, stats: dict) -> None:
    """Count a line over the row limit as its source's `too_large`, and name it in the
    log; only parsed for its id and source (a few times its size, never rendered)."""
    row = _named(json_object(raw, f"{path}:{no}"), f"{path}:{no}")
    st = stats[row["source"]]
    st["conversations"] += 1
    st["dropped"]["too_large"] += 1
    rid = row["id"]  # the line is huge: its id may be too, and a log line is not
    log.warning("%s:%d: row %r%s is %d bytes, over tokenize.max_row_bytes (%d): dropped "
                "unrendered", path, no, rid[:80], "..." if len(rid) > 80 else "", len(raw),
                limit)


def _named(row: dict, where: str) -> dict:
    """`row`, once its id and source are non-empty strings."""
    for key in ("id", "source"):
        if not isinstance(row.get(key), str) or not row[key]:
            raise StageError(f"{where}: '{key}' must be a non-empty string")
    return row


def _parse(raw: bytes, path: str, no: int) -> dict:
    """One completion line, checked enough that rendering cannot misread it."""
    where = f"{path}:{no}"
    row = _named(json_object(raw, where), where)
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


# ---------------------------------------------------------------- counts


class Totals:
    """Counters merged from chunk results, and the report made from them."""

    def __init__(self) -> None:
        self.stats: dict = collections.defaultdict(_new_stats)
        self.lengths: dict = collections.defaultdict(lambda: array("i"))
        self.served = rendercheck.new_stats()
        self._last_log = time.monotonic()

    def add(self, r: ChunkResult) -> None:
        for src, st in r.stats.items():
            _add_counts(self.stats[src], st)
        for src, values in r.lengths.items():
            self.lengths[src].extend(values)
        rendercheck.merge(self.served, r.served)

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
            "serve_check": rendercheck.summary(self.served),
            "multi_turn": cfg.multi_turn,
            "max_row_bytes": row_bytes_limit(cfg),
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


def line_chunks(src: Path) -> Iterator[tuple[int, list[bytes]]]:
    """(first line number, lines) groups of lines, by bytes (see CHUNK_BYTES); the same
    groups whatever the number of processes that take them."""

    def limit(left: int) -> int:
        return min(CHUNK_BYTES, max(MIN_CHUNK_BYTES, left // TAIL_PIECES))

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
