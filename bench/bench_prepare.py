"""Benchmark the prepare stage against simply reading and hashing the same file.

  python bench/bench_prepare.py            500K rows (and 100K for the memory curve)
  python bench/bench_prepare.py --quick    50K / 10K rows (also BENCH_QUICK=1)

The source is generated ShareGPT JSON lines (1-4 turns, a system prompt on some rows,
half the texts in paragraphs, some with code, ~1% duplicate rows). The stage runs as
`python -m stages.prepare` in a subprocess, timed wall-clock from start to exit
(interpreter and worker start included), its CPU time read with os.wait4, its peak RSS
as bench/peak.py reads it.
The baseline, in this process: read every line, `json.loads` it and blake2b it.
Baseline and stage run twice, interleaved, and the faster of each run counts.

  prepare_vs_read            stage rows/s with default params (num_proc 0; one process
                             on a 2-CPU machine) / baseline rows/s, wall clock
  prepare_vs_read_cpu        one process, rows per CPU-second / the baseline's (less
                             sensitive to other load on a shared machine)
  prepare_vs_read_2proc      num_proc 2 (two workers + the reader), wall clock
  prepare_vs_orjson_read     one process against the baseline parsed with orjson
  prepare_peak_rss_mb        peak RSS of the one-process stage on the large source
  prepare_peak_rss_small_mb  ... on the small one: the difference is the dedup set
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import orjson
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "work" / "prepare"
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(1, str(ROOT))

import harness  # noqa: E402
from peak import outcome, stage_command  # noqa: E402

from stages.common import reports  # noqa: E402

WORDS = (
    "the a model data train token python function value error result system user answer "
    "question explain why how list write code test file number matrix graph network loss "
    "gradient step memory thread process server request cache time space order sort tree "
    "string array index key hash map set queue stack heap node edge path cost price rate"
).split()


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "?"


def _text(rng: random.Random, n: int) -> str:
    """Prose of about n words; half in paragraphs, some with a code block, like real prompts."""
    if rng.random() < 0.5:
        return _sentence(rng, n)
    parts = [_sentence(rng, max(3, n // 3)) for _ in range(3)]
    if rng.random() < 0.3:
        parts.append("```python\ndef f(x):\n    return x + 1\n```")
    return "\n\n".join(parts)


def make_source(path: Path, rows: int) -> None:
    if path.exists():
        return
    rng = random.Random(rows)
    # texts drawn from pools (generating every word of 500K rows takes minutes); each
    # user turn starts with its row number, so rows differ unless duplicated on purpose
    systems = [_sentence(rng, rng.randint(5, 20)) for _ in range(200)]
    asks = [_text(rng, rng.randint(8, 60)) for _ in range(5000)]
    answers = [_text(rng, rng.randint(20, 90)) for _ in range(5000)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    previous: list[str] = []
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(rows):
            if previous and rng.random() < 0.01:
                f.write(rng.choice(previous))  # an exact duplicate row
                continue
            conv = []
            if rng.random() < 0.3:
                conv.append({"from": "system", "value": rng.choice(systems)})
            for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4))):
                conv.append({"from": "human", "value": f"[{i}] " + rng.choice(asks)})
                conv.append({"from": "gpt", "value": rng.choice(answers)})
            line = json.dumps({"id": f"row-{i}", "conversations": conv}) + "\n"
            if len(previous) < 1000:
                previous.append(line)
            f.write(line)
    tmp.rename(path)


def baseline(path: Path, loads) -> tuple[float, float]:
    """Rows per second (wall, CPU) of reading, parsing and hashing each line in one process."""
    wall, cpu = time.perf_counter(), time.process_time()
    n = 0
    with open(path, "rb", buffering=1 << 20) as f:
        for line in f:
            loads(line)
            hashlib.blake2b(line, digest_size=16).digest()
            n += 1
    return n / (time.perf_counter() - wall), n / (time.process_time() - cpu)


def run_stage(path: Path, rows: int, num_proc: int, extra: dict | None = None, tag: str = "") -> dict:
    """Rows per second (wall and CPU) and peak RSS of `python -m stages.prepare` on `path`
    (`extra`: more prepare params, in a run folder named with `tag`)."""
    run_dir = WORK / f"run-{rows}-{num_proc}{tag}"
    run_dir.mkdir(parents=True, exist_ok=True)
    params = run_dir / "params.yaml"
    params.write_text(yaml.safe_dump({"prepare": {
        "seed": 0, "max_prompt_chars": 32000, "on_bad_row": "error", "multi_turn": "context",
        "num_proc": num_proc,
        "sources": [{"name": "bench", "path": str(path), "format": "sharegpt"}],
        **(extra or {}),
    }}))
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    proc = subprocess.Popen(
        stage_command("prepare", "--params", str(params)),
        cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    err = proc.stderr.read().decode()  # stdout is one line: it cannot fill its pipe
    out = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)  # for the CPU time
    seconds = time.perf_counter() - start
    proc.stderr.close()
    proc.stdout.close()
    if os.waitstatus_to_exitcode(status) != 0 or outcome(out)[0] != 0:
        raise RuntimeError(f"prepare failed on {path}:\n{err}")
    report = reports.read(run_dir / "reports", "prepare")  # index_mb: the run's part
    assert report["totals"]["read"] == rows, report["totals"]
    # with workers, the peak is the stage process's own (the biggest)
    return {"wall": rows / seconds, "cpu": rows / (usage.ru_utime + usage.ru_stime),
            "rss_mb": outcome(out)[1], "report": report}


def main(quick: bool | None = None) -> dict:
    if quick is None:
        quick = harness.quick()
    big, small = (50_000, 10_000) if quick else (500_000, 100_000)
    big_path, small_path = WORK / f"sharegpt-v3-{big}.jsonl", WORK / f"sharegpt-v3-{small}.jsonl"
    make_source(big_path, big)
    make_source(small_path, small)
    baseline(big_path, json.loads)  # warm the page cache
    # other load on a shared machine comes and goes: interleave the runs, keep the best
    reads, stages = [], []
    for _ in range(2):
        reads.append(baseline(big_path, json.loads))
        stages.append(run_stage(big_path, big, 0))
    read_wall, read_cpu = max(r[0] for r in reads), max(r[1] for r in reads)
    default = {k: max(s[k] for s in stages) for k in ("wall", "cpu")}
    default["rss_mb"] = max(s["rss_mb"] for s in stages)
    orjson_wall, _ = baseline(big_path, orjson.loads)
    two = run_stage(big_path, big, 2)
    small_run = run_stage(small_path, small, 1)
    one = default if _workers_by_default() == 1 else run_stage(big_path, big, 1)
    return {
        # the stage with default params (num_proc 0) vs the one-process read
        "prepare_vs_read": round(default["wall"] / read_wall, 3),
        "prepare_vs_read_cpu": round(one["cpu"] / read_cpu, 3),
        "prepare_vs_read_2proc": round(two["wall"] / read_wall, 3),
        "prepare_vs_orjson_read": round(one["wall"] / orjson_wall, 3),
        "prepare_rows_per_s": round(default["wall"]),
        "prepare_read_rows_per_s": round(read_wall),
        "prepare_peak_rss_mb": round(one["rss_mb"], 1),
        "prepare_peak_rss_small_mb": round(small_run["rss_mb"], 1),
    }


def _workers_by_default() -> int:
    sys.path.insert(0, str(ROOT))
    from stages.process import cpus

    return cpus.workers_beside_reader()


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key} = {value}")
