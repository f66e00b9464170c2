"""Hand the merged set to the trainer that will read it, in that trainer's own format.

    python -m stages.export --for trl       --merged data/merged --out export/trl
    python -m stages.export --for specforge --merged data/merged --out export/specforge
    python -m stages.export --for axolotl   --merged data/merged --out export/axolotl

trl: a save_to_disk folder of `id`, `input_ids`, `assistant_masks`; specforge:
`train.jsonl` (and `vocab_mapping.pt` with `--draft-vocab-size`); axolotl: a save_to_disk
folder of exactly `input_ids`, `attention_mask`, `labels`. Every row is exported, in
dataset order, unchanged; what the trainer then cuts or drops at `--max-length` is
counted and named in OUT/export.json and on stdout. `--drop-refused` leaves out the rows
the trainer would drop, each named in export.json (`left_out`). Streamed from the merged shards'
memory maps, written beside --out and renamed over it; nothing under --merged is opened
for writing. Why each layout, and each trainer's settings: docs/stages.md, "Hand it to a
trainer".
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import datasets
import numpy as np
import orjson
import pyarrow as pa

from stages.common import outputs, secrets
from stages.common.errors import StageError, json_file, regular
from stages.dataset import fingerprint
from stages.dataset.loader import IGNORE
from stages.dataset.schema import schema_differences
from stages.dataset.shards import (
    STATE_FILE,
    ShardFile,
    list_shards,
    open_shard,
    shard_name,
    write_metadata,
)
from stages.process import cli

REPORT = "export.json"  # in --out, beside what the trainer reads
MAX_VOCAB = 1 << 24  # --target-vocab-size: 128 MiB of counts; real vocabularies are < 2**18
JSONL = "train.jsonl"
VOCAB_MAPPING = "vocab_mapping.pt"
MAX_NAMED = 20  # ids named per kind of row a trainer does not take whole (counts are whole)

TRL_FEATURES = datasets.Features({
    "id": datasets.Value("string"),
    "input_ids": datasets.List(datasets.Value("int32")),
    "assistant_masks": datasets.List(datasets.Value("int8")),
})
# int64 labels: PyTorch's cross-entropy refuses int32 targets, and a trainer that formats
# the dataset as torch tensors hands the column's own type to the loss
AXOLOTL_FEATURES = datasets.Features({
    "input_ids": datasets.List(datasets.Value("int32")),
    "attention_mask": datasets.List(datasets.Value("int8")),
    "labels": datasets.List(datasets.Value("int64")),
})


# ------------------------------------------------------------------ one record batch


class Part(NamedTuple):
    """One record batch of the merged set, checked, with what trainers decide rows by:
    its tokens as the trainer sees them, in each row's first max_length (all without a
    max_length)."""

    id: pa.Array
    input_ids: pa.Array
    loss_mask: pa.Array
    offsets: np.ndarray  # row boundaries into ids/mask, from 0
    ids: np.ndarray  # int32 token ids of the batch's rows back to back (zero-copy)
    mask: np.ndarray  # int8
    lengths: np.ndarray
    trained: np.ndarray  # per token: supervised, and in its row's first max_length
    trained_per_row: np.ndarray
    adjacent: np.ndarray  # per row: two trained tokens next to each other


def read_part(batch: pa.RecordBatch, path: Path, max_length: Optional[int]) -> Part:
    """The batch as a Part, or a StageError naming the shard and row it cannot export."""
    id_col, ids_col, mask_col = (batch.column(name) for name in ("id", "input_ids", "loss_mask"))
    if id_col.null_count:
        raise StageError(f"{path}: an id is null (run validate)")
    for name, col in (("input_ids", ids_col), ("loss_mask", mask_col)):
        if col.null_count:
            raise StageError(f"{path}: row {_row_id(id_col, _first(col.is_null()))}: "
                             f"{name} is null (run validate)")
    offsets, ids = _flat(ids_col)
    mask_offsets, mask = _flat(mask_col)
    lengths = np.diff(offsets)
    if not np.array_equal(offsets, mask_offsets):
        bad = _first(lengths != np.diff(mask_offsets))
        raise StageError(f"{path}: row {_row_id(id_col, bad)}: "
                         "input_ids and loss_mask lengths differ (run validate)")
    # one pass per check; which row is bad is looked up only when one is
    as_bytes = mask.view(np.uint8)  # -1 reads as 255
    for what, wrong, bad in (
            ("a loss_mask value other than 0 and 1", lambda: as_bytes.max() > 1,
             lambda: as_bytes > 1),
            ("a negative token id", lambda: ids.min() < 0, lambda: ids < 0)):
        if len(ids) and wrong():
            row = int(np.searchsorted(offsets, _first(bad()), side="right")) - 1
            raise StageError(f"{path}: row {_row_id(id_col, row)} holds {what} (run validate)")
    trained = mask.view(np.bool_)  # 0 and 1 only, checked above
    if max_length is not None and (lengths > max_length).any():
        trained = trained.copy()
        for row in np.flatnonzero(lengths > max_length):
            trained[offsets[row] + max_length:offsets[row + 1]] = False
    pairs = np.zeros(len(ids), bool)  # pairs[i]: tokens i and i + 1 trained, in one row
    if len(ids) > 1:
        np.logical_and(trained[:-1], trained[1:], out=pairs[:-1])
        pairs[offsets[1:-1] - 1] = False  # across a row boundary (pairs[-1] stays False)
    return Part(
        id_col, ids_col, mask_col, offsets, ids, mask, lengths, trained,
        _per_row(trained, offsets), _per_row(pairs, offsets) > 0,
    )


def _per_row(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """How many flags are set in each row."""
    at = np.flatnonzero(flags)  # sorted: each row's flags lie between two of its offsets
    return np.searchsorted(at, offsets[1:]) - np.searchsorted(at, offsets[:-1])


def _first(flags) -> int:
    """The index of the first true flag."""
    return int(np.flatnonzero(np.asarray(flags))[0])


def _row_id(ids: pa.Array, row: int) -> str:
    return repr(ids[row].as_py())


def _flat(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Row offsets (from 0) and the flattened values of a list column (zero-copy)."""
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values.slice(offsets[0], offsets[-1] - offsets[0]).to_numpy()
    return offsets - offsets[0], values


