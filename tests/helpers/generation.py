"""Running the generate stage in a scratch folder against the fake server, and reading
what it wrote: the prompts and params it is given, its outputs, cache and report."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml

from stages import generate
from stages.common import params, reports
from tests.helpers import stagecli
from tests.helpers.repo import ROOT
from tests.helpers.fakeserver import command as fake_command

PATHS = stagecli.paths("generate")  # where dvc.yaml has the stage read and write

KEY = "sk-test-DO-NOT-LEAK-7f3a9c"


def make_prompts(wd: Path, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        row = {
            "id": f"p{i:05d}",
            "source": "tools" if i % 11 == 0 else "chat",
            "messages": [{"role": "user", "content": f"question number {i} " + "word " * (i % 9)}],
        }
        if i % 11 == 0:
            row["tools"] = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
        if i % 5 == 0:
            row["messages"].insert(0, {"role": "system", "content": "Be brief."})
        rows.append(row)
    path = wd / "data/prompts/prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return rows


def write_params(wd: Path, **gen) -> Path:
    base = {
        "concurrency": 8,
        "max_tokens": 64,
        "backoff_base": 0.02,
        "backoff_max": 0.2,
        "progress_interval": 0.5,
        "request_timeout": 20,
    }
    base.update(gen)
    path = wd / "params.yaml"
    path.write_text(yaml.safe_dump({"generate": base}), encoding="utf-8")
    return path


def url_server(url: str, **server) -> dict:
    return {"url": url, "unreachable_deadline": 10, **server}


def launch_server(wd: Path, spec: dict, **server) -> dict:
    cmd = fake_command(0, spec)
    cmd[cmd.index("--port") + 1] = "{port}"
    cmd[cmd.index("--host") + 1] = "{host}"
    return {
        "launch": {
            "engine": "sglang",
            "model": "fake-model",
            "command": cmd,
            "startup_timeout": 120,  # a fake server, on a machine that may be busy
            "stop_timeout": 1,
        },
        **server,
    }


def env(**extra) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["HF_HUB_OFFLINE"] = "1"
    e.update(extra)
    return e


def stage(wd: Path, timeout: float = 300, **extra_env) -> subprocess.CompletedProcess:
    return subprocess.run(
        stagecli.command("generate"), cwd=wd, env=env(**extra_env),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def start_stage(wd: Path, **extra_env) -> subprocess.Popen:
    return subprocess.Popen(
        stagecli.command("generate"), cwd=wd, env=env(**extra_env),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def here(wd: Path) -> dict:
    """Run the stage in this process (faster than a new one) with `wd` as the repo root."""
    cwd = os.getcwd()
    os.chdir(wd)
    try:
        return generate.run(params.load("generate", "params.yaml"), PATHS)
    finally:
        os.chdir(cwd)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def outputs(wd: Path) -> tuple[list[dict], list[dict]]:
    out = wd / "data/completions"
    return read_jsonl(out / "completions.jsonl"), read_jsonl(out / "failures.jsonl")


def cache_entries(wd: Path) -> list[bytes]:
    keys = []
    for seg in sorted((wd / ".cache/requests").glob("*/seg-*.log")):
        for line in seg.read_bytes().splitlines(keepends=True):
            if line.endswith(b"}\n"):
                keys.append(line[:64])
    return keys


def cache_bytes(wd: Path) -> int:
    return sum(seg.stat().st_size for seg in (wd / ".cache/requests").glob("*/seg-*.log"))


def report(wd: Path) -> dict:
    return reports.read(wd / "reports", "generate")


def to_send(output: str) -> int:
    line = next(ln for ln in output.splitlines() if "requests to send" in ln)
    return int(line.split(", ")[-1].split()[0])
