"""Merge and validate on a generated multi-GB base set (issue 6).

  .venv/bin/python bench/bench_merge.py [--quick]      (or BENCH_QUICK=1)

Figures (ratios are against baselines measured in the same run, on the same files):
  merge_vs_copy_new         merge wall time / time to copy only the new shards' bytes; best
                            of two merges and three copies, interleaved, each after
                            harness.settle_disk()
  merge_cache_growth_ratio  DVC cache growth after `dvc add` of the merged version (cache
                            type hardlink,symlink, base already in the cache) / new bytes
  validate_vs_scan          validate throughput / a raw numpy scan (min, max, lengths of
                            input_ids and loss_mask) over the same shards, single-threaded;
                            validate with its default threads (and `_1thread`: threads 1),
                            its training step (train_check) off, its samples page's
                            time (samples_page_seconds) taken out
  merge_peak_rss_mb, validate_peak_rss_mb   peak RSS of the stage process (bench/peak.py)
  *_peak_rss_half_mb        the same with half the base shards: flat means these match
plus the sizes they were measured on. The base is >= 2 GB of 256 MB shards (256 MB of
64 MB shards with --quick), rows of 500-4000 tokens; the new rows are 1/5 of it, as in
the reference run (193K rows onto 902K). Work files live in bench/work/merge and are
removed afterwards. Stage times are the stages' own `seconds` (imports excluded); each stage
runs in its own process so its peak RSS is its own.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import harness  # noqa: E402
from peak import outcome, stage_command  # noqa: E402
from stages.common import reports  # noqa: E402
from stages.dataset import fingerprint  # noqa: E402
from stages.dataset.schema import ARROW_SCHEMA  # noqa: E402
from stages.dataset.shards import ShardFile, open_shard, write_metadata  # noqa: E402

WORK = ROOT / "bench" / "work" / "merge"
VOCAB = 248_077
FINGERPRINT = {
    "tokenizer": {"name": "bench", "vocab_sha256": "0" * 64, "vocab_size": VOCAB,
                  "special_tokens": {}},
    "chat_template_sha256": "1" * 64,
    "policy": {"max_seq_len": 4096, "min_loss_tokens": 1},  # what validate reads as limits
    "versions": {},
}


def generate(folder: Path, total_bytes: int, shard_bytes: int, prefix: str, seed: int,
             lengths: tuple[int, int] = (500, 4000)) -> int:
    """A save_to_disk-style folder of HF-like shards: rows of `lengths` tokens, the last
    ~40% supervised, written in 1000-row record batches. Returns the row count."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    names, rows, written = [], 0, 0
    while written < total_bytes:
        name = f"data-{len(names):05d}.arrow"
        with ShardFile(folder / name) as writer:
            size = 0
            while size < min(shard_bytes, total_bytes - written):
                batch = _batch(rng, rows, 1000, prefix, lengths)
                writer.write(batch)
                size += batch.nbytes
                rows += batch.num_rows
        written += (folder / name).stat().st_size
        names.append(name)
    write_metadata(folder, names, f"bench-{prefix}")
    (folder / fingerprint.FILE).write_text(json.dumps(FINGERPRINT))
    return rows


def _batch(rng, first: int, n: int, prefix: str, span: tuple[int, int]) -> pa.RecordBatch:
    lengths = rng.integers(*span, n).astype(np.int32)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    ids = rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32)
    mask = np.zeros(int(offsets[-1]), np.int8)
    answer = (lengths * 0.4).astype(np.int32)
    starts = offsets[1:] - answer
    # ones from each row's answer start to its end, via a +1/-1 difference array
    step = np.zeros(int(offsets[-1]) + 1, np.int8)
    np.add.at(step, starts, 1)
    np.add.at(step, offsets[1:], -1)
    mask[:] = np.cumsum(step[:-1], dtype=np.int8)
    sources = np.array(["alpha", "beta", "gamma"])[rng.integers(0, 3, n)]
    return pa.RecordBatch.from_arrays(
        [
            pa.array([f"{prefix}-{first + i}" for i in range(n)]),
            pa.array(sources),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
            pa.array(lengths),
            pa.array(answer),
        ],
        schema=ARROW_SCHEMA,
    )


def raw_scan(folder: Path) -> float:
    """The floor: min, max and lengths over the flattened lists, nothing else."""
    from stages.dataset.shards import list_shards

    start = time.perf_counter()
    for path in list_shards(folder):
        with open_shard(path) as reader:
            for batch in reader:
                for name in ("input_ids", "loss_mask"):
                    col = batch.column(name)
                    offsets = col.offsets.to_numpy()
                    values = col.values.slice(offsets[0], offsets[-1] - offsets[0]).to_numpy()
                    np.diff(offsets)
                    if len(values):
                        values.min(), values.max()
    return time.perf_counter() - start


def _checks_seconds(report: dict) -> float:
    """validate's time over the data: its samples page (a tokenizer load and a few rows,
    the same at any size) apart, as the training check is."""
    return report["seconds"] - report.get("samples_page_seconds", 0.0)