# ------------------------------------------------------- what a trainer does not take


@dataclass(frozen=True)
class Effect:
    """A kind of row the trainer does not take whole, and what it does with it."""

    key: str
    action: str
    rule: str  # how the trainer decides, {L} standing for max_length
    rows: Callable[[Part, int], np.ndarray]  # per row of a part: affected (max_length)

    @property
    def refused(self) -> bool:
        """The trainer drops the row (rather than cutting it)."""
        return self.action.startswith("dropped")


def _longer(part: Part, max_length: int) -> np.ndarray:
    return part.lengths > max_length


def _none_supervised(part: Part, max_length: int) -> np.ndarray:
    return part.trained_per_row == 0


def _no_two_adjacent(part: Part, max_length: int) -> np.ndarray:
    return ~part.adjacent


def _shorter_than_two(part: Part, max_length: int) -> np.ndarray:
    return part.lengths < 2


class Tally:
    """Rows, tokens and the rows each Effect names, over the parts of an export."""

    def __init__(self, effects: tuple[Effect, ...], max_length: Optional[int],
                 default_max_length: int):
        self.effects = effects
        self.max_length = max_length
        self.default_max_length = default_max_length
        self.rows = self.tokens = self.supervised = self.longest = 0
        self.over_default = 0
        self.affected = 0  # rows named by at least one effect
        self.named: dict[str, list[str]] = {e.key: [] for e in effects}
        self.counts: dict[str, int] = {e.key: 0 for e in effects}
        self.left_out: dict[str, list[str]] = {}  # --drop-refused: every id, by first rule

    def _limit(self) -> int:
        # no cut: every row fits max_length, which is then the longest row
        return self.max_length if self.max_length is not None else np.iinfo(np.int64).max

    def refuse(self, part: Part) -> np.ndarray:
        """Per row of `part`: one the trainer drops; each such id is named in left_out."""
        refused = np.zeros(len(part.lengths), bool)
        for effect in (e for e in self.effects if e.refused):
            hit = effect.rows(part, self._limit()) & ~refused
            if hit.any():
                self.left_out.setdefault(effect.key, []).extend(
                    part.id.take(np.flatnonzero(hit)).to_pylist())
            refused |= hit
        return refused

    def add(self, part: Part) -> None:
        self.rows += len(part.lengths)
        self.tokens += len(part.ids)
        self.supervised += int(np.count_nonzero(part.mask == 1))
        self.longest = max(self.longest, int(part.lengths.max(initial=0)))
        self.over_default += int(np.count_nonzero(part.lengths > self.default_max_length))
        limit = self._limit()
        any_effect = np.zeros(len(part.lengths), bool)
        for effect in self.effects:
            hit = effect.rows(part, limit)
            any_effect |= hit
            self.counts[effect.key] += int(np.count_nonzero(hit))
            room = MAX_NAMED - len(self.named[effect.key])
            if room > 0 and hit.any():
                self.named[effect.key] += part.id.take(np.flatnonzero(hit)[:room]).to_pylist()
        self.affected += int(np.count_nonzero(any_effect))

    def max_length_used(self) -> int:
        return self.max_length if self.max_length is not None else self.longest

    def section(self) -> dict:
        length = self.max_length_used()
        return {
            effect.key: {"action": effect.action, "rule": effect.rule.format(L=length),
                         "rows": self.counts[effect.key], "ids": self.named[effect.key]}
            for effect in self.effects
        }


