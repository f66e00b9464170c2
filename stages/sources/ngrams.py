"""The words of a batch of texts and the hashes of their runs, vectorised with numpy (no
Python loop per word): `Words.of(texts)` folds and splits them, `.runs(first, length)`
hashes word runs, `words(text)` lists the words of one text.

Text is put in Unicode NFC and lower-cased; every character that is not a letter, digit
or combining mark separates words, and each letter of a script written without spaces
(Han, Hiragana, Katakana, Thai, Lao, Khmer, Myanmar) is a word of its own. `pack` puts a
batch in one buffer another process reads back with `Words.unpack`.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from typing import Optional, Sequence

import numpy as np

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


def remix(h: np.ndarray) -> np.ndarray:
    """A second hash of hashes `h` (a new array), independent of the bits of the first."""
    return _mix(h ^ _M2)


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


class Words:
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
    def of(cls, texts: Sequence[str]) -> "Words":
        data = pack(texts)
        if not data.isascii():
            data = pack([t if t.isascii() else _canonical(t) for t in texts])
        try:
            return cls(data, len(texts))
        except Unpacked:  # a text holding \0 itself: read it as a space
            return cls.of([t.replace("\0", " ") for t in texts])

    @classmethod
    def unpack(cls, data: bytes, n: int) -> "Words":
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
    w = Words.of([text])
    return [w.phrase(j, 1) for j in range(1, w.words - 1)]
