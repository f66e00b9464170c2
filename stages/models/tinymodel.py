"""The demo model: a tiny random-weight Qwen3 with the bundled Qwen3.6 vocabulary.

It lets the whole pipeline, a real `transformers serve` included, run on a laptop CPU.
Its weights come from a fixed seed, so two builds are byte-identical; its text is random.
The folder holds the weights (safetensors), config, generation config and the bundled
tokenizer with this project's chat template, so any Hugging Face tool loads it like a
real checkpoint. Two edits to the random embeddings (`build`) make its answers behave
like a chat model's at the protocol level: it never writes markup such as `<tool_call>`
or `<|im_start|>`, and it ends answers on its own often enough that both finish reasons
("stop", "length") occur. `demo:tiny-qwen3-vllm` is the same recipe in the shape vLLM's
CPU attention accepts (it rejects head_dim 16), with `</think>` given a steady chance
too (`_bias_think`): about half its answers close their thinking, answer and stop.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from stages.common.errors import StageError

from stages.common.reading import json_file
from stages.common.outputs import atomic_dir
from stages.models import tokenizer

log = logging.getLogger(__name__)

NAME = "demo:tiny-qwen3"  # how params name it (generate's engine, validate's train check)
DEFAULT_PATH = ".cache/demo-model"
VLLM_PATH = ".cache/demo-model-vllm"
SEED = 0
STAMP = "demo-model-stamp.json"
# Bump when the way the model is assembled changes, so old builds are replaced.
BUILD_VERSION = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

ARCHITECTURE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
# Heads of 64 (vLLM's CPU attention has kernels for 32, 64, 80, 96, 112, 128, 256).
VLLM_ARCHITECTURE = {
    **ARCHITECTURE,
    "hidden_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "intermediate_size": 256,
    "tie_word_embeddings": False,
}
# Size of the shared component and of `<|im_end|>`'s row along it (row norms are ~0.16).
# Tuned by sampling 24 answers (temperature 0.7, top_p 0.95, top_k 20, 64 tokens max):
# 0.4 gave lengths 3..64, mean 36, 9 past 48; 0.5 ended one answer at once (empty).
STOP_SHARED = 0.02
STOP_EOS = 0.4


@dataclass(frozen=True)
class Recipe:
    """What decides a build: shape and the three biased rows (`think`: `</think>`'s)."""

    architecture: dict
    shared: float
    eos: float
    think: Optional[tuple[float, float]] = None  # `</think>` (as output, as input)


DEMO = Recipe(ARCHITECTURE, STOP_SHARED, STOP_EOS)
# Sampled like the above (transformers, one prompt, 24 answers): 11 closed their thinking,
# answered and stopped, 2 closed and ran to 64 tokens, 11 stopped still thinking (no
# answer: truncated). A tied `</think>` row repeated itself until the end instead.
VLLM = Recipe(VLLM_ARCHITECTURE, STOP_SHARED, 0.8, (2.0, -2.0))
VLLM_NAME = "demo:tiny-qwen3-vllm"  # the shape vLLM's CPU attention accepts
BUILDS = {NAME: (DEFAULT_PATH, DEMO), VLLM_NAME: (VLLM_PATH, VLLM)}
# The sampling a Qwen3 checkpoint ships with. Requests override temperature and top_p;
# `transformers serve` refuses a top_k field (422), so top_k comes only from here.
SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}


def _stamp(tokenizer_stamp: dict, recipe: Recipe) -> dict:
    stop = [recipe.shared, recipe.eos] + (list(recipe.think) if recipe.think is not None else [])
    return {
        "build_version": BUILD_VERSION,
        "seed": SEED,
        "architecture": recipe.architecture,
        "sampling": SAMPLING,
        "stop": stop,
        "tokenizer": hashlib.sha256(
            json.dumps(tokenizer_stamp, sort_keys=True).encode("utf-8")
        ).hexdigest(),
    }


