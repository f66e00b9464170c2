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
word's hash mixes the 8-byte little-endian words of its folded UTF-8 bytes; a run of
words hashes as a polynomial of its words' hashes mod 2^64 (from prefix sums where an
index needs the runs at every position, by Horner's rule for a prompt's probes). The
index is the n-gram hashes sorted with the item of each, and two bit filters of shorter runs,
m = n - k + 1 words with k = n // 2, that answer "surely absent" for almost every probe
of a clean prompt without touching the sorted array: ~18 bytes per indexed n-gram,
whatever the size of the mix. A prompt is probed only at every k-th word: an n-gram it
shares with an item starts at most k - 1 words before a probed position whose m-word run
lies inside that n-gram, so that run is in the filters and the n-grams around every probe
that passes them are looked up; the check is exact, at a fraction of the lookups.
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

from stages.common import params
from stages.common.errors import StageError, writable
from stages.sources import layouts, readers

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
# letters kept, every other ASCII byte 0 (a separator), \0 -> 1 (the break between texts).
_BYTES = bytearray(range(256))
for _c in range(128):
    _BYTES[_c] = ord(chr(_c).lower()) if chr(_c).isalnum() else 0
_BYTES[0] = 1
_BYTES = bytes(_BYTES)
_BREAK = " \0 "  # between texts: the byte 1 between separators, a word no text can hold
_PAD = " " * 16  # after the last: reads 16 bytes past a word's start stay in the buffer
_patterns: Optional[tuple[re.Pattern, re.Pattern]] = None  # built for the first non-ASCII text

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ONES, _HIGHS = np.uint64(0x0101010101010101), np.uint64(0x8080808080808080)
_CHUNK = np.uint64(0xD6E8FEB86659FD93)
# Two filters of the probed runs before the sorted n-gram hashes: a small one (4 bits per
# run, ~1 in 5 absent runs pass) that stays in the CPU caches beside the dedup set of a
# large mix, then a large one (32 bits per run, two set by each: ~1 in 270 pass) read only
# for those, so that the sorted array is searched about once per batch of prompts.
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
    t = x >> _S30
    x ^= t
    x *= _M1
    x ^= np.right_shift(x, _S27, out=t)
    x *= _M2
    x ^= np.right_shift(x, _S31, out=t)
    return x


class _Powers:
    """base**k and base**-k mod 2^64 for k < n, grown on demand (bounded by the largest batch)."""

    def __init__(self, base: int):
        self.base = base
        self.root = np.uint64(base)
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


class Unpacked(ValueError):
    """A packed batch whose texts cannot be told apart (a text holds \\0): check the texts."""


def pack(texts: Sequence[str]) -> bytes:
    """A batch of texts as one buffer (what Index.check_packed reads, cheap to send to
    another process): their UTF-8 between breaks, the break before each and after the last."""
    return _BREAK.join(["", *texts, _PAD]).encode()


