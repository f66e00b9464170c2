"""The seed's job at the seed's scale: tokenize -> merge -> validate -> dvc commit -> dvc push.

  python bench/bench_seed.py                     1/20 of the seed, and 1/40 (what `make bench` runs)
  BENCH_SEED_SCALE=full python bench/bench_seed.py   the seed itself, and half of it
  BENCH_SEED_SCALE=0.1 ...                       any fraction of it (BENCH_QUICK=1: 1/200)
  BENCH_SEED_BASE=foreign ...                    the base in another tool's layout, adopted
                                                 by merge (merge.adopt)

The seed (docs/gpu-host.md's reference run, examples/reference.yaml): 193,010 prompts
from six sources in its proportions, 15 failures, 192,995 thinking answers of 2,712 output tokens on average
(lognormal, a few runaway ones cut at max_tokens), merged onto a 902,087-row base of about
2,040 tokens a row. The answers are written as generate writes them, their token counts
real for the bundled Qwen3.6 tokenizer: texts are composed from a pool of paragraphs whose
tokens are counted once (a paragraph break before a letter is a boundary the tokenizer
never merges across; samples are checked against a full render, and tokenize's
serve-render check holds every row to it). The base is random token ids in the contract
(`foreign`: .parquet files of int64 input_ids and labels, as a Hugging Face trainer's set).

In a temporary git + DVC repo (hardlink cache, a local remote), with the shipped
params.yaml but for the seed's own choices (thinking on, max_seq_len 32768), each stage
runs as dvc.yaml writes its command, in a process of its own; then `dvc commit` records
the three stages and `dvc push` sends the version to the remote. Figures, `seed_` + :

  <stage>_seconds, <stage>_wall_seconds   the stage's own time / the process's, imports included
  <stage>_tok_per_s                        tokens the stage handled / its own time
  <stage>_peak_rss_mb                      the stage process's peak RSS (bench/peak.py;
                                           validate: its report's process peak, which the
                                           training check's resets hide from VmHWM)
  <stage>_tree_pss_mb                      peak summed PSS of the process and its workers
  <stage>_anon_mb                          peak summed anonymous memory (no mapped file pages)
  <stage>_bytes_written                    bytes of new files (links to existing ones excluded)
  *_half                                   the same at half the scale: memory flat = equal
  tokenize_vs_floor                        tokenize tok/s / encode_batch_fast on pre-rendered
                                           text of a sample of the same rows, in as many
                                           processes as the stage's workers (its mean
                                           over three runs before the stage and three after)
  rows, tokens, ...                        totals, held exact: base + new = merged = validated
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

import harness  # noqa: E402
import bench_tokenize  # noqa: E402
from peak import outcome, stage_command  # noqa: E402
from stages.common import reports  # noqa: E402
from stages.process import cpus

WORK = ROOT / "bench" / "work" / "seed"

# the seed (docs/gpu-host.md's reference run)
SOURCES = {"infinity_instruct": 99_000, "webinstructsub": 40_000, "codefeedback": 29_000,
           "metamathqa": 24_000, "hermes_function_calling": 1_200, "agent_trajectories": 553}
TOOL_SOURCES = {"hermes_function_calling": 1, "agent_trajectories": 3}  # tool rounds
PROMPTS, FAILURES, BASE_ROWS = 193_010, 15, 902_087
OUTPUT_MEAN, BASE_MEAN, MAX_TOKENS = 2_712, 2_040, 32_768
RUNAWAY = 0.001  # answers that think until max_tokens (truncated: tokenize drops them)
BASE_SHARDS = 45
PARAMS = {"tokenize": {"enable_thinking": True, "max_seq_len": 32_768}}
FLOOR_ROWS, FLOOR_RUNS = 2_000, 3


def main() -> dict:
    scale = _scale()
    foreign = os.environ.get("BENCH_SEED_BASE", "contract") == "foreign"
    if foreign:
        from stages.common import params

        if "adopt" not in params.Merge.__dataclass_fields__:
            raise SystemExit("BENCH_SEED_BASE=foreign needs merge.adopt (issue 21), "
                             "not in this tree")
    os.chdir(ROOT)  # the bundled tokenizer is cached under ./.cache
    from stages.models.tokenizer import load_once

    tok = load_once(bench_tokenize.TOKENIZER)
    pool = Pool(tok)
    figures = {"seed_scale": scale, "seed_base": "foreign" if foreign else "contract"}
    half = _run(scale / 2, pool, tok, foreign, floor=False)
    full = _run(scale, pool, tok, foreign, floor=True)
    figures.update({f"seed_{k}": v for k, v in full.items()})
    figures.update({f"seed_{k}_half": v for k, v in half.items()
                    if _is_memory(k) or k in ("rows", "tokens", "scale")})
    return figures


def _scale() -> float:
    value = os.environ.get("BENCH_SEED_SCALE")
    if value == "full":
        return 1.0
    if value:
        return float(value)
    quick = harness.quick()
    return 1 / 200 if quick else 1 / 20


def _is_memory(key: str) -> bool:
    return key.endswith(("_peak_rss_mb", "_tree_pss_mb", "_anon_mb"))


# ------------------------------------------------------------------------- text


class Pool:
    """Paragraphs whose tokens are counted once: a text made of them joined by blank
    lines has the sum of their counts (every paragraph starts with a letter, so the
    tokenizer's pre-split always cuts after the break)."""

    def __init__(self, tok, size: int = 6000, seed: int = 0):
        rng = random.Random(seed)
        text = bench_tokenize.Text(rng)
        self.texts = [text.prose(rng.randint(20, 90)) for _ in range(size)]  # some hold code
        encode = tok.backend_tokenizer.encode_batch_fast

        def counts(suffix: str) -> np.ndarray:
            done = encode([t + suffix for t in self.texts], add_special_tokens=False)
            return np.array([len(e.ids) for e in done], np.int64)

        self.alone, self.broken, self.newline = counts(""), counts("\n\n"), counts("\n")
        self.mean = float(self.broken.mean())

    def text(self, picks: np.ndarray) -> str:
        return "\n\n".join(self.texts[i] for i in picks)

    def count(self, picks: np.ndarray, then_newline: bool = False) -> int:
        """Tokens of text(picks), followed by a special token (or by "\\n" and one)."""
        last = (self.newline if then_newline else self.alone)[picks[-1]]
        return int(self.broken[picks[:-1]].sum() + last)


TOOLS = bench_tokenize.TOOLS


class Conversations:
    """Completion rows in the seed's shape, written as generate writes them."""

    def __init__(self, tok, pool: Pool, seed: int):
        from stages.chat.encoder import ChatEncoder

        self.tok, self.pool = tok, pool
        self.rng = np.random.default_rng(seed)
        self.encoder = ChatEncoder(tok, enable_thinking=True,
                                   name=bench_tokenize.TOKENIZER)
        self.overhead = {}
        for system in (False, True):  # template tokens around the contents, counted once
            picks = self._picks(40)
            msgs = self._prompt(picks, picks if system else None)
            content = pool.count(picks) * (2 if system else 1)
            self.overhead[system] = len(self.encoder.prompt_ids(msgs)) - content
        end = tok.backend_tokenizer.encode("</think>\n\n", add_special_tokens=False)
        self.think_end = len(end.ids)

    def _picks(self, tokens: float) -> np.ndarray:
        return self.rng.integers(0, len(self.pool.texts), max(1, round(tokens / self.pool.mean)))

    def _prompt(self, user, system=None) -> list[dict]:
        msgs = [] if system is None else [{"role": "system", "content": self.pool.text(system)}]
        return msgs + [{"role": "user", "content": self.pool.text(user)}]

    def row(self, i: int, source: str) -> dict:
        rng, pool = self.rng, self.pool
        system = self._picks(rng.uniform(30, 150)) if rng.random() < 0.2 else None
        user = self._picks(rng.lognormal(math.log(150), 0.7))
        msgs = self._prompt(user, system)
        tools = None
        if source in TOOL_SOURCES:
            tools = TOOLS
            for r in range(TOOL_SOURCES[source]):
                msgs.append({"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "id": f"call_{r}", "function": {
                        "name": "search", "arguments": {"query": f"step {r} of {i}"}}}]})
                msgs.append({"role": "tool", "tool_call_id": f"call_{r}",
                             "content": pool.text(self._picks(rng.uniform(60, 400)))})
            prompt = len(self.encoder.prompt_ids(msgs, tools))  # few rows: counted whole
        else:
            prompt = self.overhead[system is not None] + pool.count(user) + (
                pool.count(system) if system is not None else 0)
        runaway = rng.random() < RUNAWAY
        target = MAX_TOKENS if runaway else rng.lognormal(math.log(OUTPUT_MEAN) - 0.18, 0.6)
        if runaway:
            reasoning = self._picks(MAX_TOKENS)
            answer = None
            completion = pool.count(reasoning)
        else:
            reasoning = self._picks(target * 0.85)
            answer = self._picks(target * 0.15)
            completion = (pool.count(reasoning, then_newline=True) + self.think_end
                          + pool.count(answer) + 1)  # + <|im_end|>
        final = {"role": "assistant", "reasoning_content": pool.text(reasoning),
                 "content": None if answer is None else pool.text(answer)}
        row = {"id": hashlib.blake2b(f"{source}{i}".encode(), digest_size=8).hexdigest(),
               "source": source, "messages": msgs + [final],
               "finish_reason": "length" if runaway else "stop", "truncated": runaway,
               "usage": {"prompt_tokens": prompt, "completion_tokens": completion},
               "model": "bench:seed", "sampling": "bench"}
        if tools:
            row["tools"] = tools
        return row


