"""Training batches from a merged dataset folder, streamed shard by shard.

    from stages.dataset.loader import batches
    for batch in batches("data/merged", tokens_per_batch=16384, packed=True):
        loss = model(**batch, use_cache=False).loss

Rows come in dataset order, or block-shuffled with a `seed`, through read-only memory
maps one record batch at a time (memory flat in the set's size). Labels are `input_ids`
where `loss_mask` is 1, and -100 elsewhere and at each row's first position. A batch
holds at most `tokens_per_batch` tokens, padded ([rows, longest row], with
`attention_mask`) or packed (whole rows back to back, with `position_ids` and varlen
boundaries, and no `attention_mask` on purpose). `batches(..., tensors=False)` gives
numpy arrays without torch; `budget()` is the token arithmetic of an epoch under the
same rule. Why each choice: docs/stages.md, merge, "Load it for training".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stages.common.errors import StageError
from stages.dataset import arrays
from stages.dataset.shards import list_shards, open_columns, open_shard

IGNORE = -100  # label value the loss skips


class Row(NamedTuple):
    input_ids: np.ndarray  # int32, a view into the record batch read
    loss_mask: np.ndarray  # int8
    source: str


def rows(folder: str | Path, seed: Optional[int] = None) -> Iterator[Row]:
    """Every row of the dataset folder, in dataset order (or shuffled: see chunks)."""
    for chunk in chunks(folder, seed):
        yield from chunk


def chunks(folder: str | Path, seed: Optional[int] = None) -> Iterator[list[Row]]:
    """The rows of each record batch of each shard, in dataset order.

    With a seed, a block shuffle: shards in a random order, the record batches of each
    shard in a random order, rows within each record batch shuffled (memory then grows
    up to one shard, released when the shard is done).
    """
    rng = None if seed is None else np.random.default_rng(seed)
    shards = list_shards(folder)
    for path in shards if rng is None else [shards[i] for i in rng.permutation(len(shards))]:
        with open_shard(path, ("source", "input_ids", "loss_mask")) as reader:
            record_batches = reader if rng is None else _shuffled(list(reader), rng)
            for batch in record_batches:
                ids_off, ids = _flat(batch.column("input_ids"), path, "input_ids")
                mask_off, mask = _flat(batch.column("loss_mask"), path, "loss_mask")
                if not np.array_equal(ids_off, mask_off):
                    raise StageError(f"{path}: input_ids and loss_mask lengths differ "
                                     "(run validate)")
                sources = batch.column("source").to_pylist()
                chunk = [Row(ids[lo:hi], mask[lo:hi], source)
                         for lo, hi, source in zip(ids_off[:-1], ids_off[1:], sources)]
                yield chunk if rng is None else _shuffled(chunk, rng)


def _shuffled(items: list, rng: np.random.Generator) -> list:
    return [items[i] for i in rng.permutation(len(items))]


def _flat(column: pa.Array, path: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Row offsets and the flattened values of a list column (zero-copy); StageError
    when a value in it is null, a token no model reads (validate names those rows)."""
    offsets, values = arrays.flat(column)
    if values.null_count:
        raise StageError(f"{path}: {name} holds a null (run validate)")
    return offsets, arrays.values(values)


# ----------------------------------------------------------------- batching rule


class Batcher:
    """Where batches close, over a stream of row lengths: the one batching rule, shared
    by the loader and the token budget.

    padded: a batch takes the next row while (rows + 1) x its longest row fits in
    `tokens_per_batch`; packed: while the tokens fit. A row that does not fit alone is a
    batch of its own. Counts what the batches hold (tokens) and occupy (slots: rows x
    longest row padded, `tokens_per_batch` per pack when packs are padded to a fixed size).
    """

    def __init__(self, tokens_per_batch: int, packed: bool):
        if tokens_per_batch < 1:
            raise StageError(f"tokens_per_batch must be >= 1, got {tokens_per_batch}")
        self.budget = tokens_per_batch
        self.packed = packed
        self.open = (0, 0, 0)  # the open batch: rows, longest row, tokens
        self.batches = self.tokens = self.slots = 0

    def add(self, lengths: np.ndarray) -> list[int]:
        """Row counts of the batches that `lengths` (the next rows) close, in order."""
        # One row at a time in plain Python: greedy batching is sequential, and a few
        # integer operations per row (no builtin calls) cost less than numpy calls per
        # batch, the more so the fewer rows a batch holds (validate's budget runs both).
        budget, packed = self.budget, self.packed
        rows, longest, tokens = self.open
        sizes, closed, slots = [], 0, 0
        for n in np.asarray(lengths, np.int64).tolist():
            wide = n if n > longest else longest
            if rows and (tokens + n if packed else (rows + 1) * wide) > budget:
                sizes.append(rows)
                closed += tokens
                slots += (tokens if tokens > budget else budget) if packed else rows * longest
                rows = tokens = 0
                wide = n
            rows += 1
            tokens += n
            longest = wide
        self.open = (rows, longest, tokens)
        self._count(sizes, closed, slots)
        return sizes

    def finish(self) -> list[int]:
        """Row counts of the batches left open at the end of the stream."""
        rows, longest, tokens = self.open
        self.open = (0, 0, 0)
        if not rows:
            return []
        self._count([rows], tokens, max(tokens, self.budget) if self.packed else rows * longest)
        return [rows]

    def _count(self, sizes: list[int], tokens: int, slots: int) -> None:
        self.batches += len(sizes)
        self.tokens += tokens
        self.slots += slots


