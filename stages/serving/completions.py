"""data/completions as generate writes it: completions.jsonl and failures.jsonl in
prompt order, from the request cache only (`write_outputs`), each row made from a cached
reply (`completion_row`: the prompt's messages and the answer, its finish and truncation,
usage, model, sampling hash and the engine's token ids) or failure (`failure_row`), and
generation.json beside them (what tokenize follows).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from stages.chat import thinking
from stages.common import outputs, stagefiles
from stages.common.errors import StageError
from stages.serving import cacherecords, engineids, toolshape, turns
from stages.serving.client import parse_reply
from stages.serving.promptindex import PromptLocations
from stages.serving.requestcache import RequestCache

# "abort" is retried now (client.py), but caches written before may still hold one
TRUNCATED_FINISH = ("length", "abort")


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
    counts, ids = turns.new_counts()
    kinds: dict[str, int] = {}
    transient_kinds: dict[str, int] = {}
    by_source: dict[str, dict] = {}  # the same counts per source, for the lineage card
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    with outputs.atomic_dir(out) as tmp, open(plan.path, "rb") as src, open(
        tmp / stagefiles.COMPLETIONS_FILE, "w", encoding="utf-8", newline="\n"
    ) as comp, open(tmp / stagefiles.FAILURES_FILE, "w", encoding="utf-8", newline="\n") as fail:
        for i in range(plan.n):
            line = src.readline()
            if len(line) != plan.offsets[i + 1] - plan.offsets[i]:
                raise StageError(f"{plan.path}: changed while generate was running; run it again")
            prompt = json.loads(line)
            if plan.seg[i] >= 0:
                rec = cacherecords.cached_record(cache.read_json(int(plan.seg[i]), int(plan.off[i])))
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
                row = record_row(prompt, rec, meta, engine)
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
        outputs.write_json(tmp / stagefiles.GENERATION_FILE, generation)
    turns.finish_counts(counts, ids, kinds, transient_kinds, by_source)
    return counts


def record_row(prompt: dict, rec: dict, meta: dict, engine: Optional[str]) -> dict:
    """The completion row of a success record (cacherecords), `meta` as write_outputs."""
    return completion_row(prompt, rec["reply"], meta["model"], meta["sampling_hash"],
                          meta["sampling"]["enable_thinking"], engine,
                          cacherecords.reasoning_split(rec))


def completion_row(
    prompt: dict, reply: dict, model: str, sampling_hash: str, enable_thinking: bool,
    engine: Optional[str] = None, reasoning_split: bool = False,
) -> dict:
    # parsed again here, not taken from the client's Reply: rows are written from the
    # cached reply, so a row from a resumed run (its reply sent by an earlier run) and
    # one from a fresh run come out the same; the client's parse feeds only live counts
    parts = parse_reply(reply, enable_thinking, reasoning_split)
    answer: dict[str, Any] = {
        "role": "assistant", "content": parts.content,
        "reasoning_content": thinking.recorded_reasoning(parts.reasoning, parts.content),
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
