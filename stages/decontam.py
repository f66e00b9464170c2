"""Decontamination: the word n-grams of evaluation items, hashed into an index built once
per run, and a batched check of prompts against it.

Words. Text is put in Unicode NFC and lower-cased; every character that is not a letter,
digit or combining mark (punctuation, symbols, whitespace, `_`) separates words, so case,
spacing and punctuation never hide a copy. Scripts written without spaces between words
(Han, Hiragana, Katakana, Thai, Lao, Khmer, Myanmar) give no word boundaries to find:
each of their letters is a word of its own, so an n-gram there is n characters.

An evaluation item is the text of its user turns. Its n-grams (n words in a row within
one message) go into the index; an item of fewer than n words goes, when `short_exact`,
into a list matched against whole messages instead. A prompt matches when one of its
n-grams (from any message) is in the index, or with `min_overlap` when at least that
fraction of its n-grams is shared with one evaluation item; it is attributed to the
item it shares most n-grams with.

Hashing is vectorised over a whole batch of texts (numpy, no Python loop per word):
each word gets a 64-bit polynomial hash of its code points, mixed; each n-gram a
polynomial hash of its words' hashes, mixed again. The index is those hashes sorted, the
item of each, and a bit array of 32 bits per n-gram that answers "surely absent" for
almost every n-gram of a clean prompt without touching the sorted array. Its memory is
~16 bytes per indexed n-gram, whatever the size of the mix.
"""

from __future__ import annotations

import json
import logging
import time
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from stages import params as P
from stages import sources
from stages.errors import StageError

log = logging.getLogger("prepare")

# character classes
_SEP, _WORD, _ALONE, _BREAK = 0, 1, 2, 3
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
_UNI_LIMIT = 0x40000  # code points above (planes 4-16: tags, private use) separate words

_ASCII_CLASS = np.zeros(256, np.uint8)
for _c in range(128):
    if chr(_c).isalnum():
        _ASCII_CLASS[_c] = _WORD
_ASCII_CLASS[0] = _BREAK
_ASCII_LOWER = np.arange(256, dtype=np.uint8)
_ASCII_LOWER[ord("A"): ord("Z") + 1] += 32
_unicode_class: Optional[np.ndarray] = None  # built on the first non-ASCII text

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_LEN = np.uint64(0x9E3779B97F4A7C15)  # n-grams of different lengths hash apart
_BITS_PER_ENTRY = 32


def _classes() -> np.ndarray:
    global _unicode_class
    if _unicode_class is None:
        table = np.zeros(_UNI_LIMIT, np.uint8)
        cat = unicodedata.category
        for c in range(_UNI_LIMIT):
            if cat(chr(c))[0] in "LNM":
                table[c] = _WORD
        for lo, hi in _ALONE_RANGES:
            part = table[lo: hi + 1]
            part[part == _WORD] = _ALONE
        table[0] = _BREAK
        table[ord("_")] = _SEP
        _unicode_class = table
    return _unicode_class


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


_CHAR_POWERS = _Powers(0x100000001B3 * 2 + 1)  # odd: invertible mod 2^64
_WORD_POWERS = _Powers(0xC2B2AE3D27D4EB4F)


