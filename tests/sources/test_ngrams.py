"""Words as decontamination sees them, and the hashes of their runs (stages/sources/ngrams.py)."""

from __future__ import annotations

import numpy as np

from stages.sources.ngrams import Words, pack, words


def test_words_fold_case_punctuation_whitespace_and_unicode_forms():
    assert words("Hello,\tWORLD!!  it's 2+2=4\n(foo_bar)") == [
        "hello", "world", "it", "s", "2", "2", "4", "foo", "bar"]
    composed, decomposed = "caf\u00e9 na\u00efve", "cafe\u0301 nai\u0308ve"
    assert words(composed) == words(decomposed) == ["café", "naïve"]
    assert words("STRASSE Straße") == ["strasse", "straße"]


def test_scripts_without_spaces_give_one_word_per_letter():
    assert words("Привет, мир!") == ["привет", "мир"]
    assert words("区块链。是什么？") == ["区", "块", "链", "是", "什", "么"]
    assert words("カタカナとひらがな") == list("カタカナとひらがな")
    assert words("abc漢字def 한국어 문장") == ["abc", "漢", "字", "def", "한국어", "문장"]
    assert words("नमस्ते दुनिया") == ["नमस्ते", "दुनिया"]  # combining marks stay in the word


def test_a_run_hashes_the_same_from_prefix_sums_and_from_its_words():
    w = Words.of([" ".join(f"w{i}" for i in range(40)), "a b c", ""])
    first = np.arange(1, 30)
    many = w.runs(first, 13)  # more words than the batch: from prefix sums
    few = w.runs(first[:2], 13)  # summed from the words
    assert (many[:2] == few).all() and len(set(many.tolist())) == len(first)
    lengths = np.array([1, 5, 13])
    assert (w.runs(first[:3], lengths) == [w.runs(first[k:k + 1], int(n))[0]
                                           for k, n in enumerate(lengths)]).all()


def test_a_packed_batch_reads_back_as_the_same_words():
    texts = ["Hello, World", "Überall größer", "区块链", ""]
    again = Words.unpack(pack(texts), len(texts))
    direct = Words.of(texts)
    assert (again.h == direct.h).all() and again.count.tolist() == direct.count.tolist() == [2, 2, 3, 0]