def write_completions(repo: Path, scale: float, tok, pool: Pool) -> dict:
    """data/prompts, data/completions (completions + failures) and the two upstream
    reports, in the seed's proportions at `scale`; the facts written."""
    import orjson

    conv = Conversations(tok, pool, seed=round(scale * 1e6))
    per_source = {s: max(1, round(n / sum(SOURCES.values()) * PROMPTS * scale))
                  for s, n in SOURCES.items()}
    order = [s for s, n in per_source.items() for _ in range(n)]
    random.Random(0).shuffle(order)
    failed = set(random.Random(1).sample(range(len(order)), FAILURES))
    for name in ("prompts", "completions"):
        (repo / "data" / name).mkdir(parents=True)
    facts = {"prompts": len(order), "answers": 0, "output_tokens": 0, "truncated": 0}
    with open(repo / "data/completions/completions.jsonl", "wb") as out, \
            open(repo / "data/completions/failures.jsonl", "wb") as failures, \
            open(repo / "data/prompts/prompts.jsonl", "wb") as prompts:
        for i, source in enumerate(order):
            row = conv.row(i, source)
            prompt = {k: row[k] for k in ("id", "source", "tools") if k in row}
            prompts.write(orjson.dumps({**prompt, "messages": row["messages"][:-1]}) + b"\n")
            if i in failed:
                failures.write(orjson.dumps({**prompt, "error": "server_error", "attempts": 9})
                               + b"\n")
                continue
            out.write(orjson.dumps(row) + b"\n")
            facts["answers"] += 1
            facts["output_tokens"] += row["usage"]["completion_tokens"]
            facts["truncated"] += row["truncated"]
    _check_counts(repo / "data/completions/completions.jsonl", conv)
    reports = repo / "reports"
    reports.mkdir()
    sources = {s: {"prompts": n} for s, n in per_source.items()}
    (reports / "prepare.json").write_text(json.dumps(
        {"bench": "synthetic seed", "totals": {"kept": len(order)}, "sources": sources}))
    (reports / "generate.json").write_text(json.dumps(
        {"bench": "synthetic seed", "model": "bench:seed", "completions": facts["answers"],
         "failures": FAILURES, "output_tokens": facts["output_tokens"]}))
    return facts


