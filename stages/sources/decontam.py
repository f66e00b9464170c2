"""Decontamination: the word n-grams of evaluation sets in an index built once per run,
and a batched check of prompts against it.

  built = decontam.build(policy, on_bad_row)   # Indexed: the index, figures per eval set
  hits = built.index.check(texts, counts)      # per prompt: None, or Hit(item, ngram)
  built.index.where(hit.item)                  # (eval set, item number within it)

An evaluation item is the text of its user turns; a prompt is checked on all its texts
but earlier assistant answers. Words and the hashes of their runs come from
stages/sources/ngrams.py; what matches, and how prepare counts it: docs/stages.md
("Decontamination"). Worker processes open a saved index by its key (`register`,
`opened`, `forget`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import numpy as np

from stages.common import params
from stages.common.errors import StageError
from stages.common.reading import json_file, writable
from stages.sources import layouts, readers
from stages.sources.ngrams import Words, remix

log = logging.getLogger(__name__)

# Two filters of the probed runs before the sorted n-gram hashes: a small one (4 bits per
# run, ~1 in 5 absent runs pass) that stays in the CPU caches beside the dedup set of a
# large mix, then a large one (32 bits per run, two set by each: ~1 in 270 pass) read only
# for those, so that the sorted array is searched about once per batch of prompts.
_COARSE_BITS, _FINE_BITS = 4, 32


def _step(n: int) -> int:
    """Words between probes of a prompt (k): the filters hold runs of n - k + 1 words."""
    return max(1, n // 2)


# ------------------------------------------------------------------------ the index


class Hit(NamedTuple):
    """What the check found for a prompt: the evaluation item (a number across all sets;
    Index.where names it) and the n-gram they share (the item's text when it is short)."""

    item: int
    ngram: str


class Match:
    """A contaminated prompt: its id, the evaluation set and item, the shared n-gram."""

    __slots__ = ("prompt_id", "eval_set", "eval_item", "ngram")

    def __init__(self, prompt_id: str, eval_set: str, eval_item: int, ngram: str):
        self.prompt_id, self.eval_set, self.eval_item, self.ngram = prompt_id, eval_set, eval_item, ngram

    def __reduce__(self):
        return (Match, (self.prompt_id, self.eval_set, self.eval_item, self.ngram))

    def example(self, source: str) -> dict:
        return {"prompt_id": self.prompt_id, "source": source, "eval_set": self.eval_set,
                "eval_item": self.eval_item, "ngram": self.ngram}


BLOCK = 32  # sorted n-gram hashes per block of the lookup (Index._lower_bound)
_ARRAYS = ("hashes", "items", "coarse", "fine", "short_hashes", "short_items", "set_starts")


class Index:
    """Sorted n-gram hashes of every evaluation item with the item of each (global item
    numbers; `set_starts` maps them back to a set and an index within it), two bit arrays
    that filter out absent probes (runs of m = n - k + 1 words of items long enough to
    have n-grams), and the hashes of short items matched exactly.

    Two filters, ~18 bytes per indexed n-gram, answer "surely absent" for almost every
    probe of a clean prompt without touching the sorted array. A prompt is probed only at
    every k-th word (k = n // 2): an n-gram it shares with an item starts at most k - 1
    words before a probed position whose m-word run lies inside that n-gram, so that run
    is in the filters, and the n-grams around every probe that passes them are looked up:
    the check is exact, at a fraction of the lookups."""

    def __init__(self, policy: params.Decontaminate, names: list[str], arrays: dict):
        self.policy = policy
        self.n = policy.ngram
        self.step = _step(self.n)
        self.names = names
        for key in _ARRAYS:
            setattr(self, key, arrays[key])
        self.fences = self.hashes[::BLOCK].copy()  # the first hash of each block

    @classmethod
    def from_parts(cls, policy, names, set_starts, parts: "_Parts") -> "Index":
        probes = np.concatenate(parts.probes) if parts.probes else np.zeros(0, np.uint64)
        parts.probes.clear()
        coarse, fine = _bitmap(probes, _COARSE_BITS, _coarse_slots), _bitmap(probes, _FINE_BITS, _fine_slots)
        del probes
        hashes, items = _sorted_unique(parts.hashes, parts.items)
        short_hashes, short_items = _sorted_unique(parts.short_hashes, parts.short_items)
        arrays = dict(hashes=hashes, items=items, coarse=coarse, fine=fine, short_hashes=short_hashes,
                      short_items=short_items, set_starts=np.asarray(set_starts, np.int64))
        return cls(policy, names, arrays)

    def nbytes(self) -> int:
        return sum(getattr(self, k).nbytes for k in _ARRAYS) + self.fences.nbytes

    def save(self, folder: Path) -> None:
        for key in _ARRAYS:
            np.save(folder / f"{key}.npy", getattr(self, key))
        (folder / "index.json").write_text(json.dumps({"names": self.names, "policy": {
            "ngram": self.policy.ngram, "min_overlap": self.policy.min_overlap,
            "short_exact": self.policy.short_exact}}))

    @classmethod
    def load(cls, folder: Path) -> "Index":
        meta = json_file(folder / "index.json")
        policy = params.Decontaminate(**meta["policy"])
        # memory-mapped: worker processes share one copy through the page cache
        arrays = {key: np.asarray(np.load(folder / f"{key}.npy", mmap_mode="r")) for key in _ARRAYS}
        return cls(policy, meta["names"], arrays)

    def where(self, item: int) -> tuple[str, int]:
        s = int(np.searchsorted(self.set_starts, item, side="right")) - 1
        return self.names[s], int(item - self.set_starts[s])

    # -- checking ------------------------------------------------------------------

    def check(self, texts: list[str], counts: Sequence[int]) -> list[Optional[Hit]]:
        """Prompts given as their message texts in a row, counts[p] of them for prompt p:
        per prompt None, or its Hit."""
        if not texts:
            return [None] * len(counts)
        return self._check(Words.of(texts), counts)

    def check_packed(self, data: bytes, counts: Sequence[int]) -> list[Optional[Hit]]:
        """`check` of the texts `pack` put in `data` (raises Unpacked when a text held \\0)."""
        n = int(sum(counts))
        if not n:
            return [None] * len(counts)
        return self._check(Words.unpack(data, n), counts)

    def _check(self, w: Words, counts: Sequence[int]) -> list[Optional[Hit]]:
        out: list[Optional[Hit]] = [None] * len(counts)
        if len(self.hashes):
            k = self.step
            probe = w.every(self.n - k + 1, k)
            cand = np.flatnonzero(_bits_set(self.coarse, probe, _coarse_slots))
            if len(cand):
                cand = cand[_bits_set(self.fine, probe[cand], _fine_slots)]
            if len(cand):  # the n-grams holding a probe that passed: k of them end to end per probe
                first = (cand[:, None] * k - np.arange(k - 1, -1, -1)).ravel()
                first = first[(first >= 0) & (first <= w.words - self.n)]
                self._confirm(w, first, counts, out)
        if len(self.short_hashes):
            self._exact(w, counts, out)
        return out

    def _confirm(self, w: Words, first, counts, out) -> None:
        """The n-grams starting at words first[k] (in text order), looked up."""
        h = w.runs(first, self.n)
        lo = self._lower_bound(h)
        found = np.flatnonzero(self.hashes.take(lo, mode="clip") == h)
        if not len(found):
            return
        # one entry per (shared n-gram, eval item), at most 64 items per n-gram (boilerplate)
        lo, first, h = lo[found], first[found], h[found]
        pair_first, rows = first, lo
        if (self.hashes.take(lo + 1, mode="clip") == h).any():  # an n-gram of several items
            reps = np.minimum(np.searchsorted(self.hashes, h, side="right") - lo, 64)
            pair_first = np.repeat(first, reps)
            offset = np.arange(len(pair_first)) - np.repeat(np.cumsum(reps) - reps, reps)
            rows = np.repeat(lo, reps) + offset
        items = self.items.take(rows).astype(np.int64)
        prompts = _owner(counts)[w.text_of(pair_first)]
        pairs, at, shared = np.unique((prompts << 32) | items, return_index=True, return_counts=True)
        prompt, item = pairs >> 32, pairs & 0xFFFFFFFF
        # per prompt, the item sharing most n-grams (the lowest item of a tie)
        order = np.lexsort((item, -shared, prompt))
        best = order[np.concatenate(([True], prompt[order][1:] != prompt[order][:-1]))]
        need = self.policy.min_overlap
        if need is not None:
            per_text = np.maximum(w.count - self.n + 1, 0)
            total = np.bincount(_owner(counts), weights=per_text, minlength=len(out))
            best = best[shared[best] >= need * total[prompt[best]]]
        for b in best.tolist():
            out[int(prompt[b])] = Hit(int(item[b]), w.phrase(int(pair_first[at[b]]), self.n))

    def _lower_bound(self, h: np.ndarray) -> np.ndarray:
        """np.searchsorted(self.hashes, h): the fences (a few hundred KB that stay in the
        CPU caches) give the block, then one block is read per key, not ~20 scattered
        entries of an array evicted between batches."""
        block = np.searchsorted(self.fences, h)  # blocks whose first hash is below h ...
        block -= 1  # ... the last of which holds the answer, or ends just before it
        np.maximum(block, 0, out=block)
        block *= BLOCK
        window = self.hashes.take(block[:, None] + np.arange(BLOCK), mode="clip")
        block += (window < h[:, None]).sum(axis=1)
        return np.minimum(block, len(self.hashes), out=block)

    def _exact(self, w: Words, counts, out) -> None:
        short = np.flatnonzero((w.count > 0) & (w.count < self.n))
        if not len(short):
            return
        first = w.breaks[short] + 1
        h = w.runs(first, w.count[short])
        pos = np.searchsorted(self.short_hashes, h)
        found = np.flatnonzero(self.short_hashes.take(pos, mode="clip") == h)
        if not len(found):
            return
        owner = _owner(counts)
        for k in found.tolist():
            s = int(short[k])
            p = int(owner[s])
            if out[p] is None:
                out[p] = Hit(int(self.short_items[pos[k]]), w.phrase(int(first[k]), int(w.count[s])))


def _owner(counts: Sequence[int]) -> np.ndarray:
    """The prompt of each text, for prompts of counts[p] texts."""
    return np.repeat(np.arange(len(counts)), counts)


def _coarse_slots(h: np.ndarray, nbits: int):
    """The bit of each hash in a bit array of `nbits`: its top bits."""
    yield (h >> np.uint64(65 - nbits.bit_length())).view(np.int64)


def _fine_slots(h: np.ndarray, nbits: int):
    """Two bits per hash, the top and bottom bits of a remix of it (the coarse filter has
    read its top bits)."""
    g = remix(h)
    yield (g >> np.uint64(65 - nbits.bit_length())).view(np.int64)
    g &= np.uint64(nbits - 1)
    yield g.view(np.int64)


_BITMAP_CHUNK = 1 << 23  # bits of a bitmap built at once, one byte each while built


def _bitmap(hashes: np.ndarray, bits_per_entry: int, slots_of) -> np.ndarray:
    """A bit array with the bits `slots_of` gives each of `hashes` set."""
    nbits = 1 << max(6, (max(len(hashes), 1) * bits_per_entry - 1).bit_length())
    bits = np.zeros(nbits // 8, np.uint8)
    size = min(_BITMAP_CHUNK, nbits)
    chunk = np.empty(size, bool)  # one buffer for every chunk: clearing it beats fresh pages
    starts = list(range(0, nbits, size))
    for slot in slots_of(hashes, nbits):
        bounds = [0, len(slot)]
        if len(starts) > 1:
            slot.sort()  # then one chunk of the bit array at a time
            bounds = np.searchsorted(slot, starts + [nbits]).tolist()
        for i, lo in enumerate(starts):
            chunk.fill(False)
            part = slot[bounds[i]: bounds[i + 1]]
            chunk[part - lo if lo else part] = True
            bits[lo // 8: lo // 8 + size // 8] |= np.packbits(chunk, bitorder="little")
        del slot
    return bits


def _bits_set(bits: np.ndarray, h: np.ndarray, slots_of) -> np.ndarray:
    """Where every bit of h is set."""
    found = None
    for slot in slots_of(h, len(bits) * 8):
        at = ((bits.take(slot >> 3) >> (slot & 7).astype(np.uint8)) & np.uint8(1)).view(bool)
        found = at if found is None else found & at
    return found


def _sorted_unique(parts: list, item_parts: list) -> tuple[np.ndarray, np.ndarray]:
    """The (hash, item) pairs of the batches in `parts`, sorted, each once; the lists are
    emptied as they are read so the peak stays near twice the index."""
    hashes = np.concatenate(parts) if parts else np.zeros(0, np.uint64)
    items = np.concatenate(item_parts) if item_parts else np.zeros(0, np.uint32)
    parts.clear()
    item_parts.clear()
    order = np.argsort(hashes)
    hashes = hashes[order]
    items = items[order]
    del order
    tie = np.flatnonzero(hashes[1:] == hashes[:-1])
    if len(tie):  # an n-gram of several items (or twice in one): those rows by item, then unique
        rows = np.union1d(tie, tie + 1)
        by_item = np.lexsort((items[rows], hashes[rows]))
        hashes[rows], items[rows] = hashes[rows][by_item], items[rows][by_item]
        keep = np.concatenate(([True], (hashes[1:] != hashes[:-1]) | (items[1:] != items[:-1])))
        hashes, items = hashes[keep], items[keep]
    return hashes, items


_OPEN: dict[str, Index] = {}  # indexes of this process, by key


def register(key: str, index: Index) -> None:
    _OPEN[key] = index


def opened(key: str) -> Index:
    """The index registered under `key`, or (in a worker process) loaded from that folder."""
    index = _OPEN.get(key)
    if index is None:
        index = _OPEN[key] = Index.load(Path(key))
    return index


def forget(key: str) -> None:
    _OPEN.pop(key, None)


# ------------------------------------------------------------- building the index

_BUILD_BATCH = 2048  # evaluation items hashed at once


class _Parts:
    """What the batches of evaluation items give, before it is sorted into an index."""

    def __init__(self):
        self.hashes: list = []  # n-gram hashes
        self.items: list = []  # ... and the item of each
        self.probes: list = []  # hashes of the runs the filters hold
        self.short_hashes: list = []
        self.short_items: list = []


class Indexed(NamedTuple):
    """The evaluation sets indexed, and the report's figures for each set (by name)."""

    index: Index
    stats: dict[str, dict]


def build(policy: params.Decontaminate, on_bad_row: str,
          max_record_bytes: int = params.Prepare.max_record_bytes) -> Indexed:
    """Read every evaluation set and index it."""
    started = time.monotonic()
    names = [e.name for e in policy.evals]
    parts = _Parts()
    set_starts = []
    stats: dict[str, dict] = {}
    total = 0
    for ev in policy.evals:
        set_starts.append(total)
        st = stats[ev.name] = {"path": ev.path, "items": 0, "indexed": 0, "short": 0,
                               "skipped": {}}
        batch: list[str] = []
        batch_items: list[int] = []
        for text in _eval_texts(ev, on_bad_row, max_record_bytes, st):
            if text is not None:
                batch.append(text)
                batch_items.append(total)
            total += 1
            if len(batch) >= _BUILD_BATCH:
                _index_batch(policy, batch, batch_items, parts, st)
                batch, batch_items = [], []
        _index_batch(policy, batch, batch_items, parts, st)
        st["items"] = total - set_starts[-1]
        if st["indexed"] + st["short"] == 0:
            why = ", ".join(f"{k}: {v}" for k, v in st["skipped"].items()) or "no rows"
            raise StageError(f"prepare.decontaminate: eval set {ev.name}: no item to index ({why})")
    index = Index.from_parts(policy, names, set_starts, parts)
    log.info(
        "decontaminate: indexed %d items of %d eval sets (%d n-grams, %d short items, %.1f MB) in %.1fs",
        total, len(names), len(index.hashes), len(index.short_hashes), index.nbytes() / 2**20,
        time.monotonic() - started,
    )
    return Indexed(index, stats)


def _index_batch(policy, texts, item_ids, parts: _Parts, st) -> None:
    if not texts:
        return
    w = Words.of(texts)
    n = policy.ngram
    ids = np.asarray(item_ids, np.uint32)
    long_enough = np.flatnonzero(w.count >= n)
    first, text = w.windows(long_enough, n)
    parts.hashes.append(w.runs(first, n))
    parts.items.append(ids[text])
    m = n - _step(n) + 1
    parts.probes.append(w.runs(w.windows(long_enough, m)[0], m))
    st["indexed"] += len(long_enough)
    short = np.flatnonzero((w.count < n) & (w.count > 0))
    st["skipped"]["no_words"] = st["skipped"].get("no_words", 0) + int((w.count == 0).sum())
    if not st["skipped"]["no_words"]:
        del st["skipped"]["no_words"]
    if policy.short_exact:
        st["short"] += len(short)
        parts.short_hashes.append(w.runs(w.breaks[short] + 1, w.count[short]))
        parts.short_items.append(ids[short])
    elif len(short):
        st["skipped"]["short"] = st["skipped"].get("short", 0) + len(short)


def _eval_texts(ev: params.EvalSet, on_bad_row: str, max_record_bytes: int, st: dict):
    """The text of each row of an evaluation set (its user turns), or None for a row
    without one (counted in st['skipped'] by reason)."""
    src = ev.as_source()
    layout = layouts.Layout(src, "context")
    field = layout.columns()[0]

    def check(names: list[str], where: str) -> None:
        if field not in names:
            shown = ", ".join(sorted(names)[:40]) or "none"
            raise StageError(f"eval set {ev.name}: field {field!r}: not in {where} (fields: {shown})")

    reader = readers.Reader(src, layout.columns(), check, max_record_bytes)
    skipped = st["skipped"]
    for pos, item in reader:
        if type(item) is bytes:
            item = readers.parse_line(item)
            if item is None:
                continue  # a blank line is not a row
        if type(item) is dict:
            item = layout.convert(item)
        elif type(item) is not readers.BadRow:
            item = layouts.Dropped("not_an_object")
        if type(item) is readers.BadRow:  # malformed, or a tool call no template can write
            if on_bad_row != "skip":
                raise StageError(f"eval set {ev.name}: {reader.where(pos)}: {item.message}")
            skipped[item.reason] = skipped.get(item.reason, 0) + 1
            yield None
            continue
        if type(item) is layouts.Dropped:
            skipped[item.reason] = skipped.get(item.reason, 0) + 1
            yield None
            continue
        text = "\n".join(m["content"] for m in item.messages if m["role"] == "user")
        if not writable(text):  # a lone surrogate (JSON "\ud800"): no UTF-8 to hash
            if on_bad_row != "skip":
                raise StageError(f"eval set {ev.name}: {reader.where(pos)}: text that is not "
                                 "valid Unicode (a lone surrogate); set prepare.on_bad_row: "
                                 "skip to count and skip such rows")
            skipped["invalid_text"] = skipped.get("invalid_text", 0) + 1
            yield None
            continue
        yield text
