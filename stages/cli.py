"""The command line every stage shares: `python -m stages.<name> [--params FILE]`."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from stages import params as P
from stages.errors import StageError


def main(section: str, doc: str, run: Callable[[object], object], argv=None) -> int:
    """Parse the command line, load and check the stage's params, run it.

    Every failure the user can act on is one line on stderr and exit status 1;
    Ctrl-C is exit status 130. Both leave earlier outputs untouched because stages
    write to temporary paths and rename at the end.
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
    try:
        cfg = P.load(section, args.params)
        run(cfg)
    except StageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"error: {section} interrupted; nothing partial was written", file=sys.stderr)
        return 130
    return 0


def entry(section: str, doc: str, run: Callable[[object], object]) -> None:
    sys.exit(main(section, doc, run))
