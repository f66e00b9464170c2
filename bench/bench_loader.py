"""The training loader on a generated multi-GB merged set, against the training step.

  .venv/bin/python bench/bench_loader.py [--quick]      (or BENCH_QUICK=1)

Figures (each measured in a process of its own; peak RSS is its VmHWM, bench/peak.py):
  loader_vs_train_step        loader batches/s (a full pass, torch tensors, packed) /
                              training steps/s of the demo model on the same batches
                              (forward + backward on this machine's CPU) - goal >= 1
  loader_vs_train_step_padded the same with padded batches
  loader_peak_rss_mb          peak RSS of the packed pass over the whole set
  loader_peak_rss_half_mb     the same over a set half the size: flat means these match
  loader_batches_per_second, loader_tokens_per_second, train_step_batches_per_second
plus the sizes. The set is >= 2 GB of 256 MB shards (256 MB of 64 MB shards with
--quick), rows of 32-480 tokens (bench/bench_merge.py's generator), batches of 512 tokens:
the demo model's 248K-entry vocabulary makes larger CPU steps slow and memory-hungry.
The page cache is warm (the set was just written). Work files go to bench/work/loader.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import harness  # noqa: E402
from bench_merge import generate  # noqa: E402

WORK = ROOT / "bench" / "work" / "loader"
TOKENS = 512
ROW_TOKENS = (32, 480)

# each pass ends by printing one JSON line: what it did and its own peak RSS
PASS = """
import json, sys, time
from stages.dataset.loader import batches
folder, packed = sys.argv[1], sys.argv[2] == "packed"
start, n, tokens = time.perf_counter(), 0, 0
for batch in batches(folder, {tokens}, packed=packed):
    n += 1
    mask = batch.get("attention_mask")
    tokens += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
seconds = time.perf_counter() - start
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({{"batches": n, "tokens": tokens, "seconds": seconds,
                  "peak_mb": int(status["VmHWM"].split()[0]) / 1024}}))
""".format(tokens=TOKENS)

STEP = """
import itertools, json, sys, time
import torch
from transformers import AutoModelForCausalLM
from stages.dataset.loader import batches
from stages.models import tinymodel
folder, packed, steps = sys.argv[1], sys.argv[2] == "packed", int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(str(tinymodel.ensure_model())).eval()
times = []
for batch in itertools.islice(batches(folder, {tokens}, packed=packed), steps + 1):
    start = time.perf_counter()
    model(**batch, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - start)
print(json.dumps({{"seconds": sum(times[1:]), "steps": len(times) - 1}}))  # first: warm-up
""".format(tokens=TOKENS)


def main(quick: bool | None = None) -> dict:
    if quick is None:
        quick = harness.quick()
    total, shard = harness.set_bytes(quick, 2200)
    with harness.scratch(WORK):
        full, half = WORK / "full", WORK / "half"
        rows = generate(full, total, shard, "full", 1, ROW_TOKENS)
        half_rows = generate(half, total // 2, shard, "half", 2, ROW_TOKENS)
        size = sum(p.stat().st_size for p in full.glob("*.arrow"))
        packed = harness.python_json(PASS, str(full), "packed")
        padded = harness.python_json(PASS, str(full), "padded")
        packed_half = harness.python_json(PASS, str(half), "packed")
        steps = 3 if quick else 5
        train = harness.python_json(STEP, str(full), "packed", str(steps))
        train_padded = harness.python_json(STEP, str(full), "padded", str(steps))
        train_rate = train["steps"] / train["seconds"]
        train_rate_padded = train_padded["steps"] / train_padded["seconds"]
        rate = packed["batches"] / packed["seconds"]
        rate_padded = padded["batches"] / padded["seconds"]
        return {
            "loader_vs_train_step": round(rate / train_rate, 1),
            "loader_vs_train_step_padded": round(rate_padded / train_rate_padded, 1),
            "loader_peak_rss_mb": round(packed["peak_mb"], 1),
            "loader_peak_rss_padded_mb": round(padded["peak_mb"], 1),
            "loader_peak_rss_half_mb": round(packed_half["peak_mb"], 1),
            "loader_batches_per_second": round(rate, 1),
            "loader_batches_per_second_padded": round(rate_padded, 1),
            "loader_tokens_per_second": round(packed["tokens"] / packed["seconds"]),
            "train_step_batches_per_second": round(train_rate, 3),
            "train_step_batches_per_second_padded": round(train_rate_padded, 3),
            "loader_set_gb": round(size / 1e9, 3),
            "loader_rows": rows,
            "loader_rows_half": half_rows,
            "loader_batches": packed["batches"],
            "loader_tokens_per_batch": TOKENS,
        }


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key} = {value}")
