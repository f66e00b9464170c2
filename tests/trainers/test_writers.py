"""writers: a save_to_disk folder of Arrow shards that datasets loads as it was given."""

from __future__ import annotations

import datasets
import pyarrow as pa

from stages.dataset.schema import hf_schema
from stages.trainers.writers import ArrowFolder
from tests.helpers.trainerparts import part

SCHEMA = hf_schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32()))])
FEATURES = datasets.Features({"id": datasets.Value("string"),
                              "input_ids": datasets.List(datasets.Value("int32"))})


def test_one_shard_per_merged_shard_loaded_by_datasets(tmp_path):
    writer = ArrowFolder(tmp_path, SCHEMA, lambda p: [p.id, p.input_ids])
    for index, rows in enumerate([[("a", [1, 2], [0, 1])], [("b", [3], [1]), ("c", [4], [0])]]):
        writer.begin(index, 2)
        writer.write(part(rows))
        writer.end()
    assert writer.finish() == {"files": ["data-00000-of-00002.arrow",
                                         "data-00001-of-00002.arrow"],
                               "columns": ["id", "input_ids"]}
    loaded = datasets.load_from_disk(str(tmp_path))
    assert loaded.features == FEATURES
    assert loaded.to_list() == [{"id": "a", "input_ids": [1, 2]}, {"id": "b", "input_ids": [3]},
                                {"id": "c", "input_ids": [4]}]
    shard = pa.ipc.open_stream(pa.memory_map(str(tmp_path / "data-00000-of-00002.arrow")))
    assert shard.schema == FEATURES.arrow_schema
