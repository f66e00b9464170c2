"""Tokenize completions into input_ids and assistant-only loss masks (data/tokenized/).

`python -m stages.tokenize` streams data/completions/completions.jsonl in chunks; each
chunk's lines are parsed, filtered, rendered with the tokenizer's chat template, encoded
and checked against the tokens the engine served (stages/chat/tokenrows.py); the rows are
written as a save_to_disk folder in bounded shards (stages/dataset/shards.py) with its
fingerprint.json (stages/dataset/fingerprint.py), and the counts as reports/tokenize.json.

num_proc worker processes (0: one per usable CPU) take chunks of about equal bytes from a
shared queue; results are written in input order, so the output does not depend on
num_proc. Behaviour, params and the report: docs/stages.md, "tokenize".
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from stages.chat import rendercheck, tokenrows
from stages.chat.encoder import ChatEncoder
from stages.common import outputs, params, stagefiles
from stages.process import cpus
from stages.common.errors import StageError
from stages.common.reading import absent, json_object, read_regular
from stages.dataset import fingerprint
from stages.dataset.shards import ShardWriter, write_metadata
from stages.models import tokenizer
from stages.process import children, cli

log = logging.getLogger(__name__)

PATHS = {"completions": "generate's folder", "out": "folder the dataset is written to",
         "reports": "folder of the stage reports"}


def run(cfg: params.Tokenize, paths) -> dict:
    """`paths`: the PATHS, as dvc.yaml gives them (`cli.pipeline_paths`)."""
    outputs.check_apart({"--completions": paths.completions, "tokenize.tokenizer": cfg.tokenizer,
                         "tokenize.chat_template": cfg.chat_template}, [("--out", paths.out)])
    try:
        report = tokenize_file(paths.completions / stagefiles.COMPLETIONS_FILE, paths.out, cfg)
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
    tok = tokenizer.load_once(cfg.tokenizer, cfg.chat_template, cfg.trust_remote_code)
    tok_id = tokenizer.identity_of(cfg.tokenizer, tok)
    encoder = ChatEncoder(tok, enable_thinking=cfg.enable_thinking, name=_template_name(cfg))
    log.info("tokenizing %s with %s (template %s), multi_turn=%s, enable_thinking=%s, "
             "ids=%s, %d process(es)", src, cfg.tokenizer, _template_name(cfg),
             cfg.multi_turn, cfg.enable_thinking, cfg.ids, cfg.num_proc)
    totals = tokenrows.Totals()
    why = generation.get("engine_ids_missing", rendercheck.NO_IDS)
    with outputs.atomic_dir(dst) as tmp:
        writer = ShardWriter(tmp, cfg.shard_rows, cfg.shard_max_mb << 20)
        for result in _results(src, cfg, encoder, why):
            totals.add(result)
            if result.batch is not None:
                writer.write(result.batch)
            totals.progress(started)
        names = writer.close()
        problem = rendercheck.failure(totals.served, cfg.max_render_mismatch) or \
            rendercheck.answer_failure(totals.served, cfg.max_answer_mismatch)
        if problem:
            raise RenderMismatch(problem, totals.report(cfg, 0, time.monotonic() - started))
        recorded = fingerprint.build(tok_id, tokenizer.template_sha256(tok), cfg)
        outputs.write_json(tmp / fingerprint.FILE, recorded)
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
    """What generate recorded beside the completions (stages/serving/completions.py:
    model, sampling params, why rows may lack engine ids); {} when there is no such file."""
    path = src.parent / stagefiles.GENERATION_FILE
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
                        src.parent / stagefiles.GENERATION_FILE, recorded)
        return recorded
    if recorded is not None and recorded != cfg.enable_thinking:
        log.warning("tokenize.enable_thinking=%s, but the completions were generated with "
                    "enable_thinking=%s (set it to null to follow generate)",
                    cfg.enable_thinking, recorded)
    return cfg.enable_thinking


def _template_name(cfg: params.Tokenize) -> str:
    return cfg.chat_template or f"{cfg.tokenizer} (its own template)"


# ---------------------------------------------------------------- reading


def _results(src: Path, cfg: params.Tokenize, encoder: ChatEncoder,
             why_without: str = rendercheck.NO_IDS) -> Iterator[tokenrows.ChunkResult]:
    """Chunk results in input order, computed here or by `num_proc` forked workers."""
    global _STATE
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    # one encoding thread per process: num_proc processes use num_proc cores
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _STATE = (encoder, cfg, str(src), why_without)
    try:
        if cfg.num_proc == 1:
            for chunk in tokenrows.line_chunks(src):
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


def _pooled(src: Path, cfg: params.Tokenize) -> Iterator[tokenrows.ChunkResult]:
    """Chunk results in input order from `num_proc` forked workers (forked: they
    inherit the loaded tokenizer instead of loading it again)."""
    window = collections.deque()
    workers = children.Workers("fork", cfg.num_proc)
    try:
        for chunk in tokenrows.line_chunks(src):
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


_STATE: Optional[tuple] = None  # what `work` needs, set before the workers fork


def work(chunk: tuple[int, list[bytes]]) -> tokenrows.ChunkResult:
    """One chunk of completion lines made rows (stages/chat/tokenrows.py)."""
    encoder, cfg, path, why_without = _STATE
    return tokenrows.tokenize_chunk(chunk, encoder, cfg, path, why_without)


if __name__ == "__main__":
    cli.entry("tokenize", __doc__, run, PATHS)
