"""The decontamination of one prepare run: `Evals(cfg, workers, out)` builds the index of
the evaluation sets once (none without them), makes it findable by the processes that
check prompts (its `key`, for prompts.PromptSpec), counts the prompts it drops and writes
the report's `decontamination` section; `close()` at the end of the run.

Without worker processes, on a machine of two CPUs or fewer, the checks may go to a
checker process of their own (stages/sources/checker.py): `checker_ready()` says when.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Optional

from stages.common import outputs, params
from stages.process import cpus
from stages.sources import decontam
from stages.sources.checker import Checker

log = logging.getLogger(__name__)

# CPUs that must have sat idle for a checker to start: on a busy machine it would only
# take CPU time from prepare and add its own costs (the pipe, its start)
SPARE_CPU = 0.5


class Evals:
    """The decontamination index of this run, where worker processes find it (or the
    checker process, without workers), and the count of prompts it drops."""

    def __init__(self, cfg: params.Prepare, workers: bool, out: Path):
        self.key: Optional[str] = None
        self.out = out  # the index is saved beside it (outputs.scratch_dir)
        self.folder: Optional[str] = None
        policy = cfg.decontaminate
        self.policy = policy
        self.stats: dict[str, dict] = {}
        self.examples: list[dict] = []
        self.checker: Optional[Checker] = None
        self.cpu_times: Optional[cpus.CpuTimes] = None
        if not policy.evals:
            return
        built = decontam.build(policy, cfg.on_bad_row, cfg.max_record_bytes)
        self.index, self.stats = built.index, built.stats
        for st in self.stats.values():
            st.update(contaminated=0, by_source={})
        if workers:
            self.key = self.saved()
        else:
            self.key = f"inline-{os.getpid()}-{time.monotonic_ns()}"
            if cfg.num_proc == 0:  # one process chosen for a machine of <= 2 CPUs: use the second
                self.checker = Checker(self.saved)
                self.cpu_times = cpus.times()  # how busy the machine is, from here on
        decontam.register(self.key, self.index)

    def saved(self) -> str:
        """The folder of the index, saved once for the processes that memory-map it;
        where a run killed outright left one, the next run removes it."""
        if self.folder is None:
            self.folder = str(outputs.scratch_dir(self.out, "evals"))
            self.index.save(Path(self.folder))
        return self.folder

    def checker_ready(self) -> bool:
        """Whether groups go to the checker process. It is started when a source first
        proves large, if a CPU sits idle then (else not at all this run), and takes groups
        once it has loaded the index."""
        if self.checker is None:
            return False
        if self.checker.gave_up:  # it stopped answering: this process checks from now on
            self.checker = None
            return False
        if self.checker.proc is None:
            if cpus.idle_since(self.cpu_times) < SPARE_CPU:
                log.info("decontamination checks in this process: no idle CPU for a checker")
                self.checker = None
                return False
            log.info("starting the decontamination checker process")
        return self.checker.ready()

    def count(self, source: str, match: decontam.Match) -> None:
        st = self.stats[match.eval_set]
        st["contaminated"] += 1
        st["by_source"][source] = st["by_source"].get(source, 0) + 1
        if st["contaminated"] <= 3 and len(self.examples) < 20:
            self.examples.append(match.example(source))

    def report(self) -> dict:
        p = self.policy
        out = {"ngram": p.ngram, "min_overlap": p.min_overlap, "short_exact": p.short_exact,
               "evals": self.stats, "examples": self.examples}
        if self.key is not None:
            out["index_ngrams"] = len(self.index.hashes)
            out["index_mb"] = round(self.index.nbytes() / 2**20, 1)
        return out

    def close(self) -> None:
        if self.checker is not None:
            self.checker.close()
        if self.key is not None:
            decontam.forget(self.key)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
