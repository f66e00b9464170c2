"""Supervised-token counts over an export and the EAGLE-3 vocabulary mapping built from
them (SpecForge's `vocab_mapping.pt`).

SpecForge's rule (specforge/data/preprocessing.py, process_token_dict_to_mappings): the
draft vocabulary is the `draft` most frequent supervised tokens, topped up with unseen
tokens from the lowest ids when fewer were seen; `d2t[i] = used[i] - i` over the chosen
ids in ascending order, `t2d` marks them over the target vocabulary. Ties at the cut go
to the lower id here (SpecForge: to the token counted first).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from stages.common import outputs
from stages.common.errors import StageError
from stages.trainers.batch import Part

VOCAB_MAPPING = "vocab_mapping.pt"
MAX_VOCAB = 1 << 24  # --target-vocab-size: 128 MiB of counts; real vocabularies are < 2**18


class VocabCounts:
    """Supervised-token counts, in each row's first max_length tokens as SpecForge cuts
    them, and the mapping they give."""

    def __init__(self, draft: int, target: int):
        if not 1 <= target <= MAX_VOCAB:  # a count per id is allocated
            raise StageError(f"--target-vocab-size {target}: must be between 1 "
                             f"and {MAX_VOCAB}, more than any tokenizer's vocabulary")
        if not 1 <= draft <= target:
            raise StageError(f"--draft-vocab-size {draft}: must be between 1 and "
                             f"--target-vocab-size {target}")
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
        """Write the mapping to `path` (torch.save, as SpecForge loads it); its facts."""
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
        return {"file": path.name, "draft_vocab_size": self.draft,
                "target_vocab_size": self.target,
                "distinct_supervised_tokens": int(np.count_nonzero(self.counts)),
                "supervised_tokens_covered": round(covered / total, 6) if total else 0.0}
