"""How an export's files are written, part by part: the Writer every trainer format hands
its rows to, and the save_to_disk folder of Arrow shards TRL and axolotl read."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import pyarrow as pa

from stages.dataset.shards import ShardFile, shard_name, write_metadata
from stages.trainers.batch import Part


class Writer:
    """Files of one export, written into a temporary folder the export renames."""

    def begin(self, index: int, total: int) -> None:
        """Shard `index` of `total` of the merged set starts."""

    def write(self, part: Part) -> None:
        raise NotImplementedError

    def end(self) -> None:
        """The shard begun last is done."""

    def finish(self) -> dict:
        """Close every file; what the report says was written (`files`, ...)."""
        raise NotImplementedError


class ArrowFolder(Writer):
    """A save_to_disk folder of rows of `schema` (schema.hf_schema), one shard for each
    shard of the merged set."""

    def __init__(self, folder: Path, schema: pa.Schema,
                 columns: Callable[[Part], list[pa.Array]]):
        self.folder = folder
        self.schema = schema
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
        write_metadata(self.folder, self.names, schema=self.schema)
        return {"files": self.names, "columns": self.schema.names}
