"""export: each trainer's format read by that trainer's own code (TRL's SFTTrainer, which
also trains a step; SpecForge's prompt builder and vocabulary mapping; axolotl's three
columns), the rows each trainer would cut or drop named, flat memory, the merged set
untouched, one-line errors."""

from __future__ import annotations

import ast
import collections
import hashlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
import yaml

from stages import demo
from stages.dataset.schema import ARROW_SCHEMA
from stages.dataset.shards import ShardFile, shard_name, write_metadata
from stages.trainers import REPORT, TRAINERS
from stages.trainers.rules import MAX_NAMED
from stages.trainers.specforge import JSONL
from stages.trainers.vocab import VOCAB_MAPPING
from tests.helpers import stagecli
from tests.helpers.sets import EDGE_ROWS, L, edge_row as row, write_merged
from tests.helpers.stagecli import export_fails as fails
from tests.helpers.repo import ROOT, link_caches

IGNORE = -100


# ------------------------------------------------- a merged set from the real stages


def completion(rid: str, messages: list[dict], tools=None) -> dict:
    row = {"id": rid, "source": "fixture", "messages": messages, "finish_reason": "stop",
           "truncated": False, "model": "m", "sampling": "s"}
    if tools is not None:
        row["tools"] = tools
    return row


def answer(content: str, reasoning: str = "Let me think.", **extra) -> dict:
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, **extra}


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
NEW = [
    completion("new-0", [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Name a prime."}, answer("7.")]),
    completion("new-1", [{"role": "user", "content": "Hi"}, answer("Hello!", "A greeting."),
                         {"role": "user", "content": "Say it in French, 🙂"},
                         answer("Bonjour ! 你好 also works.")]),
    completion("new-2", [
        {"role": "user", "content": "Weather in Paris?"},
        answer("", "I should call the tool.", tool_calls=[
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]),
        {"role": "tool", "content": "18 C, sunny"},
        answer("18 °C and sunny.", "The tool said so."),
    ], tools=TOOLS),
    completion("new-3", [{"role": "user", "content": "Count to five."},
                         answer("1 2 3 4 5", "Easy: " + " ".join(str(k) for k in range(40)))]),
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")


def stage(name: str, *argv, cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", f"stages.{name}", *map(str, argv)], cwd=cwd,
                          capture_output=True, text=True, timeout=600, env=env())
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def pipeline_set(tmp_path_factory):
    """data/merged made by the real tokenize and merge commands: a base of the demo's
    arithmetic answers, then new rows with a system prompt, several turns (all trained:
    masks with gaps), a tool call, thinking and non-ASCII text."""
    root = tmp_path_factory.mktemp("export")
    link_caches(root)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["tokenize"].update(enable_thinking=True, multi_turn="all", shard_rows=6)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    base = [dict(r, finish_reason="stop", truncated=False) for r in demo.base_conversations(8)]
    write_jsonl(root / "base-completions/completions.jsonl", base)
    write_jsonl(root / "data/completions/completions.jsonl", NEW)
    stage("tokenize", "--completions", "base-completions", "--out", "data/base",
          "--reports", "base-reports", cwd=root)
    stage("tokenize", *stagecli.command("tokenize")[3:], cwd=root)
    (root / "data/prompts").mkdir()
    stage("merge", *stagecli.command("merge")[3:], cwd=root)
    rows = datasets.load_from_disk(str(root / "data/merged")).to_list()
    assert len(rows) == len(base) + len(NEW) and len({r["id"] for r in rows}) == len(rows)
    return root, rows


def run_export(trainer: str, merged: Path, out: Path, *extra) -> tuple[dict, str]:
    """`python -m stages.export` as a user runs it: (its report, its stdout)."""
    proc = subprocess.run(
        [sys.executable, "-m", "stages.export", "--for", trainer, "--merged", str(merged),
         "--out", str(out), *map(str, extra)],
        capture_output=True, text=True, timeout=300, env=env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / REPORT).read_text()), proc.stdout


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------- TRL


def sft_trainer(folder: Path, max_length: int, tmp: Path, **config):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model_dir = ROOT / ".cache/demo-model"
    args = SFTConfig(output_dir=str(tmp / "trl-run"), max_length=max_length,
                     per_device_train_batch_size=4, max_steps=1, use_cpu=True, bf16=False,
                     report_to="none", save_strategy="no", logging_steps=1, **config)
    return SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        args=args, train_dataset=datasets.load_from_disk(str(folder)),
        processing_class=AutoTokenizer.from_pretrained(model_dir))


def test_trl_sft_trainer_labels_are_loss_mask_and_one_step_trains(pipeline_set, tmp_path):
    root, rows = pipeline_set
    merged, out = root / "data/merged", tmp_path / "trl"
    before = digest(merged)
    report, stdout = run_export("trl", merged, out)
    assert f"max_length={report['max_length']}" in stdout
    assert report["max_length"] == max(len(r["input_ids"]) for r in rows)
    assert datasets.load_from_disk(str(out)).column_names == ["id", "input_ids", "assistant_masks"]
    trainer = sft_trainer(out, report["max_length"], tmp_path)
    masks = {tuple(r["input_ids"]): r["loss_mask"] for r in rows}
    batch = next(iter(trainer.get_train_dataloader()))
    assert len(batch["input_ids"]) == 4
    for ids, labels, attention in zip(batch["input_ids"], batch["labels"],
                                      batch["attention_mask"]):
        n = int(attention.sum())
        mask = masks[tuple(ids[:n].tolist())]  # the merged row this is
        assert (labels[:n] != IGNORE).int().tolist() == mask
        assert labels[:n][labels[:n] != IGNORE].tolist() == ids[:n][labels[:n] != IGNORE].tolist()
        assert (labels[n:] == IGNORE).all()
    trainer.train()
    loss = trainer.state.log_history[0]["loss"]
    assert math.isfinite(loss) and loss > 0
    assert digest(merged) == before  # TRL's cache files went into the export, not here
    assert list(out.glob("cache-*.arrow"))


def test_trl_packed_batches_keep_rows_and_masks(pipeline_set, tmp_path):
    root, rows = pipeline_set
    report, _ = run_export("trl", root / "data/merged", tmp_path / "trl")
    trainer = sft_trainer(tmp_path / "trl", report["max_length"], tmp_path, packing=True)
    masks = {tuple(r["input_ids"]): r["loss_mask"] for r in rows}
    batch = next(iter(trainer.get_train_dataloader()))
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    cuts = batch["cu_seq_lens_q"].tolist()
    assert cuts[-1] == len(ids) and len(cuts) > 2
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        mask = masks[tuple(ids[lo:hi].tolist())]
        # padding-free batches also ignore each row's first position; ours is never trained
        assert mask[0] == 0 and (labels[lo:hi] != IGNORE).int().tolist() == mask


# -------------------------------------------------------------------- SpecForge


def specforge_prompts(path: Path, max_length: int, dflash: bool = False) -> list[dict]:
    """SpecForge's own reading of a prompts file, as its EAGLE-3 or DFlash run asks."""
    from specforge.data.loss_mask import has_consecutive_supervised_tokens
    from specforge.data.prompt_builder import prepare_prompt_tasks

    return [task["payload"] for task in prepare_prompt_tasks(
        path, None, chat_template=None, max_length=max_length, is_preformatted=False,
        train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=None,
        min_loss_tokens=2 if dflash else 1,
        loss_mask_filter=has_consecutive_supervised_tokens if dflash else None)]


def test_specforge_prompt_builder_reads_every_row_with_its_mask(pipeline_set, tmp_path):
    root, rows = pipeline_set
    report, stdout = run_export("specforge", root / "data/merged", tmp_path / "sf")
    jsonl = tmp_path / "sf" / JSONL
    assert f"data.prompts_path: {jsonl}" in stdout
    assert [json.loads(line)["id"] for line in jsonl.open()] == [r["id"] for r in rows]
    for dflash in (False, True):
        payloads = specforge_prompts(jsonl, report["max_length"], dflash)
        assert payloads == [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}
                            for r in rows]


