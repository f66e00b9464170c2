"""A prepare run's decontamination: where the checks run (stages/sources/evals.py)."""

from __future__ import annotations

from stages.common import params
from stages.process import cpus
from stages.sources import checker, evals
from tests.helpers.sources import evals as eval_sets


def test_the_checker_starts_only_beside_an_idle_cpu(tmp_path, monkeypatch):
    def prepare(num_proc: int) -> params.Prepare:
        return params.build(params.Prepare, {"sources": [], "num_proc": num_proc, "decontaminate":
                                             {"evals": eval_sets(tmp_path)}}, "prepare")

    cfg = prepare(num_proc=0)
    monkeypatch.setattr(checker.Checker, "ready", lambda c: True)  # whether it starts, not how
    for idle, starts in ((1.0, True), (evals.SPARE_CPU, True), (0.2, False), (0.0, False)):
        monkeypatch.setattr(cpus, "idle_since", lambda since: idle)
        run = evals.Evals(cfg, False, tmp_path / "prompts")
        try:
            assert run.checker_ready() is starts, idle
            assert (run.checker is not None) is starts  # refused once: not asked again
        finally:
            run.close()
    one = evals.Evals(prepare(num_proc=1), False, tmp_path / "prompts")
    assert one.checker is None and not one.checker_ready()  # num_proc: 1 asks for one process
    one.close()
