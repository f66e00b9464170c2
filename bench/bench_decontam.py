"""Benchmark prepare with decontamination against prepare without it, on the same mix.

  python bench/bench_decontam.py           500K-row mix, 50K evaluation items
  python bench/bench_decontam.py --quick   50K-row mix, 5K items (also BENCH_QUICK=1)

The mix is bench_prepare's generated ShareGPT source. The evaluation set is JSON lines of
`question`s of 10 to 80 words (GSM8K's average is ~46), plus 10 questions copied from the
mix with their case, spacing and punctuation changed, so the check also finds and
attributes matches (each mix question recurs in ~1/5000 of the rows). Both runs use the
default params (num_proc 0: on 2 CPUs one process, plus the decontamination checker process
when the other CPU is idle), run twice interleaved, the faster of each counts.

  decontam_vs_prepare        rows/s with decontamination / rows/s without (target >= 0.7)
  decontam_vs_prepare_cpu    the same in rows per CPU-second (less moved by other load)
  decontam_rows_per_s        rows/s with decontamination
  decontam_peak_rss_mb       peak RSS with decontamination (bench/peak.py's way)
  decontam_plain_peak_rss_mb ... without it: the difference is the index, not the mix
  decontam_index_mb          bytes of the index arrays
  decontam_dropped           prompts dropped as contaminated
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from bench_prepare import WORDS, WORK, make_source, run_stage  # noqa: E402

PLANTED = 10


def make_evals(path: Path, items: int, mix: Path) -> None:
    if path.exists():
        return
    rng = random.Random(items)
    vocab = WORDS + [f"{w}{i}" for w in WORDS for i in range(40)]  # a wider vocabulary
    planted = []
    with open(mix, "rb") as f:
        for line in f:
            turn = json.loads(line)["conversations"]
            text = next(t["value"] for t in turn if t["from"] == "human").split("] ", 1)[1]
            if len(text.split()) >= 13 and text not in planted:
                planted.append(text)
            if len(planted) >= PLANTED:
                break
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(items - len(planted)):
            words = [rng.choice(vocab) for _ in range(rng.randint(10, 80))]
            f.write(json.dumps({"question": " ".join(words).capitalize() + "?"}) + "\n")
        for text in planted:  # a disguised copy: case, spacing, punctuation
            f.write(json.dumps({"question": text.upper().replace(" ", "  ,") + "!!"}) + "\n")
    tmp.rename(path)


def main(quick: bool | None = None) -> dict:
    if quick is None:
        quick = harness.quick()
    rows, items = (50_000, 5_000) if quick else (500_000, 50_000)
    mix = WORK / f"sharegpt-v3-{rows}.jsonl"
    evals = WORK / f"evals-{items}.jsonl"
    make_source(mix, rows)
    make_evals(evals, items, mix)
    extra = {"decontaminate": {"evals": [
        {"name": "bench_eval", "path": str(evals), "format": "columns", "prompt_field": "question"}
    ]}}
    plain, checked = [], []
    for _ in range(2):  # interleaved: other load on a shared machine comes and goes
        plain.append(run_stage(mix, rows, 0))
        checked.append(run_stage(mix, rows, 0, extra, "-decontam"))
    best_plain = max(plain, key=lambda r: r["wall"])
    best = max(checked, key=lambda r: r["wall"])
    dc = best["report"]["decontamination"]
    dropped = best["report"]["totals"]["dropped_by_reason"]["contaminated"]
    if not dropped or dc["evals"]["bench_eval"]["contaminated"] != dropped:
        raise RuntimeError(f"the planted evaluation items were not found: {dc}")
    return {
        "decontam_vs_prepare": round(best["wall"] / best_plain["wall"], 3),
        "decontam_vs_prepare_cpu": round(max(r["cpu"] for r in checked) / max(r["cpu"] for r in plain), 3),
        "decontam_rows_per_s": round(best["wall"]),
        "decontam_plain_rows_per_s": round(best_plain["wall"]),
        "decontam_peak_rss_mb": round(max(r["rss_mb"] for r in checked), 1),
        "decontam_plain_peak_rss_mb": round(max(r["rss_mb"] for r in plain), 1),
        "decontam_index_mb": dc["index_mb"],
        "decontam_index_ngrams": dc["index_ngrams"],
        "decontam_dropped": dropped,
    }


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key} = {value}")
