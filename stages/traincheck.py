"""validate's training check: real training steps on the first batches of data/merged.

The batches come from stages/loader.py, exactly as a trainer gets them. For each batch:
forward and backward on the real model (the demo model by default, any local causal LM
by path); the loss is finite; the loss equals the mean cross-entropy at the supervised
positions computed straight from input_ids and loss_mask (not through the labels);
changing the tokens at unsupervised positions and building the labels again leaves the
loss bit for bit the same, changing one supervised token does not; and every row has the
same per-token loss in a packed batch, in a padded batch and alone (the packed batch goes
to the model as the loader gives it: position_ids and varlen boundaries, no mask).

Then the longest batch: one row of `longest_batch_tokens` (default validate.max_seq_len)
tokens, forward and backward, to measure the memory a run needs at its worst before it
starts. Memory is the process's peak RSS on CPU (VmHWM, reset before each step), peak
allocated CUDA memory on a GPU; the optimizer's state is not included (it depends on the
trainer's sharding). The model runs in eval mode (dropout off, so layouts compare
exactly); gradients are computed, no weight changes.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Optional

import numpy as np

from stages import loader
from stages import params as P
from stages import tinymodel
from stages.errors import StageError

log = logging.getLogger("validate")

# Largest per-token loss difference between layouts that counts as the same: float32
# differs by ~1e-6 from summation order; a row that attends into another moves by ~0.1+.
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}


class TrainCheckFailed(StageError):
    """The loss or the batches are not what the data means (one line)."""


def missing_torch() -> Optional[str]:
    """Why the check cannot run here, or None."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return f"{e.name or 'torch'} is not installed"
    return None


def run(cfg: P.TrainCheck, folder: Path, max_seq_len: int) -> dict:
    """The report section of the check; TrainCheckFailed on the first miss."""
    import torch

    device = _device(cfg.device)
    dtype = _dtype(cfg.dtype, device)
    model, path = _load(cfg.model, device, dtype)
    vocab = model.get_input_embeddings().num_embeddings
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    tolerance = TOLERANCE[str(dtype).removeprefix("torch.")]
    steps, losses, diffs, rows, tokens, supervised = [], [], {}, 0, 0, 0
    for group in loader.grouped(loader.chunks(folder), cfg.tokens_per_batch, cfg.packed):
        if len(losses) == cfg.batches:
            break
        _check_ids(group, vocab, path)
        loss, seconds, peak, differences = _batch(model, group, cfg.packed, pad_id, device,
                                                  tolerance)
        for name, value in differences.items():
            diffs[name] = max(diffs.get(name, 0.0), value)
        losses.append(round(loss, 6))
        steps.append((seconds, peak))
        rows += len(group)
        tokens += sum(len(r.input_ids) for r in group)
        supervised += sum(int(r.loss_mask.sum()) for r in group)
    if not steps:
        raise TrainCheckFailed(f"train step: {folder} has no rows to train on")
    longest = cfg.longest_batch_tokens if cfg.longest_batch_tokens is not None else max_seq_len
    step_seconds = sum(s for s, _ in steps)
    out = {
        "model": cfg.model,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "layout": "packed" if cfg.packed else "padded",
        "tokens_per_batch": cfg.tokens_per_batch,
        "batches": len(losses),
        "rows": rows,
        "tokens": tokens,
        "supervised_tokens": supervised,
        "loss": losses,
        "tokens_per_second": round(tokens / step_seconds, 1),
        "batches_per_second": round(len(steps) / step_seconds, 3),
        "peak_memory_mb": max(p for _, p in steps),
        "memory": "torch.cuda.max_memory_allocated" if device.type == "cuda"
                  else "process peak RSS (VmHWM)",
        "max_loss_difference": {k: float(f"{v:.3g}") for k, v in diffs.items()},
        "tolerance": tolerance,
        "longest_batch": _longest(model, longest, vocab, device) if longest else None,
    }
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _device(name: str):
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise StageError("validate.train_check.device: cuda asked for, but torch sees no GPU")
    return torch.device(name)


def _dtype(name: str, device):
    import torch

    if name == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    return getattr(torch, name)


