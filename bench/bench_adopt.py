"""merge.adopt on a generated base written the way another tool writes it (issue 21).

  .venv/bin/python bench/bench_adopt.py [--quick]      (or BENCH_QUICK=1)

The base imitates the reference run's (902,087 rows, ~1.9B tokens, int64 lists as
`datasets` infers them): a folder of Arrow stream shards with `input_ids` and
`loss_mask` as list<int64>, an extra `conversation_id` column, rows of 500-4000 tokens,
written in 1000-row record batches; the new rows are a small tokenized set, so the merge
is the adoption. Figures (ratios against baselines measured in the same run, on the same
files):
  adopt_vs_copy               merge (adopt: true) wall time / copying the base's bytes
                              (shutil.copyfile, every shard); best of two merges and of
                              three copies, interleaved, each after harness.settle_disk()
  adopt_peak_rss_mb           peak RSS of the merge process (bench/peak.py)
  adopt_peak_rss_half_mb      the same with half the base shards: flat means these match
plus the sizes they were measured on. The base is 2 GB of 256 MB shards (256 MB of 64 MB
shards with --quick). Work files live in bench/work/adopt and are removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import harness  # noqa: E402
from harness import MB  # noqa: E402
from bench_merge import generate, run_stage  # noqa: E402

WORK = ROOT / "bench" / "work" / "adopt"
VOCAB = 248_077
BASE_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int64())),
                         ("loss_mask", pa.list_(pa.int64())),
                         ("conversation_id", pa.int64())])


def foreign_base(folder: Path, total_bytes: int, shard_bytes: int, seed: int) -> None:
    """A folder of int64 Arrow stream shards as `datasets` writes them."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    rows = written = shard = 0
    while written < total_bytes:
        path = folder / f"data-{shard:05d}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, BASE_SCHEMA) as writer:
            size = 0
            while size < min(shard_bytes, total_bytes - written):
                batch = _batch(rng, rows, 1000)
                writer.write_batch(batch)
                size += batch.nbytes
                rows += batch.num_rows
        written += path.stat().st_size
        shard += 1


def _batch(rng, first: int, n: int) -> pa.RecordBatch:
    lengths = rng.integers(500, 4000, n)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    ids = rng.integers(0, VOCAB, int(offsets[-1]))
    # ones from each row's answer start (the last ~40%) to its end
    step = np.zeros(int(offsets[-1]) + 1, np.int64)
    np.add.at(step, offsets[1:] - (lengths * 0.4).astype(np.int64), 1)
    np.add.at(step, offsets[1:], -1)
    mask = np.cumsum(step[:-1])
    return pa.RecordBatch.from_arrays(
        [pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
         pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
         pa.array(np.arange(first, first + n))],
        schema=BASE_SCHEMA)


def _merge(repo: Path) -> tuple[dict, float]:
    """The merge stage in its own process, from scratch; (its report, its peak RSS in MB)."""
    shutil.rmtree(repo / "data/merged", ignore_errors=True)
    harness.settle_disk()
    return run_stage("merge", repo)


def _repo(name: str, base_shards: list[Path], tokenized: Path) -> Path:
    """A folder the merge stage runs in: the base's shards and the new rows, linked."""
    repo = WORK / name
    (repo / "data/base").mkdir(parents=True)
    for path in base_shards:
        os.link(path, repo / "data/base" / path.name)
    if tokenized != repo / "data/tokenized":
        shutil.copytree(tokenized, repo / "data/tokenized", copy_function=os.link)
    (repo / "params.yaml").write_text("merge:\n  base: data/base\n  adopt: true\n")
    return repo


def main(quick: bool | None = None) -> dict:
    if quick is None:
        quick = harness.quick()
    base_bytes, shard_bytes = harness.set_bytes(quick, 2048)
    with harness.scratch(WORK):
        source = WORK / "source"
        foreign_base(source, base_bytes, shard_bytes, 1)
        generate(WORK / "tokenized", 4 * MB, 4 * MB, "new", 2)
        shards = sorted(source.glob("*.arrow"))
        repo = _repo("full", shards, WORK / "tokenized")

        copies, merges = [], []
        for _ in range(2):  # other load on a shared machine comes and goes: interleave
            copies.append(harness.copy_seconds(shards, WORK / "copy"))
            merges.append(_merge(repo))
        copies.append(harness.copy_seconds(shards, WORK / "copy"))
        report, _ = min(merges, key=lambda m: m[0]["seconds"])
        peak = max(rss for _, rss in merges)
        half_repo = _repo("half", shards[: max(1, len(shards) // 2)], WORK / "tokenized")
        half_report, half_peak = _merge(half_repo)
        adopted = report["adopted"]
        return {
            "adopt_vs_copy": round(report["seconds"] / min(copies), 3),
            "adopt_peak_rss_mb": round(peak, 1),
            "adopt_peak_rss_half_mb": round(half_peak, 1),
            "adopt_seconds": report["seconds"],
            "adopt_copy_seconds": round(min(copies), 3),
            "adopt_base_gb": round(sum(p.stat().st_size for p in shards) / 1e9, 3),
            "adopt_written_gb": round(adopted["bytes"] / 1e9, 3),
            "adopt_rows": adopted["rows"],
            "adopt_tokens": adopted["tokens"],
            "adopt_rows_half": half_report["adopted"]["rows"],
        }


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key} = {value}")
