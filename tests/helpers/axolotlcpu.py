"""axolotl 0.19.0's own data path on a CPU, for the tests: run in `.venv-axolotl`.

    .venv-axolotl/bin/python -m tests.helpers.axolotlcpu EXPORT --sequence-len L --work DIR --out F

With `sample_packing` off, then on, a config of `datasets: [{path: EXPORT, type: }]` goes
through axolotl's own `validate_config`, `normalize_config` and `load_datasets` (what `axolotl
train` and `axolotl preprocess` call: its tokenizer loader, then `prepare_datasets`, which
loads the `save_to_disk` folder, keeps it as already tokenized, drops rows by length in
`handle_long_seq_in_dataset` and, packing on, those without a trainable token in
`process_datasets_for_packing`). Packing on, the kept rows are then batched as its trainer
does: `MultipackBatchSampler` over a `RandomSampler` (one bin of micro_batch_size x
sequence_len tokens a batch), its dataloader patch, `V2BatchSamplerDataCollatorForSeq2Seq`.
base_model is a Qwen3 config.json written to DIR (no weights) and a word-level tokenizer,
used only to pad (pad id 0). Writes one JSON object to F (axolotl logs to stdout): each
run's kept rows and the packed batches. Test environment only; offline, telemetry off.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", AXOLOTL_DO_NOT_TRACK="1",
                  DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")


def tiny_model(folder: Path) -> Path:
    """A Qwen3 config.json (no weights) and the stand-in tokenizer: what normalize_config
    and load_tokenizer read of base_model."""
    folder.mkdir(parents=True, exist_ok=True)
    stand_in_tokenizer().save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 248320,
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}))
    return folder


def stand_in_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   padding_side="right", name_or_path="stand-in")


def config(export: Path, sequence_len: int, work: Path, packing: bool):
    from axolotl.utils.config import normalize_config, validate_config
    from axolotl.utils.dict import DictDefault

    cfg = validate_config(DictDefault({
        "base_model": str(tiny_model(work / "model")),
        "datasets": [{"path": str(export), "type": None}],
        "sequence_len": sequence_len, "sample_packing": packing,
        "micro_batch_size": 2, "gradient_accumulation_steps": 1, "num_epochs": 1,
        "learning_rate": 1e-4, "output_dir": str(work / "out"),
        "dataset_prepared_path": str(work / f"prepared-{int(packing)}"),
        "dataset_num_proc": 1, "seed": 7}))
    normalize_config(cfg)
    return cfg


def rows(ds) -> list[dict]:
    return [{k: ds[i][k] for k in ("input_ids", "labels", "attention_mask")}
            for i in range(len(ds))]


def packed_batches(cfg, ds, tokenizer) -> list[dict]:
    """The batches axolotl's trainer would feed with sample packing on (its sampler and its
    collator, as core/trainers/base.py and core/builders/causal.py build them)."""
    from axolotl.utils.collators import V2BatchSamplerDataCollatorForSeq2Seq
    from axolotl.utils.samplers import MultipackBatchSampler, get_dataset_lengths
    from torch.utils.data import DataLoader, RandomSampler

    sampler = MultipackBatchSampler(
        RandomSampler(ds), lengths=get_dataset_lengths(ds),
        packing_efficiency_estimate=cfg.sample_packing_eff_est or 1.0,
        batch_max_len=cfg.micro_batch_size * cfg.sequence_len, batch_size=1,
        group_size=cfg.sample_packing_group_size, bin_size=cfg.sample_packing_bin_size,
        sequential=cfg.sample_packing_sequentially, drop_last=True,
        num_processes=cfg.dataset_num_proc, mp_start_method="fork")
    multiple = cfg.pad_to_multiple_of or 64  # as HFCausalTrainerBuilder pads
    if cfg.pad_to_sequence_len:
        multiple *= math.ceil(cfg.sequence_len / multiple)
    collator = V2BatchSamplerDataCollatorForSeq2Seq(
        tokenizer, padding=True, pad_to_multiple_of=multiple, return_tensors="pt")
    if "length" in ds.column_names:
        ds = ds.remove_columns(["length"])
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=collator)
    return [{"bins": [[int(i) for i in b] for b in bins],
             **{k: v.tolist() for k, v in batch.items()}}
            for bins, batch in zip(sampler, loader)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path)
    ap.add_argument("--sequence-len", type=int, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    import axolotl
    from axolotl.common.datasets import load_datasets
    from axolotl.loaders import load_tokenizer
    from axolotl.monkeypatch.data.batch_dataset_fetcher import apply_multipack_dataloader_patch

    out = {"axolotl": axolotl.__version__, "runs": {}}
    for packing in (False, True):
        cfg = config(args.export, args.sequence_len, args.work, packing)
        train = load_datasets(cfg=cfg).train_dataset
        run = {"rows": rows(train)}
        if packing:
            apply_multipack_dataloader_patch()  # as its PatchManager does with packing on
            run["batches"] = packed_batches(cfg, train, load_tokenizer(cfg))
        out["runs"]["packing" if packing else "no_packing"] = run
    args.out.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
