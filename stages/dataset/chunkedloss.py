"""Cross-entropy under a causal LM's output layer without its [positions, vocabulary] logits.

A model's own loss computes every position's logits first: ~1 MB per token in float32
with the Qwen3.6 vocabulary, several times over with the gradient. Here the output layer
is applied to the last hidden states a chunk of positions at a time (at most CHUNK_BYTES
of logits, float32 or the model's wider dtype), keeping each position's log-sum-exp; backward computes each chunk's
logits again and turns them into their gradient in place. Memory grows with positions x
hidden size, and the loss and gradients equal the model's own up to float rounding
(tests/dataset/test_chunkedloss.py holds them to it on the demo model).

    head = Head(model, "validate.train_check.model: PATH")   # where, for its errors
    hidden = last_hidden(model, inputs)                # [positions, hidden size]
    losses = token_losses(head, hidden, targets)       # [target rows, positions]
    loss = mean_loss(losses[0], targets[0])            # what model(**batch).loss gives
"""

from __future__ import annotations

import functools

from stages.common.errors import StageError
from stages.dataset.loader import IGNORE

# the logits of one chunk of positions; backward holds a few such tensors at once
CHUNK_BYTES = 64 << 20


class Head:
    """The model's output layer and how many positions one chunk of logits holds."""

    def __init__(self, model, where: str):
        import torch

        layer = model.get_output_embeddings()
        if not isinstance(layer, torch.nn.Linear):
            raise StageError(f"{where}: its output layer is {type(layer).__name__}, not a "
                             "linear layer: its loss cannot be computed in chunks")
        self.weight, self.bias = layer.weight, layer.bias
        self.vocab = self.weight.shape[0]
        width = torch.finfo(_accumulation(self.weight.dtype)).bits // 8
        self.rows = max(1, CHUNK_BYTES // (width * self.vocab))

    def logits(self, hidden):
        """Logits of a few positions ([positions, hidden size]), at least float32."""
        import torch.nn.functional as F

        return _upcast(F.linear(hidden, self.weight, self.bias))


def last_hidden(model, inputs: dict):
    """The model body's last hidden states for `inputs` (a batch without labels), one row
    of positions after another: [rows × positions, hidden size]."""
    body = model.get_decoder()
    hidden = body(**inputs, use_cache=False).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])


def token_losses(head: Head, hidden, targets):
    """The cross-entropy of each row of `targets` ([rows, positions], token ids; IGNORE
    gives 0) at each position of `hidden`: [rows, positions]. Every row is computed from
    the same logits in one pass; gradients flow to `hidden` and the output layer."""
    return _function().apply(hidden, head.weight, head.bias, targets, head.rows)


@functools.cache
def _function():
    """The autograd Function over _forward and _backward (made on first use: torch is
    imported only where the check runs)."""
    import torch

    class ChunkedCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, bias, targets, rows):
            losses, lse = _forward(hidden, weight, bias, targets, rows)
            ctx.save_for_backward(hidden, weight, bias, targets, lse)
            ctx.rows = rows
            return losses

        @staticmethod
        def backward(ctx, grad):
            return (*_backward(*ctx.saved_tensors, grad, ctx.rows,
                               ctx.needs_input_grad[:3]), None, None)

    return ChunkedCrossEntropy


def _forward(hidden, weight, bias, targets, rows: int):
    """(losses [target rows, positions], the log-sum-exp of each position's logits)."""
    import torch
    import torch.nn.functional as F

    dtype = _accumulation(hidden.dtype)
    lse = torch.empty(len(hidden), dtype=dtype, device=hidden.device)
    losses = torch.empty(targets.shape, dtype=dtype, device=hidden.device)
    for lo in range(0, len(hidden), rows):
        part = slice(lo, lo + rows)
        logits = _upcast(F.linear(hidden[part], weight, bias))
        lse[part] = torch.logsumexp(logits, -1)
        picked = logits.gather(1, targets[:, part].clamp(min=0).T).T
        losses[:, part] = torch.where(targets[:, part] == IGNORE, 0.0, lse[part] - picked)
    return losses, lse


def _backward(hidden, weight, bias, targets, lse, grad, rows: int, needs: tuple):
    """Gradients for (hidden, weight, bias), each chunk's logits computed again: the
    gradient of a target's loss by the logits is softmax - one-hot(target)."""
    import torch
    import torch.nn.functional as F

    grad = torch.where(targets == IGNORE, 0.0, grad)
    d_hidden = torch.empty_like(hidden) if needs[0] else None
    d_weight = torch.zeros_like(weight) if needs[1] else None
    d_bias = torch.zeros_like(bias) if bias is not None and needs[2] else None
    for lo in range(0, len(hidden), rows):
        part = slice(lo, lo + rows)
        g = _upcast(F.linear(hidden[part], weight, bias))
        g.sub_(lse[part, None]).exp_()  # softmax, in place
        g.mul_(grad[:, part].sum(0)[:, None])
        at = torch.arange(g.shape[0], device=g.device).expand(len(targets), -1)
        g.index_put_((at.reshape(-1), targets[:, part].clamp(min=0).reshape(-1)),
                     -grad[:, part].reshape(-1), accumulate=True)
        g = g.to(hidden.dtype)
        if d_hidden is not None:
            d_hidden[part] = g @ weight
        if d_weight is not None:
            d_weight.addmm_(g.T, hidden[part])
        if d_bias is not None:
            d_bias += g.sum(0)
    return d_hidden, d_weight, d_bias


def _accumulation(dtype):
    """The dtype logits and losses are computed in: float32 for half-precision models (as
    the models' own loss upcasts), the model's own where it is wider (float64 in the tests,
    whose bounds follow float64's epsilon)."""
    import torch

    return torch.promote_types(dtype, torch.float32)


def _upcast(logits):
    return logits.to(_accumulation(logits.dtype))


def mean_loss(losses, targets):
    """The mean over the positions whose target is not IGNORE (NaN when there are none,
    as the models' own loss)."""
    return losses.sum() / (targets != IGNORE).sum()


def next_token_targets(batch_ids, batch_labels):
    """(labels, following tokens) as targets per position of a [rows, positions] batch:
    what each position predicts, shifted as the models shift labels (the last position
    of each row predicts nothing: IGNORE, and 0 for the following token)."""
    import torch

    def shifted(values, fill: int):
        pad = torch.full_like(values[:, :1], fill)
        return torch.cat([values[:, 1:], pad], 1).reshape(-1)

    return shifted(batch_labels, IGNORE), shifted(batch_ids, 0)
