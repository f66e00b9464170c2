"""Conversations answered turn by turn, and several answers per prompt: the send loop and
the writer of generate when a prompt has turns (stages/chat/regenerate.py) or
`samples_per_prompt` > 1.

A job is one sample of one prompt. Each of `concurrency` workers takes the next job and
asks its turns in order, turn k+1 as soon as turn k is back (never in waves). A turn's
cache key is its whole request (the target's earlier answers in it) and the sample, so a
rerun finds every answered turn and sends only the rest. Sample 0 keeps the plain
prompt's key, seed and id: one sample is a plain run. The writer walks the same turns
from the cache only, so a resumed run writes the clean run's bytes. A turn that failed
ends its conversation at the last good turn, or drops it (`on_turn_failure`).
docs/stages.md, generate, "Turns and samples".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from array import array
from pathlib import Path
from typing import Callable, Optional

import xxhash

from stages.chat import conversation, regenerate
from stages.common import outputs, params, stagefiles
from stages.common.errors import StageError
from stages.common.reading import open_regular
from stages.serving import cacherecords, fitting
from stages.serving.failurestreaks import BadBodyBreaker, HeldFailures
from stages.serving.client import BodyEncoder, ChatClient, Failure, Sampling
from stages.serving.progress import Progress, Throughput
from stages.serving.promptindex import PromptLocations
from stages.serving.requestcache import KeyIndex, RequestCache, request_key

log = logging.getLogger(__name__)


def wanted(cfg: params.Generate, plan: PromptLocations) -> bool:
    """Whether this run takes the turn path (else generate's plain one)."""
    return cfg.samples_per_prompt > 1 or plan_has_turns(plan)


def plan_has_turns(plan: PromptLocations) -> bool:
    with open_regular(plan.path) as f:
        for i, line in enumerate(f):
            if i >= plan.n:
                break
            if b'"' + regenerate.TURNS_KEY.encode() + b'"' in line and \
                    json.loads(line).get(regenerate.TURNS_KEY):
                return True
    return False


def turn_key(namespace: str, sample: int, messages: list, tools) -> bytes:
    """Sample 0's key is the plain prompt's: one sample shares the plain run's cache."""
    space = namespace if sample == 0 else f"{namespace}/sample-{sample}"
    return request_key(space, messages, tools)


def sample_id(prompt_id: str, sample: int) -> str:
    """A stable row id per sample (sample 0 keeps the prompt's)."""
    if sample == 0:
        return prompt_id
    return xxhash.xxh3_128_hexdigest(f"{prompt_id}\0sample\0{sample}".encode())


def sample_seed(seed: Optional[int], sample: int) -> Optional[int]:
    if sample == 0:
        return seed
    return (seed or 0) + sample


def _turn_problem(prompt: dict, where: str) -> None:
    turns = prompt.get(regenerate.TURNS_KEY)
    if turns is None:
        return
    if not isinstance(turns, list) or not all(
            isinstance(t, list) and t and all(isinstance(m, dict) and m.get("role") == "user"
                                              for m in t) for t in turns):
        raise StageError(f"{where}: 'turns' must be a list of lists of user messages")
    bad = conversation.problem(prompt["messages"] + [m for t in turns for m in t],
                               prompt.get("tools"))
    if bad:
        raise StageError(f"{where}: turns: {bad}")


def new_counts() -> tuple[dict, dict]:
    """The counts of a completions file being written, and of the engine ids its rows hold."""
    counts = {
        "completed": 0, "failed": 0, "failed_transient": 0, "truncated": 0,
        "prompt_tokens": 0, "output_tokens": 0,
    }  # fmt: skip
    return counts, dict.fromkeys(("rows_with_ids", "rows_unusable_ids", "rows_without_ids"), 0)


def finish_counts(counts: dict, ids: dict, kinds: dict, transient_kinds: dict,
                  by_source: dict) -> None:
    """The counts of a written completions file completed: failures by kind, transient
    and permanent apart, the engine ids and each source's counts."""
    counts["engine_ids"] = ids
    counts["failed_by_kind"] = dict(sorted(kinds.items()))
    counts["failed_transient_by_kind"] = dict(sorted(transient_kinds.items()))
    permanent = {k: v - transient_kinds.get(k, 0) for k, v in counts["failed_by_kind"].items()}
    counts["failed_permanent_by_kind"] = {k: v for k, v in permanent.items() if v}
    counts["sources"] = by_source


def count_completed(row: dict, counts: dict, by_source: dict, ids: dict) -> None:
    """A completion row written: the run's counts, its source's, and whether it holds the
    engine's token ids (generate's report; a plain run's rows and a turn-by-turn run's)."""
    for c in (counts, by_source):
        c["completed"] += 1
        c["truncated"] += row["truncated"]
    counts["prompt_tokens"] += row["usage"]["prompt_tokens"]
    counts["output_tokens"] += row["usage"]["completion_tokens"]
    served = row.get("engine_tokens")
    ids["rows_without_ids" if served is None else "rows_unusable_ids"
        if "unusable" in served else "rows_with_ids"] += 1

class CacheIndex:
    """Every record of the key space on disk by key, in arrays (~65 bytes a record, never
    a dict of replies). A run reads it again after sending: while sending, a job needs
    only the replies it got itself."""

    def __init__(self, cache: RequestCache, retry_failed: bool):
        self.cache, self.retry_failed = cache, retry_failed
        keys = bytearray()
        seg, off = array("l"), array("q")
        for key, s, o, _ in cache.scan():
            keys += key
            seg.append(s)
            off.append(o)
        self.index = KeyIndex(bytes(keys))
        self.seg, self.off = seg, off
        self.damaged = cache.damaged

    def lookup(self, key: bytes) -> Optional[dict]:
        """The record for `key`: the first intact success, else the first failure (unless
        `retry_failed`); None when there is none."""
        failed = None
        for j in self.index.find(key):
            rec = cacherecords.cached_record(self.cache.read_json(self.seg[j], self.off[j]))
            if rec is None:
                continue
            if rec["ok"]:
                return rec
            if failed is None and not self.retry_failed:
                failed = rec
        return failed

    def add(self, key: bytes, record: dict | bytes) -> None:
        try:
            if isinstance(record, bytes):
                self.cache.append_json(key, record)
            else:
                self.cache.append(key, record)
        except OSError as e:
            raise StageError(f"{self.cache.dir}: cannot append to the request cache: {e}") from None


class _Missing(Exception):
    """A turn with no record, found while reading the cache only."""


@dataclasses.dataclass
class Walk:
    """A job's turns as far as they went."""

    rows: list  # the completion row of each answered turn
    failure: Optional[dict] = None  # the record of the turn that failed
    transient: bool = False
    ended: str = "complete"  # complete | max_turns | tool_call | truncated | failed


class Regeneration:
    """One run over every job: send what the cache lacks, then write from the cache."""

    def __init__(self, cfg: params.Generate, plan: PromptLocations, cache: RequestCache,
                 server, namespace: str, meta: dict, row_of: Callable[..., dict]):
        self.cfg, self.plan, self.cache, self.namespace = cfg, plan, cache, namespace
        self.server = server  # serving/server.py's ServerHandle: the model name and dialect
        self.meta, self.row_of = meta, row_of
        self.k = cfg.samples_per_prompt
        self.index = CacheIndex(cache, cfg.retry_failed)
        self.transient: dict[bytes, dict] = {}  # failures of this run not cached
        self.gate = HeldFailures()  # permanent failures, before any success
        # twin prompts (the same first request): their turns in flight, and answered
        self.inflight: dict[bytes, asyncio.Future] = {}
        self.twins: dict[bytes, dict] = {}
        self.n_jobs = plan.n * self.k
        self.total_turns = self._count_turns()
        self.cached = self.done = self.failed = 0
        self.tally = Throughput()
        self.client: Optional[ChatClient] = None
        self.budget: Optional[fitting.ContextBudget] = None

    def _count_turns(self) -> int:
        total = 0
        with open_regular(self.plan.path) as f:
            for i in range(self.plan.n):
                line = f.readline()
                prompt = json.loads(line)
                _turn_problem(prompt, f"{self.plan.path}:{i + 1}")
                total += self._turns_of(prompt)
        return total * self.k

    def _turns_of(self, prompt: dict) -> int:
        t = regenerate.turn_count(prompt)
        return t if self.cfg.max_turns is None else min(t, self.cfg.max_turns)

    # ------------------------------------------------------------------- walking

    async def walk(self, prompt: dict, sample: int, send: bool, shared: bool = False) -> Walk:
        """Ask (or, with `send` false, read back) the turns of one job in order. `shared`:
        another prompt has the same first request (so maybe later ones too)."""
        tools = prompt.get("tools")
        request = prompt["messages"]
        walk = Walk([])
        last = self._turns_of(prompt)
        pid = sample_id(prompt["id"], sample)
        for k in range(1, last + 1):
            key = turn_key(self.namespace, sample, request, tools)
            rec = self.index.lookup(key) or self.transient.get(key)
            if rec is None and shared:
                rec = self.twins.get(key)
            if rec is None:
                if not send:
                    raise _Missing
                if shared:
                    rec = await self._send_once(key, prompt, request, k, sample)
                else:
                    rec = await self._send(key, prompt, request, k, sample)
            elif send:
                self.cached += 1
                self.done += 1
            if not rec["ok"]:
                walk.failure, walk.ended = rec, "failed"
                walk.transient = key in self.transient
                break
            turn_prompt = {"id": pid, "source": prompt.get("source"), "messages": request}
            if tools is not None:
                turn_prompt["tools"] = tools
            row = self.row_of(turn_prompt, rec)
            walk.rows.append(row)
            if k < last and regenerate.ends_conversation(row):
                walk.ended = "truncated" if row["truncated"] else "tool_call"
                break
            if k < last:
                request = regenerate.next_request(request, row["messages"][-1], prompt, k)
        else:
            if last < regenerate.turn_count(prompt):
                walk.ended = "max_turns"
        if send:
            self.done += last - len(walk.rows) - (walk.failure is not None)  # never asked
        return walk

    async def _send_once(self, key: bytes, prompt: dict, request: list, k: int,
                         sample: int) -> dict:
        """_send for a request that twin prompts may ask too: one request per key in a
        run, so twins build on the same answer (the one the writer reads back)."""
        waiting = self.inflight.get(key)
        if waiting is not None:
            self.done += 1
            return await asyncio.shield(waiting)
        fut = self.inflight[key] = asyncio.get_running_loop().create_future()
        try:
            rec = await self._send(key, prompt, request, k, sample)
        except BaseException:
            fut.cancel()
            raise
        finally:
            del self.inflight[key]
        self.twins[key] = rec
        fut.set_result(rec)
        return rec

    async def _send(self, key: bytes, prompt: dict, request: list, k: int, sample: int) -> dict:
        body_prompt = {"id": f"{sample_id(prompt['id'], sample)}-t{k}", "messages": request}
        if prompt.get("tools") is not None:
            body_prompt["tools"] = prompt["tools"]
        fit = self.budget.fit(body_prompt) if self.budget is not None else None
        if isinstance(fit, fitting.NotSent):
            f = Failure(fit.kind, None, fit.message(self.budget.counter.spec), 0, True)
            return self._failed(key, f)
        data = self.encoders[sample].encode(body_prompt, fit)
        self.tally.sent += 1
        try:
            reply = await self.client.complete(data)
        except Failure as f:
            return self._failed(key, f)
        self.tally.answered(reply.prompt_tokens, reply.completion_tokens, reply.latency)
        self.done += 1
        self.breaker.success()
        raw = cacherecords.success(reply)
        self.index.add(key, raw)
        for k2, rec in self.gate.success():
            self.transient.pop(k2, None)
            self.index.add(k2, rec)
        # the client checked this reply already; the writer reads the cached one back
        return json.loads(raw)

    def _failed(self, key: bytes, f: Failure) -> dict:
        self.tally.gave_up()
        self.done += 1
        self.failed += 1
        self.breaker.failure(f)
        rec = cacherecords.failure(f)
        if not f.permanent:
            self.transient[key] = rec
        elif self.gate.open:
            self.index.add(key, rec)
        else:
            self.transient[key] = rec
            self.gate.hold(key, rec, f)
        return rec

    # --------------------------------------------------------------------- sending

    async def answered(self) -> bool:
        """Whether the cache already answers every turn of every job (then no server is
        needed)."""
        with open_regular(self.plan.path) as f:
            for i in range(self.plan.n):
                prompt = json.loads(f.readline())
                for s in range(self.k):
                    try:
                        await self.walk(prompt, s, send=False)
                    except _Missing:
                        return False
        return True

    async def run(self, client: ChatClient, budget: Optional[fitting.ContextBudget],
                  watchdog) -> None:
        """Send every turn the cache lacks (generate's `_serving` gives the client)."""
        self.client, self.budget = client, budget
        server = self.server
        self.breaker = BadBodyBreaker(client.urls)
        sampling = Sampling.of(self.cfg)
        self.encoders = [
            BodyEncoder(server.request_model,
                        dataclasses.replace(sampling, seed=sample_seed(sampling.seed, s)),
                        server.engine)
            for s in range(self.k)
        ]
        progress = Progress(self.total_turns, 0, self.cfg.progress_interval)
        jobs = iter(range(self.n_jobs))
        fd = os.open(self.plan.path, os.O_RDONLY)

        async def worker() -> None:
            for job in jobs:  # next() never awaits: workers share the iterator safely
                i, s = divmod(job, self.k)
                await self.walk(json.loads(self.plan.line(fd, i)), s, send=True,
                                shared=bool(self.plan.index.shared[i]))

        async def ticker() -> None:
            tick = 0.5 if progress.bar is not None else min(1.0, self.cfg.progress_interval)
            while True:
                await asyncio.sleep(tick)
                if self.cache.sync_due():
                    await asyncio.to_thread(self.cache.sync)
                progress.tick(self.done, self.failed, self.tally.out_tokens, client.in_flight,
                              skipped=self.cached)

        self.tally.start()
        try:
            with progress.quiet_logs():
                async with asyncio.TaskGroup() as tg:
                    background = [tg.create_task(ticker()),
                                  tg.create_task(watchdog.watch(
                                      lambda: (self.tally.finished, client.in_flight)))]
                    n = min(self.cfg.concurrency, max(self.n_jobs, 1))
                    await asyncio.gather(*(tg.create_task(worker()) for _ in range(n)))
                    for task in background:
                        task.cancel()
        except* StageError as group:
            raise group.exceptions[0] from None
        finally:
            os.close(fd)
            self.gate.release()  # held failures stay reported, uncached
            progress.tick(self.done, self.failed, self.tally.out_tokens, client.in_flight,
                          final=True, skipped=self.cached)


    # --------------------------------------------------------------------- writing

    async def write(self, why_without_ids: str, out: Path,
                    failure_row: Callable) -> tuple[dict, dict]:
        """completions.jsonl + failures.jsonl in prompt then sample order, from the cache
        (and this run's uncached failures) only, and generation.json. Returns the counts
        and the transient failures by job (for generate's verdict)."""
        self.cache.sync()
        damaged = self.index.damaged
        # what this run appended, and every failure (retry_failed chose what to resend)
        self.index = CacheIndex(self.cache, retry_failed=False)
        self.index.damaged = damaged
        counts, ids = new_counts()
        kinds: dict[str, int] = {}
        transient_kinds: dict[str, int] = {}
        turns = {"asked": 0, "answered": 0, "failed": 0, "failed_transient": 0,
                 "conversations": 0, "multi_turn": 0, "cut_by_failure": 0,
                 "dropped_by_failure": 0, "ended_by_tool_call": 0, "ended_truncated": 0,
                 "cut_by_max_turns": 0}  # fmt: skip
        by_source: dict[str, dict] = {}
        transient: dict[int, dict] = {}
        turn_kinds: dict[str, int] = {}
        turn_transient_kinds: dict[str, int] = {}
        dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
        with outputs.atomic_dir(out) as tmp, open(self.plan.path, "rb") as src, open(
            tmp / stagefiles.COMPLETIONS_FILE, "w", encoding="utf-8", newline="\n"
        ) as comp, open(tmp / stagefiles.FAILURES_FILE, "w", encoding="utf-8", newline="\n") as fail:
            for i in range(self.plan.n):
                line = src.readline()
                if len(line) != self.plan.offsets[i + 1] - self.plan.offsets[i]:
                    raise StageError(f"{self.plan.path}: changed while generate was "
                                     "running; run it again")
                prompt = json.loads(line)
                multi = regenerate.turn_count(prompt) > 1
                for s in range(self.k):
                    job = i * self.k + s
                    walk = await self.walk(prompt, s, send=False)
                    mine = by_source.setdefault(str(prompt.get("source")), {
                        "completed": 0, "truncated": 0, "failed": 0, "failed_by_kind": {},
                        "turns_answered": 0, "turns_failed": 0, "cut_by_failure": 0,
                        "ended_by_tool_call": 0})
                    turns["conversations"] += 1
                    turns["multi_turn"] += multi
                    turns["asked"] += len(walk.rows) + (walk.failure is not None)
                    turns["answered"] += len(walk.rows)
                    mine["turns_answered"] += len(walk.rows)
                    turns["ended_by_tool_call"] += walk.ended == "tool_call"
                    mine["ended_by_tool_call"] += walk.ended == "tool_call"
                    turns["ended_truncated"] += walk.ended == "truncated"
                    turns["cut_by_max_turns"] += walk.ended == "max_turns"
                    if walk.failure is not None:
                        turns["failed"] += 1
                        mine["turns_failed"] += 1
                        turns["failed_transient"] += walk.transient
                        kind = walk.failure["kind"]
                        turn_kinds[kind] = turn_kinds.get(kind, 0) + 1
                        if walk.transient:
                            transient[job] = walk.failure
                            turn_transient_kinds[kind] = turn_transient_kinds.get(kind, 0) + 1
                    keep = walk.rows and (walk.failure is None
                                          or self.cfg.on_turn_failure == "truncate")
                    if keep:
                        if walk.failure is not None:
                            turns["cut_by_failure"] += 1
                            mine["cut_by_failure"] += 1
                        row = self._row(walk.rows, prompt, s, multi)
                        count_completed(row, counts, mine, ids)
                        comp.write(dumps(row) + "\n")
                        continue
                    if walk.rows:
                        turns["dropped_by_failure"] += 1
                    rec = walk.failure
                    counts["failed"] += 1
                    kinds[rec["kind"]] = kinds.get(rec["kind"], 0) + 1
                    if walk.transient:
                        counts["failed_transient"] += 1
                        transient_kinds[rec["kind"]] = transient_kinds.get(rec["kind"], 0) + 1
                    mine["failed"] += 1
                    mine["failed_by_kind"][rec["kind"]] = \
                        mine["failed_by_kind"].get(rec["kind"], 0) + 1
                    frow = failure_row({"id": sample_id(prompt["id"], s),
                                        "source": prompt.get("source")}, rec)
                    if self.k > 1:
                        frow["sample"] = s
                    if multi:
                        frow["turn"] = len(walk.rows) + 1
                    fail.write(dumps(frow) + "\n")
            generation = dict(self.meta)
            generation["samples_per_prompt"] = self.k
            if ids["rows_without_ids"]:
                ids["why_without"] = generation["engine_ids_missing"] = why_without_ids
            outputs.write_json(tmp / stagefiles.GENERATION_FILE, generation)  # redacted
        finish_counts(counts, ids, kinds, transient_kinds, by_source)
        perm = {k: v - turn_transient_kinds.get(k, 0) for k, v in sorted(turn_kinds.items())}
        turns["verdict"] = {  # what generate's verdict weighs: jobs with a failed turn
            "failed": turns["failed"], "failed_transient": turns["failed_transient"],
            "failed_transient_by_kind": dict(sorted(turn_transient_kinds.items())),
            "failed_permanent_by_kind": {k: v for k, v in perm.items() if v},
        }
        counts["turns"] = turns
        return counts, transient

    def _row(self, rows: list, prompt: dict, sample: int, multi: bool) -> dict:
        shown = sample if self.k > 1 else None
        if multi:
            return regenerate.conversation_row(rows, prompt, shown)
        row = rows[0]
        if shown is not None:
            row["sample"] = shown
        return row
