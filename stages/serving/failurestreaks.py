"""When failures in a row say the server or the setup is wrong: the run stops at once.

BREAKER permanent failures before the first success mean the setup is wrong (a param
the server rejects, a wrong model): `HeldFailures` holds them uncached until a success
shows the setup works, and stops the run at the BREAKER-th.
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


class HeldFailures:
    """Permanent failures before the first success, held out of the cache: the setup may
    be what failed them. `hold` stops the run at the BREAKER-th; `success` opens the gate
    and hands back what was held, to cache; `release` empties it at the end of a run."""

    def __init__(self):
        self.open = False  # a success was seen: permanent failures are cached at once
        self.held: list[tuple] = []

    def hold(self, key, record: dict, f: Failure) -> None:
        self.held.append((key, record))
        if len(self.held) >= BREAKER:
            status = f"HTTP {f.status} " if f.status else ""
            raise StageError(
                f"the first {BREAKER} requests all failed permanently, e.g. "
                f"{status}{f.message[:200]!r}: check generate.* sampling params and "
                "the model (nothing was cached as failed)"
            ) from None

    def success(self) -> list[tuple]:
        """(key, record) held until now, the first time; then nothing."""
        if self.open:
            return []
        self.open = True
        return self.release()

    def release(self) -> list[tuple]:
        held, self.held = self.held, []
        return held