def _load(spec: str, device, dtype):
    from transformers import AutoModelForCausalLM

    path = str(tinymodel.resolve(spec, "validate.train_check.model"))
    if not Path(path).is_dir():
        raise StageError(f"validate.train_check.model: {path} is not a local model folder")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StageError(f"validate.train_check.model: cannot load {path} ({first})") from None
    return model.to(device).eval(), path


def _check_ids(group: list[loader.Row], vocab: int, path: str) -> None:
    top = max((int(r.input_ids.max(initial=0)) for r in group), default=0)
    if top >= vocab:
        raise StageError(f"validate.train_check.model: {path} has {vocab} embeddings, the "
                         f"data holds token id {top}: not this data's model")


# ---------------------------------------------------------------------- one batch


def _batch(model, group, packed: bool, pad_id: int, device, tolerance: float):
    """(loss, step seconds, peak MB, max per-token difference per comparison)."""
    import torch

    layouts = {"packed": loader.collate_packed(group),
               "padded": loader.collate_padded(group, pad_id)}
    train = "packed" if packed else "padded"
    _peak_reset(device)
    start = time.perf_counter()
    out = model(**_inputs(layouts[train], device), use_cache=False)
    out.loss.backward()
    _sync(device)
    seconds = time.perf_counter() - start
    peak = _peak_mb(device)
    model.zero_grad(set_to_none=True)
    loss = out.loss.item()
    logits = out.logits.detach()
    del out
    if not math.isfinite(loss):
        raise TrainCheckFailed(f"train step: the loss is {loss} on rows {_rows(group)}")
    _check_labels(model, logits, group, train, pad_id, loss, device, tolerance)
    per_row = {train: _per_row(logits, group, train)}
    with torch.no_grad():
        other = "padded" if packed else "packed"
        logits_other = model(**_inputs(layouts[other], device), use_cache=False).logits
        per_row[other] = _per_row(logits_other, group, other)
        del logits_other
        alone = []
        for row in group:
            single = loader.collate_packed([row])
            one = model(**_inputs(single, device), use_cache=False).logits
            alone.extend(_per_row(one, [row], "packed"))
    differences = {}
    for name in ("packed", "padded"):
        worst = 0.0
        for k, (got, ref) in enumerate(zip(per_row[name], alone)):
            worst = max(worst, float((got - ref).abs().max()) if len(ref) else 0.0)
            if worst > tolerance:
                raise TrainCheckFailed(
                    f"train step: row {k} of {_rows(group)} has a per-token loss {worst:.3g} "
                    f"away from the same row alone in a {name} batch (tolerance {tolerance}): "
                    "rows attend across their boundaries"
                )
        differences[f"{name}_vs_alone"] = worst
    return loss, seconds, peak, differences


def _inputs(batch: dict, device) -> dict:
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in loader.to_torch(batch).items()}


def _per_row(logits, group, layout: str) -> list:
    """Per row, the cross-entropy of every next token (float32, on the CPU)."""
    import torch.nn.functional as F

    return [F.cross_entropy(row_logits[:-1].float(), _targets(row.input_ids[1:], logits.device),
                            reduction="none").cpu()
            for row, row_logits in zip(group, _row_logits(logits, group, layout))]


def _row_logits(logits, group, layout: str):
    """Each row's logits, [its tokens, vocabulary], in either layout."""
    offset = 0
    for k, row in enumerate(group):
        n = len(row.input_ids)
        yield logits[0, offset : offset + n] if layout == "packed" else logits[k, :n]
        offset += n


def _targets(ids: np.ndarray, device):
    import torch

    return torch.from_numpy(ids.astype(np.int64)).to(device)


