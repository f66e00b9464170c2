"""Engine-exact training rows (`tokenize.ids: engine`): the tokens the engine served.

    input_ids = the engine's prompt ids + its generated ids + the closing tokens the
                format writes after the answer (as the render has them)
    loss_mask = 1 on exactly the generated ids, 0 elsewhere

which is render mode's mask rule too. A row whose completion has no usable engine ids
is counted (`engine_ids_missing`) and rendered or dropped (`no_engine_ids`), per
`tokenize.on_missing_ids`. The engine's ids are checked like a prompt: every id inside the
vocabulary (`out_of_vocab`), the generated ids spelling the recorded answer (`answer_check`).
The rule in full: docs/stages.md, tokenize, "Engine-exact rows".
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from stages.serving.engineids import Served

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


def out_of_vocab(served: Served, vocab_size: int) -> Optional[int]:
    """The first engine id (prompt, then completion) outside [0, vocab_size), or None."""
    for ids in (served.prompt_ids, served.completion_ids):
        if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            return int(ids[(ids < 0) | (ids >= vocab_size)][0])
    return None


def answer_check(generated: np.ndarray, supervised: np.ndarray, control: set[int],
                 decode: Callable[[list[int]], str]) -> Optional[str]:
    """Whether the engine's generated ids spell the answer the row records (`supervised`:
    the render's supervised ids of it): None when they do; "text" when they decode to
    other text (a reply mixed up with another's); "control" when the text is the same but
    a control token stands where the recorded text spells it (an injected
    `<|im_start|>user` turn), which the text path tokenizes as text. A closing end-of-turn
    token on either side, or the stop string the engine ended on, is not a difference."""
    g, s = _without_closing(generated.tolist(), control), \
        _without_closing(supervised.tolist(), control)
    if g == s:
        return None
    text, recorded = _spelled(decode(g)), _spelled(decode(s))
    if text != recorded and not (text.startswith(recorded) and len(g) == len(generated)):
        return "text"
    think = {i for i in control if decode([i]) in THINK_MARKERS}
    if [i for i in g if i in control - think] != [i for i in s if i in control - think]:
        return "control"
    return None


# where the format opens and closes the thinking: the render closes a reasoning an engine
# cut off before `</think>`, so they are the format's, not the answer's
THINK_MARKERS = ("<think>", "</think>")


def _spelled(text: str) -> str:
    """`text` without its whitespace and thinking markers: the template trims the reasoning
    and the content and writes its own separators around them (closing a cut-off
    reasoning too), while the engine's ids keep what the model wrote (real engines: a
    reasoning that starts with a newline); another reply's text differs in more."""
    for marker in THINK_MARKERS:
        text = text.replace(marker, "")
    return "".join(text.split())


def _without_closing(ids: list[int], control: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in control else ids
