"""vocab: the EAGLE-3 draft vocabulary from supervised-token counts, as SpecForge builds it."""

from __future__ import annotations

import pytest

from stages.common.errors import StageError
from stages.trainers.vocab import MAX_VOCAB, VocabCounts
from tests.helpers.trainerparts import part


def test_the_most_frequent_supervised_tokens_in_ascending_order_ties_to_the_lower_id():
    counts = VocabCounts(draft=3, target=10)
    # 7 three times, 2 and 5 twice; 9 and 8 are not supervised; 6 and 4 past max_length
    counts.add(part([("a", [7, 7, 2, 9, 6], [1, 1, 1, 0, 1]),
                     ("b", [5, 5, 7, 2, 4, 8], [1, 1, 1, 1, 1, 0])], max_length=4))
    assert counts.counts.tolist() == [0, 0, 2, 0, 0, 2, 0, 3, 0, 0]
    d2t, t2d = counts.mapping()
    assert t2d.nonzero()[0].tolist() == [2, 5, 7] and d2t.tolist() == [2, 4, 5]


def test_unseen_tokens_top_up_from_the_lowest_ids():
    counts = VocabCounts(draft=3, target=6)
    counts.add(part([("a", [4, 4], [1, 1])]))
    d2t, t2d = counts.mapping()
    assert t2d.nonzero()[0].tolist() == [0, 1, 4] and d2t.tolist() == [0, 0, 2]


def test_a_token_past_the_target_vocabulary_is_an_error():
    counts = VocabCounts(draft=1, target=4)
    with pytest.raises(StageError, match="--target-vocab-size 4: the set holds token id 4"):
        counts.add(part([("a", [4], [1])]))


@pytest.mark.parametrize("draft, target, message", [
    (1, 0, "--target-vocab-size 0: must be between 1"),
    (1, MAX_VOCAB + 1, f"--target-vocab-size {MAX_VOCAB + 1}: must be between 1"),
    (0, 10, "--draft-vocab-size 0: must be between 1 and --target-vocab-size 10"),
    (11, 10, "--draft-vocab-size 11"),
])
def test_sizes_out_of_range(draft, target, message):
    with pytest.raises(StageError, match=message):
        VocabCounts(draft, target)


def test_saved_as_specforge_loads_it(tmp_path):
    torch = pytest.importorskip("torch")
    counts = VocabCounts(draft=2, target=5)
    counts.add(part([("a", [3, 3, 1], [1, 1, 1])]))
    facts = counts.save(tmp_path / "vocab_mapping.pt")
    saved = torch.load(tmp_path / "vocab_mapping.pt")
    assert saved["d2t"].tolist() == [1, 2] and saved["t2d"].tolist() == [0, 1, 0, 1, 0]
    assert facts["supervised_tokens_covered"] == 1.0 and facts["distinct_supervised_tokens"] == 2
