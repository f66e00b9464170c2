"""Each token's text joins to the tokenizer's own decode; kinds follow the ChatML turns;
the escapes of visible() undo exactly."""

from __future__ import annotations

import numpy as np

from stages.view.tokens import runs, unescape, visible


def test_pieces_join_to_the_decode_for_any_ids(text):
    rng = np.random.default_rng(1)
    for _ in range(300):
        ids = rng.integers(0, text.size, rng.integers(1, 40)).tolist()
        assert "".join(text.pieces(ids)) == text.tok.decode(ids)
    # characters split over tokens: each piece is whole characters, the join exact
    ids = text.tok.encode("naïve 世界 😀 \u202e", add_special_tokens=False)
    assert "".join(text.pieces(ids)) == "naïve 世界 😀 \u202e"


def test_an_id_outside_the_vocabulary_is_shown_not_decoded(text):
    assert text.pieces([text.size + 5, 9707]) == ["\ufffd", text.tok.decode([9707])]


def test_kinds_follow_the_turns(text):
    tok = text.tok
    rendered = ("<|im_start|>user\nhi x<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n"
                "</think>\n\nok<tool_call>\n{}\n</tool_call><|im_end|>\n")
    ids = tok.encode(rendered, add_special_tokens=False)
    pieces = text.pieces(ids)
    kinds = text.kinds(ids, pieces)
    by_kind = {}
    for p, k in zip(pieces, kinds):
        by_kind[k] = by_kind.get(k, "") + p
    assert by_kind["user"] == "hi x"
    assert by_kind["thinking"] == "\nhm\n"
    assert by_kind["tool_call"] == "\n{}\n"
    assert by_kind["answer"] == "\n\nok"
    assert by_kind["role"] == "user\nassistant\n"
    assert by_kind["control"].count("<|im_start|>") == 2


def test_visible_escapes_what_acts_on_a_screen_and_undoes_exactly():
    text = "a\x1b[31m\r\u202e\u200b\u2066⟨U+0041⟩\tok\n"
    shown = visible(text)
    assert not any(c in shown for c in "\x1b\r\u202e\u200b\u2066")
    assert "\t" in shown and "\n" in shown
    assert unescape(shown) == text


def test_runs():
    assert runs(np.array([0, 0, 1, 1, 0])) == [(0, 2, False), (2, 4, True), (4, 5, False)]
    assert runs(np.array([], bool)) == []
