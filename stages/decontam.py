"""Decontamination: the word n-grams of evaluation items, hashed into an index built once
per run, and a batched check of prompts against it.

Words. Text is put in Unicode NFC and lower-cased; every character that is not a letter,
digit or combining mark (punctuation, symbols, whitespace, `_`) separates words, so case,
spacing and punctuation never hide a copy. Scripts written without spaces between words
(Han, Hiragana, Katakana, Thai, Lao, Khmer, Myanmar) give no word boundaries to find:
each of their letters is a word of its own, so an n-gram there is n characters.

An evaluation item is the text of its user turns. Its n-grams (n words in a row within
one text) go into the index; an item of fewer than n words goes, when `short_exact`,
into a list matched against whole messages instead. A prompt is checked on its system,
user and tool messages (earlier assistant answers kept as context are not questions); it
matches when one of its n-grams is in the index, or with `min_overlap` when at least that
fraction of its n-grams is shared with one evaluation item, and is attributed to the
item it shares most n-grams with.

Hashing is vectorised over a whole batch of texts (numpy, no Python loop per word): a
word's hash mixes the 8-byte little-endian words of its folded UTF-8 bytes; an n-gram's
is a polynomial of its words' hashes mod 2^64, from prefix sums. The index is those
hashes sorted with the item of each, and two bit filters that answer "surely absent"
for almost every n-gram of a clean prompt without touching the sorted array: ~18 bytes
per indexed n-gram, whatever the size of the mix.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import unicodedata
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from stages import params as P
from stages import sources
from stages.errors import StageError

log = logging.getLogger("prepare")

# Letters of scripts written without spaces: one word each.
_ALONE_RANGES = (
    (0x0E00, 0x0EFF),  # Thai, Lao
    (0x1000, 0x109F),  # Myanmar
    (0x1780, 0x17FF),  # Khmer
    (0x2E80, 0x2FDF),  # CJK radicals, Kangxi radicals
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x31F0, 0x31FF),  # Katakana phonetic extensions
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF66, 0xFF9F),  # halfwidth Katakana
    (0x20000, 0x3FFFF),  # CJK extensions B and later
)

# UTF-8 bytes -> what the hash sees: ASCII letters lower-cased, digits and bytes of other
# letters kept, every other ASCII byte 0 (a separator), the segment break \0 -> 1.
_BYTES = bytearray(range(256))
for _c in range(128):
    _BYTES[_c] = ord(chr(_c).lower()) if chr(_c).isalnum() else 0
_BYTES[0] = 1
_BYTES = bytes(_BYTES)
_patterns: Optional[tuple[re.Pattern, re.Pattern]] = None  # built for the first non-ASCII text

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_LEN = np.uint64(0x9E3779B97F4A7C15)  # words and n-grams of different lengths hash apart
_CHUNK = np.uint64(0xD6E8FEB86659FD93)
_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(8)] + [(1 << 64) - 1], np.uint64)
# Two filters before the sorted hashes: a small one (4 bits per n-gram, ~1 in 5 absent
# n-grams pass) that stays in the CPU caches beside the dedup set of a large mix, then a
# large one (32 bits, ~1 in 40 pass) read only for those.
_COARSE_BITS, _FINE_BITS = 4, 32


def _canonical(text: str) -> str:
    """Non-ASCII text as the byte pass expects it: NFC, lower case, every character that is
    not a letter, digit or mark a space, spaces around the letters of spaceless scripts."""
    global _patterns
    if _patterns is None:
        _patterns = _build_patterns()
    seps, alone = _patterns
    text = seps.sub(" ", unicodedata.normalize("NFC", text).lower())
    return alone.sub(r" \g<0> ", text)


def _build_patterns() -> tuple[re.Pattern, re.Pattern]:
    cat = unicodedata.category
    ranges: list[list[int]] = []
    for c in range(sys.maxunicode + 1):
        if cat(chr(c))[0] in "LNM":
            if ranges and ranges[-1][1] == c - 1:
                ranges[-1][1] = c
            else:
                ranges.append([c, c])

    def cls(rs) -> str:
        return "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in rs)

    return re.compile(f"[^{cls(ranges)}]+"), re.compile(f"[{cls(_ALONE_RANGES)}]")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, in place: polynomial hashes mod 2^64 are linear, this is not."""
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