# ------------------------------------------------------------------------ writers


class ArrowFolder:
    """A save_to_disk folder of `features`, one shard for each shard of the merged set."""

    def __init__(self, folder: Path, features: datasets.Features,
                 columns: Callable[[Part], list[pa.Array]]):
        self.folder = folder
        self.features = features
        self.schema = features.arrow_schema
        self.columns = columns
        self.names: list[str] = []
        self._shard: Optional[ShardFile] = None

    def begin(self, index: int, total: int) -> None:
        self.names.append(shard_name(index, total))
        self._shard = ShardFile(self.folder / self.names[-1], self.schema)

    def write(self, part: Part) -> None:
        arrays = [array.cast(field.type)  # list item names may differ; values never do
                  for array, field in zip(self.columns(part), self.schema)]
        self._shard.write(pa.RecordBatch.from_arrays(arrays, schema=self.schema))

    def end(self) -> None:
        self._shard.close()
        self._shard = None

    def finish(self) -> dict:
        write_metadata(self.folder, self.names, features=self.features)
        return {"files": self.names, "columns": list(self.features)}


def _trl_columns(part: Part) -> list[pa.Array]:
    return [part.id, part.input_ids, part.loss_mask]


def _axolotl_columns(part: Part) -> list[pa.Array]:
    offsets = pa.array(part.offsets.astype(np.int32))
    labels = np.where(part.mask == 1, part.ids, IGNORE).astype(np.int64)
    return [part.input_ids,
            pa.ListArray.from_arrays(offsets, pa.array(np.ones(len(part.ids), np.int8))),
            pa.ListArray.from_arrays(offsets, pa.array(labels))]


class JsonLines:
    """SpecForge's prompts file, and with a draft vocabulary its EAGLE-3 mapping."""

    def __init__(self, folder: Path, vocab: Optional["VocabCounts"]):
        self.folder = folder
        self.vocab = vocab
        self._file = open(folder / JSONL, "wb")

    def begin(self, index: int, total: int) -> None:
        pass

    def write(self, part: Part) -> None:
        ids, mask, offsets = part.ids, part.mask, part.offsets
        lines = []
        for k, row_id in enumerate(part.id.to_pylist()):
            lo, hi = offsets[k], offsets[k + 1]
            lines.append(orjson.dumps({"input_ids": ids[lo:hi], "loss_mask": mask[lo:hi],
                                       "id": row_id}, option=orjson.OPT_SERIALIZE_NUMPY))
        lines.append(b"")
        self._file.write(b"\n".join(lines))
        if self.vocab is not None:
            self.vocab.add(part)

    def end(self) -> None:
        pass

    def finish(self) -> dict:
        self._file.close()
        out = {"files": [JSONL], "record_keys": ["input_ids", "loss_mask", "id"]}
        if self.vocab is not None:
            out["vocab_mapping"] = self.vocab.save(self.folder / VOCAB_MAPPING)
            out["files"].append(VOCAB_MAPPING)
        return out


