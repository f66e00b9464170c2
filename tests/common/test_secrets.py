"""Redaction of API keys and URL credentials (stages/common/secrets.py)."""

from __future__ import annotations

import base64
import json
import logging
from urllib.parse import quote, quote_plus

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.common import secrets
from stages.common.secrets import (
    MASK,
    Redactor,
    redact_args,
    redacting_logs,
    scrub,
    strip_url_credentials,
    url_credentials,
)
from tests.helpers.fakeserver import ECHO_FORMS, render, secret_pieces

KEY = 'sk-proj/A1b2+C3d4"E5f6=G7h8 I9j0\\K1l2%M3n4'


def pieces(text: str, n: int = 8) -> set[str]:
    return {text[i : i + n] for i in range(len(text) - n + 1)}


FORMS = [KEY, json.dumps(KEY)[1:-1], json.dumps(KEY, ensure_ascii=True)[1:-1], quote(KEY, safe=""), quote_plus(KEY)]


@pytest.mark.parametrize("form", FORMS)
def test_every_form_whole_or_cut_anywhere_is_masked(form):
    r = Redactor([KEY])
    for lo in range(0, len(form) - 8):
        for hi in range(lo + 8, len(form) + 1, 3):
            text = f"before {form[lo:hi]} after"
            out = r(text)
            # a neighbour that happens to continue the secret (here: a space) goes too
            assert out.startswith("before") and out.endswith("after") and MASK in out, out
            assert not any(p in out for f in FORMS for p in pieces(f)), (lo, hi, out)
    # a cut by a length limit at the very end or start of the text
    assert r("error: " + form[:11]) == "error: " + MASK
    assert r(form[-9:] + " is invalid") == MASK + " is invalid"


def test_pieces_shorter_than_eight_and_other_text_are_kept():
    r = Redactor([KEY])
    assert r("sk-proj is a prefix; so is A1b2") == "sk-proj is a prefix; so is A1b2"
    assert r("") == "" and r("plain text") == "plain text"
    text = "x" * 1000 + KEY + "y" * 1000 + KEY[:30]
    out = r(text)
    assert out == "x" * 1000 + MASK + "y" * 1000 + MASK
    assert not any(p in out for f in FORMS for p in pieces(f))


def test_nothing_to_hide_is_a_no_op():
    r = Redactor([None, ""])
    assert not r and r("sk-anything") == "sk-anything" and r.scrub({"a": [1]}) == {"a": [1]}


def test_a_secret_too_short_to_mask_is_left_with_a_warning_never_rewriting_words(caplog):
    """A placeholder key (vLLM's EMPTY) masked would rewrite "the EMPTY set" in the data."""
    r = Redactor(["EMPTY"])
    assert not r and r("the EMPTY set") == "the EMPTY set"
    assert "a secret of 5 characters is not masked" in caplog.text and "EMPTY" not in caplog.text


KEY2 = "sk-test-DO-NOT-LEAK-7f3a9c"


@pytest.mark.parametrize("spell", [
    lambda k: "".join(f"&#X{ord(c):X};" for c in k),  # entities: capital X
    lambda k: "".join(f"&#{ord(c):04d};" for c in k),  # zero-padded
    lambda k: k.replace("-", "&#45;"),  # some characters only
    lambda k: k.replace("-", "%2D"),
    lambda k: k.replace("-", "\\u002d"),
    lambda k: "".join(f"\\x{ord(c):02x}" for c in k),
    lambda k: " ".join(f"{ord(c):02x}" for c in k),  # hex, spaced
    lambda k: ":".join(f"{ord(c):02X}" for c in k),
    lambda k: " ".join(f"0x{ord(c):02x}" for c in k),
    lambda k: "\u200b".join(k),  # zero-width spaces between the characters
    lambda k: "\u00ad".join(k),  # soft hyphens
    lambda k: base64.b32encode(k.encode()).decode(),
    lambda k: base64.b64encode(k.encode("utf-16-le")).decode(),
    lambda k: "\n".join(base64.b64encode(k.encode()).decode()[i:i + 6] for i in range(0, 48, 6)),
])
def test_a_secret_spelled_in_mixed_escapes_or_split_by_separators_is_masked(spell):
    r = Redactor([KEY2])
    text = f"denied <{spell(KEY2)}> done"
    out = r(text)
    assert out.startswith("denied <") and out.endswith("> done") and MASK in out, out
    assert r.found(text) and not r.found(out), out
    # what is left decodes to no piece of the key
    left = out.replace(MASK, "")
    assert not r.found(left) and not [p for p in pieces(KEY2) if p in left]


