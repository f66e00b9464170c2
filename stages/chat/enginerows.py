"""Engine-exact training rows (`tokenize.ids: engine`): the tokens the engine served.

    input_ids = the engine's prompt ids + its generated ids + the closing tokens the
                format writes after the answer (as the render has them)
    loss_mask = 1 on exactly the generated ids, 0 elsewhere

which is render mode's mask rule too. A row whose completion has no usable engine ids
is counted (`engine_ids_missing`) and rendered or dropped (`no_engine_ids`), per
`tokenize.on_missing_ids`. The rule in full (truncated answers, stop strings, earlier
turns): docs/stages.md, tokenize, "Engine-exact rows".
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from stages.chat.engineids import Served

INT32 = 1 << 31  # the dataset stores input_ids as int32


def engine_row(served: Served, ids: np.ndarray, mask: np.ndarray, prompt_len: int,
               truncated: bool, control: set[int]
               ) -> Optional[tuple[np.ndarray, np.ndarray, bool]]:
    """(input_ids, loss_mask, whether the render's supervision of earlier turns could not
    be carried over) from the engine's ids, with the closing tokens and earlier turns'
    supervision of the render (`ids`, `mask`, its generation prompt `prompt_len` tokens
    long; `control`: the tokenizer's control-token ids); None when the row's engine ids
    are missing or too large for the dataset."""
    prompt, generated = served.prompt_ids, served.completion_ids
    if prompt is None or generated is None:
        return None
    if max(prompt.max(initial=0), generated.max(initial=0)) >= INT32:
        return None
    answer = np.flatnonzero(mask[prompt_len:]) + prompt_len
    end = int(answer[-1]) + 1 if answer.size else prompt_len
    closing = ids[end:]
    if not truncated and answer.size and int(ids[end - 1]) in control \
            and (generated.size == 0 or int(generated[-1]) != int(ids[end - 1])):
        closing = ids[end - 1:]  # the end-of-turn token the engine did not write
    same_prompt = len(prompt) == prompt_len and np.array_equal(prompt, ids[:prompt_len])
    out_ids = np.concatenate([prompt, generated, closing]).astype(np.int32)
    out_mask = np.zeros(len(out_ids), dtype=np.int8)
    if same_prompt:
        out_mask[:prompt_len] = mask[:prompt_len]
    out_mask[len(prompt):len(prompt) + len(generated)] = 1
    return out_ids, out_mask, not same_prompt and bool(mask[:prompt_len].any())
