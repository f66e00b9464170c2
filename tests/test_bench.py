"""Every benchmark runs at its smaller size against the code as it stands: one that falls
out of step with the code (a figure moved, a param renamed) fails here, in `make test`,
not in a whole `make bench`. Its figures are not judged: at this size fixed costs are the
figures (bench/README.md has the targets, met at full size)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# needs the engine venvs for ~15 min: the real-engine tests run the same engines
ENGINE_BENCH = "generate_vs_engine"
ENGINE_FIGURES = {"generate_vs_engine", "generate_vs_sglang"}

pytestmark = pytest.mark.slow


def _targets() -> dict:
    spec = importlib.util.spec_from_file_location("bench_run", BENCH / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TARGETS


def test_every_benchmark_runs_and_gives_its_figures(tmp_path):
    names = sorted(p.stem.removeprefix("bench_") for p in BENCH.glob("bench_*.py"))
    names.remove(ENGINE_BENCH)
    out = tmp_path / "results.json"
    env = dict(os.environ, BENCH_QUICK="1", BENCH_RESULTS=str(out))
    proc = subprocess.run([sys.executable, "bench/run.py", *names], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    wanted = set(_targets()) - ENGINE_FIGURES
    assert wanted <= set(results), sorted(wanted - set(results))
    assert all(isinstance(results[k], (int, float)) and math.isfinite(results[k])
               and results[k] >= 0 for k in wanted), {k: results[k] for k in wanted}
