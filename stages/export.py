"""Hand the merged set to the trainer that will read it, in that trainer's own format.

    python -m stages.export --for trl       --merged data/merged --out export/trl
    python -m stages.export --for specforge --merged data/merged --out export/specforge
    python -m stages.export --for axolotl   --merged data/merged --out export/axolotl

Each trainer's format (its columns, the rows it cuts or drops, its writer) is a class in
stages/trainers/. Every row is exported, in dataset order, unchanged; what the trainer then
cuts or drops at `--max-length` is counted and named in OUT/export.json and on stdout.
`--drop-refused` leaves out the rows the trainer would drop, each named in export.json
(`left_out`). Streamed from the merged shards a record batch at a time (read, not
mapped; the next batch read and checked in a thread while one is written), written beside
--out and renamed over it; nothing under --merged is opened for writing. Why each layout,
and each trainer's settings: docs/stages.md, "Hand it to a trainer".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

from stages.common import outputs, secrets
from stages.common.params import INT32
from stages.common.errors import StageError
from stages.common.reading import json_file, regular
from stages.dataset import arrays, fingerprint
from stages.dataset.schema import schema_differences
from stages.dataset.shards import STATE_FILE, list_shards, open_shard
from stages.process import cli
from stages.trainers import REPORT, TRAINERS, Trainer
from stages.trainers.batch import read_part
from stages.trainers.rules import Tally
from stages.trainers.vocab import VocabCounts


# ------------------------------------------------------------------------- export


def export(trainer: Trainer, merged: Path, out: Path, max_length: Optional[int] = None,
           vocab: Optional[VocabCounts] = None, drop_refused: bool = False) -> dict:
    """Write the export of `merged` for `trainer` to `out`; return its report."""
    start = time.perf_counter()
    check_paths(merged, out)
    shards = list_shards(merged)
    tally = Tally(trainer.rules, max_length, trainer.default_max_length)
    with outputs.atomic_dir(out) as tmp:
        sink = trainer.writer(tmp, vocab)
        for index, path in enumerate(shards):
            with open_shard(path) as reader:
                differences = schema_differences(reader.schema)
                if differences:
                    raise StageError(f"{path}: {'; '.join(differences)} (not a merged set)")
                sink.begin(index, len(shards))
                parts = reader.ahead(lambda batch: (batch, read_part(batch, path, max_length)))
                for batch, part in parts:
                    if not batch.num_rows:
                        continue
                    if drop_refused:
                        refused = tally.refuse(part)
                        if refused.any():
                            part = read_part(batch.filter(arrays.array(~refused)), path, max_length)
                        if not len(part.lengths):
                            continue
                    sink.write(part)
                    tally.add(part)
                sink.end()
        if not tally.rows:
            left = sum(map(len, tally.left_out.values()))
            raise StageError(f"{merged}: no rows to export"
                             + (f" ({left} left out by --drop-refused)" if left else ""))
        written = sink.finish()
        report = _report(trainer, merged, out, tally, written)
        report["seconds"] = round(time.perf_counter() - start, 3)
        outputs.write_json(tmp / REPORT, report)
    return report


def _report(trainer: Trainer, merged: Path, out: Path, tally: Tally, written: dict) -> dict:
    report = {
        "for": trainer.name,
        "merged": str(merged),
        "merged_state_hash": fingerprint.read_state_hash(merged / STATE_FILE),
        "fingerprint": _json_or_none(merged / fingerprint.FILE),
        "out": str(out),
        **written,
        "rows": tally.rows,
        "tokens": tally.tokens,
        "supervised_tokens": tally.supervised,
        "longest_row": tally.longest,
        "max_length": tally.max_length_used(),
        "max_length_from": "--max-length" if tally.max_length is not None else "the longest row",
        "exported": ("every row not left out" if tally.left_out else "every row")
        + ", in dataset order, ids and token values unchanged",
        "left_out": {key: {"rows": len(ids), "ids": ids} for key, ids in tally.left_out.items()},
        "rows_the_trainer_does_not_take_whole": tally.affected,
        "trainer_will": tally.section(),
        "trainer_default_max_length": {"key": trainer.max_length_key,
                                       "value": trainer.default_max_length,
                                       "rows_longer": tally.over_default},
    }
    report["settings"] = trainer.settings(out, report)
    return report


def _json_or_none(path: Path):
    """The JSON object at `path` (reading.json_file: bounded, regular files only), None
    when it is missing or not a JSON object; a FIFO or a device is a StageError."""
    try:
        return json_file(path)
    except (FileNotFoundError, IsADirectoryError):
        return None
    except StageError:
        if regular(path):
            return None
        raise


def check_paths(merged: Path, out: Path) -> None:
    """--merged is a folder; --out is new, empty or an earlier export, and neither holds
    the other (replacing --out must never touch the merged set)."""
    if not merged.is_dir():
        raise StageError(f"--merged {merged}: not a folder")
    outputs.check_apart({"--merged": merged}, [("--out", out)])
    if out.is_symlink() or out.exists():
        if not out.is_dir():
            raise StageError(f"--out {out}: exists and is not a folder")
        earlier = _json_or_none(out / REPORT)
        if any(out.iterdir()) and not (isinstance(earlier, dict) and "for" in earlier):
            raise StageError(f"--out {out}: a folder that is not an earlier export (no "
                             f"{REPORT}); name a new or empty folder")


# ------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one `error:` line and status 1, like every failure
        raise StageError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m stages.export", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--for", dest="trainer", required=True, choices=sorted(TRAINERS),
                   help="the trainer that reads the export")
    p.add_argument("--merged", type=Path, required=True, metavar="PATH",
                   help="the merged set (read only)")
    p.add_argument("--out", type=Path, required=True, metavar="PATH",
                   help="folder the export is written to (replaced whole)")
    p.add_argument("--max-length", type=int, metavar="N",
                   help="the max length the trainer will run with (default: the longest row)")
    p.add_argument("--draft-vocab-size", type=int, metavar="N",
                   help="specforge: write EAGLE-3's vocab_mapping.pt for this draft vocabulary")
    p.add_argument("--target-vocab-size", type=int, metavar="N",
                   help="specforge: the target model's vocab_size (its config's)")
    p.add_argument("--drop-refused", action="store_true",
                   help="leave out the rows the trainer would drop (named in export.json); "
                        "specforge: DFlash's rule, which covers EAGLE-3's")
    return p


def _vocab(args: argparse.Namespace) -> Optional[VocabCounts]:
    given = args.draft_vocab_size is not None or args.target_vocab_size is not None
    if not given:
        return None
    if args.trainer != "specforge":
        raise StageError("--draft-vocab-size/--target-vocab-size: only with --for specforge")
    if args.draft_vocab_size is None or args.target_vocab_size is None:
        raise StageError("--draft-vocab-size and --target-vocab-size go together")
    return VocabCounts(args.draft_vocab_size, args.target_vocab_size)


def summary(report: dict) -> list[str]:
    """What stdout says: the export, what the trainer will do with which rows, settings."""
    files = report["files"]
    shards = [name for name in files if name.endswith(".arrow")]
    what = (f"{len(shards)} shards of {', '.join(report['columns'])}" if shards
            else ", ".join(files))
    lines = [
        f"export for {report['for']}: {report['rows']} rows, {report['tokens']} tokens "
        f"({report['supervised_tokens']} supervised) -> {report['out']} ({what})",
    ]
    where = f"at max_length {report['max_length']} ({report['max_length_from']})"
    exported = ("every row not left out is exported, in dataset order" if report["left_out"]
                else "every row is exported, in dataset order")
    for key, left in report["left_out"].items():
        more = " ..." if left["rows"] > 3 else ""
        lines.append(f"left out (--drop-refused) {left['rows']} rows the trainer would drop "
                     f"({key}): {', '.join(left['ids'][:3])}{more}")
    affected = report["rows_the_trainer_does_not_take_whole"]
    if not affected:
        lines.append(f"{exported}; {where} the trainer takes "
                     "every one whole")
    else:
        lines.append(f"{exported}; {where} the trainer does not "
                     f"take {affected} whole (ids in {Path(report['out']) / REPORT}):")
    for effect in report["trainer_will"].values():
        if effect["rows"]:
            more = " ..." if effect["rows"] > 3 else ""
            lines.append(f"  {effect['rows']} {effect['action']}: {effect['rule']}: "
                         f"{', '.join(effect['ids'][:3])}{more}")
    mapping = report.get("vocab_mapping")
    if mapping:
        lines.append(f"vocab mapping: a draft vocabulary of {mapping['draft_vocab_size']} "
                     f"ids ({mapping['distinct_supervised_tokens']} distinct supervised ids "
                     f"seen) covers {mapping['supervised_tokens_covered']:.2%} of the "
                     "supervised tokens")
    return lines + report["settings"]


def main(argv=None) -> int:
    def work():
        args = parser().parse_args(argv)
        if args.max_length is not None and not 1 <= args.max_length <= INT32:
            raise StageError(f"--max-length {args.max_length}: must be from 1 to "
                             f"{INT32} (no row is longer: offsets are int32)")
        report = export(TRAINERS[args.trainer], args.merged, args.out, args.max_length,
                        _vocab(args), args.drop_refused)
        print(secrets.WRITTEN("\n".join(summary(report))))

    return cli.reported("export", work)


if __name__ == "__main__":
    sys.exit(main())
