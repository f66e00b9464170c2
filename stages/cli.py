"""The command line every stage shares: `python -m stages.<name> [--params FILE]`."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Callable

from stages import params as P
from stages.errors import StageError


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a scheduler), raised so that cleanups run."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def main(section: str, doc: str, run: Callable[[object], object], argv=None) -> int:
    """Parse the command line, load and check the stage's params, run it.

    Every failure the user can act on is one line on stderr and exit status 1;
    Ctrl-C is exit status 130, SIGTERM 143. All leave earlier outputs untouched because
    stages write to temporary paths and rename at the end; the temporaries are removed
    on the way out (by default SIGTERM would end the process without that).
    """
    parser = argparse.ArgumentParser(
        prog=f"python -m stages.{section}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--params",
        default="params.yaml",
        metavar="FILE",
        help=f"params file whose '{section}' section is used (default: params.yaml)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {section}: %(message)s", datefmt="%H:%M:%S"
    )
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        cfg = P.load(section, args.params)
        run(cfg)
    except StageError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 1
    except OSError as e:  # a file the stage could not read or write, not caught nearer
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {one_line(f'{section}: {where}{e.strerror or e}')}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        how = "terminated" if isinstance(e, Terminated) else "interrupted"
        print(f"error: {section} {how}; nothing partial was written", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


MAX_ERROR_CHARS = 2000
# every character str.splitlines() breaks at, written as its escape
_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


def one_line(text: str) -> str:
    """`text` as one printable line of bounded length: a name or value quoted in an error
    may hold line breaks, lone surrogates or megabytes."""
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + "..."
    text = text.translate(_BREAKS)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def entry(section: str, doc: str, run: Callable[[object], object]) -> None:
    sys.exit(main(section, doc, run))
