"""The chunked loss: equal to the model's own, loss and gradients, at bounded memory."""

from __future__ import annotations

import numpy as np
import pytest

from stages.dataset import headloss, loader
from stages.models import tinymodel
from tests.repo import ROOT


@pytest.fixture(scope="module")
def model():
    import torch
    from transformers import AutoModelForCausalLM

    path = tinymodel.ensure_model(ROOT / tinymodel.DEFAULT_PATH)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                local_files_only=True).eval()


def rows(lengths, vocab: int, seed: int = 0) -> list[loader.Row]:
    rng = np.random.default_rng(seed)
    return [loader.Row(rng.integers(0, vocab, n).astype(np.int32),
                       (np.arange(n) >= n // 3).astype(np.int8), "s") for n in lengths]


def chunked(model, head, batch: dict):
    inputs = loader.to_torch(batch)
    labels, _ = headloss.next_token_targets(inputs["input_ids"], inputs.pop("labels"))
    hidden = headloss.last_hidden(model, inputs)
    return headloss.mean_loss(headloss.token_losses(head, hidden, labels[None])[0], labels)


def gradients(model) -> dict:
    out = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("packed", [True, False])
def test_loss_and_gradients_equal_the_models_own(model, monkeypatch, packed):
    import torch

    head = headloss.Head(model, "model")
    monkeypatch.setattr(head, "rows", 7)  # many chunks, the last one short
    group = rows([40, 1, 23, 57], head.vocab)
    batch = loader.collate_packed(group) if packed else loader.collate_padded(group, 0)
    own = model(**loader.to_torch(batch), use_cache=False).loss
    own.backward()
    want = gradients(model)
    got = chunked(model, head, batch)
    got.backward()
    have = gradients(model)
    assert abs(got.item() - own.item()) < 1e-5, (got.item(), own.item())
    # the output layer is tied to the embeddings: one weight, both gradients in it
    assert set(have) == set(want) and "model.embed_tokens.weight" in want
    for name, grad in want.items():
        torch.testing.assert_close(have[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_an_untied_output_layer_with_a_bias_gets_its_own_gradients():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=500, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    model.lm_head = torch.nn.Linear(32, 500, bias=True)  # what the model's forward applies
    head = headloss.Head(model, "model")
    head.rows = 5
    batch = loader.collate_packed(rows([12, 30], 500, seed=2))
    own = model(**loader.to_torch(batch), use_cache=False).loss
    own.backward()
    want = gradients(model)
    got = chunked(model, head, batch)
    got.backward()
    have = gradients(model)
    assert abs(got.item() - own.item()) < 1e-5
    assert {"lm_head.weight", "lm_head.bias", "model.embed_tokens.weight"} <= set(want) == set(have)
    for name, grad in want.items():
        torch.testing.assert_close(have[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_every_target_row_is_its_own_cross_entropy(model):
    import torch
    import torch.nn.functional as F

    head = headloss.Head(model, "model")
    (row,) = rows([30], head.vocab, seed=3)
    hidden = headloss.last_hidden(model, loader.to_torch({"input_ids": row.input_ids[None]
                                                          .astype(np.int64)}))
    rng = np.random.default_rng(1)
    targets = torch.from_numpy(rng.integers(0, head.vocab, (3, 30)))
    targets[1, ::4] = loader.IGNORE
    with torch.no_grad():
        got = headloss.token_losses(head, hidden, targets)
        logits = head.logits(hidden)
        for k in range(3):
            want = F.cross_entropy(logits, targets[k], ignore_index=loader.IGNORE,
                                   reduction="none")
            torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-5)
    assert (got[1, ::4] == 0).all()


def test_memory_grows_with_hidden_size_not_vocabulary(model):
    """Peak memory over a step's own start, at 256 and at 1,024 tokens: the 768 tokens
    more would take ~730 MB of float32 logits alone (the model's own loss grows by ~4 MB a
    token here); chunked, they add what their hidden states take, a few MB."""
    head = headloss.Head(model, "model")

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
    with pytest.raises(headloss.StageError, match="its output layer is Identity, not a linear"):
        headloss.Head(model, "validate.train_check.model: m")