class _Words:
    """The words of a batch of texts in one row (`words` of them), as the hash of each
    (`h`). A break word stands before, between and after the texts (`breaks[s]`: the one
    before text s), so a run of words across two texts holds one and matches no indexed
    run; `count[s]` is the number of words of text s.

    One pass of bytes.translate folds case and punctuation; a word is a run of non-zero
    bytes, hashed from the 8-byte little-endian words that cover it (most words fit in
    one), read where it starts and cut at its first 0 byte, so no numpy pass runs per byte
    beyond finding where words start."""

    def __init__(self, data: bytes, n: int):
        """`data`: n texts as `pack` gives them, non-ASCII ones already made canonical."""
        raw = data.translate(_BYTES)
        nonzero = np.frombuffer(raw, np.uint8) != 0
        at = np.flatnonzero(nonzero[1:] > nonzero[:-1])
        at += 1  # word j starts at byte at[j]
        chunks = np.frombuffer(raw, "<u8", len(raw) // 8)
        h = _read(chunks, at)
        longer = np.flatnonzero(_cut(h))
        breaks = np.flatnonzero(h == 1)
        if len(breaks) != n + 1:
            raise Unpacked("a text holds \\0")
        k, scale = 8, _CHUNK
        while len(longer):  # the next 8 bytes of words longer than k - 1 bytes
            part = _read(chunks, at[longer] + k)
            goes_on = _cut(part)
            part *= scale  # a polynomial of the chunks, mixed below with the rest
            h[longer] += part
            longer = longer[goes_on]
            k, scale = k + 8, np.uint64(int(scale) * int(_CHUNK) % 2**64)
        self.h = _mix(h)
        self.raw, self.at, self.breaks = raw, at, breaks
        self.count = np.diff(breaks) - 1
        self.words = len(h)
        self._prefix: Optional[np.ndarray] = None

    @classmethod
    def of(cls, texts: Sequence[str]) -> "_Words":
        data = pack(texts)
        if not data.isascii():
            data = pack([t if t.isascii() else _canonical(t) for t in texts])
        try:
            return cls(data, len(texts))
        except Unpacked:  # a text holding \0 itself: read it as a space
            return cls.of([t.replace("\0", " ") for t in texts])

    @classmethod
    def unpack(cls, data: bytes, n: int) -> "_Words":
        """The words of the n texts `pack` put in `data`."""
        if not data.isascii():
            texts = data.decode().split(_BREAK)[1:-1]
            if len(texts) != n:
                raise Unpacked("a text holds the break")
            data = pack([t if t.isascii() else _canonical(t) for t in texts])
        return cls(data, n)

    # A run of words first .. first + length - 1 hashes as the polynomial
    # sum(h[first + i] * base**i) mod 2^64, computed the cheapest way for what is asked.

    def runs(self, first: np.ndarray, length) -> np.ndarray:
        """Hashes of the word runs first[k] .. first[k] + length[k] - 1 (length: one for all,
        or one per run): summed from the words when they are few, else from prefix sums."""
        longest = int(length) if np.ndim(length) == 0 else int(length.max(initial=0))
        if len(first) * longest > self.words:
            p, inv = self.prefix()
            return (p[first + length] - p[first]) * inv[first]
        offsets = np.arange(longest)
        terms = self.h.take(first[:, None] + offsets, mode="clip")
        terms *= _WORD_POWERS.upto(longest)[0][:longest]
        if np.ndim(length):
            terms[offsets >= length[:, None]] = 0
        return terms.sum(axis=1, dtype=np.uint64)

    def prefix(self) -> tuple[np.ndarray, np.ndarray]:
        """Prefix sums of h[j] * base**j, and the powers base**-j that bring a run back."""
        pw, inv = _WORD_POWERS.upto(self.words + 1)
        if self._prefix is None:
            self._prefix = np.empty(self.words + 1, np.uint64)
            self._prefix[0] = 0
            np.cumsum(self.h * pw[: self.words], out=self._prefix[1:])
        return self._prefix, inv

    def every(self, m: int, step: int) -> np.ndarray:
        """Hashes of the m-word runs starting at words 0, step, 2 step, ... (those that fit),
        by Horner's rule over strided views: no pass over the words that is not needed."""
        fit = self.words - m + 1
        if fit <= 0:
            return np.zeros(0, np.uint64)
        stop = step * ((fit - 1) // step) + 1
        h, base = self.h, _WORD_POWERS.root
        out = h[m - 1: m - 1 + stop: step].copy()
        for i in range(m - 2, -1, -1):
            out *= base
            out += h[i: i + stop: step]
        return out

    def windows(self, texts: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        """(first word, text) of every m-word run inside each of `texts` (m words or more)."""
        per = self.count[texts] - m + 1
        total = int(per.sum())
        base = np.repeat(self.breaks[texts] + 1 - (np.cumsum(per) - per), per)
        return base + np.arange(total), np.repeat(texts, per)

    def text_of(self, words: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.breaks, words, side="right") - 1

    def phrase(self, first: int, n: int) -> str:
        raw = self.raw
        starts = self.at[first: first + n].tolist()
        return " ".join(raw[s: raw.index(0, s)].decode("utf-8", "replace") for s in starts)


def _read(chunks: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The 8 bytes from each byte offset `at` on, as little-endian words: two aligned words
    shifted together (numpy gathers aligned words much faster than unaligned ones)."""
    shift = (at & 7).view(np.uint64)
    shift <<= 3
    word = at >> 3
    low = chunks.take(word)
    low >>= shift
    word += 1
    high = chunks.take(word)
    high <<= 64 - shift  # a shift by 64 gives 0: the low word alone
    low |= high
    return low


def _cut(x: np.ndarray) -> np.ndarray:
    """In place: clear the bytes of each x from its first 0 byte on; True where x has none
    (the word goes on past these 8 bytes)."""
    low = x - _ONES
    low &= ~x
    low &= _HIGHS  # the top bit of each 0 byte; the lowest set bit marks the first one
    goes_on = low == 0
    low ^= low - np.uint64(1)  # every bit up to that one (all of them where there is none)
    x &= low
    return goes_on


def words(text: str) -> list[str]:
    """The words decontamination sees in `text` (for tests and messages)."""
    w = _Words.of([text])
    return [w.phrase(j, 1) for j in range(1, w.words - 1)]


def _step(n: int) -> int:
    """Words between probes of a prompt (k): the filters hold runs of n - k + 1 words."""
    return max(1, n // 2)


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


_BLOCK = 32  # sorted n-gram hashes per block of the lookup (Index._lower_bound)
_ARRAYS = ("hashes", "items", "coarse", "fine", "short_hashes", "short_items", "set_starts")


class Index:
    """Sorted n-gram hashes of every evaluation item with the item of each (global item
    numbers; `set_starts` maps them back to a set and an index within it), two bit arrays
    that filter out absent probes (runs of m = n - k + 1 words of items long enough to
    have n-grams), and the hashes of short items matched exactly."""

    def __init__(self, policy: params.Decontaminate, names: list[str], arrays: dict):
        self.policy = policy
        self.n = policy.ngram
        self.step = _step(self.n)
        self.names = names
        for key in _ARRAYS:
            setattr(self, key, arrays[key])
        self.fences = self.hashes[::_BLOCK].copy()  # the first hash of each block

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
        meta = json.loads((folder / "index.json").read_text())
        policy = params.Decontaminate(**meta["policy"])
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
        if not texts:
            return [None] * len(counts)
        return self._check(_Words.of(texts), counts)

    def check_packed(self, data: bytes, counts: Sequence[int]) -> list[Optional[tuple[int, str]]]:
        """`check` of the texts `pack` put in `data` (raises Unpacked when a text held \\0)."""
        n = int(sum(counts))
        if not n:
            return [None] * len(counts)
        return self._check(_Words.unpack(data, n), counts)

    def _check(self, w: "_Words", counts: Sequence[int]) -> list[Optional[tuple[int, str]]]:
        out: list[Optional[tuple[int, str]]] = [None] * len(counts)
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

    def _confirm(self, w: _Words, first, counts, out) -> None:
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
            out[int(prompt[b])] = (int(item[b]), w.phrase(int(pair_first[at[b]]), self.n))

    def _lower_bound(self, h: np.ndarray) -> np.ndarray:
        """np.searchsorted(self.hashes, h): the fences (a few hundred KB that stay in the
        CPU caches) give the block, then one block is read per key, not ~20 scattered
        entries of an array evicted between batches."""
        block = np.searchsorted(self.fences, h)  # blocks whose first hash is below h ...
        block -= 1  # ... the last of which holds the answer, or ends just before it
        np.maximum(block, 0, out=block)
        block *= _BLOCK
        window = self.hashes.take(block[:, None] + np.arange(_BLOCK), mode="clip")
        block += (window < h[:, None]).sum(axis=1)
        return np.minimum(block, len(self.hashes), out=block)

    def _exact(self, w: _Words, counts, out) -> None:
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
                out[p] = (int(self.short_items[pos[k]]), w.phrase(int(first[k]), int(w.count[s])))


def _owner(counts: Sequence[int]) -> np.ndarray:
    """The prompt of each text, for prompts of counts[p] texts."""
    return np.repeat(np.arange(len(counts)), counts)


def _coarse_slots(h: np.ndarray, nbits: int):
    """The bit of each hash in a bit array of `nbits`: its top bits."""
    yield (h >> np.uint64(65 - nbits.bit_length())).view(np.int64)


def _fine_slots(h: np.ndarray, nbits: int):
    """Two bits per hash, the top and bottom bits of a remix of it (the coarse filter has
    read its top bits)."""
    g = _mix(h ^ _M2)
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


def build(policy: params.Decontaminate, on_bad_row: str,
          max_record_bytes: int = params.Prepare.max_record_bytes) -> tuple[Index, dict]:
    """Read every evaluation set and index it; also return the report's per-set figures."""
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
    return index, stats


def _index_batch(policy, texts, item_ids, parts: _Parts, st) -> None:
    if not texts:
        return
    w = _Words.of(texts)
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
        if type(item) is readers.BadRow:
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
        text = "\n".join(m["content"] for m in res[0] if m["role"] == "user")
        if not writable(text):  # a lone surrogate (JSON "\ud800"): no UTF-8 to hash
            if on_bad_row != "skip":
                raise StageError(f"eval set {ev.name}: {reader.where(pos)}: text that is not "
                                 "valid Unicode (a lone surrogate); set prepare.on_bad_row: "
                                 "skip to count and skip such rows")
            skipped["invalid_text"] = skipped.get("invalid_text", 0) + 1
            yield None
            continue
        yield text
