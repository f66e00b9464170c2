"""When failures in a row say the server or the setup is wrong: the run stops at once.

BREAKER permanent failures before the first success mean the setup is wrong (a param
the server rejects, a wrong model): generate stops instead of caching them all.
`BadBodyBreaker(urls)`, told of each request's `success()` or `failure(f)`, stops the run
once BREAKER requests in a row got no well-formed reply. docs/stages.md, generate,
"Only well-formed answers are cached".
"""

from __future__ import annotations

from stages.common.errors import StageError
from stages.serving.client import Failure

BREAKER = 32
BAD_BODIES = ("malformed", "bad_reply")  # a 200 whose body is not a chat completion


class BadBodyBreaker:
    """Stops the run once BREAKER requests in a row got no well-formed reply after their
    retries: the server is not answering chat completions."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.in_a_row = 0  # requests given up on bad bodies since the last success

    def success(self) -> None:
        self.in_a_row = 0

    def failure(self, f: Failure) -> None:
        if f.kind not in BAD_BODIES:
            return
        self.in_a_row += 1
        if self.in_a_row >= BREAKER:
            raise StageError(
                f"{BREAKER} requests in a row got no well-formed reply after retries, "
                f"e.g. {f.message[:200]!r}: the server at "
                f"{', '.join(self.urls)} is not answering chat completions; "
                "fix it and run again (answered requests are kept)"
            ) from None
