"""A source's rows made into groups (stages/sources/groups.py): in source order, every
row once, whether made here or in worker processes."""

from __future__ import annotations

import json

import pytest

from stages.common import params
from stages.sources import groups, layouts, readers
from stages.sources.evals import Evals
from stages.sources.layouts import FieldProbe
from stages.sources.prompts import Candidate, PromptSpec
from tests.helpers.sources import src, write_jsonl

PAD = "words to make the source span several of the reader's groups " * 20


@pytest.mark.parametrize("num_proc", [1, 2])
def test_groups_come_in_source_order_made_here_or_in_workers(tmp_path, monkeypatch, num_proc):
    monkeypatch.setattr(groups, "LOCAL_ROWS", 40)  # the rest go to the workers
    path = write_jsonl(tmp_path / "s.jsonl", [{"q": f"question {i} " + PAD} for i in range(2000)])
    source = src(path)
    cfg = params.build(params.Prepare, {"sources": [{"name": "s", "path": str(path),
                                                     "format": "columns", "prompt_field": "q"}]},
                       "prepare")
    evals = Evals(cfg, num_proc > 1, tmp_path / "out")
    spec = PromptSpec(f"groups-{num_proc}", 0, source, cfg.multi_turn, cfg.dedup,
                      cfg.max_prompt_chars, cfg.seed, False, evals.key, cfg.tool_conversations)
    layout = layouts.Layout(source, cfg.multi_turn)
    probe = FieldProbe(source, layout)
    reader = readers.Reader(source, layout.columns(), probe.check_schema, cfg.max_record_bytes)
    workers = groups.Workers(num_proc)
    try:
        made = list(groups.prepared_groups(reader, probe, spec, workers, evals))
    finally:
        workers.close()
    rows = [res for g in made for res in g.prepared.results if isinstance(res, Candidate)]
    texts = [json.loads(r.line)["messages"][-1]["content"] for r in rows]
    assert texts == [f"question {i} " + PAD for i in range(2000)]
    assert (workers.pool is not None) is (num_proc > 1)
