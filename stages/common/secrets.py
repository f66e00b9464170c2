"""Keeping secrets out of everything the pipeline writes: the one redactor.

Secrets are an API key, credentials in a URL (found by shape in any URL-like text,
whatever the scheme, `s3:/` as pathlib spells `s3://` included) and the values of secret
flags in a launch command. `WRITTEN` is the redactor every writer goes through (reports,
the card, lineage.json, logs, error lines); a stage `tell`s it what it learned is secret.
It masks every run of MIN_PIECE characters of any form a server can echo a secret in
(JSON-escaped, percent-encoded, base64, base32, hex, HTML entities), also as the text's
escapes decode and with separators dropped; a shorter secret (a placeholder key) is not
masked, with a warning. Redact first, then truncate. docs/stages.md, generate, "Secrets".
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import dataclasses
import html
import json
import logging
import re
from typing import Any, Iterable, Iterator, Optional
from urllib.parse import quote, quote_plus, unquote, urlsplit

import numpy as np

log = logging.getLogger("secrets")

MASK = "***"
MIN_PIECE = 8  # a run of this many characters of a secret is masked wherever it is
# scheme://user:password@ or scheme://token@ (scheme:/ once pathlib has normalised the
# URL): up to the last @ before the host's end
_URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*:/{1,2})[^/?#\s\"'<>]+@")
# user:password@ as a later segment of a URL's path (hf://datasets/u:TOKEN@org/name);
# matched from its own slash, so a long text is scanned once
_PATH_CREDENTIALS = re.compile(r"(?P<pre>/)[^/?#\s\"'<>@:]*:[^/?#\s\"'<>@]*@")
# a query parameter (name bounded: a long text is scanned once) and, among them, the
# names that carry a credential (presigned S3/GCS/Azure URLs, ?token=)
_PARAM = re.compile(r"(?P<name>[?&;](?P<key>[A-Za-z0-9_.-]{1,64})=)(?P<value>[^&#\s\"'<>]+)")
_SECRET_KEY = re.compile(
    r"(?:.*(?:signature|credential|token|secret|password|passwd|api[_-]?key|apikey|auth).*"
    r"|sig|key|pwd|x-amz-.+|x-goog-.+)", re.I)
# flags whose next argument (or `=value`) is a secret
_SECRET_FLAG = re.compile(r"^--?[A-Za-z0-9_-]*(api[-_]key|apikey|token|password|secret)$", re.I)


def url_credentials(url: str) -> tuple[Optional[str], Optional[str]]:
    """(user, password) written in a URL, each None when absent."""
    try:
        parts = urlsplit(url)
        user, password = parts.username, parts.password
    except ValueError:  # an unparsable port or bracket: no credentials can be read
        return None, None
    return (unquote(user) if user else None), (unquote(password) if password else None)


def strip_url_credentials(text: str) -> str:
    """`text` (a URL, or any text holding URLs) without the `user:password@` of each URL
    (a path segment's too) and with credential query parameters' values masked."""
    if "@" in text:
        text = _URL_CREDENTIALS.sub(r"\g<scheme>", text)
        text = _PATH_CREDENTIALS.sub(lambda m: m["pre"] + MASK + "@", text)
    if "=" in text:
        text = _PARAM.sub(lambda m: m["name"] + MASK if _SECRET_KEY.fullmatch(m["key"])
                          else m.group(), text)
    return text


def credentials_in(text: str) -> set[str]:
    """Each secret written in URL-like text: userinfo (user:password, the password, a
    token-only user), a path segment's user:password, a credential parameter's value."""
    found: set[str] = set()
    spans = [m.group()[len(m["scheme"]):-1] for m in _URL_CREDENTIALS.finditer(text)]
    spans += [m.group()[len(m["pre"]):-1] for m in _PATH_CREDENTIALS.finditer(text)]
    for userinfo in spans:
        user, colon, password = userinfo.partition(":")
        found.update(v for v in (userinfo, password if colon else user) if v)
        found.update(unquote(v) for v in (userinfo, password) if v)
    for m in _PARAM.finditer(text):
        if _SECRET_KEY.fullmatch(m["key"]):
            found.update({m["value"], unquote(m["value"])})
    return found


def _split_secret_flags(argv: Iterable[str]) -> Iterator[tuple[str, Optional[str]]]:
    """(what stands before a secret, the secret) for each argument: `--api-key`, then
    ("", value) for the value after it; ("--token=", value); (arg, None) for the rest."""
    secret_next = False
    for arg in argv:
        if secret_next:
            secret_next = False
            yield "", arg
            continue
        flag, eq, value = arg.partition("=")
        if _SECRET_FLAG.match(flag):
            if eq:
                yield flag + eq, value
                continue
            secret_next = True
        yield arg, None


def redact_args(argv: Iterable[str]) -> list[str]:
    """A command line with the values of --api-key/--token/--password-like flags masked
    and URL credentials stripped."""
    return [strip_url_credentials(arg) if secret is None else arg + MASK
            for arg, secret in _split_secret_flags(argv)]


def flag_secrets(argv: Iterable[str]) -> list[str]:
    """The values of the secret flags in a command line (what redact_args masks), for the
    redactor to mask wherever else they show up (an engine echoing its own arguments)."""
    return [secret for _, secret in _split_secret_flags(argv) if secret is not None]


def scrub(value: Any, keys: Iterable[Optional[str]] = ()) -> Any:
    """A JSON value with URL credentials stripped and every secret in `keys` masked."""
    return Redactor(keys).scrub(value)


def _forms(secret: str) -> set[str]:
    """The ways a secret can be spelled in a body a server sends back."""
    data = secret.encode("utf-8", "surrogatepass")
    percent = {quote(secret, safe=""), quote_plus(secret, safe=""),
               "".join(f"%{b:02X}" for b in data)}
    units = secret.encode("utf-16-be", "surrogatepass")
    escaped = "".join(f"\\u{units[i]:02x}{units[i + 1]:02x}" for i in range(0, len(units), 2))
    entities = {"".join(f"&#{ord(c)};" for c in secret),
                "".join(f"&#x{ord(c):x};" for c in secret),
                "".join(f"&#x{ord(c):X};" for c in secret), html.escape(secret)}
    forms = {
        secret,
        json.dumps(secret, ensure_ascii=False)[1:-1],
        json.dumps(secret, ensure_ascii=True)[1:-1],
        escaped, escaped.upper().replace("\\U", "\\u"),
        *percent, *(_lower_hex(p) for p in percent),
        data.hex(), data.hex().upper(), *entities,
    }
    derived = set()
    for coded in (data, secret.encode("utf-16-le", "surrogatepass"),
                  secret.encode("utf-16-be", "surrogatepass")):
        derived |= _base64_forms(coded) | _base32_forms(coded)
    # derived forms this short would mask ordinary text: kept only when long enough
    return forms | {f for f in derived if len(f) >= MIN_PIECE}


def _lower_hex(percent: str) -> str:
    return re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), percent)


def _base64_forms(data: bytes) -> set[str]:
    """The characters of base64 text that spell `data` wherever it starts in what was
    encoded (at a byte offset of 0, 1 or 2 modulo 3), standard and URL-safe; characters
    that also depend on the bytes around it are left out."""
    forms = set()
    for pad in range(3):
        text = base64.b64encode(b"\0" * pad + data).decode("ascii").rstrip("=")
        # the characters made only of `data`'s bits: after the padding's, before a
        # last one that shares bits with whatever follows
        start = (0, 2, 3)[pad]
        end = len(text) - (1 if (pad + len(data)) % 3 else 0)
        forms.add(text[start:end])
        forms.add(text[start:end].translate(_URLSAFE))
    return forms


_URLSAFE = str.maketrans("+/", "-_")


def _base32_forms(data: bytes) -> set[str]:
    """As _base64_forms, for base32 (5-byte groups, 8 characters of 5 bits each)."""
    forms = set()
    for pad in range(5):
        text = base64.b32encode(b"\0" * pad + data).decode("ascii").rstrip("=")
        start = -(-pad * 8 // 5)  # the first character with none of the padding's bits
        end = (pad + len(data)) * 8 // 5  # the last made only of `data`'s bits, excluded after
        forms.add(text[start:end])
    return forms


# escapes a secret's characters can be spelled with, decoded in place for the search:
# runs of %XX or \xXX (UTF-8 bytes), \uXXXX, HTML entities of any case and padding,
# and the zero-width characters (soft hyphen too) that split a word unseen. Each
# alternative opens with a literal character: the regex engine then skips to those
# characters instead of trying every alternative at every position (16 times faster on
# prose without escapes)
_ESCAPES = re.compile(
    r"%[0-9A-Fa-f]{2}(?:%[0-9A-Fa-f]{2})*|\\x[0-9A-Fa-f]{2}(?:\\x[0-9A-Fa-f]{2})*"
    r"|\\u[0-9A-Fa-f]{4}|&#[xX]0*[0-9A-Fa-f]{1,6};|&#0*[0-9]{1,7};|&[A-Za-z][A-Za-z0-9]{1,31};"
    "|\u00ad|\u200b|\u200c|\u200d|\u2060|\ufeff")
# what may stand between the characters of a hex or base64 run: spaces, line breaks,
# colons, commas, and the 0x before each hex byte
_SEPARATORS = re.compile(r"[\s:,]+|0[xX](?=[0-9A-Fa-f]{2})")


def _unescaped(m: re.Match) -> str:
    text = m.group()
    if text[0] == "%" or text[:2] == "\\x":
        return bytes.fromhex(text.replace("%", "").replace("\\x", "")).decode("utf-8", "replace")
    if text[:2] == "\\u":
        return chr(int(text[2:], 16))
    if text[:3] in ("&#x", "&#X"):
        code = int(text[3:-1], 16)
        return chr(code) if code < 0x110000 else text
    if text[:2] == "&#":
        code = int(text[2:-1])
        return chr(code) if code < 0x110000 else text
    if text[0] == "&":
        return html.unescape(text)
    return ""  # a zero-width character


# each view of a text searched besides the text itself: (pattern, replacement)
_VIEWS = ((_ESCAPES, _unescaped), (_SEPARATORS, lambda m: ""))


def _views(text: str) -> Iterator[tuple[re.Pattern, Any, str]]:
    """(pattern, replacement, view) for each view of `text` that differs from it, made
    when asked for: `found` stops at the first view that holds a secret."""
    for pattern, repl in _VIEWS:
        view = pattern.sub(repl, text)
        if view != text:
            yield pattern, repl, view


# Runs of MIN_PIECE characters hashed in numpy (texts from HASHED_FROM characters on,
# HASH_BLOCK characters at a time so that memory stays a few MB whatever the text): a run
# is looked up only where its hash's top _TABLE_BITS bits are set in the forms' table.
HASHED_FROM = 1 << 12
HASH_BLOCK = 1 << 20
_TABLE_BITS = 20
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd: each character changes every high bit


def _run_hashes(text: str) -> np.ndarray:
    """A uint64 hash of each MIN_PIECE run of `text` (len(text) - MIN_PIECE + 1 of them;
    lone surrogates are code points like any other)."""
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32).astype(np.uint64)
    n = len(codes) - MIN_PIECE + 1
    hashes = codes[:n].copy()
    for k in range(1, MIN_PIECE):
        hashes *= _MULTIPLIER  # wraps modulo 2**64, as it should
        hashes += codes[k : k + n]
    return hashes


def _window_table(windows: set[str]) -> np.ndarray:
    """Which top bits of a run's hash may be one of `windows` (each MIN_PIECE long)."""
    table = np.zeros(1 << _TABLE_BITS, dtype=bool)
    if windows:
        table[_run_hashes("".join(windows))[::MIN_PIECE] >> np.uint64(64 - _TABLE_BITS)] = True
    return table


def hash_hits(text: str, table: np.ndarray) -> Iterator[int]:
    """Where a MIN_PIECE run of `text` starts whose hash `table` holds: every run that is
    one of its windows, and a few that only share the hash's top bits."""
    for start in range(0, len(text) - MIN_PIECE + 1, HASH_BLOCK):
        hashes = _run_hashes(text[start : start + HASH_BLOCK + MIN_PIECE - 1])
        hits = table[hashes >> np.uint64(64 - _TABLE_BITS)]
        yield from (start + int(i) for i in np.flatnonzero(hits))


def _view_spans(text: str, pattern: re.Pattern, repl, spans: list[tuple[int, int]]
                ) -> list[tuple[int, int]]:
    """Spans of `pattern.sub(repl, text)` mapped back onto `text`: a character of the
    view stands for itself, or for the whole escape (or separator) it came from."""
    starts, segments = [], []  # per non-empty stretch of the view: (view start, source
    view = pos = 0             # start, source end, one source character per view one)
    for m in pattern.finditer(text):
        if m.start() > pos:
            starts.append(view)
            segments.append((view, pos, m.start(), True))
            view += m.start() - pos
        n = len(repl(m))
        if n:
            starts.append(view)
            segments.append((view, m.start(), m.end(), False))
            view += n
        pos = m.end()
    if pos < len(text):
        starts.append(view)
        segments.append((view, pos, len(text), True))

    def source(i: int) -> tuple[int, int]:
        first, lo, hi, literal = segments[bisect.bisect_right(starts, i) - 1]
        return (lo + i - first, lo + i - first + 1) if literal else (lo, hi)

    return [(source(lo)[0], source(hi - 1)[1]) for lo, hi in spans if hi > lo]


class Redactor:
    """Masks known secret values in text, JSON values and log records.

    Build it from the secret values (None and empty strings are ignored) and from URLs
    whose passwords are secrets: `Redactor([key], urls=[...])`.
    """

    def __init__(self, secrets: Iterable[Optional[str]] = (), urls: Iterable[str] = ()):
        self._values: set[str] = set()
        self._short: set[str] = set()  # told, too short to mask
        self._whole: list[str] = []
        self._long: list[str] = []
        self._windows: set[str] = set()
        self._table = _window_table(self._windows)
        self.add(secrets, urls)

    def add(self, secrets: Iterable[Optional[str]] = (), urls: Iterable[str] = ()) -> None:
        """Learn more secret values and URLs whose credentials are secret."""
        values = set(self._values) | {s for s in secrets if s}
        for url in urls:
            user, password = url_credentials(url)
            if password:
                values.add(password)
                if user:
                    values.add(f"{user}:{password}")
            elif user:  # http://TOKEN@host: the user part is the token
                values.add(user)
        short = {v for v in values if len(v) < MIN_PIECE}
        if short - self._short:
            log.warning("a secret of %s characters is not masked: shorter than %d, it would "
                        "rewrite ordinary words wherever they stand (a placeholder key is no "
                        "secret; a real one is longer)",
                        " and ".join(sorted({str(len(v)) for v in short - self._short})),
                        MIN_PIECE)
            self._short |= short
        values -= short
        if values == self._values:
            return
        self._values = values
        forms = set().union(*(_forms(v) for v in values)) if values else set()
        self._whole = sorted(forms, key=len, reverse=True)  # longest first: no half masks
        self._long = [f for f in self._whole if len(f) >= MIN_PIECE]
        self._windows = {
            f[i : i + MIN_PIECE] for f in self._long for i in range(len(f) - MIN_PIECE + 1)
        }
        self._table = _window_table(self._windows)

    def __bool__(self) -> bool:
        return bool(self._whole)

    def found(self, text: str) -> bool:
        """True when `text` holds a secret (whole) or a piece long enough to mask, as it
        stands or in one of its views (escapes decoded, separators dropped)."""
        return self._found(text) or any(self._found(view) for _, _, view in _views(text))

    def _found(self, text: str) -> bool:
        return any(w in text for w in self._whole) or self._has_piece(text)

    def _has_piece(self, text: str) -> bool:
        # each MIN_PIECE run of the text looked up in the set of the forms' runs: one
        # pass over the text, several times faster than a search per run of the forms
        if len(text) < HASHED_FROM:
            return not self._windows.isdisjoint(
                text[i : i + MIN_PIECE] for i in range(len(text) - MIN_PIECE + 1))
        # a long text's runs hashed in numpy first: only those whose hash is a form run's
        # are sliced and looked up (a Python step per character cost 0.15 s per 770 kB)
        return any(text[i : i + MIN_PIECE] in self._windows
                   for i in hash_hits(text, self._table))

    def found_in(self, value: Any) -> bool:
        """True when a string of the JSON value `value` (keys included) holds a secret:
        a body checked as parsed, whatever escapes spelled it."""
        return bool(self) and any(self.found(text) for text in _strings(value))

    def __call__(self, text: str) -> str:
        """`text` with secrets masked and URL credentials stripped."""
        text = strip_url_credentials(text)
        if not self._whole:
            return text
        spans = self._spans(text)
        for pattern, repl, view in _views(text):
            found = self._spans(view)  # each view made and searched once
            if found:
                spans += _view_spans(text, pattern, repl, found)
        return _masked(text, spans) if spans else text

    def _spans(self, text: str) -> list[tuple[int, int]]:
        """Where the text holds a form whole, or a run (>= MIN_PIECE) of one."""
        spans = []
        for form in self._whole:
            at = text.find(form)
            while at >= 0:
                spans.append((at, at + len(form)))
                at = text.find(form, at + 1)
        if self._has_piece(text):
            spans += self._pieces(text)
        return spans

    def _pieces(self, text: str) -> list[tuple[int, int]]:
        """Each maximal run of text that is a substring (>= MIN_PIECE) of a form."""
        spans: list[tuple[int, int]] = []
        for form in self._long:
            for i in range(len(form) - MIN_PIECE + 1):
                window = form[i : i + MIN_PIECE]
                at = text.find(window)
                while at >= 0:
                    lo, hi, a, b = at, at + MIN_PIECE, i, i + MIN_PIECE
                    while lo > 0 and a > 0 and text[lo - 1] == form[a - 1]:
                        lo, a = lo - 1, a - 1
                    while hi < len(text) and b < len(form) and text[hi] == form[b]:
                        hi, b = hi + 1, b + 1
                    spans.append((lo, hi))
                    at = text.find(window, at + 1)
        return spans

    def scrub(self, value: Any) -> Any:
        """A JSON value with every string (keys included) redacted."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, dict):
            return {self(str(k)): self.scrub(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.scrub(v) for v in value]
        return value


def _masked(text: str, spans: list[tuple[int, int]]) -> str:
    """`text` with each span (overlapping ones merged) replaced by one MASK."""
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    out, pos = [], 0
    for lo, hi in merged:
        out += [text[pos:lo], MASK]
        pos = hi
    out.append(text[pos:])
    return "".join(out)


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, keys included (no recursion: any depth)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            yield node
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)


# what every writer of a report, the card, lineage.json, a log line or an error line
# passes its text through; a stage tells it the secrets it learns (`tell`)
WRITTEN = Redactor()


def tell(secrets: Iterable[Optional[str]] = (), urls: Iterable[str] = ()) -> Redactor:
    """Add secrets (and the credentials of URLs) to WRITTEN; returns it."""
    WRITTEN.add(secrets, urls)
    return WRITTEN


def tell_params(value: Any) -> None:
    """Tell WRITTEN every credential written in a string of a params value (dataclasses,
    lists and dicts walked), whatever the scheme."""
    found: set[str] = set()
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            found |= credentials_in(node)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            stack.extend(getattr(node, f.name) for f in dataclasses.fields(node))
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    tell(found)  # one too short to mask is still stripped by shape where it is a URL's


def check_key(key: str, where: str) -> str:
    """`key` if it can go into an HTTP header; else a StageError naming `where` (never
    the key): a control character (a CRLF env file's \\r) would break every request."""
    bad = [c for c in key if ord(c) < 0x20 or ord(c) == 0x7F or not c.isprintable()]
    if bad:
        from stages.common.errors import StageError  # errors imports nothing of ours

        raise StageError(f"{where}: the key holds {len(bad)} control or non-printing "
                         f"character(s), first {ascii(bad[0])} (a CRLF env file? strip it)")
    return key


@contextlib.contextmanager
def redacting_logs(redactor: Redactor = WRITTEN) -> Iterator[None]:
    """Every log record created inside the block is redacted, whatever logger or handler
    (a tqdm redirect included) ends up writing it."""
    previous = logging.getLogRecordFactory()

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a bad format string: logging reports it later
            return record
        record.msg, record.args = redactor(message), ()
        return record

    logging.setLogRecordFactory(factory)
    try:
        yield
    finally:
        logging.setLogRecordFactory(previous)
