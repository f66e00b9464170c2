"""loader: batches from real Arrow shards against a plain Python construction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stages.common.errors import StageError
from stages.dataset import loader
from tests.helpers.sets import write

IGNORE = -100


def random_parts(seed: int = 0, n_shards: int = 3, per: int = 11) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    parts = []
    for s in range(n_shards):
        part = []
        for r in range(per):
            n = int(rng.integers(1, 40))
            mask = rng.integers(0, 2, n).tolist()
            part.append({"id": f"s{s}-r{r}", "source": ["a", "b", "c"][r % 3],
                         "input_ids": rng.integers(0, 1000, n).tolist(), "loss_mask": mask,
                         "num_tokens": n, "num_loss_tokens": sum(mask)})
        parts.append(part)
    return parts


def plain_groups(lengths: list[int], budget: int, packed: bool) -> list[int]:
    """The batching rule, one row at a time."""
    sizes, rows, longest, tokens = [], 0, 0, 0
    for n in lengths:
        grown = tokens + n if packed else (rows + 1) * max(longest, n)
        if rows and grown > budget:
            sizes.append(rows)
            rows, longest, tokens = 0, 0, 0
        rows, longest, tokens = rows + 1, max(longest, n), tokens + n
    return sizes + ([rows] if rows else [])


def plain_labels(r: dict) -> list[int]:
    return [IGNORE if k == 0 or m == 0 else t
            for k, (t, m) in enumerate(zip(r["input_ids"], r["loss_mask"]))]


@pytest.fixture
def merged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parts = random_parts()
    write(tmp_path, parts)  # 2 rows per record batch: batches cross them and shards
    return tmp_path / "data/merged", [r for p in parts for r in p]


@pytest.mark.parametrize("budget", [1, 30, 64, 200, 10_000])
def test_padded_batches_match_plain_python(merged, budget):
    folder, flat = merged
    sizes = plain_groups([r["num_tokens"] for r in flat], budget, packed=False)
    got = list(loader.batches(folder, budget, packed=False, pad_id=7, tensors=False))
    assert [len(b["input_ids"]) for b in got] == sizes
    start = 0
    for batch, size in zip(got, sizes):
        group = flat[start : start + size]
        start += size
        width = max(r["num_tokens"] for r in group)
        assert size == 1 or size * width <= budget
        for k, r in enumerate(group):
            pad = width - r["num_tokens"]
            assert batch["input_ids"][k].tolist() == r["input_ids"] + [7] * pad
            assert batch["attention_mask"][k].tolist() == [1] * r["num_tokens"] + [0] * pad
            assert batch["labels"][k].tolist() == plain_labels(r) + [IGNORE] * pad
    assert start == len(flat)


@pytest.mark.parametrize("budget", [1, 30, 64, 200, 10_000])
def test_packed_batches_match_plain_python(merged, budget):
    folder, flat = merged
    sizes = plain_groups([r["num_tokens"] for r in flat], budget, packed=True)
    got = list(loader.batches(folder, budget, packed=True, tensors=False))
    assert len(got) == len(sizes)
    start = 0
    for batch, size in zip(got, sizes):
        group = flat[start : start + size]
        start += size
        assert "attention_mask" not in batch  # a mask of ones would join the rows
        assert batch["input_ids"][0].tolist() == sum((r["input_ids"] for r in group), [])
        assert batch["labels"][0].tolist() == sum((plain_labels(r) for r in group), [])
        assert batch["position_ids"][0].tolist() == sum(
            (list(range(r["num_tokens"])) for r in group), [])
        bounds = [0]
        for r in group:
            bounds.append(bounds[-1] + r["num_tokens"])
        assert batch["cu_seq_lens_q"].tolist() == bounds == batch["cu_seq_lens_k"].tolist()
        assert batch["cu_seq_lens_q"].dtype == np.int32
        assert batch["max_length_q"] == max(r["num_tokens"] for r in group)
        assert size == 1 or bounds[-1] <= budget
    assert start == len(flat)


def test_torch_batches_share_the_numpy_values(merged):
    torch = pytest.importorskip("torch")
    folder, _ = merged
    for packed in (False, True):
        numpy_batches = list(loader.batches(folder, 64, packed=packed, tensors=False))
        torch_batches = list(loader.batches(folder, 64, packed=packed))
        assert len(numpy_batches) == len(torch_batches)
        for a, b in zip(numpy_batches, torch_batches):
            assert a.keys() == b.keys()
            for key, value in a.items():
                if isinstance(value, np.ndarray):
                    assert isinstance(b[key], torch.Tensor)
                    assert b[key].tolist() == value.tolist()
                else:
                    assert b[key] == value
            assert b["input_ids"].dtype == b["labels"].dtype == torch.int64


def test_batches_stream_before_a_later_shard_is_read(merged):
    """The first batches come out before the last shard is opened: nothing is read ahead."""
    folder, flat = merged
    last = sorted(folder.glob("*.arrow"))[-1]
    last.write_bytes(last.read_bytes()[:100])  # damaged: reading it raises
    stream = loader.batches(folder, 30, packed=True, tensors=False)
    first = next(stream)
    assert first["input_ids"][0].tolist()[: flat[0]["num_tokens"]] == flat[0]["input_ids"]
    with pytest.raises(StageError, match="not a readable Arrow stream"):
        list(stream)


def test_rows_are_views_in_dataset_order(merged):
    folder, flat = merged
    got = list(loader.rows(folder))
    assert [r.input_ids.tolist() for r in got] == [r["input_ids"] for r in flat]
    assert [r.source for r in got] == [r["source"] for r in flat]
    assert not got[0].input_ids.flags.owndata  # a view into the shard's memory map


@pytest.mark.parametrize("packed", [False, True])
def test_batcher_closes_batches_across_chunks_like_one_stream(packed):
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 300, 5000)
    lengths[17] = 5000  # longer than the budget: a batch of its own
    expected = plain_groups(lengths.tolist(), 1024, packed)
    batcher = loader.Batcher(1024, packed)
    sizes = []
    for chunk in np.split(lengths, [3, 4, 500, 2600]):
        sizes += batcher.add(chunk)
    sizes += batcher.finish()
    assert sizes == expected
    assert batcher.batches == len(expected) and batcher.tokens == lengths.sum()


def test_budget_matches_plain_arithmetic(merged):
    folder, flat = merged
    budget, per_step = 64, 3
    got = loader.budget(folder, budget, per_step)
    lengths = [r["num_tokens"] for r in flat]
    supervised = sum(r["num_loss_tokens"] for r in flat)
    for name, packed in (("padded", False), ("packed", True)):
        sizes = plain_groups(lengths, budget, packed)
        slots, start = 0, 0
        for size in sizes:
            group = lengths[start : start + size]
            start += size
            slots += max(sum(group), budget) if packed else size * max(group)
        steps = math.ceil(len(sizes) / per_step)
        assert got[name]["batches"] == len(sizes)
        assert got[name]["optimizer_steps"] == steps
        assert got[name]["padding_fraction"] == round(1 - sum(lengths) / slots, 4)
        assert got[name]["supervised_tokens_per_step"] == round(supervised / steps, 1)
    a = [r for r in flat if r["source"] == "a"]
    sup_a = sum(r["num_loss_tokens"] for r in a)
    assert got["sources"]["a"]["rows"] == len(a)
    assert got["sources"]["a"]["supervised_share"] == round(sup_a / supervised, 4)
    assert got["sources"]["a"]["supervised_tokens_per_step"]["packed"] == round(
        sup_a / got["packed"]["optimizer_steps"], 1)
    assert got["longest_row"] == max(lengths) and got["rows"] == len(flat)


def test_bad_budget_is_one_line():
    with pytest.raises(StageError, match="tokens_per_batch must be >= 1, got 0"):
        loader.Batcher(0, True)


def test_a_seed_shuffles_every_row_once_and_repeats(merged):
    folder, flat = merged
    order = [r.input_ids.tolist() for r in loader.rows(folder, seed=1)]
    assert sorted(order) == sorted(r["input_ids"] for r in flat)
    assert order != [r["input_ids"] for r in flat]
    assert order == [r.input_ids.tolist() for r in loader.rows(folder, seed=1)]
    assert order != [r.input_ids.tolist() for r in loader.rows(folder, seed=2)]
    packed = list(loader.batches(folder, 64, packed=True, tensors=False, seed=1))
    assert sum(len(b["cu_seq_lens_q"]) - 1 for b in packed) == len(flat)
