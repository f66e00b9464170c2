"""The trainer exports (stages/export.py) on a generated merged set, against copying it.

  .venv/bin/python bench/bench_export.py [--quick]      (or BENCH_QUICK=1)

Figures (each export in a process of its own; peak RSS is its VmHWM, bench/peak.py):
  export_<trainer>_vs_writer     seconds of the fastest writer of the same output found
                                 (pyarrow's IPC writer of the export's own columns for trl
                                 and axolotl; polars' write_ndjson of the same three
                                 columns for specforge), in the same run / seconds of
                                 `python -m stages.export --for <trainer>` - goal >= 0.8
  export_<trainer>_vs_writer_cpu the same with each process's own CPU seconds (threads
                                 included), which other jobs on the machine move less
  export_<trainer>_vs_copy       export seconds / seconds of copying the set's shard files
  export_<trainer>_peak_rss_mb   peak RSS of that export
  export_<trainer>_peak_rss_half_mb  the same over a set half the size: flat means these match
  export_<trainer>_out_vs_set    bytes written / bytes of the set
plus the sizes. The set is >= 2 GB of 256 MB shards (256 MB of 64 MB shards with
--quick), rows of 500-4000 tokens (bench/bench_merge.py's generator). The page cache is
warm (the set was just written). Work files go to bench/work/export.

Each export and its writer run ROUNDS times, alternated, and each side's best time is the
figure: on a virtual machine a write's cost swings several-fold with the pages the kernel
hands out (memory just freed is cheap, memory never touched costs the host a fault), so
one run of each says more about the machine's memory than about the code. Each side starts
after harness.settle_disk(): a writer is throttled by the dirty pages the one before it left.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import harness  # noqa: E402
from bench_merge import generate  # noqa: E402

WORK = ROOT / "bench" / "work" / "export"
TRAINERS = ("trl", "specforge", "axolotl")
ROUNDS = 3

# each child ends by printing one JSON line: its seconds and its own peak RSS
EXPORT = """
import json, sys, time
from stages import export
start, cpu = time.perf_counter(), time.process_time()
code = export.main(sys.argv[1:])
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"rc": code, "seconds": seconds, "cpu_seconds": cpu,
                  "peak_mb": int(status["VmHWM"].split()[0]) / 1024}))
"""
COPY = """
import json, shutil, sys, time
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
start = time.perf_counter()
dst.mkdir()
for shard in sorted(src.glob("*.arrow")):
    shutil.copyfile(shard, dst / shard.name)
print(json.dumps({"rc": 0, "seconds": time.perf_counter() - start}))
"""
# The same output written by the libraries' own writers, from memory-mapped inputs: for the
# Arrow exports their columns as the export wrote them (read zero-copy, written again); for
# specforge the merged set's three columns through polars' NDJSON writer.
WRITER = """
import json, sys, time
from pathlib import Path
import pyarrow as pa
kind, src, dst = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
dst.mkdir()
tables = []
for shard in sorted(src.glob("*.arrow")):
    with pa.memory_map(str(shard)) as source:
        tables.append((shard.name, pa.ipc.open_stream(source).read_all()))
start, cpu = time.perf_counter(), time.process_time()
if kind == "arrow":
    for name, table in tables:
        with pa.OSFile(str(dst / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
else:
    import polars as pl
    with open(dst / "train.jsonl", "wb") as f:
        for _, table in tables:
            pl.from_arrow(table.select(["input_ids", "loss_mask", "id"])).write_ndjson(f)
print(json.dumps({"rc": 0, "seconds": time.perf_counter() - start,
                  "cpu_seconds": time.process_time() - cpu}))
"""


def _export(trainer: str, merged: Path, out: Path, writer: bool = False) -> dict:
    harness.settle_disk()
    result = harness.python_json(EXPORT, "--for", trainer, "--merged", str(merged),
                                 "--out", str(out))
    result["bytes"] = sum(p.stat().st_size for p in out.iterdir())
    if writer:
        kind, src = ("ndjson", merged) if trainer == "specforge" else ("arrow", out)
        harness.settle_disk()
        done = harness.python_json(WRITER, kind, str(src), str(out.with_name("writer")))
        result["writer_seconds"] = done["seconds"]
        result["writer_cpu_seconds"] = done["cpu_seconds"]
        shutil.rmtree(out.with_name("writer"))
    shutil.rmtree(out)  # one export on disk at a time
    return result


def _best_of(trainer: str, merged: Path, out: Path) -> dict:
    """ROUNDS exports, each followed by its writer: each time the best of its rounds."""
    rounds = [_export(trainer, merged, out, writer=True) for _ in range(ROUNDS)]
    best = {key: min(r[key] for r in rounds) for key in
            ("seconds", "cpu_seconds", "writer_seconds", "writer_cpu_seconds")}
    return {**rounds[0], **best, "peak_mb": max(r["peak_mb"] for r in rounds)}


def main(quick: bool | None = None) -> dict:
    if quick is None:
        quick = harness.quick()
    total, shard = harness.set_bytes(quick, 2200)
    with harness.scratch(WORK):
        full, half = WORK / "full", WORK / "half"
        rows = generate(full, total, shard, "full", 1)
        half_rows = generate(half, total // 2, shard, "half", 2)
        size = sum(p.stat().st_size for p in full.glob("*.arrow"))
        harness.settle_disk()
        copy = harness.python_json(COPY, str(full), str(WORK / "copy"))
        shutil.rmtree(WORK / "copy")
        figures = {}
        for trainer in TRAINERS:
            done = _best_of(trainer, full, WORK / trainer)
            done_half = _export(trainer, half, WORK / trainer)
            figures[f"export_{trainer}_vs_writer"] = round(done["writer_seconds"]
                                                           / done["seconds"], 2)
            figures[f"export_{trainer}_vs_writer_cpu"] = round(done["writer_cpu_seconds"]
                                                               / done["cpu_seconds"], 2)
            figures[f"export_{trainer}_writer_seconds"] = round(done["writer_seconds"], 2)
            figures[f"export_{trainer}_vs_copy"] = round(done["seconds"] / copy["seconds"], 2)
            figures[f"export_{trainer}_peak_rss_mb"] = round(done["peak_mb"], 1)
            figures[f"export_{trainer}_peak_rss_half_mb"] = round(done_half["peak_mb"], 1)
            figures[f"export_{trainer}_out_vs_set"] = round(done["bytes"] / size, 2)
            figures[f"export_{trainer}_seconds"] = round(done["seconds"], 2)
        return {**figures, "export_copy_seconds": round(copy["seconds"], 2),
                "export_set_gb": round(size / 1e9, 3), "export_rows": rows,
                "export_rows_half": half_rows}


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key} = {value}")