class _Powers:
    """base**k and base**-k mod 2^64 for k < n, grown on demand (bounded by the largest batch)."""

    def __init__(self, base: int):
        self.base = base
        self.inverse = pow(base, -1, 1 << 64)
        self.pw = self.inv = np.ones(0, np.uint64)

    def upto(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if n > len(self.pw):
            size = max(n, 2 * len(self.pw), 1 << 12)
            self.pw = self._table(self.base, size)
            self.inv = self._table(self.inverse, size)
        return self.pw, self.inv

    @staticmethod
    def _table(base: int, size: int) -> np.ndarray:
        t = np.full(size, base, np.uint64)
        t[0] = 1
        return np.cumprod(t, out=t)


_WORD_POWERS = _Powers(0xC2B2AE3D27D4EB4F)  # odd: invertible mod 2^64


class _Words:
    """The words of a batch of texts (segments), hashed: `hashes[j]` is word j's hash,
    `segment[j]` the text it is in; `first[s]`, `count[s]` locate segment s's words.

    One pass of bytes.translate folds case and punctuation; a word is a run of non-zero
    bytes, hashed from the 8-byte little-endian words that cover it (most words fit in
    one), so no numpy pass runs per character beyond finding the runs."""

    def __init__(self, texts: Sequence[str]):
        joined = "\0".join(texts)
        if not joined.isascii():
            joined = "\0".join(t if t.isascii() else _canonical(t) for t in texts)
        raw = ("\0" + joined + "\0").encode("utf-8").translate(_BYTES)  # \0: where a text ends
        size = len(raw)
        raw += bytes(8 + (-size) % 8)  # whole 8-byte words, one more for reads at the end
        b = np.frombuffer(raw, np.uint8, size)
        breaks = np.flatnonzero(b == 1)
        if len(breaks) != len(texts) + 1:  # a text holding \0 itself: read it as a space
            self.__init__([t.replace("\0", " ") for t in texts])
            return
        self.raw = raw
        word = b > 1
        edges = np.flatnonzero(word[1:] != word[:-1]) + 1  # the text starts and ends with \0
        starts, ends = edges[0::2], edges[1::2]
        self.starts, self.ends = starts, ends
        lengths = (ends - starts).astype(np.uint64)
        aligned = np.frombuffer(raw, "<u8")
        h = _bytes_at(aligned, starts) & _MASKS[np.minimum(lengths, 8)]
        h ^= lengths * _LEN
        _mix(h)
        longer = np.flatnonzero(lengths > 8)
        k = 1
        while len(longer):  # the next 8 bytes of words longer than 8 k bytes
            rest = lengths[longer] - np.uint64(8 * k)
            part = _bytes_at(aligned, starts[longer] + 8 * k) & _MASKS[np.minimum(rest, 8)]
            h[longer] = _mix((h[longer] ^ part) + _CHUNK)
            longer = longer[rest > 8]
            k += 1
        self.hashes = h
        firsts = np.searchsorted(starts, breaks)  # the first word after each \0
        self.first = firsts[:-1]
        self.count = np.diff(firsts)
        self.segment = np.repeat(np.arange(len(texts)), self.count)
        w = len(starts)
        wpw, winv = _WORD_POWERS.upto(w + 1)
        self.prefix = np.zeros(w + 1, np.uint64)
        np.cumsum(h * wpw[:w], out=self.prefix[1:])
        self.winv = winv

    def spans(self, first: np.ndarray, length) -> np.ndarray:
        """Hashes of the word runs first[k] .. first[k] + length - 1."""
        h = (self.prefix[first + length] - self.prefix[first]) * self.winv[first]
        h += np.asarray(length, np.uint64) * _LEN  # (words hashes are mixed: a sum of them is too)
        return h

    def ngrams(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(first word of each n-gram within one segment, its hash)."""
        w = len(self.segment)
        if w < n:
            return np.zeros(0, np.int64), np.zeros(0, np.uint64)
        first = np.flatnonzero(self.segment[: w - n + 1] == self.segment[n - 1:])
        return first, self.spans(first, n)

    def phrase(self, first: int, n: int) -> str:
        spans = zip(self.starts[first: first + n].tolist(), self.ends[first: first + n].tolist())
        return " ".join(self.raw[s:e].decode("utf-8", "replace") for s, e in spans)


def _bytes_at(aligned: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The 8 bytes at each byte offset, as little-endian integers, from two aligned reads
    (numpy copies a whole unaligned view to read from it)."""
    q = offsets >> 3
    r = (offsets & 7).astype(np.uint64) << np.uint64(3)
    low = aligned[q] >> r
    high = (aligned[q + 1] << np.uint64(1)) << (np.uint64(63) - r)  # two shifts: r may be 0
    return low | high


def words(text: str) -> list[str]:
    """The words decontamination sees in `text` (for tests and messages)."""
    w = _Words([text])
    return [w.phrase(j, 1) for j in range(len(w.starts))]


# ------------------------------------------------------------------------ the index


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


_ARRAYS = ("hashes", "items", "coarse", "fine", "short_hashes", "short_items", "set_starts")


class Index:
    """Sorted n-gram hashes of every evaluation item with the item of each (global item
    numbers; `set_starts` maps them back to a set and an index within it), a bit array
    that filters out absent n-grams, and the hashes of short items matched exactly."""

    def __init__(self, policy: P.Decontaminate, names: list[str], arrays: dict):
        self.policy = policy
        self.n = policy.ngram
        self.names = names
        for key in _ARRAYS:
            setattr(self, key, arrays[key])

    @classmethod
    def from_pairs(cls, policy, names, set_starts, hashes, items, short_hashes, short_items) -> "Index":
        hashes, items = _sorted_unique(hashes, items)
        short_hashes, short_items = _sorted_unique(short_hashes, short_items)
        arrays = dict(hashes=hashes, items=items, coarse=_bitmap(hashes, _COARSE_BITS, high=True),
                      fine=_bitmap(hashes, _FINE_BITS, high=False), short_hashes=short_hashes,
                      short_items=short_items, set_starts=np.asarray(set_starts, np.int64))
        return cls(policy, names, arrays)

    def nbytes(self) -> int:
        return sum(getattr(self, k).nbytes for k in _ARRAYS)

    def save(self, folder: Path) -> None:
        for key in _ARRAYS:
            np.save(folder / f"{key}.npy", getattr(self, key))
        (folder / "index.json").write_text(json.dumps({"names": self.names, "policy": {
            "ngram": self.policy.ngram, "min_overlap": self.policy.min_overlap,
            "short_exact": self.policy.short_exact}}))

    @classmethod
    def load(cls, folder: Path) -> "Index":
        meta = json.loads((folder / "index.json").read_text())
        policy = P.Decontaminate(**meta["policy"])
        # memory-mapped: worker processes share one copy through the page cache
        arrays = {key: np.asarray(np.load(folder / f"{key}.npy", mmap_mode="r")) for key in _ARRAYS}
        return cls(policy, meta["names"], arrays)

    def where(self, item: int) -> tuple[str, int]:
        s = int(np.searchsorted(self.set_starts, item, side="right")) - 1
        return self.names[s], int(item - self.set_starts[s])

    # -- checking ------------------------------------------------------------------

    def check(self, texts: list[str], counts: Sequence[int]) -> list[Optional[tuple[int, str]]]:
        """Prompts given as their message texts in a row, counts[p] of them for prompt p:
        per prompt None, or (global eval item, shared n-gram)."""
        out: list[Optional[tuple[int, str]]] = [None] * len(counts)
        if not texts:
            return out
        w = _Words(texts)
        owner = np.repeat(np.arange(len(counts)), counts)
        first, h = w.ngrams(self.n)
        if len(h) and len(self.hashes):
            cand = np.flatnonzero(_bits_set(self.coarse, h, high=True))
            cand = cand[_bits_set(self.fine, h[cand], high=False)]
            if len(cand):
                self._confirm(w, first[cand], h[cand], owner, out)
        if len(self.short_hashes):
            self._exact(w, owner, out)
        return out

    def _confirm(self, w: _Words, first, h, owner, out) -> None:
        order = np.argsort(h)  # sorted keys: each binary search starts where the last ended
        first, h = first[order], h[order]
        lo = np.searchsorted(self.hashes, h)
        found = np.flatnonzero(self.hashes[np.minimum(lo, len(self.hashes) - 1)] == h)
        if not len(found):
            return
        found = found[np.argsort(first[found])]  # back in text order: examples show the first
        # one entry per (shared n-gram, eval item), at most 64 items per n-gram (boilerplate)
        lo, first = lo[found], first[found]
        reps = np.minimum(np.searchsorted(self.hashes, h[found], side="right") - lo, 64)
        pair_first = np.repeat(first, reps)
        offset = np.arange(len(pair_first)) - np.repeat(np.cumsum(reps) - reps, reps)
        items = self.items[np.repeat(lo, reps) + offset].astype(np.int64)
        prompts = owner[w.segment[pair_first]]
        pairs, at, shared = np.unique((prompts << 32) | items, return_index=True, return_counts=True)
        prompt, item = pairs >> 32, pairs & 0xFFFFFFFF
        # per prompt, the item sharing most n-grams (the lowest item of a tie)
        order = np.lexsort((item, -shared, prompt))
        best = order[np.concatenate(([True], prompt[order][1:] != prompt[order][:-1]))]
        need = self.policy.min_overlap
        if need is not None:
            per_text = np.maximum(w.count - self.n + 1, 0)
            total = np.bincount(owner, weights=per_text, minlength=len(out))
            best = best[shared[best] >= need * total[prompt[best]]]
        for b in best.tolist():
            out[int(prompt[b])] = (int(item[b]), w.phrase(int(pair_first[at[b]]), self.n))

    def _exact(self, w: _Words, owner, out) -> None:
        short = np.flatnonzero((w.count > 0) & (w.count < self.n))
        if not len(short):
            return
        h = w.spans(w.first[short], w.count[short])
        pos = np.searchsorted(self.short_hashes, h)
        pos = np.minimum(pos, len(self.short_hashes) - 1)
        for k in np.flatnonzero(self.short_hashes[pos] == h).tolist():
            s = int(short[k])
            p = int(owner[s])
            if out[p] is None:
                out[p] = (int(self.short_items[pos[k]]), w.phrase(int(w.first[s]), int(w.count[s])))


def _bitmap(hashes: np.ndarray, bits_per_entry: int, high: bool) -> np.ndarray:
    """A bit per slot, set for the slots of `hashes` (their top or bottom bits)."""
    slots = 1 << max(6, (max(len(hashes), 1) * bits_per_entry - 1).bit_length())
    bits = np.zeros(slots // 8, np.uint8)
    slot = _slots(hashes, slots, high)
    np.bitwise_or.at(bits, slot >> np.uint64(3), np.left_shift(1, slot & np.uint64(7)).astype(np.uint8))
    return bits


def _slots(h: np.ndarray, slots: int, high: bool) -> np.ndarray:
    if high:
        return h >> np.uint64(65 - slots.bit_length())
    return h & np.uint64(slots - 1)


def _bits_set(bits: np.ndarray, h: np.ndarray, high: bool) -> np.ndarray:
    slot = _slots(h, len(bits) * 8, high)
    return ((bits[slot >> np.uint64(3)] >> (slot & np.uint64(7)).astype(np.uint8)) & 1).view(bool)


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
    if len(hashes) > 1:
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


def build(policy: P.Decontaminate, on_bad_row: str,
          max_record_bytes: int = P.Prepare.max_record_bytes) -> tuple[Index, dict]:
    """Read every evaluation set and index it; also return the report's per-set figures."""
    started = time.monotonic()
    names = [e.name for e in policy.evals]
    hashes: list = []
    items: list = []
    short_hashes: list = []
    short_items: list = []
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
                _index_batch(policy, batch, batch_items, hashes, items, short_hashes, short_items, st)
                batch, batch_items = [], []
        _index_batch(policy, batch, batch_items, hashes, items, short_hashes, short_items, st)
        st["items"] = total - set_starts[-1]
        if st["indexed"] + st["short"] == 0:
            why = ", ".join(f"{k}: {v}" for k, v in st["skipped"].items()) or "no rows"
            raise StageError(f"prepare.decontaminate: eval set {ev.name}: no item to index ({why})")
    index = Index.from_pairs(policy, names, set_starts, hashes, items, short_hashes, short_items)
    log.info(
        "decontaminate: indexed %d items of %d eval sets (%d n-grams, %d short items, %.1f MB) in %.1fs",
        total, len(names), len(index.hashes), len(index.short_hashes), index.nbytes() / 2**20,
        time.monotonic() - started,
    )
    return index, stats


def _index_batch(policy, texts, item_ids, hashes, items, short_hashes, short_items, st) -> None:
    if not texts:
        return
    w = _Words(texts)
    n = policy.ngram
    first, h = w.ngrams(n)
    ids = np.asarray(item_ids, np.uint32)
    hashes.append(h)
    items.append(ids[w.segment[first]])
    long_enough = w.count >= n
    st["indexed"] += int(long_enough.sum())
    short = np.flatnonzero(~long_enough & (w.count > 0))
    st["skipped"]["no_words"] = st["skipped"].get("no_words", 0) + int((w.count == 0).sum())
    if not st["skipped"]["no_words"]:
        del st["skipped"]["no_words"]
    if policy.short_exact:
        st["short"] += len(short)
        short_hashes.append(w.spans(w.first[short], w.count[short]))
        short_items.append(ids[short])
    elif len(short):
        st["skipped"]["short"] = st["skipped"].get("short", 0) + len(short)


def _eval_texts(ev: P.EvalSet, on_bad_row: str, max_record_bytes: int, st: dict):
    """The text of each row of an evaluation set (its user turns), or None for a row
    without one (counted in st['skipped'] by reason)."""
    src = ev.as_source()
    layout = sources.Layout(src, "context")
    field = layout.columns()[0]

    def check(names: list[str], where: str) -> None:
        if field not in names:
            shown = ", ".join(sorted(names)[:40]) or "none"
            raise StageError(f"eval set {ev.name}: field {field!r}: not in {where} (fields: {shown})")

    reader = sources.Reader(src, layout.columns(), check, max_record_bytes)
    skipped = st["skipped"]
    for pos, item in reader:
        if type(item) is bytes:
            item = sources.parse_line(item)
            if item is None:
                continue  # a blank line is not a row
        if type(item) is sources.BadRow:
            if on_bad_row != "skip":
                raise StageError(f"eval set {ev.name}: {reader.where(pos)}: {item.message}")
            skipped[item.reason] = skipped.get(item.reason, 0) + 1
            yield None
            continue
        if type(item) is not dict:
            skipped["not_an_object"] = skipped.get("not_an_object", 0) + 1
            yield None
            continue
        res = layout.convert(item)
        if type(res) is str:
            skipped[res] = skipped.get(res, 0) + 1
            yield None
            continue
        yield "\n".join(m["content"] for m in res[0] if m["role"] == "user")
