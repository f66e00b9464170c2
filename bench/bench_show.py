"""Finding a row by id at the seed's scale: `python -m stages.show --id` reads only the id
column of each shard (its buffers alone: stages/dataset/ipcstream.py), so its time
follows rows, not tokens.

  python bench/bench_show.py            1,090,000 rows, the seed's (~650M tokens, ~3 GB)
  BENCH_SHOW_ROWS=2000000 ...           any row count (BENCH_QUICK=1: 200,000)

Writes a synthetic set in the row contract (random ids, mean ~600 tokens a row) under
bench/work/show, removed afterwards. Figures, `show_` + :

  lookup_<where>_s      Dataset.by_ids for a row at the start / middle / end of the set,
                        the set's pages first dropped from the page cache (cold)
  lookup_end_read_mb    what the cold lookup of the last row read from disk (/proc/self/io)
  lookup_end_warm_s     the same lookup again (pages cached)
  read_all_s, _mb       baseline: every byte of the shards read once, cold
  read_all_vs_lookup    read_all_s / lookup_end_s
  cli_s                 `python -m stages.show --id ID` end to end, cold (tokenizer load
                        included), and cli_peak_rss_mb its peak RSS
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

import harness  # noqa: E402

WORK = ROOT / "bench" / "work" / "show"
SHARDS, MEAN, BATCH = 40, 600, 1000


def write_set(folder: Path, rows: int) -> int:
    import pyarrow as pa

    from stages.dataset import fingerprint
    from stages.dataset.schema import ARROW_SCHEMA
    from stages.dataset.shards import ShardFile, shard_name, write_metadata
    from stages.models.tokenizer import identity, load_tokenizer

    tok = load_tokenizer("bundled:qwen3.6")
    rng = np.random.default_rng(3)
    folder.mkdir(parents=True)
    (folder / fingerprint.FILE).write_text(json.dumps({"tokenizer": identity(tok)}))
    names, first, tokens = [], 0, 0
    for k in range(SHARDS):
        n = rows // SHARDS + (k < rows % SHARDS)
        names.append(shard_name(k, SHARDS))
        with ShardFile(folder / names[-1]) as shard:
            for lo in range(0, n, BATCH):
                m = min(BATCH, n - lo)
                lengths = np.clip(rng.lognormal(np.log(MEAN) - 0.18, 0.6, m), 16,
                                  32768).astype(np.int32)
                offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
                ids = rng.integers(0, 240000, int(offsets[-1]), dtype=np.int32)
                mask = (rng.random(len(ids)) < 0.7).astype(np.int8)
                shard.write(pa.RecordBatch.from_arrays(
                    [pa.array([f"row-{first + i:09d}" for i in range(m)]),
                     pa.array(["synthetic"] * m),
                     pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
                     pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
                     pa.array(lengths), pa.array(np.add.reduceat(mask, offsets[:-1])
                                                 .astype(np.int32))], schema=ARROW_SCHEMA))
                first += m
                tokens += int(offsets[-1])
    write_metadata(folder, names, "bench-show")
    return tokens


def evict(folder: Path) -> None:
    """Drop this set's pages (only its own files) from the page cache: a cold read."""
    for path in folder.iterdir():
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def read_bytes() -> int:
    """Bytes this process has had read from storage (/proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def read_all(folder: Path) -> int:
    total = 0
    for path in sorted(folder.iterdir()):
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                total += len(chunk)
    return total


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> dict:
    rows = int(os.environ.get("BENCH_SHOW_ROWS") or (200_000 if harness.quick() else 1_090_000))
    os.chdir(ROOT)  # the bundled tokenizer is cached under ./.cache
    from stages.view.rows import Dataset

    out = {"show_rows": rows}
    with harness.scratch(WORK) as work:
        folder = work / "set"
        seconds, tokens = timed(lambda: write_set(folder, rows))
        size = sum(p.stat().st_size for p in folder.iterdir())
        out.update(show_tokens=tokens, show_bytes=size, show_write_s=round(seconds, 1))
        print(f"wrote {rows:,} rows, {tokens:,} tokens, {size / 2**30:.2f} GiB in "
              f"{seconds:.0f} s", flush=True)
        data = Dataset(folder)
        for where, n in (("start", 0), ("middle", rows // 2), ("end", rows - 1)):
            evict(folder)
            before = read_bytes()
            seconds, found = timed(lambda: data.by_ids([f"row-{n:09d}"]))
            assert found[0].number == n and len(found[0].input_ids) > 0
            out[f"show_lookup_{where}_s"] = round(seconds, 3)
            out[f"show_lookup_{where}_read_mb"] = round((read_bytes() - before) / 2**20, 1)
        out["show_lookup_end_warm_s"] = round(
            timed(lambda: data.by_ids([f"row-{rows - 1:09d}"]))[0], 3)
        evict(folder)
        before = read_bytes()
        out["show_read_all_s"] = round(timed(lambda: read_all(folder))[0], 2)
        out["show_read_all_mb"] = round((read_bytes() - before) / 2**20, 1)
        out["show_read_all_vs_lookup"] = round(out["show_read_all_s"] /
                                               out["show_lookup_end_s"], 1)
        evict(folder)
        cmd = [sys.executable, "-m", "stages.show", str(folder), "--id",
               f"row-{rows - 1:09d}", "--color", "never"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=harness.env(), capture_output=True, text=True)
        out["show_cli_s"] = round(time.perf_counter() - start, 2)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        out["show_cli_peak_rss_mb"] = round(
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