def _check_counts(path: Path, conv: Conversations, rows: int = 50) -> None:
    """The first rows' prompt counts against a full render (tokenize checks them all)."""
    with open(path, "rb") as f:
        for _, line in zip(range(rows), f):
            row = json.loads(line)
            real = len(conv.encoder.prompt_ids(row["messages"][:-1], row.get("tools")))
            if real != row["usage"]["prompt_tokens"]:
                raise RuntimeError(f"bench_seed: row {row['id']}: the paragraph sum gives "
                                   f"{row['usage']['prompt_tokens']} prompt tokens, a "
                                   f"render {real}")


# ------------------------------------------------------------------------- base


def write_base(folder: Path, rows: int, fingerprint: dict, vocab: int, foreign: bool) -> int:
    """`rows` rows of random ids in BASE_SHARDS files; returns their tokens."""
    from stages.dataset import fingerprint as fp_file
    from stages.dataset.shards import write_metadata

    rng = np.random.default_rng(7)
    folder.mkdir(parents=True)
    names, tokens, first = [], 0, 0
    names_sources = np.array(list(SOURCES))
    weights = np.array(list(SOURCES.values()), float)
    for k in range(BASE_SHARDS):
        n = rows // BASE_SHARDS + (k < rows % BASE_SHARDS)
        name = f"data-{k:05d}.{'parquet' if foreign else 'arrow'}"
        batches = []
        for lo in range(0, n, 1000):
            m = min(1000, n - lo)
            lengths = np.clip(rng.lognormal(math.log(BASE_MEAN) - 0.18, 0.6, m), 16,
                              MAX_TOKENS).astype(np.int32)
            sources = names_sources[rng.choice(len(weights), m, p=weights / weights.sum())]
            batches.append(_base_batch(rng, first, lengths, sources, vocab, foreign))
            first += m
            tokens += int(lengths.sum())
        _write_shard(folder / name, batches, foreign)
        names.append(name)
    if not foreign:
        write_metadata(folder, names, "bench-seed-base")
        (folder / fp_file.FILE).write_text(json.dumps(fingerprint))
    return tokens