@pytest.mark.parametrize("draft", [5, 64])  # fewer than the 58 ids seen; more: topped up
def test_specforge_vocab_mapping_is_specforges_rule_on_these_counts(pipeline_set, tmp_path,
                                                                   draft):
    import torch
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency
    from specforge.data.preprocessing import process_token_dict_to_mappings

    root, rows = pipeline_set
    target = 248077  # the demo model's vocab_size
    report, stdout = run_export("specforge", root / "data/merged", tmp_path / "sf",
                                "--draft-vocab-size", draft, "--target-vocab-size", target)
    assert f"model.vocab_mapping_path: {tmp_path / 'sf' / VOCAB_MAPPING}" in stdout
    saved = torch.load(tmp_path / "sf" / VOCAB_MAPPING)
    counts = collections.Counter()
    for r in rows:
        counts.update(t for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    # counted in id order, SpecForge breaks ties at the cut by the lower id as export does
    d2t, t2d = process_token_dict_to_mappings(collections.Counter(dict(sorted(counts.items()))),
                                             draft, target)
    assert torch.equal(saved["d2t"], d2t) and torch.equal(saved["t2d"], t2d)
    assert saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool
    validate_vocab_mapping_consistency(saved["t2d"], saved["d2t"])
    assert report["vocab_mapping"]["distinct_supervised_tokens"] == len(counts)


# ---------------------------------------------------------------------- axolotl


def test_axolotl_has_exactly_its_three_columns(pipeline_set, tmp_path):
    root, rows = pipeline_set
    report, stdout = run_export("axolotl", root / "data/merged", tmp_path / "ax")
    assert f"sequence_len: {report['max_length']}" in stdout
    loaded = datasets.load_from_disk(str(tmp_path / "ax"))
    assert loaded.column_names == ["input_ids", "attention_mask", "labels"]
    assert len(loaded) == len(rows)
    for got, r in zip(loaded, rows):
        assert got["input_ids"] == r["input_ids"]
        assert got["attention_mask"] == [1] * len(r["input_ids"])
        assert got["labels"] == [t if m == 1 else IGNORE
                                 for t, m in zip(r["input_ids"], r["loss_mask"])]


AXOLOTL_PYTHON = ROOT / ".venv-axolotl" / "bin" / "python"


def axolotl_own_run(export: Path, sequence_len: int, work: Path) -> dict:
    """axolotl 0.19.0's own loading, preprocessing and packing of `export`, in its venv
    (tests/helpers/axolotlcpu.py says what runs)."""
    out = work / "axolotl-run.json"
    proc = subprocess.run(
        [str(AXOLOTL_PYTHON), "-m", "tests.helpers.axolotlcpu", str(export), "--sequence-len",
         str(sequence_len), "--work", str(work), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(out.read_text())


def as_rows(rows) -> collections.Counter:
    return collections.Counter((tuple(r["input_ids"]), tuple(r["labels"])) for r in rows)


@pytest.mark.slow  # a real tokenize and merge, then axolotl twice: ~20 s
@pytest.mark.real_engine("axolotl 0.19.0 (CPU): its dataset loading, preprocessing, packing")
@pytest.mark.skipif(not AXOLOTL_PYTHON.exists() and not os.environ.get("CI"),
                    reason="no axolotl venv (.venv-axolotl): run `make trainer-venv` (make test does)")
def test_axolotl_own_code_drops_what_the_export_names_and_packs_labels_in_place(
        pipeline_set, tmp_path):
    """axolotl's `load_datasets` on the export, packing off and on: the rows it keeps are the
    exported rows export.json does not name as dropped (by length; with packing on, also
    those without a supervised token), `input_ids` and `labels` unchanged; its multipack
    sampler and collator put every kept row in one bin once, its labels where they were."""
    root, rows = pipeline_set
    median = sorted(len(r["input_ids"]) for r in rows)[len(rows) // 2]
    sets = {"edge": (write_merged(tmp_path / "edge", [EDGE_ROWS[:3], EDGE_ROWS[3:]]),
                     EDGE_ROWS, L),
            "pipeline": (root / "data/merged", rows, median)}
    for name, (merged, source, sequence_len) in sets.items():
        export = tmp_path / f"{name}-axolotl"
        report, _ = run_export("axolotl", merged, export, "--max-length", sequence_len)
        # every row in dataset order, labels the token where the mask is 1 (else -100)
        exported = datasets.load_from_disk(str(export)).to_list()
        assert [(e["input_ids"], e["labels"]) for e in exported] == [
            (r["input_ids"], [t if m else IGNORE for t, m in zip(r["input_ids"], r["loss_mask"])])
            for r in source]
        ids = {key: set(effect["ids"]) for key, effect in report["trainer_will"].items()}
        assert all(len(ids[k]) == e["rows"] for k, e in report["trainer_will"].items())
        by_length = ids["longer_than_max_length"] | ids["shorter_than_min_sample_len"]
        dropped = {"no_packing": by_length, "packing": by_length | ids["no_supervised_token"]}
        if name == "edge":
            assert dropped["packing"] - by_length == {"silent"}
        assert by_length and len(dropped["packing"]) < len(source), (name, dropped)
        run = axolotl_own_run(export, sequence_len, tmp_path / f"{name}-work")
        assert run["axolotl"] == "0.19.0"
        for key, gone in dropped.items():
            kept = [e for e, r in zip(exported, source) if r["id"] not in gone]
            assert as_rows(run["runs"][key]["rows"]) == as_rows(kept), (name, key)
            assert all(r["attention_mask"] == [1] * len(r["input_ids"])
                       for r in run["runs"][key]["rows"])
        packed = run["runs"]["packing"]
        kept = packed["rows"]
        assert sorted(i for b in packed["batches"] for rows_ in b["bins"] for i in rows_) == \
            list(range(len(kept))), (name, packed["batches"])
        for batch in packed["batches"]:
            for bin_, tokens, labels, attention, positions in zip(
                    batch["bins"], batch["input_ids"], batch["labels"],
                    batch["attention_mask"], batch["position_ids"]):
                at = 0
                for k, index in enumerate(bin_):
                    n = len(kept[index]["input_ids"])
                    assert tokens[at:at + n] == kept[index]["input_ids"], (name, bin_)
                    assert labels[at:at + n] == kept[index]["labels"], (name, bin_)
                    assert attention[at:at + n] == [k + 1] * n
                    assert positions[at:at + n] == list(range(n))
                    at += n
                assert set(labels[at:]) <= {IGNORE} and set(attention[at:]) <= {0}


# ------------------------------------------------ rows a trainer cuts or drops, named


def named(report: dict) -> dict[str, list[str]]:
    return {key: effect["ids"] for key, effect in report["trainer_will"].items()
            if effect["rows"] or effect["ids"]}


def test_what_each_trainer_cuts_or_drops_is_named(tmp_path):
    merged = write_merged(tmp_path / "merged", [EDGE_ROWS[:3], EDGE_ROWS[3:]])
    reports = {t: run_export(t, merged, tmp_path / t, "--max-length", L)[0]
               for t in TRAINERS}
    assert named(reports["trl"]) == {"longer_than_max_length": ["long", "late", "last-pair"],
                                     "no_supervised_token": ["late", "silent", "one"]}
    assert named(reports["specforge"]) == {
        "longer_than_max_length": ["long", "late", "last-pair"],
        "eagle3_no_supervised_token": ["late", "silent", "one"],
        "dflash_no_two_adjacent_supervised": ["late", "lonely", "silent", "one"]}
    assert named(reports["axolotl"]) == {
        "longer_than_max_length": ["long", "late", "last-pair"],
        "shorter_than_min_sample_len": ["one"],
        "no_supervised_token": ["late", "silent", "one"]}
    for report in reports.values():
        assert report["rows"] == len(EDGE_ROWS) and report["max_length"] == L
        assert report["trainer_default_max_length"]["rows_longer"] == 0
    assert reports["trl"]["rows_the_trainer_does_not_take_whole"] == 5
    # the trainers' own code agrees on what it keeps
    jsonl = tmp_path / "specforge" / JSONL
    for dflash, key in ((False, "eagle3_no_supervised_token"),
                        (True, "dflash_no_two_adjacent_supervised")):
        kept = specforge_prompts(jsonl, L, dflash)
        dropped = set(reports["specforge"]["trainer_will"][key]["ids"])
        assert [p["input_ids"] for p in kept] == [
            r["input_ids"][:L] for r in EDGE_ROWS if r["id"] not in dropped]
    trainer = sft_trainer(tmp_path / "trl", L, tmp_path)
    assert trainer.train_dataset["id"] == [
        r["id"] for r in EDGE_ROWS if r["id"] not in ("late", "silent", "one")]
    assert max(len(ids) for ids in trainer.train_dataset["input_ids"]) == L


@pytest.mark.slow  # six exports and an SFTTrainer: ~40 s
def test_drop_refused_leaves_out_what_each_trainer_drops(tmp_path):
    """--drop-refused: the rows left out are the ones named as dropped without it, each by
    id, and the trainer's own code then drops nothing (TRL's SFTTrainer, SpecForge's prompt
    builder for DFlash and EAGLE-3)."""
    merged = write_merged(tmp_path / "merged", [EDGE_ROWS[:3], EDGE_ROWS[3:]])
    for trainer in TRAINERS:
        whole, _ = run_export(trainer, merged, tmp_path / f"{trainer}-whole", "--max-length", L)
        report, stdout = run_export(trainer, merged, tmp_path / trainer, "--max-length", L,
                                    "--drop-refused")
        dropped = {i for effect in whole["trainer_will"].values()
                   if effect["action"].startswith("dropped") for i in effect["ids"]}
        left = [i for effect in report["left_out"].values() for i in effect["ids"]]
        assert sorted(left) == sorted(dropped) and len(left) == len(set(left)), trainer
        assert report["rows"] == len(EDGE_ROWS) - len(dropped)
        assert all(not effect["rows"] for effect in report["trainer_will"].values()
                   if effect["action"].startswith("dropped")), report["trainer_will"]
        assert "left out (--drop-refused)" in stdout
    kept = [r for r in EDGE_ROWS if r["id"] not in ("late", "lonely", "silent", "one")]
    jsonl = tmp_path / "specforge" / JSONL
    assert [json.loads(line)["id"] for line in jsonl.open()] == [r["id"] for r in kept]
    for dflash in (False, True):
        assert [p["input_ids"] for p in specforge_prompts(jsonl, L, dflash)] == [
            r["input_ids"][:L] for r in kept]
    trainer = sft_trainer(tmp_path / "trl", L, tmp_path)
    assert trainer.train_dataset["id"] == [
        r["id"] for r in EDGE_ROWS if r["id"] not in ("late", "silent", "one")]
    axolotl = datasets.load_from_disk(str(tmp_path / "axolotl"))
    assert axolotl["input_ids"] == [r["input_ids"] for r in EDGE_ROWS
                                    if r["id"] in ("fine", "lonely")]


def test_drop_refused_of_every_row_is_a_one_line_error(tmp_path):
    write_merged(tmp_path / "merged", [[row("silent", [0, 0, 0])]])
    message = fails("--for", "trl", "--merged", "merged", "--out", "x", "--drop-refused",
                    cwd=tmp_path)
    assert "no rows to export (1 left out by --drop-refused)" in message
    assert not (tmp_path / "x").exists()


def test_named_ids_are_capped_and_counts_whole(tmp_path):
    rows = [row(f"r{k}", [0, 0]) for k in range(MAX_NAMED + 7)]
    merged = write_merged(tmp_path / "merged", [rows[:11], rows[11:]], batch_rows=4)
    report, stdout = run_export("axolotl", merged, tmp_path / "out")
    effect = report["trainer_will"]["no_supervised_token"]
    assert effect["rows"] == len(rows)
    assert effect["ids"] == [r["id"] for r in rows][: MAX_NAMED]
    assert f"{len(rows)} dropped: no supervised token" in stdout


# ------------------------------------------------------------- memory, paths, errors


def synthetic(folder: Path, rows_per_shard: int, shards: int = 2, seed: int = 0) -> Path:
    """A merged-like set of ~1000-token rows in record batches of 500 rows."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    names = [shard_name(s, shards) for s in range(shards)]
    for s, name in enumerate(names):
        with ShardFile(folder / name) as f:
            for b in range(rows_per_shard // 500):
                lengths = rng.integers(500, 1500, 500)
                offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
                mask = (rng.random(int(lengths.sum())) < 0.6).astype(np.int8)
                f.write(pa.RecordBatch.from_arrays([
                    pa.array([f"s{s}-{b}-{r}" for r in range(500)]), pa.array(["syn"] * 500),
                    pa.ListArray.from_arrays(offsets, pa.array(
                        rng.integers(0, 248000, len(mask)).astype(np.int32))),
                    pa.ListArray.from_arrays(offsets, pa.array(mask)),
                    pa.array(lengths.astype(np.int32)),
                    pa.array(np.add.reduceat(mask, offsets.to_numpy()[:-1], dtype=np.int32))],
                    schema=ARROW_SCHEMA))
    write_metadata(folder, names, state=f"synthetic-{rows_per_shard}")
    return folder


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_memory_stays_flat_as_the_set_doubles(tmp_path, trainer):
    half = synthetic(tmp_path / "half", 2000)  # 4,000 rows, ~4M tokens, ~20 MB
    full = synthetic(tmp_path / "full", 4000)  # twice as many rows in the same shards
    peaks = {}
    for name, merged in (("half", half), ("full", full)):
        proc, kib = stagecli.measured("export", ["--for", trainer, "--merged", merged,
                                                 "--out", tmp_path / f"out-{name}",
                                                 "--max-length", 1000], tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        peaks[name] = kib / 1024
    data_mb = sum(p.stat().st_size for p in full.glob("*.arrow")) / 2**20
    # the full set holds ~20 MB more tokens; a copy of them (or of the output) would show
    assert peaks["full"] - peaks["half"] < data_mb / 8, (peaks, data_mb)


def test_nothing_under_merged_changes(pipeline_set, tmp_path):
    root, _ = pipeline_set
    merged = root / "data/merged"
    before = digest(merged)
    for trainer in TRAINERS:
        run_export(trainer, merged, tmp_path / trainer)
    assert digest(merged) == before


def test_an_earlier_export_is_replaced_whole(tmp_path):
    merged = write_merged(tmp_path / "merged", [EDGE_ROWS])
    out = tmp_path / "out"
    run_export("axolotl", merged, out)
    (out / "cache-stale.arrow").write_bytes(b"old")
    report, _ = run_export("trl", merged, out)
    assert report["for"] == "trl" and not (out / "cache-stale.arrow").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "out"]  # no temporaries


@pytest.mark.parametrize("argv, words", [
    (["--for", "trl", "--out", "x"], "required: --merged"),
    (["--for", "unsloth", "--merged", "merged", "--out", "x"], "invalid choice: 'unsloth'"),
    (["--for", "trl", "--merged", "missing", "--out", "x"], "--merged missing: not a folder"),
    (["--for", "trl", "--merged", "merged", "--out", "merged/trl"], "is inside --merged"),
    (["--for", "trl", "--merged", "merged", "--out", "merged"], "merged is inside --out"),
    (["--for", "trl", "--merged", "merged", "--out", "."], "merged is inside --out ."),
    (["--for", "trl", "--merged", "merged", "--out", "mine"], "not an earlier export"),
    (["--for", "trl", "--merged", "merged", "--out", "x", "--max-length", "0"],
     "must be from 1 to 2147483647"),
    (["--for", "specforge", "--merged", "merged", "--out", "x", "--max-length",
      str(2**63 - 1)], "must be from 1 to 2147483647"),
    (["--for", "trl", "--merged", "merged", "--out", "x", "--draft-vocab-size", "8",
      "--target-vocab-size", "9"], "only with --for specforge"),
    (["--for", "specforge", "--merged", "merged", "--out", "x", "--draft-vocab-size", "8"],
     "go together"),
    (["--for", "specforge", "--merged", "merged", "--out", "x", "--draft-vocab-size", "8",
      "--target-vocab-size", "20"], "--target-vocab-size 20: the set holds token id"),
    (["--for", "specforge", "--merged", "merged", "--out", "x", "--draft-vocab-size", "8",
      "--target-vocab-size", "100000000000"], "must be between 1 and 16777216"),
    (["--for", "trl", "--merged", "merged", "--out", "loop"], "--out loop: exists and is not"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, argv, words):
    write_merged(tmp_path / "merged", [EDGE_ROWS])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine/notes.txt").write_text("keep me")
    (tmp_path / "loop").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop")
    assert words in fails(*argv, cwd=tmp_path)
    assert (tmp_path / "mine/notes.txt").read_text() == "keep me"
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("damage, words", [
    (lambda r: r.update(loss_mask=[2] + r["loss_mask"][1:]), "holds a loss_mask value other"),
    (lambda r: r.update(input_ids=[-5] + r["input_ids"][1:]), "holds a negative token id"),
    (lambda r: r.update(loss_mask=r["loss_mask"][:-1]), "lengths differ"),
    (lambda r: r.update(input_ids=None), "input_ids is null"),
])
def test_a_row_no_trainer_can_take_is_refused_by_id(tmp_path, damage, words):
    run_export("trl", write_merged(tmp_path / "merged", [EDGE_ROWS]), tmp_path / "out")
    before = digest(tmp_path / "out")
    rows = [dict(r) for r in EDGE_ROWS]
    damage(rows[4])
    write_merged(tmp_path / "damaged", [rows[:3], rows[3:]])
    message = fails("--for", "trl", "--merged", "damaged", "--out", "out", cwd=tmp_path)
    assert words in message and "'silent'" in message and "damaged/data-00001" in message
    assert digest(tmp_path / "out") == before  # the earlier export stays as it was


# ------------------------------------------- SpecForge's own trainer on the export


SF_LENGTH = 64  # data.max_length: the demo rows run 36-169 tokens, EDGE_ROWS up to 11
TARGET_VOCAB = 248077  # the demo model's
SF_DRAFT_VOCAB = 32000  # what SpecForge's generated EAGLE-3 draft config holds
STEP = re.compile(r"^step (\d+): (\{.*\})$", re.M)


@pytest.fixture(scope="module")
def specforge_target(tmp_path_factory):
    """The demo model's shape and vocabulary with 4 layers (EAGLE-3 captures 3 distinct
    layers; the demo model has 2), saved as SpecForge loads a target: bf16, sharded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("specforge-target")
    demo_model = ROOT / ".cache/demo-model"
    config = AutoConfig.from_pretrained(demo_model)
    config.num_hidden_layers, config.layer_types = 4, ["full_attention"] * 4
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(
        folder, max_shard_size="20MB")
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def batch_size(rows: int) -> int:
    """A batch size that divides `rows`: SpecForge drops an epoch's last incomplete batch
    (drop_last), which no export can name (it depends on the batch size and ranks)."""
    return max(size for size in range(1, 6) if rows % size == 0)


def specforge_config(tmp: Path, strategy: str, target: Path, batch: int, **model) -> Path:
    """A `specforge train` config for a CPU: offline features, no sharding, sdpa."""
    config = {
        "model": {"target_model_path": str(target), "torch_dtype": "bfloat16",
                  # the demo model ties its embeddings: its checkpoint has no lm_head.weight
                  "lm_head_key": "model.embed_tokens.weight", **model},
        "data": {"hidden_states_path": str(tmp / f"features-{strategy}"),
                 "max_length": SF_LENGTH, "dataloader_num_workers": 0,
                 "cache_dir": str(tmp / "sf-cache")},
        "training": {"strategy": strategy, "fsdp_sharding": "NO_SHARD",
                     "attention_backend": "sdpa", "batch_size": batch, "num_epochs": 1,
                     "learning_rate": 1e-3, "log_interval": 1},
        "output_dir": str(tmp / f"run-{strategy}"),
    }
    path = tmp / f"{strategy}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def specforge(*argv, tmp: Path) -> str:
    """A SpecForge command on the CPU; its output."""
    proc = subprocess.run([*map(str, argv)], cwd=tmp, capture_output=True, text=True,
                          timeout=900, env=dict(env(), SPECFORGE_DEVICE="cpu"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def features_of(folder: Path) -> list[list[int]]:
    import torch

    return [torch.load(p)["input_ids"].tolist() for p in sorted(folder.glob("*.ckpt"))]


def trained_steps(output: str, config: Path) -> list[dict]:
    """The steps the run logged, each with a finite loss, and the checkpoint it wrote."""
    steps = [(int(n), ast.literal_eval(logged)) for n, logged in STEP.findall(output)]
    assert [n for n, _ in steps] == list(range(1, len(steps) + 1)) and steps, output[-3000:]
    assert all(math.isfinite(logged["loss"]) for _, logged in steps), steps
    run = Path(yaml.safe_load(config.read_text())["output_dir"])
    assert list(run.glob(f"*-step{len(steps)}/training_state*.pt")), sorted(run.rglob("*"))
    print(f"{config.stem}: {len(steps)} steps, losses "  # seen with pytest -s
          f"{[round(logged['loss'], 3) for _, logged in steps]}")
    return [logged for _, logged in steps]


@pytest.mark.slow
def test_specforge_trains_dflash_and_eagle3_on_the_export(pipeline_set, specforge_target,
                                                          tmp_path):
    """SpecForge's own trainer, offline on a CPU, on the specforge export of a set with
    multi-turn, long, short and refused rows: every row trained or named by the export."""
    _, rows = pipeline_set
    merged = write_merged(tmp_path / "merged", [rows, EDGE_ROWS])
    every = rows + EDGE_ROWS
    cut = [r["input_ids"][:SF_LENGTH] for r in every]
    features = [sys.executable, "-m", "tests.helpers.specforgecpu", "features", "--prompts"]

    # DFlash, as shipped, on the export that leaves out what DFlash refuses
    full, _ = run_export("specforge", merged, tmp_path / "sf-full", "--max-length", SF_LENGTH)
    out = tmp_path / "sf"
    report, _ = run_export("specforge", merged, out, "--max-length", SF_LENGTH,
                           "--drop-refused", "--draft-vocab-size", SF_DRAFT_VOCAB,
                           "--target-vocab-size", TARGET_VOCAB)
    refused = full["trainer_will"]["dflash_no_two_adjacent_supervised"]
    left_out = [i for left in report["left_out"].values() for i in left["ids"]]
    assert refused["rows"] == len(refused["ids"]) > 0 and sorted(left_out) == sorted(refused["ids"])
    # SpecForge's own reading of the whole export drops exactly those rows
    assert [p["input_ids"] for p in specforge_prompts(tmp_path / "sf-full" / JSONL,
                                                      SF_LENGTH, dflash=True)] == [
        ids for ids, r in zip(cut, every) if r["id"] not in left_out]
    dflash = specforge_config(tmp_path, "dflash", specforge_target, batch_size(report["rows"]))
    specforge(*features, out / JSONL, "--config", dflash, tmp=tmp_path)
    assert features_of(tmp_path / "features-dflash") == [  # every exported row, none dropped
        ids for ids, r in zip(cut, every) if r["id"] not in left_out]
    assert report["rows"] == len(every) - len(left_out)
    steps = trained_steps(specforge(Path(sys.executable).parent / "specforge", "train",
                                    "--config", dflash, tmp=tmp_path), dflash)
    assert len(steps) == report["rows"] // batch_size(report["rows"])

    # EAGLE-3 on the whole export, with the vocabulary mapping it wrote; its loss is
    # SpecForge's reference implementation instead of the Triton kernel (tests/helpers/specforgecpu.py)
    out = tmp_path / "sf-eagle"
    report, _ = run_export("specforge", merged, out, "--max-length", SF_LENGTH,
                           "--draft-vocab-size", SF_DRAFT_VOCAB, "--target-vocab-size",
                           TARGET_VOCAB)
    dropped = report["trainer_will"]["eagle3_no_supervised_token"]["ids"]
    kept = [ids for ids, r in zip(cut, every) if r["id"] not in dropped]
    eagle3 = specforge_config(tmp_path, "eagle3", specforge_target, batch_size(len(kept)),
                              aux_hidden_state_layer_ids=[0, 1, 2],
                              vocab_mapping_path=str(out / VOCAB_MAPPING))
    specforge(*features, out / JSONL, "--config", eagle3, tmp=tmp_path)
    assert features_of(tmp_path / "features-eagle3") == kept and len(kept) < len(every)
    output = specforge(sys.executable, "-m", "tests.helpers.specforgecpu", "train", "--config", eagle3,
                       tmp=tmp_path)
    assert "Added missing tokens" not in output  # the export's mapping, not one of its own
    steps = trained_steps(output, eagle3)
    assert len(steps) == len(kept) // batch_size(len(kept))
