"""The command line every stage shares: `python -m stages.<name> --PATH ... [--params FILE]`.

Where a stage reads and writes is given on its command line, and dvc.yaml's `cmd` is
where those paths are written; code that runs a stage without DVC (tests, the demo, the
benchmarks) reads them from there with `pipeline_command` and `pipeline_paths`.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Callable

import yaml

from stages.common import params, secrets
from stages.common.errors import StageError

PIPELINE = Path(__file__).resolve().parents[2] / "dvc.yaml"


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a scheduler), raised so that cleanups run."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def parser(section: str, doc: str, paths: dict[str, str]) -> argparse.ArgumentParser:
    """The stage's options: one required `--NAME PATH` per entry of `paths` (name: help)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m stages.{section}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for name, help in paths.items():
        parser.add_argument(f"--{name}", type=Path, required=True, metavar="PATH", help=help)
    parser.add_argument(
        "--params",
        default="params.yaml",
        metavar="FILE",
        help=f"params file whose '{section}' section is used (default: params.yaml)",
    )
    return parser


def only_paths(args: argparse.Namespace, paths: dict[str, str]) -> argparse.Namespace:
    return argparse.Namespace(**{name: getattr(args, name) for name in paths})


def main(section: str, doc: str, run: Callable[[object, argparse.Namespace], object],
         paths: dict[str, str], argv=None) -> int:
    """Parse the command line, load and check the stage's params, run it.

    Every failure the user can act on is one line on stderr and exit status 1;
    Ctrl-C is exit status 130, SIGTERM 143. All leave earlier outputs untouched because
    stages write to temporary paths and rename at the end; the temporaries are removed
    on the way out (by default SIGTERM would end the process without that).
    """
    args = parser(section, doc, paths).parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {section}: %(message)s", datefmt="%H:%M:%S"
    )
    def work():
        cfg = params.load(section, args.params)
        secrets.tell_params(cfg)  # a credential in a path param: redacted wherever written
        if "reports" in paths:
            check_report_folders(args.reports, section)
        run(cfg, only_paths(args, paths))

    return reported(section, work)


def reported(section: str, work: Callable[[], object]) -> int:
    """Run `work` under the rules of main: the exit status, each failure one line."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    # credentials typed into a path on the command line are secrets from here on
    secrets.tell_params(sys.argv[1:])
    try:
        with secrets.redacting_logs():
            work()
    except StageError as e:
        print(f"error: {one_line(secrets.WRITTEN(str(e)))}", file=sys.stderr)
        return 1
    except OSError as e:  # a file the stage could not read or write, not caught nearer
        where = f"{e.filename}: " if e.filename else ""
        text = secrets.WRITTEN(f"{section}: {where}{e.strerror or e}")
        print(f"error: {one_line(text)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        how = "terminated" if isinstance(e, Terminated) else "interrupted"
        print(f"error: {section} {how}; nothing partial was written", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def check_report_folders(folder: Path, section: str) -> None:
    """StageError before any work when a report of the stage could not be written at the
    end (`reports/runs` a file or a dangling link), not after the work is done."""
    from stages.common import reports  # common.reports imports nothing of the process

    for path in (reports.facts_path(folder, section), reports.run_path(folder, section)):
        for parent in reversed(path.parents):
            if os.path.lexists(parent) and not parent.is_dir():
                raise StageError(f"--reports {folder}: {parent} is not a folder, and "
                                 f"{path} goes there; remove or rename it")


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


def entry(section: str, doc: str, run: Callable[[object, argparse.Namespace], object],
          paths: dict[str, str]) -> None:
    sys.exit(main(section, doc, run, paths))


def pipeline_command(section: str, pipeline: Path = PIPELINE) -> list[str]:
    """The stage's `cmd` in dvc.yaml, as argv."""
    doc = yaml.safe_load(pipeline.read_text(encoding="utf-8"))
    return shlex.split(doc["stages"][section]["cmd"])


def pipeline_outs(pipeline: Path = PIPELINE) -> list[str]:
    """Every out of every stage in dvc.yaml (paths a stage replaces as a whole)."""
    doc = yaml.safe_load(pipeline.read_text(encoding="utf-8"))
    found = []
    for stage in doc["stages"].values():
        for out in stage.get("outs") or []:
            found.extend(out if isinstance(out, dict) else [out])
    return found


def pipeline_paths(section: str, paths: dict[str, str],
                   pipeline: Path = PIPELINE) -> argparse.Namespace:
    """The paths dvc.yaml gives the stage, for running it without DVC."""
    argv = pipeline_command(section, pipeline)[3:]  # after `python -m stages.<section>`
    return only_paths(parser(section, "", paths).parse_args(argv), paths)