def _base_batch(rng, first: int, lengths: np.ndarray, sources, vocab: int, foreign: bool):
    import pyarrow as pa

    from stages.dataset.schema import ARROW_SCHEMA

    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    ids = rng.integers(0, vocab, int(offsets[-1]), dtype=np.int32)
    prompt = (lengths * rng.uniform(0.05, 0.3, len(lengths))).astype(np.int32)
    row_of = np.repeat(np.arange(len(lengths)), lengths)
    mask = (np.arange(len(ids)) - offsets[:-1][row_of] >= prompt[row_of]).astype(np.int8)
    if foreign:  # as a Hugging Face trainer's set: int64 ids, labels -100 where untrained
        labels = np.where(mask == 1, ids, -100).astype(np.int64)
        off64 = offsets.astype(np.int64)
        return pa.RecordBatch.from_arrays(
            [pa.LargeListArray.from_arrays(pa.array(off64), pa.array(ids.astype(np.int64))),
             pa.LargeListArray.from_arrays(pa.array(off64), pa.array(labels))],
            names=["input_ids", "labels"])
    loss = np.add.reduceat(mask, offsets[:-1], dtype=np.int64).astype(np.int32)
    return pa.RecordBatch.from_arrays(
        [pa.array([f"base-{first + i:08d}" for i in range(len(lengths))]), pa.array(sources),
         pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
         pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
         pa.array(lengths), pa.array(loss)], schema=ARROW_SCHEMA)


