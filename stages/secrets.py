"""What never reaches a file: passwords inside URLs, API keys, values of secret flags.

Reports, completions and the lineage card are committed or pushed; a server URL such as
http://user:pass@host or a launch argument such as `--api-key sk-...` must reach them
without the secret part.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Optional

# scheme://user:password@host or scheme://token@host: everything between // and @
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s\"']+@")
# flags whose next argument (or `=value`) is a secret
_SECRET_FLAG = re.compile(r"^--?[A-Za-z0-9-]*(api-key|apikey|token|password|secret)$", re.I)
MASK = "***"


def strip_url_credentials(text: str) -> str:
    """`text` with the `user:password@` part of every URL in it removed."""
    return _URL_CREDENTIALS.sub(r"\g<scheme>", text)


def redact_args(argv: Iterable[str]) -> list[str]:
    """A command line with the values of --api-key/--token/--password-like flags masked."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if _SECRET_FLAG.match(flag):
            if eq:
                out.append(f"{flag}={MASK}")
                continue
            hide_next = True
        out.append(strip_url_credentials(arg))
    return out


def scrub(obj: Any, keys: Iterable[Optional[str]] = ()) -> Any:
    """A JSON-like value with URL credentials stripped and every key in `keys` masked."""
    text = strip_url_credentials(json.dumps(obj, ensure_ascii=False))
    for key in keys:
        if key:
            text = text.replace(json.dumps(key, ensure_ascii=False)[1:-1], MASK)
    return json.loads(text)
