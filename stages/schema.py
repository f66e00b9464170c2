"""The tokenized-row contract: explicit Arrow/datasets features shared by tokenize,
merge and validate (datasets would infer int64 for unknown columns)."""

from __future__ import annotations

import datasets
import pyarrow as pa

FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "source": datasets.Value("string"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "num_tokens": datasets.Value("int32"),
        "num_loss_tokens": datasets.Value("int32"),
    }
)

ARROW_SCHEMA: pa.Schema = FEATURES.arrow_schema

FINGERPRINT_FILE = "fingerprint.json"
