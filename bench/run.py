"""Run every bench/bench_*.py and write bench/results.json (a flat object of figures).

  python bench/run.py                 all benchmarks
  python bench/run.py tokenize merge  only these
  BENCH_QUICK=1 python bench/run.py   smaller inputs, for a quick look

Each benchmark measures its baselines in the same run and reports ratios; absolute
times on a shared 2-core machine are noise, ratios are not.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(names: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    out = HERE / "results.json"
    results = json.loads(out.read_text()) if out.exists() and names else {}
    failed = []
    for path in sorted(HERE.glob("bench_*.py")):
        name = path.stem.removeprefix("bench_")
        if names and name not in names:
            continue
        print(f"== bench {name}", flush=True)
        start = time.perf_counter()
        try:
            figures = load(path).main()
        except Exception:
            traceback.print_exc()
            failed.append(name)
            continue
        for key, value in figures.items():
            print(f"   {key} = {value}")
        results.update(figures)
        print(f"   ({time.perf_counter() - start:.0f} s)", flush=True)
    out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
