"""Source files for prepare's tests: evaluation items (English, trivia, non-Latin), sources
written as JSON lines or Parquet, a `params.Source` for a path, and the stage run in a folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages import prepare
from stages.common import params, reports
from tests.helpers import stagecli

PATHS = stagecli.paths("prepare")  # where dvc.yaml has the stage read and write

GSM = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn?",
    "What is 7 times 8?",  # 4 words: shorter than an n-gram
]
TRIVIA = [
    "Which planet in our solar system has the largest number of confirmed moons, and "
    "roughly how many have been catalogued so far?",
    "Who wrote the novel in which a whaling captain named Ahab hunts a white whale across "
    "the oceans of the world?",
]
INTL = [
    "Сколько будет, если к произведению семи и восьми прибавить частное от деления сорока "
    "восьми на шесть, а затем вычесть девять?",
    "一个长方形花园的长是十二米，宽比长少四米，沿着花园的四周修一条小路，小路的总长度是多少米？",
]


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row, ensure_ascii=False))
            f.write("\n")
    return path


def run(tmp_path: Path, sources: list[dict], **prepare_keys):
    """Run the stage in tmp_path; return (report, output rows, output bytes)."""
    os.chdir(tmp_path)
    cfg = params.build(params.Prepare, {"sources": sources, **prepare_keys}, "prepare")
    report = prepare.run(cfg, PATHS)
    data = (tmp_path / "data/prompts/prompts.jsonl").read_bytes()
    rows = [json.loads(line) for line in data.splitlines()]
    assert reports.read(tmp_path / "reports", "prepare") == {**report, "host": reports.host()}
    return report, rows, data


def evals(tmp_path: Path) -> list[dict]:
    gsm = write_jsonl(tmp_path / "evals/gsm.jsonl", [{"question": q, "answer": "1"} for q in GSM])
    trivia = tmp_path / "evals/trivia.parquet"
    pq.write_table(pa.table({"id": list(range(len(TRIVIA))), "problem": TRIVIA}), trivia)
    intl = write_jsonl(tmp_path / "evals/intl.jsonl",
                       [{"messages": [{"role": "system", "content": "Answer briefly."},
                                      {"role": "user", "content": q}]} for q in INTL])
    return [
        {"name": "gsm", "path": str(gsm), "format": "columns", "prompt_field": "question"},
        {"name": "trivia", "path": str(trivia), "format": "columns", "prompt_field": "problem"},
        {"name": "intl", "path": str(intl), "format": "messages"},
    ]


def src(path, fmt="columns", **kw) -> params.Source:
    if fmt == "columns":
        kw.setdefault("prompt_field", "q")
    return params.Source(name=kw.pop("name", "s"), path=str(path), format=fmt, **kw)