class VocabCounts:
    """Supervised-token counts (in each row's first max_length tokens, as SpecForge cuts
    them) and the EAGLE-3 vocabulary mapping built from them.

    SpecForge's rule (specforge/data/preprocessing.py, process_token_dict_to_mappings):
    the draft vocabulary is the `draft` most frequent supervised tokens, topped up with
    unseen tokens from the lowest ids when fewer were seen; `d2t[i] = used[i] - i` over
    the chosen ids in ascending order, `t2d` marks them over the target vocabulary.
    Ties at the cut go to the lower id here (SpecForge: to the token counted first).
    """

    def __init__(self, draft: int, target: int):
        self.draft = draft
        self.target = target
        self.counts = np.zeros(target, np.int64)

    def add(self, part: Part) -> None:
        tokens = part.ids[part.trained]
        if len(tokens) and int(tokens.max()) >= self.target:
            raise StageError(f"--target-vocab-size {self.target}: the set holds token id "
                             f"{int(tokens.max())}; give the target model's vocab_size")
        self.counts += np.bincount(tokens, minlength=self.target)

    def mapping(self) -> tuple[np.ndarray, np.ndarray]:
        """(d2t int64 [draft], t2d bool [target])."""
        ranked = np.lexsort((np.arange(self.target), -self.counts))  # count down, id up
        used = np.sort(ranked[: self.draft])
        t2d = np.zeros(self.target, bool)
        t2d[used] = True
        return (used - np.arange(self.draft)).astype(np.int64), t2d

    def save(self, path: Path) -> dict:
        try:
            import torch
        except ImportError:
            raise StageError("--draft-vocab-size: writing vocab_mapping.pt needs torch "
                             "(pip install the demo extra)") from None
        d2t, t2d = self.mapping()
        with outputs.atomic_file(path, "wb") as f:
            torch.save({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)}, f)
        total = int(self.counts.sum())
        covered = int(self.counts[t2d].sum())
        return {"file": VOCAB_MAPPING, "draft_vocab_size": self.draft,
                "target_vocab_size": self.target,
                "distinct_supervised_tokens": int(np.count_nonzero(self.counts)),
                "supervised_tokens_covered": round(covered / total, 6) if total else 0.0}


# ----------------------------------------------------------------------- trainers


@dataclass(frozen=True)
class Trainer:
    name: str
    default_max_length: int  # the trainer's own default
    max_length_key: str  # where its max length is set
    effects: tuple[Effect, ...]
    writer: Callable[[Path, Optional[VocabCounts]], object]  # ArrowFolder or JsonLines
    settings: Callable[[Path, dict], list[str]]  # what to set, from the export's report


def _length_note(report: dict, verb: str) -> str:
    """Why max_length is what it is, and what the trainer's default would do."""
    longer = report["trainer_will"]["longer_than_max_length"]["rows"]
    default = report["trainer_default_max_length"]
    given = (f"{verb}s {longer} rows longer" if longer else f"{verb}s none") + \
        f" (longest row {report['longest_row']})"
    return f"{given}; the default {default['value']} would {verb} {default['rows_longer']}"


def _trl_settings(out: Path, report: dict) -> list[str]:
    return [
        "SFTConfig settings that matter (TRL 1.16):",
        f"  max_length={report['max_length']}  # {_length_note(report, 'cut')}",
        "  assistant_only_loss=False  # the default: the labels come from assistant_masks "
        "(True is for conversational text and raises here)",
        "  dataset_kwargs=None  # keep dataset preparation: it builds the labels from "
        "assistant_masks (skip_prepare_dataset=True refuses mask columns without labels)",
        "  packing=True  # optional: rows packed without padding (bfd; TRL runs it with "
        "flash-attention); off, each batch is padded",
        f"train_dataset = datasets.load_from_disk({str(out)!r})  "
        "# its map() cache files are written into that folder",
    ]


def _specforge_settings(out: Path, report: dict) -> list[str]:
    lines = [
        "SpecForge config keys (0.2.0):",
        f"  data.prompts_path: {out / JSONL}  # one JSONL file: a folder is not read",
        f"  data.max_length: {report['max_length']}  # {_length_note(report, 'cut')}",
    ]
    mapping = report.get("vocab_mapping")
    if mapping:
        lines.append(f"  model.vocab_mapping_path: {out / VOCAB_MAPPING}  # EAGLE-3, a draft "
                     f"config with draft_vocab_size {mapping['draft_vocab_size']} and "
                     f"vocab_size {mapping['target_vocab_size']}")
    else:
        lines.append("  model.vocab_mapping_path: for EAGLE-3 with a smaller draft vocabulary, "
                     "export again with --draft-vocab-size and --target-vocab-size")
    return lines


