"""Benchmark regenerating conversations turn by turn against a zero-latency fake server.

  regenerate_vs_single     turns/s of the generate stage regenerating N conversations of
                           T turns (each turn sent when the one before returns), divided
                           by requests/s of the same stage on N x T single prompts, both
                           against the same server process in the same run, best of two
                           interleaved. Must be >= 0.7.
  regenerate_rss_growth_mb peak RSS of the stage over many conversations minus its peak
                           over 1K: what grows with the number of conversations.

Run alone: `.venv/bin/python bench/bench_regenerate.py [--quick]` (or BENCH_QUICK=1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "work" / "regenerate"
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import bench_generate  # noqa: E402
import harness  # noqa: E402

TURNS = 4


def write_conversations(wd: Path, n: int) -> Path:
    path = wd / "data/prompts/prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            users = [{"role": "user", "content": f"Conversation {i}, question {k}: explain item "
                      f"{(i * 7919 + k) % 100003} in two sentences."} for k in range(TURNS)]
            row = {"id": f"r{i:07d}", "source": "bench", "messages": users[:1],
                   "turns": [[u] for u in users[1:]]}
            f.write(json.dumps(row) + "\n")
    return path


def main() -> dict:
    from tests.helpers.fakeserver import spawn

    n_conv = 2_000 if harness.quick() else 5_000
    n_mem = 10_000 if harness.quick() else 50_000
    WORK.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    with harness.scratch(WORK), spawn({"record": False, "latency": 0}) as fake:
        regen_dir, single_dir = WORK / "regen", WORK / "single"
        write_conversations(regen_dir, n_conv)
        bench_generate.write_prompts(single_dir, n_conv * TURNS)
        for wd in (regen_dir, single_dir):
            bench_generate.write_params(wd, fake.url)
        regen, single = [], []
        for _ in range(2):  # interleaved, best of each: the machine is shared
            report, _ = bench_generate.run_stage(regen_dir)
            assert report["turns"]["answered"] == n_conv * TURNS, report["turns"]
            regen.append(report["request_throughput"])
            report, _ = bench_generate.run_stage(single_dir)
            assert report["completed"] == n_conv * TURNS, report
            single.append(report["request_throughput"])
        results["regenerate_turns_s"] = round(max(regen), 1)
        results["regenerate_single_req_s"] = round(max(single), 1)
        results["regenerate_vs_single"] = round(max(regen) / max(single), 3)

        small, big = WORK / "mem-small", WORK / "mem-big"
        write_conversations(small, 1_000)
        write_conversations(big, n_mem)
        for wd in (small, big):
            bench_generate.write_params(wd, fake.url)
        _, peak_small = bench_generate.run_stage(small, sample_rss=True)
        report, peak_big = bench_generate.run_stage(big, sample_rss=True)
        assert report["turns"]["answered"] == n_mem * TURNS, report["turns"]
        results["regenerate_rss_growth_mb"] = round((peak_big - peak_small) / 2**20, 1)
        results["regenerate_rss_conversations"] = n_mem
    return results


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key} = {value}")
