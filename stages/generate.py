"""Generate: have the target model answer every prompt, and keep every answer.

  python -m stages.generate --prompts PATH --out PATH --reports PATH [--params params.yaml]
  (the paths: dvc.yaml's cmd)

A run is plan -> send -> write -> verdict. Plan: where each prompt's answer already is in
the request cache (serving/promptindex.py). Send: the requests still missing, to
`generate.server` (serving/handle.py: URLs, or an engine it launches and watches), each
reply cached as it arrives. Write: data/completions (completions.jsonl, failures.jsonl,
generation.json) in prompt order, from the cache only, and reports/generate.json.
Verdict: more failures than `generate.max_transient_failures` /
`max_permanent_failures` allow exit 1, so DVC records no version. The API key is read
from the variable `generate.server.api_key_env` names and never written. The rules in
full: docs/stages.md, "generate".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import time
from array import array
from pathlib import Path
from typing import Any, Optional

import numpy as np

from stages.chat import conversation, engineids
from stages.common import outputs, params
from stages.common.errors import StageError
from stages.common import secrets
from stages.common.secrets import Redactor, redacting_logs
from stages.process import cli
from stages.serving import fitting, records, servesetup, toolshape, turns
from stages.serving.breakers import BREAKER, BadBodyBreaker
from stages.serving.client import (
    BodyEncoder,
    CHAT_PATH,
    ChatClient,
    Failure,
    Reply,
    RetryPolicy,
    Sampling,
    build_body,
    parse_reply,
)
from stages.serving.handle import ServerHandle, api_key, check_server, server_urls
from stages.serving.progress import SPEED_KEYS, Latencies, Progress, speed
from stages.serving.promptindex import PromptLocations
from stages.serving.requestcache import RequestCache, short_hash
from stages.serving.watchdog import UrlWatchdog, Watchdog

log = logging.getLogger("stages.generate")

PATHS = {"prompts": "prepare's folder", "out": "folder the completions are written to",
         "reports": "folder of the stage reports"}
# "abort" is retried now (client.py), but caches written before may still hold one
TRUNCATED_FINISH = ("length", "abort")


# ------------------------------------------------------------------------ params


def check(cfg: params.Generate) -> None:
    check_server(cfg.server)
    params.check_ranges(cfg, "generate")
    s = cfg.server
    if s.router_timeout is not None and cfg.request_timeout > s.router_timeout:
        raise StageError(servesetup.router_timeout_advice(cfg.request_timeout, s.router_timeout))
    for name in ("max_transient_failures", "max_permanent_failures"):
        limit = getattr(cfg, name)
        if isinstance(limit, float) and not 0 <= limit <= 1:
            raise StageError(
                f"generate.{name}: a fraction must be in [0, 1], got {limit} "
                "(write a whole number for a count)"
            )
        if isinstance(limit, int) and limit < 0:
            raise StageError(f"generate.{name}: must be >= 0, got {limit}")


def check_cache_dir(cache_dir: str, paths) -> None:
    """StageError when the request cache would live inside (or hold) a folder the pipeline
    writes (this stage's paths, any out in dvc.yaml): the stage that writes it replaces it
    whole, cache and all, and every request would be sent again; or when the prompts are
    inside the folder this stage replaces."""
    taken = [str(p) for p in vars(paths).values()] + cli.pipeline_outs()
    outputs.check_apart({"generate.cache_dir": cache_dir},
                        [("a folder the pipeline writes (dvc.yaml)", f) for f in taken])
    outputs.check_apart({"--prompts": paths.prompts}, [("--out", paths.out)])


# --------------------------------------------------------------------- the stage


def run(cfg: params.Generate, paths) -> dict:
    """`paths`: the PATHS, as dvc.yaml gives them (`cli.pipeline_paths`)."""
    check(cfg)
    check_cache_dir(cfg.cache_dir, paths)
    key = api_key(cfg.server)
    redact = secrets.tell([key], urls=server_urls(cfg.server))  # the one redactor
    with redacting_logs(redact):
        try:
            return asyncio.run(_run(cfg, key, redact, paths))
        except asyncio.CancelledError:  # our SIGTERM handler cancelled the run (Ctrl-C:
            raise cli.Terminated from None  # asyncio raises KeyboardInterrupt itself)
        except StageError as e:  # any message may quote a URL or a server's words
            e.args = (redact(str(e)),)
            raise


async def _run(cfg: params.Generate, key: Optional[str], redact: Redactor, paths) -> dict:
    try:  # SIGTERM (a killed `dvc repro`) stops like Ctrl-C: cache closed, server stopped
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    except (RuntimeError, ValueError):  # not the main thread
        pass
    t0 = time.monotonic()
    server = ServerHandle(cfg, key, redact)
    label = await server.resolve_label()
    seed_used = await server.seed_used()
    router = await server.behind_router()
    sampling = Sampling.of(cfg)
    sampling_hash = short_hash(sampling.as_dict())
    namespace = short_hash({"model": label, "sampling": sampling.as_dict()})
    plan = PromptLocations(paths.prompts / conversation.PROMPTS_FILE, cfg.limit, namespace)
    meta = {"model": label, "sampling": sampling.as_dict(), "sampling_hash": sampling_hash}
    if turns.wanted(cfg, plan):  # turns and samples: stages/serving/turns.py
        return await _run_turns(cfg, key, paths, plan, server, (router, seed_used, t0),
                                namespace, meta)
    with RequestCache(cfg.cache_dir, namespace, meta) as cache:
        damaged = plan.locate(cache, cfg.retry_failed)
        pending = plan.pending()
        log.info(
            "%d prompts: %d answered in the cache %s, %d requests to send",
            plan.n, int(np.count_nonzero(plan.seg >= 0)), cache.dir, len(pending),
        )  # fmt: skip
        if cfg.limit is not None and plan.n and not pending:
            _print_first_request(plan.first_prompt(), server, sampling, cfg)
        gen = None
        if pending:
            gen = await _send(cfg, plan, cache, server, key, pending)
        transient = gen.transient if gen else {}
        counts = write_outputs(plan, cache, transient, meta,
                               engineids.why_without(server.engine, router), paths.out,
                               server.engine)
    report = {
        "requests": plan.n,
        **counts,
        "from_cache": gen.cached if gen else plan.n,
        "sent": gen.sent if gen else 0,
        "retries": gen.client.retries if gen else 0,
        "clamped": gen.client.clamped if gen else 0,
        "context": gen.budget.report() if gen and gen.budget else None,
        "wall_time_s": round(time.monotonic() - t0, 3),
        **(gen.metrics() if gen else Generation.metrics_empty()),
        "model": label,
        "sampling": sampling_hash,
        "sampling_params": sampling.as_dict(),
        "seed_honoured": seed_used,
        "server": server.info(),
        "cache_dir": str(cache.dir),
        "cache_damaged": damaged,
    }
    outputs.write_report(paths.reports, "generate", server.redact.scrub(report))
    _conclude(counts, plan.n, cfg, transient, paths.out)
    return report


async def _run_turns(cfg: params.Generate, key: Optional[str], paths, plan: PromptLocations,
                     server: ServerHandle, facts: tuple, namespace: str, meta: dict) -> dict:
    """_run for conversations regenerated turn by turn or several samples per prompt
    (`facts`: whether a router is in front, whether the seed is honoured, the start)."""
    router, seed_used, t0 = facts
    with RequestCache(cfg.cache_dir, namespace, meta) as cache:
        regen = turns.Regeneration(cfg, plan, cache, server, namespace, meta, lambda prompt, reply:
                                   completion_row(prompt, reply, meta["model"],
                                                  meta["sampling_hash"],
                                                  meta["sampling"]["enable_thinking"],
                                                  server.engine))
        log.info("%d prompts x %d samples: %d turns to walk, cache %s", plan.n,
                 cfg.samples_per_prompt, regen.total_turns, cache.dir)
        if cfg.limit is not None and plan.n:  # the dry run's view: the first turn's request
            _print_first_request(plan.first_prompt(), server, Sampling.of(cfg), cfg)
        if not await regen.answered():
            await _serving(cfg, plan, server, key, regen.run)
        counts, transient = await regen.write(
            engineids.why_without(server.engine, router), paths.out, failure_row)
    report = {
        "requests": regen.n_jobs, **counts,
        "from_cache": counts["turns"]["asked"] - regen.finished, "sent": regen.sent,
        "retries": regen.client.retries if regen.client else 0,
        "clamped": regen.client.clamped if regen.client else 0,
        "context": regen.budget.report() if regen.budget else None,
        "wall_time_s": round(time.monotonic() - t0, 3), **regen.metrics(),
        "model": meta["model"], "sampling": meta["sampling_hash"],
        "sampling_params": meta["sampling"], "samples_per_prompt": cfg.samples_per_prompt,
        "seed_honoured": seed_used, "server": server.info(),
        "cache_dir": str(cache.dir), "cache_damaged": regen.index.damaged,
    }
    outputs.write_report(paths.reports, "generate", server.redact.scrub(report))
    # every failed turn counts against the tolerances, kept conversations cut by one too
    _conclude(dict(counts, **counts["turns"]["verdict"]), regen.n_jobs, cfg, transient, paths.out)
    return report


# -------------------------------------------------------------------------- send


async def _send(
    cfg: params.Generate,
    plan: PromptLocations,
    cache: RequestCache,
    server: ServerHandle,
    key: Optional[str],
    pending: array,
) -> Generation:
    async def work(client: ChatClient, budget, watchdog) -> Generation:
        gen = Generation(cfg, plan, cache, server, client, budget)
        await gen.run(pending, watchdog)
        return gen

    return await _serving(cfg, plan, server, key, work)


async def _serving(cfg: params.Generate, plan: PromptLocations, server: ServerHandle,
                   key: Optional[str], work):
    """`work(client, budget, watchdog)` with the server up and a client open to it."""
    async with server.running(plan.tools) as urls:
        budget = await server.budget()
        watchdog = server.watchdog()
        async with ChatClient(
            urls, api_key=key, concurrency=cfg.concurrency,
            request_timeout=cfg.request_timeout, retry=RetryPolicy.of(cfg),
            enable_thinking=cfg.enable_thinking,
            unreachable_deadline=cfg.server.unreachable_deadline, gate=watchdog,
            min_new_tokens=cfg.min_new_tokens,
        ) as client:  # fmt: skip
            return await work(client, budget, watchdog)


def _print_first_request(
    prompt: dict, server: ServerHandle, sampling: Sampling, cfg: params.Generate
) -> None:
    """The dry run's view: exactly the body sent (or that would be), the key redacted."""
    body = build_body(prompt, server.request_model or server.label, sampling, server.engine)
    launched = getattr(server.launched, "url", "") or "<launched>"
    where = server.shown_urls()[0] if server.urls else launched
    auth = f"Bearer <${cfg.server.api_key_env}, redacted>" if cfg.server.api_key_env else "(none)"
    print(f"first request: POST {where}{CHAT_PATH}  Authorization: {auth}")
    print(server.redact(json.dumps(body, indent=2, ensure_ascii=False)), flush=True)


class Generation:
    """One run of the send loop over the pending prompts."""

    def __init__(
        self, cfg: params.Generate, plan: PromptLocations, cache: RequestCache,
        server: ServerHandle, client: ChatClient, budget: Optional[fitting.ContextBudget] = None,
    ):
        self.cfg, self.plan, self.cache, self.server, self.client = cfg, plan, cache, server, client
        self.budget = budget  # None: max_tokens as set, the engine's context error clamps
        self.sampling = Sampling.of(cfg)
        self.encoder = BodyEncoder(server.request_model, self.sampling, server.engine)
        self.done = int(np.count_nonzero(plan.seg >= 0))
        self.cached = self.done
        self.transient: dict[int, dict] = {}
        self.held: list[tuple[int, dict]] = []
        self.any_success = False
        self.breaker = BadBodyBreaker(client.urls)
        self.sent = 0
        self.finished = 0  # requests of this run that completed or gave up
        self.completed = 0
        self.failed = int(np.count_nonzero((plan.seg >= 0) & ~plan.ok))
        self.out_tokens = 0
        self.in_tokens = 0
        self.latencies = Latencies()
        self.first_send: Optional[float] = None
        self.last_done: Optional[float] = None

    def _mark(self, i: int, record: dict | bytes, good: bool = False) -> None:
        key = self.plan.index.key(i)
        try:
            if isinstance(record, bytes):
                seg, off = self.cache.append_json(key, record)
            else:
                seg, off = self.cache.append(key, record)
        except OSError as e:
            raise StageError(f"{self.cache.dir}: cannot append to the request cache: {e}") from None
        idxs = self.plan.index.twins(i)
        if len(idxs) == 1:
            self.plan.seg[i], self.plan.off[i], self.plan.ok[i] = seg, off, good
        else:
            self.plan.set(idxs, seg, off, good)
        self.done += len(idxs)

    async def _one(self, fd: int, i: int) -> None:
        prompt = json.loads(self.plan.line(fd, i))
        fit = self.budget.fit(prompt) if self.budget is not None else None
        if isinstance(fit, fitting.TooLong):  # a permanent failure, without a request
            message = fit.message(self.budget.counter.spec)
            self._failed(i, Failure("context_overflow", None, message, 0, True))
            return
        data = self.encoder.encode(prompt, fit)
        if self.sent == 0 and self.cfg.limit is not None:
            sampling = self.sampling if fit is None else dataclasses.replace(self.sampling, max_tokens=fit)
            _print_first_request(prompt, self.server, sampling, self.cfg)
        self.sent += 1
        try:
            reply = await self.client.complete(data)
        except Failure as f:
            self._failed(i, f)
            return
        self._succeeded(i, reply)

    def _failed(self, i: int, f: Failure) -> None:
        """Prompt `i` gave up: transient ones are reported, permanent ones cached once a
        success shows the setup works."""
        self.finished += 1
        record = records.failure(f)
        n = len(self.plan.index.twins(i))
        self.failed += n
        self.breaker.failure(f)
        if not f.permanent:
            self.transient[i] = record
            self.done += n
        elif self.any_success:
            self._mark(i, record)
        else:
            self.held.append((i, record))
            self.done += n
            if len(self.held) >= BREAKER:
                status = f"HTTP {f.status} " if f.status else ""
                raise StageError(
                    f"the first {BREAKER} requests all failed permanently, e.g. "
                    f"{status}{f.message[:200]!r}: check generate.* sampling params and "
                    "the model (nothing was cached as failed)"
                ) from None

    def _succeeded(self, i: int, reply: Reply) -> None:
        self.finished += 1
        self.completed += 1
        self.breaker.success()
        self.out_tokens += reply.completion_tokens
        self.in_tokens += reply.prompt_tokens
        self.latencies.add(reply.latency)
        self.last_done = time.monotonic()
        self._mark(i, records.success(reply), True)
        if not self.any_success:
            self.any_success = True
            for j, rec in self.held:
                self.done -= len(self.plan.index.twins(j))
                self._mark(j, rec)
            self.held.clear()

    async def run(self, pending: array, watchdog: Watchdog | UrlWatchdog) -> None:
        progress = Progress(self.plan.n, self.done, self.cfg.progress_interval)
        it = iter(pending)
        fd = os.open(self.plan.path, os.O_RDONLY)

        async def worker() -> None:
            for i in it:  # next() never awaits: workers share the iterator safely
                await self._one(fd, i)

        async def ticker() -> None:
            await self._tick(progress)

        async def watch() -> None:
            await watchdog.watch(lambda: (self.finished, self.client.in_flight))

        self.first_send = time.monotonic()
        try:
            with progress.quiet_logs():
                await self._workers(pending, worker, ticker, watch)
        except* StageError as group:
            raise group.exceptions[0] from None
        finally:
            os.close(fd)
            # permanent failures never confirmed by a success: reported, not cached
            for j, rec in self.held:
                self.transient[j] = rec
            self.held.clear()
            in_flight = self.client.in_flight
            progress.tick(self.done, self.failed, self.out_tokens, in_flight, final=True)

    async def _tick(self, progress: Progress) -> None:
        """In the background: fsync the cache when due (about once a second, so a crash
        loses at most that much of the replies) and update the progress line."""
        tick = 0.5 if progress.bar is not None else min(1.0, self.cfg.progress_interval)
        while True:
            await asyncio.sleep(tick)
            if self.cache.sync_due():
                await asyncio.to_thread(self.cache.sync)
            progress.tick(self.done, self.failed, self.out_tokens, self.client.in_flight)

    async def _workers(self, pending: array, worker, ticker, watch) -> None:
        async with asyncio.TaskGroup() as tg:
            background = [tg.create_task(ticker()), tg.create_task(watch())]
            n = min(self.cfg.concurrency, len(pending))
            await asyncio.gather(*(tg.create_task(worker()) for _ in range(n)))
            for task in background:
                task.cancel()

    @staticmethod
    def metrics_empty() -> dict:
        return dict.fromkeys(SPEED_KEYS, 0.0)

    def metrics(self) -> dict:
        dur = (self.last_done - self.first_send) if self.last_done and self.first_send else 0.0
        return speed(dur, self.completed, self.in_tokens, self.out_tokens, self.latencies)


# ------------------------------------------------------------------------- write


def write_outputs(
    plan: PromptLocations,
    cache: RequestCache,
    transient: dict[int, dict],
    meta: dict,
    why_without_ids: str,
    out: Path,
    engine: Optional[str] = None,
) -> dict:
    """completions.jsonl + failures.jsonl in prompt order, from the cache only, and
    generation.json: `meta` (the model, sampling params and their hash the rows were
    generated with), and when some rows lack the engine's ids, why (`why_without_ids`),
    which tokenize reads. Rows hold their tools as `engine` rendered them (toolshape)."""
    model, sampling_hash = meta["model"], meta["sampling_hash"]
    enable_thinking = meta["sampling"]["enable_thinking"]
    counts = {
        "completed": 0, "failed": 0, "failed_transient": 0, "truncated": 0,
        "prompt_tokens": 0, "output_tokens": 0,
    }  # fmt: skip
    ids = dict.fromkeys(("rows_with_ids", "rows_unusable_ids", "rows_without_ids"), 0)
    kinds: dict[str, int] = {}
    transient_kinds: dict[str, int] = {}
    by_source: dict[str, dict] = {}  # the same counts per source, for the lineage card
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    with outputs.atomic_dir(out) as tmp, open(plan.path, "rb") as src, open(
        tmp / conversation.COMPLETIONS_FILE, "w", encoding="utf-8", newline="\n"
    ) as comp, open(tmp / "failures.jsonl", "w", encoding="utf-8", newline="\n") as fail:
        for i in range(plan.n):
            line = src.readline()
            if len(line) != plan.offsets[i + 1] - plan.offsets[i]:
                raise StageError(f"{plan.path}: changed while generate was running; run it again")
            prompt = json.loads(line)
            if plan.seg[i] >= 0:
                rec = records.cached_record(cache.read_json(int(plan.seg[i]), int(plan.off[i])))
                if rec is None:
                    raise StageError(
                        f"{cache.dir}: changed while generate was running; run it again"
                    )
            else:  # retries spent this run: reported, not cached, resent next run
                rec = transient[plan.index.twins(i)[0]]
                counts["failed_transient"] += 1
                transient_kinds[rec["kind"]] = transient_kinds.get(rec["kind"], 0) + 1
            mine = by_source.setdefault(str(prompt.get("source")), {
                "completed": 0, "truncated": 0, "failed": 0, "failed_by_kind": {}})
            if rec["ok"]:
                row = completion_row(prompt, rec["reply"], model, sampling_hash, enable_thinking,
                                     engine)
                turns.count_completed(row, counts, mine, ids)
                comp.write(dumps(row) + "\n")
            else:
                counts["failed"] += 1
                kinds[rec["kind"]] = kinds.get(rec["kind"], 0) + 1
                mine["failed"] += 1
                mine["failed_by_kind"][rec["kind"]] = mine["failed_by_kind"].get(rec["kind"], 0) + 1
                fail.write(dumps(failure_row(prompt, rec)) + "\n")
        generation = dict(meta)
        if ids["rows_without_ids"]:
            ids["why_without"] = generation["engine_ids_missing"] = why_without_ids
        outputs.write_json(tmp / conversation.GENERATION_FILE, generation)
    counts["engine_ids"] = ids
    counts["failed_by_kind"] = dict(sorted(kinds.items()))
    counts["failed_transient_by_kind"] = dict(sorted(transient_kinds.items()))
    permanent = {k: v - transient_kinds.get(k, 0) for k, v in counts["failed_by_kind"].items()}
    counts["failed_permanent_by_kind"] = {k: v for k, v in permanent.items() if v}
    counts["sources"] = by_source
    return counts


def completion_row(
    prompt: dict, reply: dict, model: str, sampling_hash: str, enable_thinking: bool,
    engine: Optional[str] = None,
) -> dict:
    # parsed again here, not taken from the client's Reply: rows are written from the
    # cached reply, so a row from a resumed run (its reply sent by an earlier run) and
    # one from a fresh run come out the same; the client's parse feeds only live counts
    parts = parse_reply(reply, enable_thinking)
    answer: dict[str, Any] = {
        "role": "assistant", "content": parts.content, "reasoning_content": parts.reasoning,
    }  # fmt: skip
    if parts.tool_calls:
        answer["tool_calls"] = parts.tool_calls
    row: dict[str, Any] = {
        "id": prompt["id"],
        "source": prompt.get("source"),
        "messages": prompt["messages"] + [answer],
    }
    if "tools" in prompt:  # as the engine rendered them into the prompt it served
        row["tools"] = toolshape.served_tools(engineids.engine_of(reply, engine), prompt["tools"])
    # Thinking that never closed leaves reasoning and no answer: data, not a success.
    truncated = parts.finish_reason in TRUNCATED_FINISH or (
        not parts.content and not parts.tool_calls)
    row.update(
        finish_reason=parts.finish_reason,
        truncated=truncated,
        usage={"prompt_tokens": parts.prompt_tokens, "completion_tokens": parts.completion_tokens},
        model=model,
        sampling=sampling_hash,
    )
    served = engineids.from_reply(reply)
    if served is not None:
        row["engine_tokens"] = served
    return row


def failure_row(prompt: dict, rec: dict) -> dict:
    return {
        "id": prompt["id"],
        "source": prompt.get("source"),
        "kind": rec["kind"],
        "status": rec["status"],
        "message": rec["message"],
        "attempts": rec["attempts"],
    }


# ----------------------------------------------------------------------- verdict


def _conclude(counts: dict, n: int, cfg: params.Generate, transient: dict, out: Path) -> None:
    """Say how the run ended; fail it (exit 1: DVC records nothing) when too much failed."""
    log.info(
        "done: %d completed (%d truncated), %d failed %s -> %s",
        counts["completed"], counts["truncated"], counts["failed"],
        counts["failed_by_kind"] or "", out,
    )  # fmt: skip
    ids = counts["engine_ids"]
    if ids["rows_without_ids"]:
        log.info("%d of %d completions carry no engine token ids: %s", ids["rows_without_ids"],
                 counts["completed"], ids["why_without"])
    if ids["rows_unusable_ids"]:
        log.warning("%d completions came with token ids that are not a list of token ids "
                    "(counted as such by tokenize's serve-render check)", ids["rows_unusable_ids"])
    problem = verdict(counts, n, cfg, transient, out)
    if problem:
        raise StageError(problem)
    if counts["failed_transient"]:
        log.warning(
            "%d prompts failed with transient errors (retries spent), within "
            "generate.max_transient_failures: they are in failures.jsonl and are resent "
            "by the next run (dvc repro -f generate)",
            counts["failed_transient"],
        )


def allowed(limit: int | float, n: int) -> int:
    """How many failures a tolerance allows: an integer is a count, a float a fraction."""
    return limit if isinstance(limit, int) else int(limit * n)


def verdict(counts: dict, n: int, cfg: params.Generate, transient: dict[int, dict],
            out: Path) -> Optional[str]:
    """Why this run is not a finished dataset version (one line), or None when it is.

    Transient failures may pass when sent again: beyond `max_transient_failures` the work
    is not done. Permanent ones are data, beyond `max_permanent_failures` the setup is
    suspect. Either way the stage exits 1, DVC records nothing, and the next `dvc repro`
    runs it again: transient requests are resent, answered ones come from the cache.
    """
    n_transient = counts["failed_transient"]
    limit = cfg.max_transient_failures
    if n_transient > allowed(limit, n):
        first = transient[min(transient)]  # the first in prompt order: the same every run
        status = f"HTTP {first['status']} " if first["status"] else ""
        return (
            f"{n_transient} of {n} requests still failing after retries with errors that may "
            f"pass when sent again ({_kinds(counts['failed_transient_by_kind'])}; e.g. "
            f"{status}{first['message'][:120]!r}), above the {allowed(limit, n)} that "
            f"generate.max_transient_failures={limit} allows: the run is not finished and no "
            "version is recorded; run `dvc repro` again once the server is healthy (only "
            "unanswered requests are sent)"
        )
    n_permanent = counts["failed"] - n_transient
    limit = cfg.max_permanent_failures
    if n_permanent > allowed(limit, n):
        kinds = _kinds(counts["failed_permanent_by_kind"])
        return (
            f"{n_permanent} of {n} requests failed permanently ({kinds}), above the "
            f"{allowed(limit, n)} that generate.max_permanent_failures={limit} allows: see "
            f"{out / 'failures.jsonl'}; fix the prompts or params and set "
            "generate.retry_failed: true to resend them, or raise the tolerance"
        )
    return None


def _kinds(by_kind: dict[str, int]) -> str:
    return ", ".join(f"{kind} {count}" for kind, count in by_kind.items())


if __name__ == "__main__":
    cli.entry("generate", __doc__, run, PATHS)