def run_stage(name: str, repo: Path) -> tuple[dict, float]:
    """Run a stage in its own process; return (its report, peak RSS in MB)."""
    rc, peak_mb = outcome(harness.sh(stage_command(name), repo))
    if rc:
        raise RuntimeError(f"{name} failed")
    return reports.read(repo / "reports", name), peak_mb  # seconds: the run's part


def _cache_bytes(repo: Path) -> int:
    seen, total = set(), 0
    for path in (repo / ".dvc" / "cache").rglob("*"):
        st = path.lstat()
        if path.is_file() and st.st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_size
    return total


def _half_size(repo: Path, params: str) -> dict:
    """Merge and validate again with half the base shards: their peaks should not move."""
    half = WORK / "half"
    (half / "data" / "base").mkdir(parents=True)
    base = sorted((repo / "data/base").glob("*.arrow"))
    for path in base[: max(1, len(base) // 2)] + [repo / "data/base" / fingerprint.FILE]:
        os.link(path, half / "data/base" / path.name)
    shutil.copytree(repo / "data/tokenized", half / "data/tokenized", copy_function=os.link)
    (half / "params.yaml").write_text(params)
    report, merge_rss = run_stage("merge", half)
    validate_rss = run_stage("validate", half)[1]
    return {
        "merge_peak_rss_half_mb": round(merge_rss, 1),
        "validate_peak_rss_half_mb": round(validate_rss, 1),
        "merge_rows_half": report["merged"]["rows"],
    }


def main(quick: bool | None = None) -> dict:
    if quick is None:
        quick = harness.quick()
    base_bytes, shard_bytes = harness.set_bytes(quick, 2200)
    new_bytes = base_bytes // 5  # the reference run appended 193K rows to 902K
    repo = WORK / "repo"
    with harness.scratch(WORK):
        repo.mkdir(parents=True)
        harness.sh(["git", "init", "-q"], repo)
        harness.sh(["dvc", "init", "-q"], repo)
        harness.sh(["dvc", "config", "cache.type", "hardlink,symlink"], repo)
        base_rows = generate(repo / "data/base", base_bytes, shard_bytes, "base", 1)
        new_rows = generate(repo / "data/tokenized", new_bytes, shard_bytes, "new", 2)
        # the training step (validate.train_check) is a fixed cost of a few batches, not a
        # pass over the data: off here, so the figure stays validate's own data checks
        params = ("merge:\n  base: data/base\nvalidate:\n  max_seq_len: 4096\n"
                  "  train_check:\n    enabled: false\n")
        (repo / "params.yaml").write_text(params)
        harness.sh(["dvc", "add", "-q", "data/base"], repo)
        cache_before = _cache_bytes(repo)

        new_shards = sorted((repo / "data/tokenized").glob("*.arrow"))
        new_size = sum(p.stat().st_size for p in new_shards)
        copies, merges = [], []
        for _ in range(2):  # other load on a shared machine comes and goes: interleave
            copies.append(harness.copy_seconds(new_shards, WORK / "copy"))
            shutil.rmtree(repo / "data/merged", ignore_errors=True)
            harness.settle_disk()
            merges.append(run_stage("merge", repo))
        copies.append(harness.copy_seconds(new_shards, WORK / "copy"))
        copy_seconds = min(copies)
        merge_report, merge_rss = min(merges, key=lambda m: m[0]["seconds"])
        harness.sh(["dvc", "add", "-q", "data/merged"], repo)
        growth = _cache_bytes(repo) - cache_before

        raw_scan(repo / "data/merged")  # warm the page cache the same way for both
        # other load on a shared machine comes and goes: interleave, keep the best of each
        scans, runs, singles = [], [], []
        for _ in range(3):
            scans.append(raw_scan(repo / "data/merged"))
            (repo / "params.yaml").write_text(params)  # default: threads up to 4
            runs.append(run_stage("validate", repo))
            one = params.replace("validate:\n", "validate:\n  threads: 1\n")
            (repo / "params.yaml").write_text(one)
            singles.append(_checks_seconds(run_stage("validate", repo)[0]))
        validate_seconds = min(_checks_seconds(report) for report, _ in runs)
        validate_rss = max(rss for _, rss in runs)
        one_thread = min(singles)
        scan_seconds = min(scans)
        merged = merge_report["merged"]
        half = _half_size(repo, params)
        return {
            "merge_vs_copy_new": round(merge_report["seconds"] / copy_seconds, 3),
            "merge_cache_growth_ratio": round(growth / new_size, 4),
            "validate_vs_scan": round(scan_seconds / validate_seconds, 3),
            "validate_vs_scan_1thread": round(scan_seconds / one_thread, 3),
            "merge_peak_rss_mb": round(merge_rss, 1),
            "validate_peak_rss_mb": round(validate_rss, 1),
            "merge_seconds": merge_report["seconds"],
            "merge_copy_new_seconds": round(copy_seconds, 3),
            "validate_seconds": validate_seconds,
            "validate_scan_seconds": round(scan_seconds, 3),
            "merge_base_gb": round(merge_report["base"]["bytes"] / 1e9, 3),
            "merge_new_mb": round(new_size / 1e6, 1),
            "merge_rows": merged["rows"],
            "merge_base_rows": base_rows,
            "merge_new_rows": new_rows,
            **half,
        }


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key} = {value}")