def _check_labels(model, logits, group, layout: str, pad_id: int, loss: float, device,
                  tolerance: float) -> None:
    """The loss sees the supervised tokens and nothing else."""
    import torch
    import torch.nn.functional as F

    def loss_with(rows) -> float:
        batch = (loader.collate_packed(rows) if layout == "packed"
                 else loader.collate_padded(rows, pad_id))
        labels = loader.to_torch(batch)["labels"].to(device)
        with torch.no_grad():
            return model.loss_function(logits=logits, labels=labels,
                                       vocab_size=model.config.vocab_size).item()

    vocab = model.get_input_embeddings().num_embeddings
    unsupervised = [r._replace(input_ids=np.where(r.loss_mask == 1, r.input_ids,
                                                  (r.input_ids + 1) % vocab)) for r in group]
    baseline, changed = loss_with(group), loss_with(unsupervised)
    if changed != baseline:
        raise TrainCheckFailed(
            f"train step: the loss sees tokens outside loss_mask: changing the tokens where "
            f"loss_mask is 0 moved it from {baseline:.6g} to {changed:.6g} (rows {_rows(group)})"
        )
    k, p = _a_supervised_position(group)
    if k is not None:
        # the replacement whose logit is farthest from the token's: the largest change
        scores = list(_row_logits(logits, group, layout))[k][p - 1]
        ids = group[k].input_ids.copy()
        top, bottom = int(scores.argmax()), int(scores.argmin())
        here = scores[int(ids[p])]
        ids[p] = top if abs(scores[top] - here) >= abs(scores[bottom] - here) else bottom
        moved = list(group)
        moved[k] = group[k]._replace(input_ids=ids)
        if loss_with(moved) == baseline:
            raise TrainCheckFailed(
                f"train step: the loss ignores supervised tokens: changing token {p} of row "
                f"{k} (loss_mask 1) left it at {baseline:.6g} (rows {_rows(group)})"
            )
    # the reference: cross-entropy at supervised positions, from input_ids and loss_mask
    total, count = 0.0, 0
    with torch.no_grad():
        for row, row_logits in zip(group, _row_logits(logits, group, layout)):
            where = np.flatnonzero(row.loss_mask[1:] == 1)
            if len(where):
                picked = row_logits[torch.from_numpy(where).to(logits.device)].float()
                total += F.cross_entropy(picked, _targets(row.input_ids[1:][where], logits.device),
                                         reduction="sum").item()
                count += len(where)
    reference = total / count if count else float("nan")
    if not abs(reference - loss) <= tolerance * max(1.0, abs(reference)):
        raise TrainCheckFailed(
            f"train step: the loss {loss:.6g} is not the mean cross-entropy of the {count} "
            f"supervised tokens ({reference:.6g}): the labels do not follow loss_mask "
            f"(rows {_rows(group)})"
        )


def _a_supervised_position(group) -> tuple[Optional[int], Optional[int]]:
    for k, row in enumerate(group):
        where = np.flatnonzero(row.loss_mask[1:] == 1)
        if len(where):
            return k, int(where[0]) + 1
    return None, None


def _rows(group) -> str:
    return f"{len(group)} rows of {sum(len(r.input_ids) for r in group)} tokens"


# ---------------------------------------------------------------- longest batch


def _longest(model, tokens: int, vocab: int, device) -> dict:
    """Forward and backward on one row of `tokens` tokens: the memory at the worst."""
    import torch

    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, tokens).astype(np.int32)
    mask = (np.arange(tokens) >= tokens * 2 // 5).astype(np.int8)  # an answer after a prompt
    batch = loader.collate_packed([loader.Row(ids, mask, "longest")])
    _peak_reset(device)
    start = time.perf_counter()
    try:
        out = model(**_inputs(batch, device), use_cache=False)
        out.loss.backward()
        _sync(device)
    except torch.OutOfMemoryError as e:
        raise TrainCheckFailed(
            f"train step: the longest batch ({tokens} tokens) runs out of memory on "
            f"{device}: {str(e).splitlines()[0]}"
        ) from None
    seconds = time.perf_counter() - start
    peak = _peak_mb(device)
    del out
    model.zero_grad(set_to_none=True)
    return {"tokens": tokens, "peak_memory_mb": peak, "seconds": round(seconds, 3)}


# ----------------------------------------------------------------------- memory


def _peak_reset(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # "5" resets this process's VmHWM to its current RSS (Linux)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then the peak is the process's since it started


def _peak_mb(device) -> float:
    import torch

    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    try:
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f)
        return round(int(status["VmHWM"].split()[0]) / 1024, 1)
    except (OSError, KeyError, ValueError):
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
