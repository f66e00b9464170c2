"""validate's training check: real training steps on the first batches of data/merged.

The batches come from dataset/loader.py as a trainer gets them, made of the first rows
that fit in `tokens_per_batch`. For each: forward and backward on the real model (the
demo model by default, any local causal LM by path), in eval mode (dropout off, so the
layouts compare exactly; no weight changes). The loss must be finite, equal the mean
cross-entropy of the supervised tokens computed from input_ids and loss_mask, stay bit
for bit the same when unsupervised tokens change and move when a supervised one does,
and give every row the same per-token loss packed, padded and alone. It comes from
dataset/chunkedloss.py, held equal to the model's own on the first row (`head_check`).
Then one longest batch measures the memory a run needs at its worst. What each figure
means (peak RSS, CUDA memory, `full_logits_mb`): docs/stages.md, validate, "Ready to
train on".
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Optional

import numpy as np

from stages.common import params
from stages.common.errors import StageError
from stages.dataset import chunkedloss, loader
from stages.models import tinymodel

log = logging.getLogger(__name__)

# Largest per-token loss difference between layouts that counts as the same: float32
# differs by ~1e-6 from summation order; a row that attends into another moves by ~0.1+.
def loss_tolerance(dtype) -> float:
    """How far apart two losses of the same tokens may be, relative to max(1, |loss|):
    sqrt of the dtype's epsilon, i.e. half its significant bits agree (3.5e-4 in float32,
    0.088 in bfloat16). Computing the same sums in another order (packed, padded, alone;
    chunked or whole-vocabulary logits; another CPU's kernels or thread split) moves a
    loss by units in the last place; a label one token off moves it by O(1)."""
    import torch

    return math.sqrt(torch.finfo(dtype).eps)


def _apart(got, reference) -> float:
    """|got - reference| relative to max(1, |reference|): what loss_tolerance() bounds."""
    return abs(got - reference) / max(1.0, abs(reference))


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


def run(cfg: params.TrainCheck, folder: Path, max_seq_len: int) -> dict:
    """The report section of the check; TrainCheckFailed on the first miss."""
    import torch

    started = time.perf_counter()
    device = _device(cfg.device)
    dtype = _dtype(cfg.dtype, device)
    memory = Memory(device)
    model, path = _load(cfg.model, device, dtype)
    head = chunkedloss.Head(model, f"validate.train_check.model: {path}")
    vocab = model.get_input_embeddings().num_embeddings
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    tolerance = float(f"{loss_tolerance(dtype):.3g}")
    fitting = Fitting(cfg.tokens_per_batch)
    steps, losses, diffs, rows, tokens, supervised = [], [], {}, 0, 0, 0
    head_check = None
    for group in loader.grouped(fitting.rows(loader.chunks(folder)), cfg.tokens_per_batch,
                                cfg.packed):
        if len(losses) == cfg.batches:
            break
        _check_ids(group, vocab, path)
        if head_check is None:
            head_check = _head_check(model, head, group[0], device, tolerance, path)
        loss, seconds, differences = _batch(model, head, group, cfg.packed, pad_id, device,
                                            tolerance, memory)
        for name, value in differences.items():
            diffs[name] = max(diffs.get(name, 0.0), value)
        losses.append(round(loss, 6))
        steps.append((seconds, memory.step_mb()))
        rows += len(group)
        tokens += sum(len(r.input_ids) for r in group)
        supervised += sum(int(r.loss_mask.sum()) for r in group)
    if not steps:
        if fitting.skipped:
            return {"skipped": fitting.none_fit(folder), "longer_than_batch": fitting.report()}
        raise TrainCheckFailed(f"train step: {folder} has no rows to train on")
    longest, longest_off = _longest_tokens(cfg, max_seq_len, device)
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
        "longer_than_batch": fitting.report(),
        "loss": losses,
        "loss_computed": f"over chunks of {head.rows} positions from the last hidden states",
        "head_check": head_check,
        "tokens_per_second": round(tokens / step_seconds, 1),
        "batches_per_second": round(len(steps) / step_seconds, 3),
        "peak_memory_mb": max(p for _, p in steps),
        "peak_memory_mb_per_step": [p for _, p in steps],
        "memory": memory.what(),
        "max_loss_difference": {k: float(f"{v:.3g}") for k, v in diffs.items()},
        "tolerance": tolerance,
        "longest_batch": (_longest(model, head, longest, vocab, device, memory) if longest
                          else {"skipped": longest_off} if longest_off else None),
    }
    out["process_peak_rss_mb"] = memory.process_peak_mb()
    out["seconds"] = round(time.perf_counter() - started, 1)  # the whole check, loading included
    del model, head
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


class Fitting:
    """The rows that fit in one batch, counting those that do not (a row longer than
    `tokens_per_batch` is a batch of its own to the loader: the check skips it)."""

    def __init__(self, tokens_per_batch: int):
        self.budget = tokens_per_batch
        self.read = self.skipped = 0
        self.shortest: Optional[int] = None

    def rows(self, chunks):
        for chunk in chunks:
            fit = [r for r in chunk if len(r.input_ids) <= self.budget]
            self.read += len(chunk)
            self.skipped += len(chunk) - len(fit)
            if chunk:
                shortest = min(len(r.input_ids) for r in chunk)
                self.shortest = shortest if self.shortest is None else min(shortest,
                                                                          self.shortest)
            yield fit

    def report(self) -> dict:
        return {"rows": self.skipped, "of_rows_read": self.read}

    def none_fit(self, folder: Path) -> str:
        return (f"no row of {folder} fits in validate.train_check.tokens_per_batch "
                f"{self.budget}: all {self.read} rows are longer (the shortest has "
                f"{self.shortest} tokens)")


def _longest_tokens(cfg: params.TrainCheck, max_seq_len: int, device) -> tuple[int, Optional[str]]:
    """The tokens of the longest batch (0: not run) and, when null leaves it off, why."""
    if cfg.longest_batch_tokens is not None:
        return cfg.longest_batch_tokens, None
    if device.type == "cuda":
        return max_seq_len, None
    return 0, (f"off on cpu: longest_batch_tokens null means max_seq_len ({max_seq_len} "
               "tokens), minutes of compute on a device the model does not train on; a "
               "number of tokens runs it here")


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

HEAD_CHECK_TOKENS = 64  # the sample on which the chunked loss meets the model's own


def _head_check(model, head, row: loader.Row, device, tolerance: float, path: str) -> dict:
    """The chunked loss against `model(**batch).loss` on the first tokens of `row`, every
    token a target: they must agree, or the model computes its logits otherwise (a scale,
    a soft cap) and the chunked loss cannot stand for it."""
    import torch

    n = min(len(row.input_ids), HEAD_CHECK_TOKENS)
    sample = loader.Row(row.input_ids[:n], np.ones(n, np.int8), row.source)
    inputs = _inputs(loader.collate_packed([sample]), device)
    with torch.no_grad():
        own = model(**inputs, use_cache=False).loss.item()
        chunked = _loss(model, head, inputs).item()
    difference = _apart(chunked, own)
    if not difference <= tolerance:
        raise StageError(
            f"validate.train_check.model: {path}: its own loss ({own:.6g}) is not the "
            f"cross-entropy of its output layer on its last hidden states ({chunked:.6g}) on "
            f"{n} tokens: the check's chunked loss cannot stand for this model's")
    return {"tokens": n, "model_loss": round(own, 6), "difference": float(f"{difference:.3g}")}


def _loss(model, head, inputs: dict):
    """The mean next-token loss of a batch with labels, computed in chunks."""
    inputs = dict(inputs)
    labels, _ = chunkedloss.next_token_targets(inputs["input_ids"], inputs.pop("labels"))
    hidden = chunkedloss.last_hidden(model, inputs)
    return chunkedloss.mean_loss(chunkedloss.token_losses(head, hidden, labels[None])[0], labels)


def _batch(model, head, group, packed: bool, pad_id: int, device, tolerance: float,
           memory: "Memory"):
    """(loss, step seconds, max per-token difference per comparison)."""
    import torch

    layouts = {"packed": loader.collate_packed(group),
               "padded": loader.collate_padded(group, pad_id)}
    train = "packed" if packed else "padded"
    width = layouts["padded"]["input_ids"].shape[1]
    memory.reset()
    start = time.perf_counter()
    inputs = _inputs(layouts[train], device)
    labels, following = chunkedloss.next_token_targets(inputs["input_ids"], inputs.pop("labels"))
    hidden = chunkedloss.last_hidden(model, inputs)
    # the labels again from changed rows, scored from the same logits in the same pass
    variants = _changed_labels(head, hidden.detach(), group, train, pad_id, width, device)
    targets = torch.stack([labels, following, *variants])
    losses = chunkedloss.token_losses(head, hidden, targets)
    loss = chunkedloss.mean_loss(losses[0], labels)
    loss.backward()
    _sync(device)
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    value = loss.item()
    losses = losses.detach()
    del hidden, loss
    if not math.isfinite(value):
        raise TrainCheckFailed(f"train step: the loss is {value} on rows {_rows(group)}")
    per_row = {train: _per_row(losses[1], group, train, width)}
    _check_labels(losses, targets, per_row[train], group, value, tolerance)
    with torch.no_grad():
        other = "padded" if packed else "packed"
        per_row[other] = _per_row(_following_losses(model, head, layouts[other], device),
                                  group, other, width)
        alone = per_row["packed"] if len(group) == 1 else []  # one row: packed is alone
        for row in group if len(group) > 1 else []:
            single = loader.collate_packed([row])
            alone.extend(_per_row(_following_losses(model, head, single, device), [row],
                                  "packed", width))
    differences = {}
    for name in ("packed", "padded"):
        worst = 0.0
        for k, (got, ref) in enumerate(zip(per_row[name], alone)):
            worst = max(worst, float(((got - ref).abs() / ref.abs().clamp(min=1.0)).max())
                        if len(ref) else 0.0)
            if worst > tolerance:
                raise TrainCheckFailed(
                    f"train step: row {k} of {_rows(group)} has a per-token loss {worst:.3g} "
                    f"away from the same row alone in a {name} batch (tolerance {tolerance}): "
                    "rows attend across their boundaries"
                )
        differences[f"{name}_vs_alone"] = worst
    return value, seconds, differences


def _inputs(batch: dict, device) -> dict:
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in loader.to_torch(batch).items()}


def _following_losses(model, head, batch: dict, device):
    """The cross-entropy of every next token of a collated batch, per position."""
    inputs = _inputs(batch, device)
    _, following = chunkedloss.next_token_targets(inputs["input_ids"], inputs.pop("labels"))
    hidden = chunkedloss.last_hidden(model, inputs)
    return chunkedloss.token_losses(head, hidden, following[None])[0]


def _per_row(values, group, layout: str, width: int) -> list:
    """Per row, the losses of its next tokens (float32, on the CPU), from per-position
    `values` of a batch in `layout` (`width`: a padded batch's row length)."""
    out, offset = [], 0
    for k, row in enumerate(group):
        n = len(row.input_ids)
        start = offset if layout == "packed" else k * width
        out.append(values[start : start + max(n - 1, 0)].float().cpu())
        offset += n
    return out


def _changed_labels(head, hidden, group, layout: str, pad_id: int, width: int, device) -> list:
    """Targets from rows changed where loss_mask is 0 (the loss must not move) and, where
    a row has a supervised token, from rows with that token changed (it must move)."""
    import torch

    vocab = head.vocab

    def targets(rows):
        batch = (loader.collate_packed(rows) if layout == "packed"
                 else loader.collate_padded(rows, pad_id))
        inputs = loader.to_torch(batch)
        return chunkedloss.next_token_targets(inputs["input_ids"], inputs["labels"])[0].to(device)

    unsupervised = [r._replace(input_ids=np.where(r.loss_mask == 1, r.input_ids,
                                                  (r.input_ids + 1) % vocab)) for r in group]
    out = [targets(unsupervised)]
    k, p = _a_supervised_position(group)
    if k is not None:
        # the replacement whose logit is farthest from the token's: the largest change
        before = sum(len(r.input_ids) for r in group[:k]) if layout == "packed" else k * width
        with torch.no_grad():
            scores = head.logits(hidden[before + p - 1 : before + p])[0]
        ids = group[k].input_ids.copy()
        top, bottom = int(scores.argmax()), int(scores.argmin())
        here = scores[int(ids[p])]
        ids[p] = top if abs(scores[top] - here) >= abs(scores[bottom] - here) else bottom
        moved = list(group)
        moved[k] = group[k]._replace(input_ids=ids)
        out.append(targets(moved))
    return out


def _check_labels(losses, targets, per_row: list, group, loss: float,
                  tolerance: float) -> None:
    """The loss sees the supervised tokens and nothing else. `losses`/`targets`: per
    position, the labels, the following tokens, then the changed labels' (_changed_labels)."""

    def loss_with(k: int) -> float:
        return chunkedloss.mean_loss(losses[k], targets[k]).item()

    baseline = loss_with(0)
    changed = loss_with(2)
    if changed != baseline:
        raise TrainCheckFailed(
            f"train step: the loss sees tokens outside loss_mask: changing the tokens where "
            f"loss_mask is 0 moved it from {baseline:.6g} to {changed:.6g} (rows {_rows(group)})"
        )
    if len(targets) > 3 and loss_with(3) == baseline:
        k, p = _a_supervised_position(group)
        raise TrainCheckFailed(
            f"train step: the loss ignores supervised tokens: changing token {p} of row "
            f"{k} (loss_mask 1) left it at {baseline:.6g} (rows {_rows(group)})"
        )
    # the reference: cross-entropy at supervised positions, from input_ids and loss_mask
    total, count = 0.0, 0
    for row, values in zip(group, per_row):
        where = np.flatnonzero(row.loss_mask[1:] == 1)
        total += float(values[where].sum()) if len(where) else 0.0
        count += len(where)
    reference = total / count if count else float("nan")
    if not _apart(loss, reference) <= tolerance:
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


def _longest(model, head, tokens: int, vocab: int, device, memory: "Memory") -> dict:
    """Forward and backward on one row of `tokens` tokens: the memory at the worst."""
    import torch

    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, tokens).astype(np.int32)
    mask = (np.arange(tokens) >= tokens * 2 // 5).astype(np.int8)  # an answer after a prompt
    batch = loader.collate_packed([loader.Row(ids, mask, "longest")])
    memory.reset()
    start = time.perf_counter()
    try:
        _loss(model, head, _inputs(batch, device)).backward()
        _sync(device)
    except torch.OutOfMemoryError as e:
        raise TrainCheckFailed(
            f"train step: the longest batch ({tokens} tokens) runs out of memory on "
            f"{device}: {str(e).splitlines()[0]}"
        ) from None
    seconds = time.perf_counter() - start
    peak = memory.step_mb()
    model.zero_grad(set_to_none=True)
    return {"tokens": tokens, "peak_memory_mb": peak, "seconds": round(seconds, 3),
            "full_logits_mb": round(tokens * vocab * 4 / 2**20, 1)}


# ----------------------------------------------------------------------- memory


class Memory:
    """Peak memory of each step, and the process's own peak across the steps' resets."""

    def __init__(self, device):
        self.device = device
        self.before = _vmhwm_mb()  # the process's peak before the first reset

    def what(self) -> str:
        return ("torch.cuda.max_memory_allocated" if self.device.type == "cuda"
                else "process peak RSS (VmHWM) per step")

    def reset(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.before = max(self.before, _vmhwm_mb())
        try:  # "5" resets this process's VmHWM to its current RSS (Linux)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass  # then the peak is the process's since it started

    def step_mb(self) -> float:
        """The peak since the last reset."""
        import torch

        if self.device.type == "cuda":
            return round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)
        return _vmhwm_mb()

    def process_peak_mb(self) -> float:
        """The process's highest RSS so far, through every reset."""
        return max(self.before, _vmhwm_mb())


def _vmhwm_mb() -> float:
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
