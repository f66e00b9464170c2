"""How long `dvc repro` takes when nothing changed, on a pipeline with >= 2 GB of outputs.

  .venv/bin/python bench/bench_repro.py [--quick]      (or BENCH_QUICK=1)

Builds a throwaway git + DVC repo under bench/work/repro with the project's cache
setting (`cache.type` from .dvc/config: hardlink,symlink) and a four-stage pipeline shaped like the real
one, without the model: `base` writes Arrow shards of token rows (2 GB; 256 MB quick),
`tokenize` writes one new shard, `merge` hardlinks the base shards and copies the new
one into data/merged (as stages/merge.py does), `validate` memory-maps every merged
shard and writes a metrics file. Then it times

  noop_repro_seconds    a second `dvc repro`: every stage is checked, none runs
                        (the issue's bound is 10 s)
  noop_status_seconds   `dvc status` on the same repo
  first_repro_seconds   the first `dvc repro` (writes and hashes everything)
  outputs_gb            bytes in all stage outputs, every file counted (the base shards
                        appear twice: data/base and data/merged)
  disk_gb_link          `du` of the whole repo, cache included, hardlinked files once
  disk_gb_copy          the same after `dvc config cache.type copy` +
                        `dvc checkout --relink`: what DVC's default mode
                        (reflink,copy) costs on ext4, where reflinks are not available
  disk_copy_vs_link     disk_gb_copy / disk_gb_link

The stage commands are this file's own sub-commands (`write`, `merge`, `validate`).
The work folder is removed afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402
from harness import MB  # noqa: E402
WORK = ROOT / "bench" / "work" / "repro"
BIN = Path(sys.executable).parent
GB = 1 << 30
SHARD_BYTES = 128 * MB
ROW_TOKENS = 2048
VOCAB = 248_077

PIPELINE = """\
stages:
  base:
    cmd: python {me} write data/base {base_mb} 1
    outs: [data/base]
  tokenize:
    cmd: python {me} write data/tokenized {new_mb} 2
    outs: [data/tokenized]
  merge:
    cmd: python {me} merge data/base data/tokenized data/merged
    deps: [data/base, data/tokenized]
    outs: [data/merged]
  validate:
    cmd: python {me} validate data/merged reports/validate.json
    deps: [data/merged]
    metrics:
      - reports/validate.json:
          cache: false
"""

SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])


# ------------------------------------------------------------------ stage commands


def write_shards(folder: Path, total_mb: int, seed: int) -> None:
    """Arrow IPC stream shards (the format datasets saves) of fixed-length token rows."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    row_bytes = ROW_TOKENS * 5  # int32 id + int8 mask
    rows_per_batch = 1024
    left = total_mb * MB
    shard = 0
    while left > 0:
        target = min(SHARD_BYTES, left)
        with pa.OSFile(str(folder / f"data-{shard:05d}.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, SCHEMA) as writer:
            done = 0
            while done < target:
                n = max(1, min(rows_per_batch, (target - done) // row_bytes))
                ids = rng.integers(0, VOCAB, size=n * ROW_TOKENS, dtype=np.int32)
                mask = np.zeros(n * ROW_TOKENS, dtype=np.int8)
                mask.reshape(n, ROW_TOKENS)[:, ROW_TOKENS // 2:] = 1
                offsets = pa.array(np.arange(0, (n + 1) * ROW_TOKENS, ROW_TOKENS, dtype=np.int32))
                writer.write_batch(pa.record_batch([
                    pa.ListArray.from_arrays(offsets, pa.array(ids)),
                    pa.ListArray.from_arrays(offsets, pa.array(mask)),
                ], schema=SCHEMA))
                done += n * row_bytes
        left -= target
        shard += 1


def merge_shards(base: Path, new: Path, out: Path) -> None:
    """Base shards linked (never rewritten), new shards copied after them."""
    out.mkdir(parents=True)
    names = sorted(base.glob("*.arrow"))
    for i, src in enumerate(names):
        os.link(src, out / f"data-{i:05d}.arrow")
    for j, src in enumerate(sorted(new.glob("*.arrow"))):
        shutil.copyfile(src, out / f"data-{len(names) + j:05d}.arrow")


def validate_shards(folder: Path, report: Path) -> None:
    rows = tokens = 0
    for path in sorted(folder.glob("*.arrow")):
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_stream(source).read_all()
        rows += table.num_rows
        tokens += len(table.column("input_ids").combine_chunks().values)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps({"rows": rows, "tokens": tokens}) + "\n")


# ------------------------------------------------------------------ the benchmark


def sh(cmd: list[str], cwd: Path) -> tuple[float, str]:
    """Run a command; its wall time and output."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               DVC_NO_ANALYTICS="1")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}")
    return elapsed, proc.stdout


def noop_repro(repo: Path) -> float:
    """One `dvc repro` that must run nothing: a timing of one that did would mislead."""
    elapsed, out = sh(["dvc", "repro"], repo)
    if "Running stage" in out:
        raise RuntimeError(f"a no-op dvc repro ran a stage:\n{out[-3000:]}")
    return elapsed


def du_bytes(path: Path) -> int:
    """Disk use of a tree, each hardlinked inode counted once (as `du` does)."""
    out = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return int(out.split()[0])


def outputs_bytes(repo: Path) -> int:
    return sum(p.stat().st_size for p in (repo / "data").rglob("*") if p.is_file())


def build(repo: Path, base_mb: int, new_mb: int) -> None:
    repo.mkdir(parents=True)
    sh(["git", "init", "-q"], repo)
    sh(["dvc", "init", "-q"], repo)
    sh(["dvc", "config", "core.analytics", "false"], repo)
    # the link mode this project ships, read from its own .dvc/config
    project_type = sh(["dvc", "config", "cache.type"], ROOT)[1].strip()
    sh(["dvc", "config", "cache.type", project_type], repo)
    (repo / "dvc.yaml").write_text(
        PIPELINE.format(me=Path(__file__).resolve(), base_mb=base_mb, new_mb=new_mb)
    )


def main(quick: bool | None = None) -> dict:
    if quick is None:
        quick = harness.quick()
    base_mb, new_mb = (192, 64) if quick else (1920, 128)
    with harness.scratch(WORK):
        repo = WORK / "pipeline"
        build(repo, base_mb, new_mb)
        first, _ = sh(["dvc", "repro"], repo)
        noop = statistics.median(noop_repro(repo) for _ in range(3))
        status = statistics.median(sh(["dvc", "status"], repo)[0] for _ in range(3))
        outputs = outputs_bytes(repo)
        link = du_bytes(repo)
        sh(["dvc", "config", "cache.type", "copy"], repo)
        sh(["dvc", "checkout", "--relink"], repo)
        copy = du_bytes(repo)
    return {
        "noop_repro_seconds": round(noop, 2),
        "noop_status_seconds": round(status, 2),
        "first_repro_seconds": round(first, 1),
        "outputs_gb": round(outputs / GB, 2),
        "disk_gb_link": round(link / GB, 2),
        "disk_gb_copy": round(copy / GB, 2),
        "disk_copy_vs_link": round(copy / link, 2),
    }


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("write", "merge", "validate"):
        cmd, args = sys.argv[1], sys.argv[2:]
        if cmd == "write":
            write_shards(Path(args[0]), int(args[1]), int(args[2]))
        elif cmd == "merge":
            merge_shards(Path(args[0]), Path(args[1]), Path(args[2]))
        else:
            validate_shards(Path(args[0]), Path(args[1]))
    else:
        for key, value in main().items():
            print(f"{key} = {value}")
