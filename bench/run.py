"""Run every bench/bench_*.py and write bench/results.json (a flat object of figures).

  python bench/run.py                 all benchmarks
  python bench/run.py tokenize merge  only these
  BENCH_QUICK=1 python bench/run.py   smaller inputs, for a quick look
  BENCH_RESULTS=PATH ...              the figures go to PATH instead (tests/test_bench.py)

Each benchmark measures its baselines in the same run and reports ratios; absolute
times on a shared 2-core machine are noise, ratios are not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


MARK = "BENCH-RESULT "
# each figure with a numeric target (bench/README.md says what each compares): at least
# (>=) or at most (<=) this; the run ends by saying which figures in results.json miss theirs
TARGETS = {
    "prepare_vs_read": (">=", 0.5), "decontam_vs_prepare": (">=", 0.7),
    "generate_vs_floor": (">=", 0.7), "generate_rss_growth_mb": ("<=", 100),
    "regenerate_vs_single": (">=", 0.7), "generate_vs_engine": (">=", 0.95),
    "generate_vs_sglang": (">=", 0.95), "tokenize_vs_floor": (">=", 0.85),
    "tokenize_vs_naive": (">=", 4), "tokenize_scaling_2proc": (">=", 1.7),
    "merge_vs_copy_new": ("<=", 1.3), "merge_cache_growth_ratio": ("<=", 1.05),
    "validate_vs_scan": (">=", 0.6), "adopt_vs_copy": ("<=", 1.5),
    "noop_repro_seconds": ("<=", 10), "loader_vs_train_step": (">=", 1),
    "export_trl_vs_writer": (">=", 0.8), "export_specforge_vs_writer": (">=", 0.8),
    "export_axolotl_vs_writer": (">=", 0.8), "seed_tokenize_vs_floor": (">=", 0.85),
}


def run_one(path: Path) -> dict:
    """Run one benchmark in a process of its own, so that one benchmark's memory and
    imports do not weigh on the next (stage peaks are the stages' own: bench/peak.py)."""
    # imported under its own name, so worker processes can pickle its functions
    code = (
        "import importlib, json, sys\n"
        f"sys.path[:0] = [{str(HERE)!r}, {str(ROOT)!r}]\n"
        f"m = importlib.import_module({path.stem!r})\n"
        f"print({MARK!r} + json.dumps(m.main()), flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    figures = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(MARK):
            figures = json.loads(line[len(MARK):])
        else:
            sys.stdout.write(line)
    if proc.wait() != 0 or figures is None:
        raise RuntimeError(f"{path.name} exited {proc.returncode}")
    return figures


def main(names: list[str]) -> int:
    out = Path(os.environ.get("BENCH_RESULTS") or HERE / "results.json")
    results = json.loads(out.read_text()) if out.exists() and names else {}
    failed = []
    for path in sorted(HERE.glob("bench_*.py")):
        name = path.stem.removeprefix("bench_")
        if names and name not in names:
            continue
        print(f"== bench {name}", flush=True)
        start = time.perf_counter()
        try:
            figures = run_one(path)
        except Exception:
            traceback.print_exc()
            failed.append(name)
            continue
        for key, value in figures.items():
            print(f"   {key} = {value}")
        results.update(figures)
        print(f"   ({time.perf_counter() - start:.0f} s)", flush=True)
    out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")
    measured = {key: results[key] for key in TARGETS if key in results}
    missed = [f"{key} = {value} (target {' '.join(map(str, TARGETS[key]))})"
              for key, value in measured.items() if not _meets(value, *TARGETS[key])]
    print(f"{len(measured) - len(missed)} of {len(measured)} figures with a target met it"
          + "".join(f"\n   missed: {line}" for line in missed))
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


def _meets(value: float, op: str, target: float) -> bool:
    return value >= target if op == ">=" else value <= target


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