def _axolotl_settings(out: Path, report: dict) -> list[str]:
    return [
        "axolotl config keys:",
        f"  datasets: [{{path: {out}, type: }}]  # empty type: already tokenized",
        f"  sequence_len: {report['max_length']}  # {_length_note(report, 'drop')}",
    ]


LONGER_CUT = Effect("longer_than_max_length", "cut",
                    "longer than {L} tokens: the trainer keeps the first {L}", _longer)
TRAINERS = {
    "trl": Trainer("trl", 1024, "SFTConfig.max_length", (
        LONGER_CUT,
        Effect("no_supervised_token", "dropped",
               "no supervised token in the first {L}: SFTTrainer drops a row whose labels "
               "are all -100 after its cut (when packing is off)", _none_supervised),
    ), lambda folder, vocab: ArrowFolder(folder, TRL_FEATURES, _trl_columns), _trl_settings),
    "specforge": Trainer("specforge", 2048, "data.max_length", (
        LONGER_CUT,
        Effect("eagle3_no_supervised_token", "dropped by EAGLE-3",
               "no supervised token in the first {L} (EAGLE-3 needs 1)", _none_supervised),
        Effect("dflash_no_two_adjacent_supervised", "dropped by DFlash",
               "no two adjacent supervised tokens in the first {L}", _no_two_adjacent),
    ), JsonLines, _specforge_settings),
    "axolotl": Trainer("axolotl", 512, "sequence_len", (
        Effect("longer_than_max_length", "dropped",
               "longer than {L} tokens: dropped (excess_length_strategy drop, the default; "
               "truncate keeps the first {L})", _longer),
        Effect("shorter_than_min_sample_len", "dropped", "fewer than 2 tokens (min_sample_len)",
               _shorter_than_two),
        Effect("no_supervised_token", "dropped",
               "no supervised token in the first {L}: all labels -100 (axolotl 0.19 drops "
               "these in preprocessing with sample_packing on)", _none_supervised),
    ), lambda folder, vocab: ArrowFolder(folder, AXOLOTL_FEATURES, _axolotl_columns),
        _axolotl_settings),
}


# ------------------------------------------------------------------------- export


def export(trainer: Trainer, merged: Path, out: Path, max_length: Optional[int] = None,
           vocab: Optional[VocabCounts] = None, drop_refused: bool = False) -> dict:
    """Write the export of `merged` for `trainer` to `out`; return its report."""
    start = time.perf_counter()
    check_paths(merged, out)
    shards = list_shards(merged)
    tally = Tally(trainer.effects, max_length, trainer.default_max_length)
    with outputs.atomic_dir(out) as tmp:
        sink = trainer.writer(tmp, vocab)
        for index, path in enumerate(shards):
            with open_shard(path, drop_behind=True) as reader:
                differences = schema_differences(reader.schema)
                if differences:
                    raise StageError(f"{path}: {'; '.join(differences)} (not a merged set)")
                sink.begin(index, len(shards))
                for batch in (b for b in reader if b.num_rows):
                    part = read_part(batch, path, max_length)
                    if drop_refused:
                        refused = tally.refuse(part)
                        if refused.any():
                            part = read_part(batch.filter(pa.array(~refused)), path, max_length)
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
    """The JSON object at `path` (errors.json_file: bounded, regular files only), None
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
    if not 1 <= args.target_vocab_size <= MAX_VOCAB:  # a count per id is allocated
        raise StageError(f"--target-vocab-size {args.target_vocab_size}: must be between 1 "
                         f"and {MAX_VOCAB}, more than any tokenizer's vocabulary")
    if not 1 <= args.draft_vocab_size <= args.target_vocab_size:
        raise StageError(f"--draft-vocab-size {args.draft_vocab_size}: must be between 1 and "
                         f"--target-vocab-size {args.target_vocab_size}")
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
        if args.max_length is not None and args.max_length < 1:
            raise StageError(f"--max-length {args.max_length}: must be >= 1")
        report = export(TRAINERS[args.trainer], args.merged, args.out, args.max_length,
                        _vocab(args), args.drop_refused)
        print(secrets.WRITTEN("\n".join(summary(report))))

    return cli.reported("export", work)


if __name__ == "__main__":
    sys.exit(main())