def _write_shard(path: Path, batches: list, foreign: bool) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stages.dataset.shards import ShardFile

    if foreign:
        pq.write_table(pa.Table.from_batches(batches), path, row_group_size=1000)
        return
    with ShardFile(path) as writer:
        for batch in batches:
            writer.write(batch)


# ------------------------------------------------------------------------- the run


def _run(scale: float, pool: Pool, tok, foreign: bool, floor: bool) -> dict:
    """One whole job at `scale` in a fresh repo under WORK (removed after)."""
    from stages.common import params
    from stages.dataset import fingerprint as fp_file
    from stages.models import tokenizer
    from stages.models.tokenizer import load_once

    shutil.rmtree(WORK, ignore_errors=True)
    repo = WORK / "repo"
    try:
        config = _setup(repo, foreign)
        facts = write_completions(repo, scale, tok, pool)
        cfg = params.load("tokenize", repo / "params.yaml")
        tok_id = tokenizer.identity_of(cfg.tokenizer, load_once(cfg.tokenizer))
        base_tokens = write_base(repo / "data/base", round(BASE_ROWS * scale),
                                 fp_file.build(tok_id, tokenizer.template_sha256(tok), cfg), len(tok), foreign)
        harness.sh(["dvc", "add", "-q", "data/base"], repo)
        out = {"scale": scale, "prompts": facts["prompts"], "answers": facts["answers"],
               "output_tokens_mean": round(facts["output_tokens"] / facts["answers"]),
               "base_rows": round(BASE_ROWS * scale), "base_tokens": base_tokens,
               "completions_mb": round(_size(repo / "data/completions") / 1e6, 1),
               "base_mb": round(_size(repo / "data/base") / 1e6, 1)}
        reports = {}
        floors = [_floor(repo)] if floor else []  # around the stage: the load moves
        for stage in ("tokenize", "merge", "validate"):
            reports[stage], figures = _stage(stage, repo)
            out.update({f"{stage}_{k}": v for k, v in figures.items()})
            if floor and stage == "tokenize":
                floors.append(_floor(repo))
        out.update(_totals(reports, out))
        out.update(_versioned(repo))
        if floor:
            rate = sum(f[0] for f in floors) / 2
            per_cpu = max(f[1] for f in floors)
            out.update(tokenize_floor_tok_per_s=round(rate),
                       tokenize_vs_floor=round(out["tokenize_tok_per_s"] / rate, 3),
                       tokenize_floor_tok_per_cpu_s=round(per_cpu),
                       tokenize_vs_floor_cpu=round(out["tokenize_tok_per_cpu_s"] / per_cpu, 3))
        out["params"] = json.dumps(config, sort_keys=True)
        return out
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


