"""Tokenized sets written for the tests: a base as `datasets` saves it (merge's input), a
merged folder as merge writes it (validate's and export's input), a small set for the
viewer, and a shard whose offsets lie."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa

from stages.dataset.schema import ARROW_SCHEMA, FEATURES

from stages.dataset.shards import ShardFile, shard_name, write_metadata

# ----------------------------------------------------------- a base, as datasets saves it

BASE_FP = {
    "tokenizer": {"name": "tok", "vocab_sha256": "a" * 64, "vocab_size": 1000,
                  "special_tokens": {"<|im_end|>": 7}},
    "chat_template_sha256": "c" * 64,
    "policy": {"multi_turn": "last"},
    "versions": {"datasets": datasets.__version__},
}


def rows(ids: list[str], source: str = "s", tag: int = 0) -> dict:
    """Valid tokenized rows; `tag` goes into the first token so versions can be told apart."""
    n = len(ids)
    return {
        "id": ids,
        "source": [source] * n,
        "input_ids": [[tag, 11, 12, 13, 14] for _ in range(n)],
        "loss_mask": [[0, 0, 1, 1, 1] for _ in range(n)],
        "num_tokens": [5] * n,
        "num_loss_tokens": [3] * n,
    }


def save(folder: Path, data: dict, shards: int = 1, fingerprint: dict | None = BASE_FP) -> None:
    """A real datasets save_to_disk folder (+ fingerprint.json)."""
    datasets.Dataset.from_dict(data, features=FEATURES).save_to_disk(
        str(folder), num_shards=shards
    )
    if fingerprint is not None:
        (folder / "fingerprint.json").write_text(json.dumps(fingerprint))


def ids(prefix: str, n: int, start: int = 0) -> list[str]:
    return [f"{prefix}{i}" for i in range(start, start + n)]


# ------------------------------------------------------ data/merged, as merge writes it

VOCAB = 1000
MERGED_FP = {"tokenizer": {"name": "tok", "vocab_sha256": "a" * 64, "vocab_size": VOCAB,
                    "special_tokens": {}},
      "chat_template_sha256": "c" * 64, "policy": {"max_seq_len": 64, "min_loss_tokens": 1},
      "versions": {}}


def row(rid: str, source: str = "alpha", prompt: int = 3, answer: int = 4) -> dict:
    ids = [(7 * len(rid) + k) % VOCAB for k in range(prompt + answer)]
    return {"id": rid, "source": source, "input_ids": ids,
            "loss_mask": [0] * prompt + [1] * answer,
            "num_tokens": prompt + answer, "num_loss_tokens": answer}


def shards(n_shards: int = 2, per: int = 5) -> list[list[dict]]:
    return [[row(f"s{s}-r{r}", "alpha" if r % 2 else "beta", prompt=2 + r, answer=3 + s)
             for r in range(per)] for s in range(n_shards)]


def write(root: Path, parts: list[list[dict]], schemas=None, report_rows: int | None = None,
          fingerprint: dict | None = MERGED_FP) -> None:
    """data/merged as merge writes it, built with pyarrow alone (+ reports/merge.json)."""
    folder = root / "data/merged"
    folder.mkdir(parents=True)
    names = []
    for i, part in enumerate(parts):
        schema = (schemas or {}).get(i, ARROW_SCHEMA)
        table = pa.Table.from_pylist(part, schema=schema)
        name = f"data-{i:05d}-of-{len(parts):05d}.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink, \
                pa.ipc.new_stream(sink, schema) as writer:
            writer.write_table(table, max_chunksize=2)  # several record batches per shard
        names.append(name)
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "t",
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}
    (folder / "state.json").write_text(json.dumps(state))
    (folder / "dataset_info.json").write_text(json.dumps({"features": FEATURES.to_dict()}))
    if fingerprint is not None:
        (folder / "fingerprint.json").write_text(json.dumps(fingerprint))
    rows = sum(len(p) for p in parts) if report_rows is None else report_rows
    (root / "reports").mkdir(exist_ok=True)
    (root / "reports/merge.json").write_text(json.dumps({"merged": {"rows": rows}}))


# --------------------------------------------------------------------- for the viewer


class SetFacts:
    """What the viewer reads of a set beside its rows: fingerprint and lineage."""

    def __init__(self, fingerprint=None, lineage=None):
        self.fingerprint = fingerprint or {}
        self.lineage = lineage or {}

    def describe(self):
        return "a test set"


def write_set(folder: Path, rows: dict[str, tuple[list[int], list[int]]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    ids = list(rows)
    tokens = [rows[i][0] for i in ids]
    masks = [rows[i][1] for i in ids]
    with ShardFile(folder / shard_name(0, 1)) as shard:
        shard.write(pa.RecordBatch.from_arrays(
            [pa.array(ids), pa.array(["s"] * len(ids)), pa.array(tokens, pa.list_(pa.int32())),
             pa.array(masks, pa.list_(pa.int8())), pa.array([len(t) for t in tokens], pa.int32()),
             pa.array([sum(m) for m in masks], pa.int32())], schema=ARROW_SCHEMA))
    (folder / "fingerprint.json").write_text(json.dumps({"tokenizer": {"name": "bundled:qwen3.6"}}))
    write_metadata(folder, [shard_name(0, 1)])


def damaged_tokens_shard(path: Path) -> Path:
    """A shard of rows a (2 tokens) and b (3), whose input_ids offsets say b ends at
    token 99 of 5 (its id column sound)."""
    batch = pa.RecordBatch.from_arrays(
        [pa.array(["a", "b"]), pa.array(["s", "s"]),
         pa.array([[7, 8], [9, 10, 11]], pa.list_(pa.int32())),
         pa.array([[0, 1], [0, 1, 1]], pa.list_(pa.int8())), pa.array([2, 3], pa.int32()),
         pa.array([1, 2], pa.int32())], schema=ARROW_SCHEMA)
    with ShardFile(path) as shard:
        shard.write(batch)
    raw = path.read_bytes()
    good = np.array([0, 2, 5], np.int32).tobytes()
    assert raw.count(good) == 2  # input_ids' offsets, then loss_mask's
    path.write_bytes(raw.replace(good, np.array([0, 2, 99], np.int32).tobytes(), 1))
    return path


# ------------------------------------------------ a merged set of rows trainers refuse


def edge_row(rid: str, mask: list[int]) -> dict:
    return {"id": rid, "source": "s", "input_ids": [(7 * k + len(rid)) % 5000 + 10
                                                   for k in range(len(mask))],
            "loss_mask": mask, "num_tokens": len(mask), "num_loss_tokens": sum(mask)}


L = 8
EDGE_ROWS = [
    edge_row("fine", [0, 0, 0, 1, 1, 1]),
    edge_row("long", [0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1]),  # cut at L, still trained
    edge_row("late", [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]),  # cut at L: nothing supervised left
    edge_row("lonely", [0, 1, 0, 1, 0, 1]),  # supervised, never two in a row
    edge_row("silent", [0, 0, 0, 0]),
    edge_row("one", [0]),
    edge_row("last-pair", [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]),  # the pair at positions 6-7 is in L
]


def write_merged(folder: Path, parts: list[list[dict]], batch_rows: int = 2) -> Path:
    folder.mkdir(parents=True)
    names = [shard_name(i, len(parts)) for i in range(len(parts))]
    for name, part in zip(names, parts):
        with ShardFile(folder / name) as f:
            for batch in pa.Table.from_pylist(part, schema=ARROW_SCHEMA).to_batches(batch_rows):
                f.write(batch)
    write_metadata(folder, names, state="test")
    return folder
