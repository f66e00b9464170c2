"""Benchmark the generate stage against a zero-latency fake SGLang server.

  generate_vs_floor        completions/s of the stage's send loop (client, request cache,
                           progress, all of it, as `python -m stages.generate`) with 1,000
                           requests in flight, divided by completions/s of a minimal
                           aiohttp loop (post a pre-built body, read, json.loads) against
                           the same server process in the same run. Must be >= 0.7.
  generate_rss_growth_mb   peak RSS of the stage over 200K prompts minus its peak over 1K
                           prompts: everything that grows with the number of prompts.
                           Must be < 100.

Run alone: `.venv/bin/python bench/bench_generate.py [--quick]` (or BENCH_QUICK=1):
quick mode uses 5K requests for the ratio and 20K prompts for memory.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "work" / "generate"
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import harness  # noqa: E402
from stages.common import reports  # noqa: E402

IN_FLIGHT = 1000


def write_prompts(wd: Path, n: int) -> Path:
    path = wd / "data/prompts/prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            text = f"Question {i}: explain item {i * 7919 % 100003} in two sentences, please."
            row = {"id": f"b{i:07d}", "source": "bench", "messages": [{"role": "user", "content": text}]}
            f.write(json.dumps(row) + "\n")
    return path


def write_params(wd: Path, url: str) -> None:
    import yaml

    gen = {
        "server": {"url": url, "model": "fake-model"},
        "concurrency": IN_FLIGHT,
        "max_tokens": 64,
        "progress_interval": 3600,
        "request_timeout": 600,
    }
    (wd / "params.yaml").write_text(yaml.safe_dump({"generate": gen}), encoding="utf-8")


def run_stage(wd: Path, sample_rss: bool = False) -> tuple[dict, int]:
    """Run the stage as its own process from an empty cache; (report, peak RSS bytes)."""
    import psutil

    from stages.process import cli

    shutil.rmtree(wd / ".cache", ignore_errors=True)
    shutil.rmtree(wd / "data/completions", ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, *cli.pipeline_command("generate")[1:]], cwd=wd, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    peak = 0
    if sample_rss:
        ps = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                peak = max(peak, ps.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"generate stage failed: {err[-2000:]}")
    return reports.read(wd / "reports", "generate"), peak  # throughput: the run's part


async def floor_loop(url: str, bodies: list[bytes]) -> float:
    """The least a client can do: completions/s of post + read + json.loads."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=IN_FLIGHT + 16, limit_per_host=0)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        it = iter(bodies)
        endpoint = url + "/v1/chat/completions"

        async def worker() -> None:
            for body in it:
                async with session.post(endpoint, data=body) as r:
                    json.loads(await r.read())

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
        return len(bodies) / (time.perf_counter() - t0)


def floor_bodies(prompts: Path) -> list[bytes]:
    from stages.serving.client import Sampling, build_body

    sampling = Sampling(64, 0.6, 0.95, 20, None, True, True)
    out = []
    with open(prompts, "rb") as f:
        for line in f:
            out.append(json.dumps(build_body(json.loads(line), "fake-model", sampling, "sglang")).encode())
    return out


def main() -> dict:
    from tests.helpers.fakeserver import spawn

    n_ratio = 5_000 if harness.quick() else 10_000
    n_mem = 20_000 if harness.quick() else 200_000
    WORK.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    with spawn({"record": False, "latency": 0}) as fake:
        ratio_dir = WORK / "ratio"
        prompts = write_prompts(ratio_dir, n_ratio)
        write_params(ratio_dir, fake.url)
        bodies = floor_bodies(prompts)
        floors, stages_ = [], []
        for _ in range(2):  # interleaved, best of each: the machine is shared
            floors.append(asyncio.run(floor_loop(fake.url, bodies)))
            report, _ = run_stage(ratio_dir)
            assert report["completed"] == n_ratio, report
            stages_.append(report["request_throughput"])
        results["generate_floor_req_s"] = round(max(floors), 1)
        results["generate_stage_req_s"] = round(max(stages_), 1)
        results["generate_vs_floor"] = round(max(stages_) / max(floors), 3)

        small, big = WORK / "mem-small", WORK / "mem-big"
        write_prompts(small, 1_000)
        write_prompts(big, n_mem)
        for wd in (small, big):
            write_params(wd, fake.url)
        _, peak_small = run_stage(small, sample_rss=True)
        report, peak_big = run_stage(big, sample_rss=True)
        assert report["completed"] == n_mem, report
        results["generate_rss_growth_mb"] = round((peak_big - peak_small) / 2**20, 1)
        results["generate_rss_prompts"] = n_mem
        results["generate_big_run_req_s"] = report["request_throughput"]
    return results


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key} = {value}")