def test_the_values_of_secret_flags_are_secrets_in_every_spelling():
    argv = ["--port", "1", "--api_key", "U-2222bbbb", "--hf-token=T-3333cccc",
            "--admin-api-key", "A-4444dddd", "--model", "m"]
    assert secrets.flag_secrets(argv) == ["U-2222bbbb", "T-3333cccc", "A-4444dddd"]
    assert redact_args(argv) == ["--port", "1", "--api_key", MASK, f"--hf-token={MASK}",
                                 "--admin-api-key", MASK, "--model", "m"]


def test_url_credentials_are_stripped_and_their_password_redacted():
    url = "https://bob:p%40ss-word-1234@example.com:8443/v1?x=1"
    assert strip_url_credentials(url) == "https://example.com:8443/v1?x=1"
    assert url_credentials(url) == ("bob", "p@ss-word-1234")
    assert strip_url_credentials("http://h:1/v1") == "http://h:1/v1"
    assert strip_url_credentials("http://user@h") == "http://h"
    assert strip_url_credentials("not a url, a@b.c") == "not a url, a@b.c"
    assert strip_url_credentials("http://h/?mail=a@b") == "http://h/?mail=a@b"
    text = "down: http://alice:pw@h:30000/v1 and https://tok@h2/x, ftp://h3/ok, http://u:p@ss@h4"
    assert strip_url_credentials(text) == "down: http://h:30000/v1 and https://h2/x, ftp://h3/ok, http://h4"
    assert url_credentials("http://[bad") == (None, None)
    r = Redactor(urls=[url, "http://plain:1"])
    assert r(f"failed: {url}") == "failed: https://example.com:8443/v1?x=1"
    assert r("said p@ss-word-1234 and bob:p@ss-word-1234") == f"said {MASK} and {MASK}"


def test_scrub_masks_every_string_of_a_json_value():
    doc = {"a": [KEY, 1, None, {"k": KEY[:12], "url": "http://u:p@h"}], KEY: True}
    expected = {"a": [MASK, 1, None, {"k": MASK, "url": "http://h"}], MASK: True}
    assert Redactor([KEY]).scrub(doc) == scrub(doc, [KEY, None]) == expected
    assert scrub({"u": ["https://tok@h2/x"], "n": 3}) == {"u": ["https://h2/x"], "n": 3}


def test_secret_flags_are_masked_in_both_spellings():
    argv = ["--tp", "8", "--api-key", "sk-1", "--hf-token=hf_2", "--password", "p",
            "--port", "30000", "http://u:p@h:1"]  # fmt: skip
    assert redact_args(argv) == ["--tp", "8", "--api-key", MASK, "--hf-token=" + MASK,
                                 "--password", MASK, "--port", "30000", "http://h:1"]  # fmt: skip


def test_log_records_are_redacted_inside_the_block_only(caplog):
    log = logging.getLogger("stages.test_secrets")
    caplog.set_level(logging.INFO)
    with redacting_logs(Redactor([KEY])):
        log.info("server said %s", KEY[3:])
        log.warning("url %s", f"http://u:{KEY}@h")
    log.info("after %s", KEY)
    assert [r.getMessage() for r in caplog.records] == [
        f"server said {MASK}", f"url http://u:{MASK}@h", f"after {KEY}",
    ]


def test_url_credentials_are_stripped_wherever_the_url_is():
    text = "down: http://alice:pw@h:30000/v1 and https://tok@h2/x, ftp://h3/ok"
    assert secrets.strip_url_credentials(text) == \
        "down: http://h:30000/v1 and https://h2/x, ftp://h3/ok"


def test_scrub_masks_keys_and_urls_in_nested_values():
    obj = {"a": ["Bearer sk-9\"x-4c1d", {"url": "http://u:p@h"}], "n": 3, "key": None}
    assert secrets.scrub(obj, ["sk-9\"x-4c1d", None]) == {"a": ["Bearer ***", {"url": "http://h"}],
                                                     "n": 3, "key": None}


