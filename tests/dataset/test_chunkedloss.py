"""The chunked loss: equal to the model's own, loss and gradients, at bounded memory."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from stages.dataset import chunkedloss, loader, traincheck
from stages.models import tinymodel
from tests.helpers.repo import ROOT


@pytest.fixture(scope="module")
def model():
    import torch
    from transformers import AutoModelForCausalLM

    path = tinymodel.ensure_model(ROOT / tinymodel.DEFAULT_PATH)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                local_files_only=True).eval()


@pytest.fixture(scope="module")
def model64(model):
    """The demo model in float64: the reference the float32 results are held to, and where
    the chunked computation must equal the model's own up to float64 rounding."""
    return copy.deepcopy(model).double()


def rows(lengths, vocab: int, seed: int = 0) -> list[loader.Row]:
    rng = np.random.default_rng(seed)
    return [loader.Row(rng.integers(0, vocab, n).astype(np.int32),
                       (np.arange(n) >= n // 3).astype(np.int8), "s") for n in lengths]


def chunked(model, head, batch: dict):
    inputs = loader.to_torch(batch)
    labels, _ = chunkedloss.next_token_targets(inputs["input_ids"], inputs.pop("labels"))
    hidden = chunkedloss.last_hidden(model, inputs)
    return chunkedloss.mean_loss(chunkedloss.token_losses(head, hidden, labels[None])[0], labels)


def own(model, batch: dict):
    """The model's own loss, from its whole-vocabulary logits in the model's dtype
    (`model(**batch).loss` would cast float64 logits to float32 first)."""
    import torch.nn.functional as F

    inputs = loader.to_torch(batch)
    labels, _ = chunkedloss.next_token_targets(inputs["input_ids"], inputs.pop("labels"))
    logits = model(**inputs, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels,
                           ignore_index=loader.IGNORE)


def gradients(model) -> dict:
    out = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def rounding(dtype, terms: int) -> float:
    """The worst-case relative rounding of a sum of `terms` values in `dtype` (n * eps:
    Higham's gamma_n), whatever order a CPU, a kernel set or a thread count sums them in."""
    import torch

    return terms * torch.finfo(dtype).eps


def assert_equal_up_to_rounding(got, want, bound: float, name: str):
    scale = float(want.abs().max())
    worst = float((got - want).abs().max())
    assert worst <= bound * scale, f"{name}: {worst:.3g} apart, bound {bound:.3g} x {scale:.3g}"


def step(model, loss_of, batch):
    loss = loss_of(model, batch)
    loss.backward()
    return loss.detach(), gradients(model)


@pytest.mark.numeric
@pytest.mark.parametrize("packed", [True, False])
def test_loss_and_gradients_equal_the_models_own(model64, monkeypatch, packed):
    """In float64, where rounding is ~1e-16, the chunked loss and every gradient equal the
    model's own within the rounding of the longest sum (one over the vocabulary): a
    wrong chunk, target or gradient term is off by many orders more."""
    import torch

    head = chunkedloss.Head(model64, "model")
    monkeypatch.setattr(head, "rows", 7)  # many chunks, the last one short
    group = rows([24, 1, 13, 31], head.vocab)
    batch = loader.collate_packed(group) if packed else loader.collate_padded(group, 0)
    want_loss, want = step(model64, own, batch)
    got_loss, have = step(model64, lambda m, b: chunked(m, head, b), batch)
    bound = rounding(torch.float64, head.vocab)
    assert got_loss.dtype == torch.float64
    assert_equal_up_to_rounding(got_loss, want_loss, bound, "loss")
    # the output layer is tied to the embeddings: one weight, both gradients in it
    assert set(have) == set(want) and "model.embed_tokens.weight" in want
    for name, grad in want.items():
        assert_equal_up_to_rounding(have[name], grad, bound, name)


@pytest.mark.numeric
def test_float32_keeps_at_least_half_its_digits(model, model64, monkeypatch):
    """The check's float32 loss and gradients against the float64 ones: every tensor
    within sqrt(eps) of its own norm, the rule the training check holds losses to (an
    accidental half-precision step would be ~2**8 times further off)."""
    import torch

    head = chunkedloss.Head(model, "model")
    monkeypatch.setattr(head, "rows", 7)
    batch = loader.collate_packed(rows([24, 1, 13, 31], head.vocab))
    want_loss, want = step(model64, own, batch)
    got_loss, have = step(model, lambda m, b: chunked(m, head, b), batch)
    digits = traincheck.loss_tolerance(torch.float32)
    assert got_loss.dtype == torch.float32
    assert abs(got_loss.double() - want_loss) <= digits * abs(want_loss)
    for name, grad in want.items():
        off = float((have[name].double() - grad).norm())
        assert off <= digits * float(grad.norm()), (name, off, float(grad.norm()))


@pytest.mark.numeric
def test_an_untied_output_layer_with_a_bias_gets_its_own_gradients():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=500, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    model.lm_head = torch.nn.Linear(32, 500, bias=True)  # what the model's forward applies
    model.double()
    head = chunkedloss.Head(model, "model")
    head.rows = 5
    batch = loader.collate_packed(rows([12, 30], 500, seed=2))
    want_loss, want = step(model, own, batch)
    got_loss, have = step(model, lambda m, b: chunked(m, head, b), batch)
    bound = rounding(torch.float64, head.vocab)
    assert_equal_up_to_rounding(got_loss, want_loss, bound, "loss")
    assert {"lm_head.weight", "lm_head.bias", "model.embed_tokens.weight"} <= set(want) == set(have)
    for name, grad in want.items():
        assert_equal_up_to_rounding(have[name], grad, bound, name)


@pytest.mark.numeric
def test_every_target_row_is_its_own_cross_entropy(model64):
    import torch
    import torch.nn.functional as F

    head = chunkedloss.Head(model64, "model")
    (row,) = rows([30], head.vocab, seed=3)
    hidden = chunkedloss.last_hidden(model64, loader.to_torch({"input_ids": row.input_ids[None]
                                                            .astype(np.int64)}))
    rng = np.random.default_rng(1)
    targets = torch.from_numpy(rng.integers(0, head.vocab, (3, 30)))
    targets[1, ::4] = loader.IGNORE
    with torch.no_grad():
        got = chunkedloss.token_losses(head, hidden, targets)
        logits = head.logits(hidden)
        for k in range(3):
            want = F.cross_entropy(logits, targets[k], ignore_index=loader.IGNORE,
                                   reduction="none")
            assert_equal_up_to_rounding(got[k], want, rounding(torch.float64, head.vocab),
                                        f"target row {k}")
    assert (got[1, ::4] == 0).all()


@pytest.mark.slow  # ~11 s: two steps whose peaks are measured apart
def test_memory_grows_with_hidden_size_not_vocabulary(model):
    """Peak memory over a step's own start, at 256 and at 1,024 tokens: the 768 tokens
    more would take ~730 MB of float32 logits alone (the model's own loss grows by ~4 MB a
    token here); chunked, they add what their hidden states take, a few MB."""
    head = chunkedloss.Head(model, "model")

    def growth(tokens: int) -> float:
        batch = loader.collate_packed(rows([tokens], head.vocab, seed=tokens))
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the current RSS
        chunked(model, head, batch).backward()
        model.zero_grad(set_to_none=True)
        return _status("VmHWM") - before

    growth(256)  # the allocator's first use
    short, long = growth(256), growth(1024)
    extra_logits_mb = 768 * head.vocab * 4 / 2**20
    assert long - short < extra_logits_mb / 10, (short, long, extra_logits_mb)


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return int(status[key].split()[0]) / 1024


def test_a_model_without_a_linear_output_layer_is_named(model, monkeypatch):
    import torch

    monkeypatch.setattr(model, "get_output_embeddings", lambda: torch.nn.Identity())
    with pytest.raises(chunkedloss.StageError, match="its output layer is Identity, not a linear"):
        chunkedloss.Head(model, "validate.train_check.model: m")