class _Words:
    """The words of a batch of texts (segments), hashed: `hashes[j]` is word j's hash,
    `segment[j]` the text it is in; `first[s]`, `count[s]` locate segment s's words."""

    def __init__(self, texts: Sequence[str]):
        joined = "\x00".join(t.replace("\x00", " ") if "\x00" in t else t for t in texts)
        if joined.isascii():
            raw = np.frombuffer(joined.encode(), np.uint8)
            cls = _ASCII_CLASS[raw]
            code = _ASCII_LOWER[raw]
            starts, ends = _runs(cls == _WORD)
        else:
            joined = unicodedata.normalize("NFC", joined).lower()
            code = np.frombuffer(joined.encode("utf-32-le"), np.uint32)
            cls = _classes()[np.minimum(code, _UNI_LIMIT - 1)]
            cls[code >= _UNI_LIMIT] = _SEP
            starts, ends = _runs_alone(cls)
        self.text = joined
        self.starts, self.ends = starts, ends
        n = len(code)
        pw, inv = _CHAR_POWERS.upto(n + 1)
        prefix = np.zeros(n + 1, np.uint64)
        np.cumsum(code * pw[:n], out=prefix[1:])
        self.hashes = _mix((prefix[ends] - prefix[starts]) * inv[starts])
        breaks = np.flatnonzero(cls == _BREAK)
        self.segment = np.searchsorted(breaks, starts)
        self.count = np.bincount(self.segment, minlength=len(texts))
        self.first = np.zeros(len(texts), np.int64)
        np.cumsum(self.count[:-1], out=self.first[1:])
        w = len(starts)
        wpw, winv = _WORD_POWERS.upto(w + 1)
        self.prefix = np.zeros(w + 1, np.uint64)
        np.cumsum(self.hashes * wpw[:w], out=self.prefix[1:])
        self.winv = winv

    def spans(self, first: np.ndarray, length) -> np.ndarray:
        """Hashes of the word runs first[k] .. first[k] + length - 1."""
        h = (self.prefix[first + length] - self.prefix[first]) * self.winv[first]
        h += np.asarray(length, np.uint64) * _LEN
        return _mix(h)

    def ngrams(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(first word of each n-gram within one segment, its hash)."""
        w = len(self.segment)
        if w < n:
            return np.zeros(0, np.int64), np.zeros(0, np.uint64)
        first = np.flatnonzero(self.segment[: w - n + 1] == self.segment[n - 1:])
        return first, self.spans(first, n)

    def phrase(self, first: int, n: int) -> str:
        return " ".join(self.text[s:e] for s, e in zip(self.starts[first: first + n], self.ends[first: first + n])).lower()


def _runs(word: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    edges = np.diff(np.concatenate(([0], word.view(np.int8), [0])))
    return np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)


def _runs_alone(cls: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Word runs where every _ALONE character is a run of its own."""
    inword = (cls == _WORD) | (cls == _ALONE)
    alone = cls == _ALONE
    before = np.concatenate(([False], inword[:-1]))
    after = np.concatenate((inword[1:], [False]))
    alone_before = np.concatenate(([False], alone[:-1]))
    alone_after = np.concatenate((alone[1:], [False]))
    starts = np.flatnonzero(inword & (~before | alone | alone_before))
    ends = np.flatnonzero(inword & (~after | alone | alone_after)) + 1
    return starts, ends


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


_ARRAYS = ("hashes", "items", "bits", "short_hashes", "short_items", "set_starts")


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
        self.shift = np.uint64(64 - int(len(self.bits) * 8).bit_length() + 1)

    @classmethod
    def from_pairs(cls, policy, names, set_starts, hashes, items, short_hashes, short_items) -> "Index":
        hashes, items = _sorted_unique(hashes, items)
        short_hashes, short_items = _sorted_unique(short_hashes, short_items)
        slots = 1 << max(6, (max(len(hashes), 1) * _BITS_PER_ENTRY - 1).bit_length())
        bits = np.zeros(slots // 8, np.uint8)
        slot = hashes >> np.uint64(64 - slots.bit_length() + 1)
        np.bitwise_or.at(bits, slot >> np.uint64(3), np.left_shift(1, slot & np.uint64(7)).astype(np.uint8))
        arrays = dict(hashes=hashes, items=items, bits=bits, short_hashes=short_hashes,
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
        arrays = {key: np.load(folder / f"{key}.npy", mmap_mode="r") for key in _ARRAYS}
        return cls(policy, meta["names"], arrays)

    def where(self, item: int) -> tuple[str, int]:
        s = int(np.searchsorted(self.set_starts, item, side="right")) - 1
        return self.names[s], int(item - self.set_starts[s])

    # -- checking ------------------------------------------------------------------

    def check(self, prompts: Sequence[Sequence[str]]) -> list[Optional[tuple[int, str]]]:
        """Per prompt (its message texts): None, or (global eval item, shared n-gram)."""
        texts: list[str] = []
        owner: list[int] = []
        for p, messages in enumerate(prompts):
            texts.extend(messages)
            owner.extend([p] * len(messages))
        out: list[Optional[tuple[int, str]]] = [None] * len(prompts)
        if not texts:
            return out
        w = _Words(texts)
        owner_arr = np.asarray(owner, np.int64)
        n = self.n
        first, h = w.ngrams(n)
        if len(h) and len(self.hashes):
            slot = h >> self.shift
            maybe = (self.bits[slot >> np.uint64(3)] >> (slot & np.uint64(7)).astype(np.uint8)) & 1
            cand = np.flatnonzero(maybe)
            if len(cand):
                self._confirm(w, first[cand], h[cand], owner_arr, out)
        if len(self.short_hashes):
            self._exact(w, owner_arr, out)
        return out

    def _confirm(self, w: _Words, first, h, owner, out) -> None:
        lo = np.searchsorted(self.hashes, h, side="left")
        hi = np.searchsorted(self.hashes, h, side="right")
        found = np.flatnonzero(hi > lo)
        if not len(found):
            return
        shared: dict[int, Counter] = {}
        where: dict[tuple[int, int], int] = {}  # (prompt, item) -> first word of a shared n-gram
        for k in found.tolist():
            start = int(first[k])
            p = int(owner[w.segment[start]])
            counts = shared.setdefault(p, Counter())
            for item in self.items[lo[k]: min(hi[k], lo[k] + 64)].tolist():  # cap: boilerplate n-grams
                counts[item] += 1
                where.setdefault((p, item), start)
        n, need = self.n, self.policy.min_overlap
        for p, counts in shared.items():
            item, count = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
            if need is not None:
                segs = np.flatnonzero(owner == p)
                total = int(np.maximum(w.count[segs] - n + 1, 0).sum())
                if count < need * total:
                    continue
            out[p] = (item, w.phrase(where[(p, item)], n))

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


def _sorted_unique(hashes, items) -> tuple[np.ndarray, np.ndarray]:
    hashes = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
    items = np.concatenate(items) if items else np.zeros(0, np.uint32)
    order = np.lexsort((items, hashes))
    hashes, items = hashes[order], items[order]
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


def build(policy: P.Decontaminate, on_bad_row: str) -> tuple[Index, dict]:
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
        for text in _eval_texts(ev, on_bad_row, st):
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


def _eval_texts(ev: P.EvalSet, on_bad_row: str, st: dict):
    """The text of each row of an evaluation set (its user turns), or None for a row
    without one (counted in st['skipped'] by reason)."""
    src = ev.as_source()
    layout = sources.Layout(src, "context")
    field = layout.columns()[0]

    def check(names: list[str], where: str) -> None:
        if field not in names:
            shown = ", ".join(sorted(names)[:40]) or "none"
            raise StageError(f"eval set {ev.name}: field {field!r}: not in {where} (fields: {shown})")

    reader = sources.Reader(src, layout.columns(), check)
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
