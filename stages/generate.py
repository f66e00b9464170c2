"""Generate: have the target model answer every prompt, and keep every answer.

  python -m stages.generate --prompts PATH --out PATH --reports PATH [--params params.yaml]
  (the paths: dvc.yaml's cmd)

A run is plan -> send -> write -> verdict. Plan: where each prompt's answer already is in
the request cache (serving/promptindex.py). Send: the requests still missing, to
`generate.server` (serving/server.py: URLs, or an engine it launches and watches), each
reply cached as it arrives (serving/sendloop.py; turn by turn: serving/turns.py). Write:
data/completions in prompt order, from the cache only (serving/completions.py), and
reports/generate.json.
Verdict: more failures than `generate.max_transient_failures` /
`max_permanent_failures` allow exit 1, so DVC records no version. The API key is read
from the variable `generate.server.api_key_env` names and never written. The rules in
full: docs/stages.md, "generate".
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from array import array
from pathlib import Path
from typing import Optional

import numpy as np

from stages.serving import engineids
from stages.common import outputs, params, stagefiles
from stages.common.errors import StageError
from stages.common import secrets
from stages.common.secrets import Redactor, redacting_logs
from stages.process import cli
from stages.serving import completions, engineflags, sendloop, turns
from stages.serving.client import ChatClient, RetryPolicy, Sampling
from stages.serving.server import (ServerHandle, api_key, check_server, launch_secrets,
                                   server_urls)
from stages.serving.progress import Throughput
from stages.serving.promptindex import PromptLocations
from stages.serving.requestcache import RequestCache, short_hash

log = logging.getLogger("stages.generate")

PATHS = {"prompts": "prepare's folder", "out": "folder the completions are written to",
         "reports": "folder of the stage reports"}


# ------------------------------------------------------------------------ params


def check(cfg: params.Generate) -> None:
    check_server(cfg.server)
    params.check_ranges(cfg, "generate")
    s = cfg.server
    if s.router_timeout is not None and cfg.request_timeout > s.router_timeout:
        raise StageError(engineflags.router_timeout_advice(cfg.request_timeout, s.router_timeout))
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
    redact = secrets.tell([key, *launch_secrets(cfg.server)],  # the one redactor
                          urls=server_urls(cfg.server))
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
    plan = PromptLocations(paths.prompts / stagefiles.PROMPTS_FILE, cfg.limit, namespace)
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
            sendloop.print_first_request(plan.first_prompt(), server, sampling, cfg)
        gen = None
        if pending:
            gen = await _send(cfg, plan, cache, server, key, pending)
        transient = gen.transient if gen else {}
        counts = completions.write_outputs(plan, cache, transient, meta,
                               engineids.why_without(server.engine, router), paths.out,
                               server.engine)
    report = {
        "requests": plan.n,
        **counts,
        "from_cache": gen.cached if gen else plan.n,
        "sent": gen.tally.sent if gen else 0,
        "retries": gen.client.retries if gen else 0,
        "clamped": gen.client.clamped if gen else 0,
        "context": gen.budget.report() if gen and gen.budget else None,
        "wall_time_s": round(time.monotonic() - t0, 3),
        **(gen.tally.metrics() if gen else Throughput.metrics_empty()),
        "model": label,
        "sampling": sampling_hash,
        "sampling_params": sampling.as_dict(),
        "seed_honoured": seed_used,
        "server": server.info(),
        "cache_dir": str(cache.dir),
        "cache_damaged": damaged,
        "cache_unverified": cache.unverified,
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
        regen = turns.Regeneration(cfg, plan, cache, server, namespace, meta, lambda prompt, rec:
                                   completions.record_row(prompt, rec, meta, server.engine))
        log.info("%d prompts x %d samples: %d turns to walk, cache %s", plan.n,
                 cfg.samples_per_prompt, regen.total_turns, cache.dir)
        if cfg.limit is not None and plan.n:  # the dry run's view: the first turn's request
            sendloop.print_first_request(plan.first_prompt(), server, Sampling.of(cfg), cfg)
        if not await regen.answered():
            await _serving(cfg, plan, server, key, regen.run)
        counts, transient = await regen.write(
            engineids.why_without(server.engine, router), paths.out, completions.failure_row)
    report = {
        "requests": regen.n_jobs, **counts,
        "from_cache": counts["turns"]["asked"] - regen.tally.finished, "sent": regen.tally.sent,
        "retries": regen.client.retries if regen.client else 0,
        "clamped": regen.client.clamped if regen.client else 0,
        "context": regen.budget.report() if regen.budget else None,
        "wall_time_s": round(time.monotonic() - t0, 3), **regen.tally.metrics(),
        "model": meta["model"], "sampling": meta["sampling_hash"],
        "sampling_params": meta["sampling"], "samples_per_prompt": cfg.samples_per_prompt,
        "seed_honoured": seed_used, "server": server.info(),
        "cache_dir": str(cache.dir), "cache_damaged": regen.index.damaged,
        "cache_unverified": cache.unverified,
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
) -> sendloop.Generation:
    async def work(client: ChatClient, budget, watchdog) -> sendloop.Generation:
        gen = sendloop.Generation(cfg, plan, cache, server, client, budget)
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
            enable_thinking=cfg.enable_thinking, reasoning_split=await server.reasoning_split(),
            unreachable_deadline=cfg.server.unreachable_deadline, gate=watchdog,
            min_new_tokens=cfg.min_new_tokens,
        ) as client:  # fmt: skip
            return await work(client, budget, watchdog)


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
                    "(tokenize refuses such rows, naming each)", ids["rows_unusable_ids"])
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