# ------------------------------------------------- every encoding a server can echo back

secret_text = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x2FF), min_size=8,
                      max_size=40)
around = st.text(st.sampled_from("ab :/\n{}\"\\"), max_size=12)


@settings(max_examples=80, deadline=None)
@given(secret_text, st.sampled_from(ECHO_FORMS), around, around)
def test_each_echo_form_of_any_key_is_masked_wherever_it_stands(key, form, before, after):
    text = before + render("{" + form + "}", key) + after
    out = Redactor([key])(text)
    assert not [p for p in secret_pieces(key) if p in out], (form, out)


@settings(max_examples=60, deadline=None)
@given(secret_text, st.sampled_from(["Bearer ", "Basic ", "x", "xy", ""]), around)
def test_the_key_in_base64_at_any_offset_is_masked(key, prefix, after):
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        text = encode((prefix + key + after).encode()).decode()
        out = Redactor([key])(text)
        assert MASK in out and not [p for p in secret_pieces(key) if p in out], (prefix, out)


def test_a_token_only_url_makes_its_token_a_secret():
    token = "tok-3f9a77c2e1b04d55"
    r = Redactor(urls=[f"http://{token}@gpu-host:30000"])
    basic = base64.b64encode(f"{token}:".encode()).decode()
    assert r(f"said {token} and Basic {basic}") == f"said {MASK} and Basic {MASK}" + basic[-2:]
    assert not [p for p in secret_pieces(token) if p in r(f"Basic {basic}")]


def test_a_secret_is_found_in_a_parsed_body_whatever_escapes_spelled_it():
    key = "sk-abc/def+ghi=jkl"
    mixed = '{"a": ["' + "".join(c if i % 2 else f"\\u{ord(c):04x}" for i, c in enumerate(key)) + '"]}'
    r = Redactor([key])
    assert r.found_in(json.loads(mixed))
    assert r.found(mixed) and MASK in r(mixed)  # and unparsed, its escapes decoded
    assert r.found_in({key[2:]: 1}) and not r.found_in({"a": [1, None, "x" * 100]})
    assert not Redactor([]).found_in({"a": key})


# ------------------------------------------------- long texts: hashed runs, views once

SPELLS = [KEY2, KEY2[3:14], " ".join(f"{ord(c):02x}" for c in KEY2), KEY2.replace("-", "%2D"),
          "".join(f"&#{ord(c)};" for c in KEY2), base64.b64encode(KEY2.encode()).decode()]


@pytest.mark.parametrize("spell", SPELLS)
def test_a_long_text_is_searched_as_a_short_one_across_every_block_edge(monkeypatch, spell):
    """Long texts' runs are hashed in numpy, a block at a time: a piece is found and masked
    wherever it stands, a block's edge included, as the short path finds it."""
    r = Redactor([KEY2])
    short = f"denied <{spell}> done"
    assert len(short) < secrets.HASHED_FROM
    expected = r(short)
    monkeypatch.setattr(secrets, "HASHED_FROM", 16)
    monkeypatch.setattr(secrets, "HASH_BLOCK", 32)
    for pad in range(40):  # the text's start at every offset of a block
        text = "." * pad + short + "." * 50
        assert r(text) == "." * pad + expected + "." * 50, pad
        assert r.found(text) and not r.found(r(text)), pad
    assert r("." * 5000) == "." * 5000 and not r.found("." * 5000)


def test_each_view_is_made_and_searched_once(monkeypatch):
    """A view that holds a piece is searched once, not once to say so and again for where."""
    r = Redactor([KEY2])
    monkeypatch.setattr(secrets, "HASHED_FROM", 16)  # every text's runs hashed, and counted
    searched = []
    hits = secrets.hash_hits
    monkeypatch.setattr(secrets, "hash_hits", lambda t, table: searched.append(t) or hits(t, table))
    # a piece of the key's hex, spaced: in the separator view only, and never whole
    text = "x %41 " + " ".join(f"{ord(c):02x}" for c in KEY2[2:20])
    assert MASK in r(text)
    assert len(searched) == len(set(searched)) == 3  # the text and its two views
