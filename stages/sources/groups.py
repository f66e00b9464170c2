"""A source's rows made into prompt groups, in source order: the first LOCAL_ROWS here,
the rest in worker processes (`prepare.num_proc`) or, with decontamination on one CPU,
here while the checker process checks the groups before. Memory stays flat however far
the reader could run ahead."""

from __future__ import annotations

import logging
from collections import deque
from typing import Iterator, NamedTuple, Optional, Sequence

from stages.process import children
from stages.sources import prompts, readers
from stages.sources.checker import CHECK_AHEAD, Checker
from stages.sources.evals import Evals
from stages.sources.layouts import FieldProbe
from stages.sources.prompts import Prepared, PromptSpec

log = logging.getLogger(__name__)

LOCAL_ROWS = 20000  # rows of each source prepared in-process before workers (or the checker) take over


class Workers:
    """A pool of `n` worker processes, started only when a source proves large."""

    def __init__(self, n: int):
        self.n = n
        self.pool: Optional[children.Workers] = None

    def get(self) -> children.Workers:
        if self.pool is None:
            # spawn, not fork: a source read earlier may have started pyarrow/datasets threads
            self.pool = children.Workers("spawn", self.n)
            log.info("started %d worker processes", self.n)
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()


class Group(NamedTuple):
    """A group of a source's rows as made, with where they come from."""

    file: str  # the reader's `current` when it read the group
    unit: str  # of `positions`: "line" or "row"
    positions: Sequence[int]
    prepared: Prepared


def prepared_groups(
    reader: readers.Reader, probe: FieldProbe, spec: PromptSpec, workers: Workers, evals: Evals
) -> Iterator[Group]:
    """Each group of rows made, in source order.

    The first LOCAL_ROWS rows are prepared here; the rest, when num_proc > 1, in worker
    processes with at most 4 groups per worker in flight, so memory stays flat however
    far the reader could run ahead; in one process with decontamination, here while the
    checker process checks the groups before (at most CHECK_AHEAD) once it is ready."""
    pending: deque = deque()
    sent = 0
    try:
        for positions, items in reader.batches():
            if probe.active:
                for pos, item in zip(positions, items):
                    if probe.active:
                        probe.see(item, reader.where(pos))
            place = (reader.current, reader.unit, positions)
            if workers.n > 1 and sent >= LOCAL_ROWS:
                pending.append((place, workers.get().submit(prompts.work, spec, items)))
                while len(pending) > 4 * workers.n:
                    place, job = pending.popleft()
                    yield Group(*place, _result(job, workers))
            elif sent >= LOCAL_ROWS and evals.checker_ready():  # once ready, it stays ready
                pending.append((place, _CheckJob(evals.checker, spec, items)))
                while len(pending) > CHECK_AHEAD:
                    place, job = pending.popleft()
                    yield Group(*place, job.get())
            else:  # `sent` only grows, so no group is pending here
                yield Group(*place, prompts.work(spec, items))
            sent += len(items)
        probe.finish()
        while pending:
            place, job = pending.popleft()
            yield Group(*place, _result(job, workers))
    finally:
        if pending and evals.checker is not None:  # left early: replies the next source must not read
            evals.checker.close()


def _result(job, workers: Workers) -> Prepared:
    """A group's result from a worker process or from the checker."""
    if isinstance(job, _CheckJob):
        return job.get()
    return workers.get().result(job, "prepare")


class _CheckJob:
    """A group whose texts went to the checker: its rows, kept here until its hits come back."""

    def __init__(self, checker: Checker, spec: PromptSpec, items: list):
        self.checker, self.maker = checker, prompts.maker(spec)
        self.results, self.texts, self.counts = self.maker.make_unchecked(items)
        self.unknown = prompts.unknown_roles(self.maker)
        checker.send(self.texts, self.counts)

    def get(self) -> Prepared:
        hits = self.checker.hits()
        if hits is None:
            hits = self.maker.evals.check(self.texts, self.counts)
        return Prepared(self.maker.drop_matches(self.results, hits), self.unknown)