def _setup(repo: Path, foreign: bool) -> dict:
    """A git + DVC repo with the three stages of dvc.yaml, the project's code and cache
    linked in, and the shipped params but for the seed's own choices; those choices."""
    repo.mkdir(parents=True)
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"],
                ["dvc", "config", "cache.type", "hardlink,symlink"],
                ["dvc", "remote", "add", "-q", "-d", "local", str(WORK / "remote")]):
        harness.sh(cmd, repo)
    (repo / "stages").symlink_to(ROOT / "stages")
    (repo / ".cache").symlink_to(ROOT / ".cache")
    pipeline = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    pipeline["stages"] = {k: v for k, v in pipeline["stages"].items()
                          if k in ("tokenize", "merge", "validate")}
    (repo / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    config = yaml.safe_load((ROOT / "params.yaml").read_text())
    changed = {s: dict(v) for s, v in PARAMS.items()}
    if foreign:
        changed["merge"] = {"adopt": True}
    for section, values in changed.items():
        config[section].update(values)
    (repo / "params.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (repo / ".gitignore").write_text("/stages\n/.cache\n")
    return changed


def _stage(name: str, repo: Path) -> tuple[dict, dict]:
    """Run the stage as dvc.yaml writes it; (its report, figures)."""
    before = _inodes(repo / "data") | _inodes(repo / "reports")
    cpu = _children_cpu()
    start = time.perf_counter()
    stdout, sampled = _sampled(stage_command(name), repo)
    wall = time.perf_counter() - start
    cpu = _children_cpu() - cpu
    rc, peak = outcome(stdout)
    if rc:
        raise RuntimeError(f"bench_seed: {name} exited {rc}")
    report = reports.read(repo / "reports", name)  # the facts and the run's timings
    if name == "validate" and isinstance(report["train_check"].get("process_peak_rss_mb"), float):
        peak = max(peak, report["train_check"]["process_peak_rss_mb"])
    tokens = {"tokenize": report.get("tokens"), "validate": report.get("tokens"),
              "merge": (report.get("merged") or {}).get("tokens")}[name]
    after = _inodes(repo / "data") | _inodes(repo / "reports")
    written = sum(size for ino, size in after.items() if ino not in before)
    return report, {"seconds": report["seconds"], "wall_seconds": round(wall, 1),
                    "tok_per_s": round(tokens / report["seconds"]),
                    "cpu_seconds": round(cpu, 1), "tok_per_cpu_s": round(tokens / cpu),
                    "peak_rss_mb": round(peak, 1), **sampled, "bytes_written": written}


def _children_cpu() -> float:
    """CPU seconds of the child processes waited for so far (their workers included)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _sampled(cmd: list[str], cwd: Path) -> tuple[str, dict]:
    """Run `cmd`, sampling its process tree: (stdout, peak summed PSS and anonymous MB)."""
    import psutil

    proc = subprocess.Popen(cmd, cwd=cwd, env=harness.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peaks = {"tree_pss_mb": 0.0, "anon_mb": 0.0}
    done = threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not done.is_set():
            pss = anon = 0
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in tree:
                try:
                    pss += p.memory_full_info().pss
                    anon += _anon(p.pid)
                except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
                    pass
            peaks["tree_pss_mb"] = max(peaks["tree_pss_mb"], round(pss / 2**20, 1))
            peaks["anon_mb"] = max(peaks["anon_mb"], round(anon / 2**20, 1))
            done.wait(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    stdout, stderr = proc.communicate()
    done.set()
    thread.join()
    if proc.returncode:
        raise RuntimeError(f"{cmd[3]} exited {proc.returncode}: {stderr[-3000:]}")
    return stdout, peaks


def _anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _totals(reports: dict, out: dict) -> dict:
    """Row and token totals, held exact: base + new = merged = validated."""
    tok, mer, val = reports["tokenize"], reports["merge"], reports["validate"]
    new_rows, new_tokens = tok["rows"], tok["tokens"]
    merged = mer["merged"]
    expect = (out["base_rows"] + new_rows, out["base_tokens"] + new_tokens)
    got = {"merged": (merged["rows"], merged["tokens"]), "validated": (val["rows"], val["tokens"])}
    for what, pair in got.items():
        if pair != expect:
            raise RuntimeError(f"bench_seed: {what} rows/tokens {pair} != base + new {expect}")
    if not val["passed"]:
        raise RuntimeError("bench_seed: validate did not pass")
    served = tok["serve_check"]
    if served["mismatches"] or served["completion"]["beyond_slack"]:
        raise RuntimeError(f"bench_seed: serve-render check: {served}")
    out = {"rows": merged["rows"], "tokens": merged["tokens"], "new_rows": new_rows,
           "new_tokens": new_tokens, "tokenize_procs": cpus.usable(),
           "tokenize_completion_counts_differ": served["completion"]["differ"]}
    out.update({f"tokenize_dropped_{k}": v for k, v in tok["dropped"].items() if v})
    check = val["train_check"]
    if "skipped" in check:
        out["check_skipped"] = check["skipped"]
        return out
    longest = check["longest_batch"] or {}
    out.update({
        "check_seconds": check["seconds"], "check_batches": check["batches"],
        "check_tokens": check["tokens"], "check_tok_per_s": check["tokens_per_second"],
        "check_rows_longer_than_batch": check["longer_than_batch"]["rows"],
        "check_rows_read": check["longer_than_batch"]["of_rows_read"],
        "check_step_peak_mb": check["peak_memory_mb"],
        "check_process_peak_mb": check["process_peak_rss_mb"],
        "check_longest": (f"{longest['tokens']} tokens, {longest['seconds']} s, peak "
                          f"{longest['peak_memory_mb']} MB" if "tokens" in longest
                          else longest.get("skipped", "off"))})
    return out


def _versioned(repo: Path) -> dict:
    """`dvc commit` of the three stages, then `dvc push` to the local remote."""
    cache_before = _size(repo / ".dvc/cache")
    start = time.perf_counter()
    harness.sh(["dvc", "commit", "-f", "-q"], repo)
    commit = time.perf_counter() - start
    start = time.perf_counter()
    harness.sh(["dvc", "push", "-q"], repo)
    push = time.perf_counter() - start
    status = harness.sh(["dvc", "status", "--json"], repo).strip()
    if json.loads(status or "{}"):
        raise RuntimeError(f"bench_seed: after dvc commit, dvc status says {status[:2000]}")
    return {"dvc_commit_seconds": round(commit, 1), "dvc_push_seconds": round(push, 1),
            "dvc_cache_growth_bytes": _size(repo / ".dvc/cache") - cache_before,
            "dvc_pushed_bytes": _size(WORK / "remote")}


FLOOR_CODE = """
import json, sys
sys.path[:0] = ["bench"]
import bench_seed
print(json.dumps(bench_seed.floor_here(sys.argv[1])))
"""


def _floor(repo: Path) -> tuple[float, float]:
    """`floor_here` in a process of its own, as the stage's is: forked workers inherit
    their parent's C heap, and workers forked from this one, after its own encoding,
    spent ~10% more CPU (dev/LOG.md, 2026-12-06)."""
    figures = harness.python_json(FLOOR_CODE, str(repo))
    return figures["rate"], figures["per_cpu"]


def floor_here(repo: str) -> dict:
    """encode_batch_fast on the pre-rendered first FLOOR_ROWS answers: `rate`, tok/s in as
    many single-threaded processes as tokenize's workers, forked as the stage's, over
    FLOOR_RUNS runs and the pool's start; `per_cpu`, tok per CPU second on one thread,
    what the machine's other load does not move."""
    import multiprocessing

    texts = bench_tokenize.rendered(Path(repo) / "data/completions/completions.jsonl",
                                    FLOOR_ROWS)
    procs = cpus.usable()
    bench_tokenize._TEXTS[:] = texts
    step = math.ceil(len(texts) / procs)
    parts = [(lo, min(lo + step, len(texts))) for lo in range(0, len(texts), step)]
    # the mean of its runs, as the stage's figure is one long run: a best of short runs
    # would set the cores' fastest spell against the stage's average (dev/LOG.md 2026-12-06)
    start = time.perf_counter()
    with bench_tokenize.single_threaded(), multiprocessing.get_context("fork").Pool(procs) as pool:
        for _ in range(FLOOR_RUNS):
            counts = pool.map(bench_tokenize._encode_part, parts)
    rate = FLOOR_RUNS * sum(counts) / (time.perf_counter() - start)
    start = time.process_time()
    bench_tokenize.bare_one(texts)  # one thread, off the main one as the stage's
    return {"rate": rate, "per_cpu": sum(counts) / (time.process_time() - start)}


# ------------------------------------------------------------------------- files


def _inodes(folder: Path) -> dict[int, int]:
    return {p.lstat().st_ino: p.lstat().st_size for p in folder.rglob("*") if p.is_file()}


def _size(folder: Path) -> int:
    return sum(_inodes(folder).values()) if folder.exists() else 0


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key} = {value}")