def ensure_model(path: str | Path = DEFAULT_PATH, recipe: Recipe = DEMO) -> Path:
    """Build the demo model at `path` unless a current build is there; return its path.

    The returned path is absolute, so a server started from another directory finds it.
    """
    folder = Path(path)
    tokenizer_dir = tokenizer.ensure_bundled()
    stamp = _stamp(tokenizer.bundled_stamp(), recipe)
    if tokenizer.read_stamp(folder, STAMP) != stamp:
        with tokenizer.file_lock(folder.parent / f".{folder.name}.lock"):
            if tokenizer.read_stamp(folder, STAMP) != stamp:
                build(folder, tokenizer_dir, stamp, recipe)
    return folder.resolve()


def resolve(spec: str, key: str) -> str:
    """A model param as a path or Hub id: a demo model's name becomes its built folder."""
    if spec in BUILDS:
        path, recipe = BUILDS[spec]
        return str(ensure_model(path, recipe))
    if spec.startswith("demo:"):
        raise StageError(f"{key}: unknown demo model {spec!r} (known: {', '.join(BUILDS)})")
    return spec


def build(folder: Path, tokenizer_dir: Path, stamp: dict, recipe: Recipe = DEMO) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    log.info("building the demo model into %s (once)", folder)
    # The raw tokenizer is enough for the sizes and ids, and loads twice as fast.
    backend = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    names = json_file(tokenizer_dir / "tokenizer_config.json")
    eos_id = backend.token_to_id(names["eos_token"])
    pad_id = backend.token_to_id(names["pad_token"])
    config = Qwen3Config(
        vocab_size=backend.get_vocab_size(with_added_tokens=True),
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
        **recipe.architecture,
    )
    # every added token, special or not: the model writes none of them (`</think>` apart)
    specials = sorted(backend.get_added_tokens_decoder())
    # Only the generator's state decides the weights; restore it so callers are unaffected.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen3ForCausalLM(config)
        direction = torch.randn(config.hidden_size)
    model.eval()
    with torch.no_grad():
        rows = model.get_input_embeddings().weight  # tied to the output layer
        direction /= direction.norm()
        # Every row shares a small component along one direction and <|im_end|> points
        # along it, so it keeps a steady chance per token: sampled at temperature 0.7,
        # answers end after ~30 tokens on average and about a third run past 48.
        rows += recipe.shared * direction
        # A zero row's logit is 0 and never reaches the top 20 sampled from: no
        # `<tool_call>` (a server's response parser fails on a random "tool call"), no
        # `<|im_start|>`.
        rows[specials] = 0.0
        rows[eos_id] = recipe.eos * direction
        if recipe.think is not None:
            _bias_think(model, backend.token_to_id("</think>"), specials, recipe, direction)
    generation = GenerationConfig(
        bos_token_id=None,
        # Qwen3 checkpoints stop on either end marker.
        eos_token_id=[eos_id, pad_id],
        pad_token_id=pad_id,
        **SAMPLING,
    )
    with atomic_dir(folder) as tmp, _quiet_progress():
        model.save_pretrained(str(tmp), safe_serialization=True)
        generation.save_pretrained(str(tmp))
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer_dir / name, tmp / name)
        (tmp / STAMP).write_text(json.dumps(stamp, indent=1) + "\n", encoding="utf-8")
        for item in tmp.iterdir():
            item.chmod(0o644)
        tmp.chmod(0o755)


def _bias_think(model, think_id: int, specials: list[int], recipe: Recipe, direction) -> None:
    """`</think>` keeps a steady chance per token along a second direction, as
    `<|im_end|>` does along the first; untied, its input row points the other way along
    the second, so once written it is unlikely again and an answer follows."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED + 1)
        second = torch.randn(direction.shape[0])
    second -= (second @ direction) * direction
    second /= second.norm()
    rows = model.get_input_embeddings().weight
    plain = torch.ones(rows.shape[0], dtype=torch.bool)
    plain[specials] = False
    rows[plain] += recipe.shared * second
    out = model.get_output_embeddings().weight
    out.copy_(rows)
    out[think_id] = recipe.think[0] * second
    rows[think_id] = recipe.shared * direction + recipe.think[1] * second


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """No progress bar for a sub-second save in the demo's output."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tinymodel: %(message)s")
    print(ensure_model())
