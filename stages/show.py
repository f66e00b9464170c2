"""Look at rows as the trainer will see them, supervised tokens marked.

    python -m stages.show                         3 seeded rows of data/merged
    python -m stages.show --id ID [--id ID ...]   rows by id (reads only the id columns)
    python -m stages.show --source S --sample 5 --seed 1 | --longest 2 | --row 17
    python -m stages.show --tokens                one token a line: position, id, kind
    python -m stages.show --html rows.html        one self-contained page
    python -m stages.show --rev HEAD~1 --id ID    the same row at a git revision, diffs marked
    python -m stages.show PATH                    any set or export (TRL, axolotl, SpecForge)

Colour on a terminal; with NO_COLOR or piped, supervised spans are written [[...]], each
exactly the decode of its tokens. The marking, the header and the page: docs/stages.md,
"Look at the rows".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from stages.common import outputs
from stages.common.errors import StageError
from stages.process import cli
from stages.view import page, terminal, versions
from stages.view.marked import mark
from stages.view.rows import Dataset

DEFAULT_SAMPLE = 3
MAX_TOKENS = 20000


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise StageError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m stages.show", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", nargs="?", type=Path,
                   help="a dataset folder or export (default: the pipeline's merged set)")
    p.add_argument("--id", action="append", default=[], help="a row id (repeatable)")
    p.add_argument("--row", action="append", type=int, default=[],
                   help="a row number, from 0 in dataset order (repeatable)")
    p.add_argument("--source", help="only rows of this source")
    p.add_argument("--sample", type=int, default=0, help="N rows drawn with --seed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--longest", type=int, default=0, help="the N longest rows")
    p.add_argument("--shortest", type=int, default=0, help="the N shortest rows")
    p.add_argument("--tokens", action="store_true", help="one token a line: position, id")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help=f"tokens shown per row (default {MAX_TOKENS}; 0: all)")
    p.add_argument("--html", type=Path, metavar="FILE", help="write one HTML page instead")
    p.add_argument("--rev", help="also show each row at this git revision (read through "
                                 "DVC), the tokens that differ marked")
    p.add_argument("--tokenizer", help="decode with this tokenizer (default: the set's)")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    return p


def colour(choice: str, html: bool) -> bool:
    if html or choice == "never":
        return False
    if choice == "always":
        return True
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def choose(data: Dataset, args: argparse.Namespace) -> list:
    rows = data.by_ids(args.id) if args.id else []
    rows += data.by_numbers(args.row) if args.row else []
    sample = args.sample
    if not (rows or sample or args.longest or args.shortest):
        sample = DEFAULT_SAMPLE
    if sample or args.longest or args.shortest or args.source is not None and not rows:
        rows += data.chosen(source=args.source, sample=sample, seed=args.seed,
                            longest=args.longest, shortest=args.shortest)
    return rows


def counterparts(old: Dataset, rows: list) -> list:
    """Each row as `old` has it (by id; by row number where the set has no ids), or None."""
    out = []
    for row in rows:
        try:
            found = old.by_ids([row.id]) if row.id is not None else old.by_numbers([row.number])
        except StageError:
            found = [None]
        out.append(found[0])
    return out


def main(argv=None) -> int:
    def work():
        args = parser().parse_args(argv)
        for name in ("sample", "longest", "shortest", "max_tokens", "seed"):
            if getattr(args, name) < 0:
                raise StageError(f"--{name.replace('_', '-')} must be >= 0")
        folder = args.data or default_data()
        if args.html:  # never written over a file of the set it shows
            outputs.check_apart({"the set": folder}, [("--html", args.html)])
        data = Dataset(folder)
        rows = choose(data, args)
        from stages.view.tokens import text_for

        text = text_for(data.fingerprint, args.tokenizer)
        marked = [mark(r, text, data, args.max_tokens) for r in rows]
        pairs = []
        with (versions.at_revision(folder, args.rev) if args.rev
              else contextlib.nullcontext()) as old_folder:
            if old_folder is not None:
                old = Dataset(old_folder)
                for m, row in zip(marked, counterparts(old, rows)):
                    if row is None:
                        m.facts["at " + args.rev] = "no such row"
                        continue
                    o = mark(row, text, old, args.max_tokens)
                    o.differs, m.differs = versions.differences(o.ids, o.supervised, m.ids,
                                                                m.supervised)
                    m.facts["differs from " + args.rev] = _count(m, o)
                    m.facts["differing positions"] = _positions(m.differs)
                    pairs.append((o, m))
        if args.html:
            title = f"{folder}: {len(marked)} rows"
            if args.rev:
                body = page.page(title + f", against {args.rev}", [],
                                 pairs=[(o, m, f"at {args.rev}:", "now:") for o, m in pairs],
                                 note="left: " + args.rev + "; right: the workspace")
            else:
                body = page.page(title, marked)
            with outputs.atomic_file(args.html) as f:
                f.write(body)
            print(f"wrote {args.html}: {len(marked)} rows")
            return
        use = colour(args.color, False)
        out = [terminal.LEGEND_COLOUR if use else terminal.LEGEND_PLAIN]
        olds = {id(m): o for o, m in pairs}
        for m in marked:
            if id(m) in olds:
                out.append(terminal.render(olds[id(m)], use, args.tokens).replace(
                    "=== row", f"=== at {args.rev}: row", 1))
            out.append(terminal.render(m, use, args.tokens))
        sys.stdout.write(out[0] + "\n\n" + "".join(out[1:]))

    return cli.reported("show", work)


def _count(new, old) -> str:
    return (f"{int(new.differs.sum())} of {new.shown} tokens here, "
            f"{int(old.differs.sum())} of {old.shown} there")


def _positions(flags, most: int = 20) -> str:
    """The flagged positions as ranges (`3-5, 9`), the first `most` of them."""
    from stages.view.tokens import runs

    spans = [(a, b) for a, b, on in runs(flags) if on]
    text = ", ".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in spans[:most])
    return (text + (f", ... ({len(spans) - most} more)" if len(spans) > most else "")) or "none"


def default_data() -> Path:
    from stages import validate

    return cli.pipeline_paths("validate", validate.PATHS).merged


if __name__ == "__main__":
    sys.exit(main())