# ----------------------------------------------------------------------- collate


def labels(input_ids: np.ndarray, loss_mask: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Next-token targets of rows laid end to end: the token where loss_mask is 1,
    IGNORE elsewhere and at each row's first position (`starts`)."""
    out = np.where(loss_mask == 1, input_ids, IGNORE).astype(np.int64)
    out[starts] = IGNORE
    return out


def _concat(batch: list[Row]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    lengths = np.array([len(r.input_ids) for r in batch], np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    ids = np.concatenate([r.input_ids for r in batch]).astype(np.int64)
    mask = np.concatenate([r.loss_mask for r in batch])
    starts = offsets[:-1][lengths > 0]
    return ids, labels(ids, mask, starts), lengths, offsets


def collate_padded(batch: list[Row], pad_id: int = 0) -> dict[str, np.ndarray]:
    """Rows right-padded to the longest: input_ids, attention_mask, labels [rows, longest]."""
    ids, targets, lengths, _ = _concat(batch)
    width = int(lengths.max()) if len(lengths) else 0
    real = np.arange(width) < lengths[:, None]  # row-major: fills row by row
    out = {
        "input_ids": np.full(real.shape, pad_id, np.int64),
        "attention_mask": real.astype(np.int64),
        "labels": np.full(real.shape, IGNORE, np.int64),
    }
    out["input_ids"][real] = ids
    out["labels"][real] = targets
    return out


def collate_packed(batch: list[Row]) -> dict[str, np.ndarray | int]:
    """Rows back to back in one sequence, positions restarting per row, varlen boundaries."""
    ids, targets, lengths, offsets = _concat(batch)
    positions = np.arange(len(ids)) - np.repeat(offsets[:-1], lengths)
    cu = offsets.astype(np.int32)
    longest = int(lengths.max()) if len(lengths) else 0
    return {
        "input_ids": ids[None],
        "labels": targets[None],
        "position_ids": positions[None],
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def to_torch(batch: dict) -> dict:
    """numpy arrays as torch tensors (sharing memory), ints as they are."""
    import torch

    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


def grouped(chunks: Iterable[list[Row]], tokens_per_batch: int,
            packed: bool) -> Iterator[list[Row]]:
    """The rows of `chunks` (lists of rows, in order) grouped by the Batcher's rule."""
    batcher = Batcher(tokens_per_batch, packed)
    held: list[Row] = []
    for chunk in chunks:
        held.extend(chunk)
        start = 0
        for size in batcher.add(np.array([len(r.input_ids) for r in chunk], np.int64)):
            yield held[start : start + size]
            start += size
        del held[:start]
    start = 0
    for size in batcher.finish():
        yield held[start : start + size]
        start += size


def batches(folder: str | Path, tokens_per_batch: int = 16384,
            packed: bool = False, pad_id: int = 0, tensors: bool = True,
            seed: Optional[int] = None) -> Iterator[dict]:
    """Training batches of the dataset folder (see the module docstring); `seed`: a new
    block shuffle per seed (see chunks), e.g. the epoch number."""
    for group in grouped(chunks(folder, seed), tokens_per_batch, packed):
        batch = collate_packed(group) if packed else collate_padded(group, pad_id)
        yield to_torch(batch) if tensors else batch


# -------------------------------------------------------------------- the budget


def budget(folder: str | Path, tokens_per_batch: int, batches_per_step: int = 1) -> dict:
    """Token arithmetic of one epoch over the dataset folder (see token_budget).

    Reads only the num_tokens, num_loss_tokens and source columns (their buffers alone):
    the stored counters, which validate proves equal to the lists.
    """
    def columns():
        for path in list_shards(folder):
            with open_columns(path, ("num_tokens", "num_loss_tokens", "source")) as stream:
                for batch in stream:
                    yield (arrays.values(pc.fill_null(batch.column("num_tokens"), 0)),
                           arrays.values(pc.fill_null(batch.column("num_loss_tokens"), 0)),
                           batch.column("source"))

    return token_budget(columns(), tokens_per_batch, batches_per_step)


def token_budget(chunks: Iterable[tuple[np.ndarray, np.ndarray, pa.Array | list[str]]],
                 tokens_per_batch: int, batches_per_step: int = 1) -> dict:
    """Batches, optimizer steps and padding of an epoch, padded and packed (TokenBudget).

    `chunks`: (row lengths, supervised tokens per row, source per row), in dataset order.
    """
    budget = TokenBudget(tokens_per_batch, batches_per_step)
    for lengths, supervised, sources in chunks:
        budget.add(lengths, supervised, sources)
    return budget.result()


class TokenBudget:
    """The token arithmetic of an epoch, fed rows in dataset order (`add`), so a pass
    that reads them anyway (validate's scan) needs no second one. An optimizer step takes
    `batches_per_step` batches (gradient accumulation x data-parallel ranks).
    padding_fraction: slots that hold no token, padded batches (rows x longest row) and
    packs filled to `tokens_per_batch` (0 with varlen attention, which needs no padding:
    then it is the unused share of the budget)."""

    def __init__(self, tokens_per_batch: int, batches_per_step: int = 1):
        if batches_per_step < 1:
            raise StageError(f"batches_per_step must be >= 1, got {batches_per_step}")
        self.tokens_per_batch, self.batches_per_step = tokens_per_batch, batches_per_step
        self.layouts = {"padded": Batcher(tokens_per_batch, False),
                        "packed": Batcher(tokens_per_batch, True)}
        self.per_source: dict[str, list[int]] = {}
        self.rows = self.longest = 0

    def add(self, lengths, supervised, sources: pa.Array | list[str]) -> None:
        """The next rows: their lengths, supervised tokens and sources."""
        lengths = np.asarray(lengths, np.int64)
        for batcher in self.layouts.values():
            batcher.add(lengths)
        self.rows += len(lengths)
        self.longest = max(self.longest, int(lengths.max(initial=0)))
        codes, names = _codes(sources)
        tokens = np.bincount(codes, weights=lengths, minlength=len(names))
        sup = np.bincount(codes, weights=np.asarray(supervised, np.int64), minlength=len(names))
        counts = np.bincount(codes, minlength=len(names))
        for k, name in enumerate(names):
            into = self.per_source.setdefault(name, [0, 0, 0])
            into[0] += int(counts[k])
            into[1] += int(tokens[k])
            into[2] += int(sup[k])

    def result(self) -> dict:
        per_source = self.per_source
        supervised_total = sum(v[2] for v in per_source.values())
        out = {"tokens_per_batch": self.tokens_per_batch,
               "batches_per_step": self.batches_per_step,
               "rows": self.rows, "longest_row": self.longest}
        steps = {}
        for name, batcher in self.layouts.items():
            batcher.finish()
            steps[name] = math.ceil(batcher.batches / self.batches_per_step)
            out[name] = {
                "batches": batcher.batches,
                "optimizer_steps": steps[name],
                "tokens": batcher.tokens,
                "padding_fraction": round(1 - batcher.tokens / batcher.slots, 4)
                if batcher.slots else 0.0,
                "supervised_tokens_per_step": round(supervised_total / steps[name], 1)
                if steps[name] else 0.0,
            }
        out["sources"] = {
            name: {
                "rows": v[0],
                "tokens": v[1],
                "supervised_tokens": v[2],
                "supervised_share": round(v[2] / supervised_total, 4) if supervised_total
                else 0.0,
                "supervised_tokens_per_step": {
                    layout: round(v[2] / n, 1) if n else 0.0 for layout, n in steps.items()},
            }
            for name, v in sorted(per_source.items())
        }
        return out


def _codes(sources: pa.Array | list) -> tuple[np.ndarray, list[str]]:
    """Per row, the index of its source's name in the names (a null is named "None")."""
    values = sources if isinstance(sources, pa.Array) else pa.array(sources)
    text = pc.fill_null(pc.cast(values, pa.large_string()), "None")
    encoded = pc.dictionary_encode(text)  # in Arrow's C++: no Python call per row
    return arrays.values(encoded.indices), encoded.dictionary.to_pylist()
