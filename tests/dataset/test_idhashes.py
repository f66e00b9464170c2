from pathlib import Path

import numpy as np
import polars as pl
import pytest

from stages.dataset.idhashes import IdHashes


def hashes_of(ids: list[str]) -> np.ndarray:
    return pl.Series(ids).hash(seed=0).to_numpy()


def feed(index: IdHashes, ids: list[str], chunk: int) -> None:
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        index.add(hashes_of(part), np.arange(start, start + len(part)))


@pytest.mark.parametrize("spill_rows,group_rows", [(1 << 18, 1 << 18), (100, 300), (7, 1)])
def test_repeated_rows_are_exactly_the_rows_of_repeated_ids(spill_rows, group_rows):
    rng = np.random.default_rng(3)
    ids = [f"id-{i}" for i in range(2000)]
    # repeats far apart (across spills and chunks) and next to each other
    for row, twin in [(5, 1999), (700, 701), (1234, 3), (1500, 1501)]:
        ids[twin] = ids[row]
    order = rng.permutation(len(ids))
    ids = [ids[i] for i in order]
    want = sorted(i for i, x in enumerate(ids) if ids.count(x) > 1)
    with IdHashes(spill_rows, group_rows) as index:
        feed(index, ids, 64)
        assert index.spilled == (spill_rows < len(ids))
        assert index.repeated_rows().tolist() == want


def test_no_repeats_and_no_rows():
    with IdHashes(10, 10) as index:
        assert index.repeated_rows().tolist() == []
    with IdHashes(10, 10) as index:
        feed(index, [f"x{i}" for i in range(95)], 20)
        assert index.repeated_rows().tolist() == []


def test_spill_files_are_removed_on_close():
    index = IdHashes(10, 10)
    feed(index, [f"x{i}" for i in range(50)], 20)
    folder = Path(index._folder.name)
    assert any(folder.iterdir())
    index.close()
    assert not folder.exists()


def test_memory_held_stays_under_the_spill_bound():
    with IdHashes(spill_rows=1000, group_rows=1000) as index:
        for start in range(0, 50_000, 500):
            index.add(hashes_of([f"r{i}" for i in range(start, start + 500)]),
                      np.arange(start, start + 500))
            assert index._held <= 1000
        assert len(index.repeated_rows()) == 0
