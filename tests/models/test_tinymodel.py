"""The demo model: deterministic, loadable, built once, with the bundled tokenizer."""

from __future__ import annotations

import hashlib
import json

import pytest

from stages.models import tinymodel, tokenizer


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    import torch

    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(123)
    a = tinymodel.ensure_model(root / "a")
    after_build = torch.rand(3)  # what the caller's generator gives after a build
    return a, tinymodel.ensure_model(root / "b"), after_build


@pytest.mark.slow  # builds the demo model twice
def test_two_builds_are_byte_identical(built):
    a, b, _ = built
    assert a.is_absolute() and b.is_absolute()
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert {"model.safetensors", "config.json", "generation_config.json",
            "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(names)
    for name in names:
        assert _sha(a / name) == _sha(b / name), name
    assert not [p for p in a.parent.iterdir() if p.name.startswith(".") and "tmp" in p.name]


@pytest.mark.slow  # builds the demo model twice
def test_loads_as_a_qwen3_with_the_bundled_vocabulary(built):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = built[0]
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "qwen3"
    tok = AutoTokenizer.from_pretrained(path)
    bundled = tokenizer.load_tokenizer("bundled:qwen3.6")
    assert config.vocab_size == len(tok) == len(bundled) == 248077
    assert config.eos_token_id == tok.eos_token_id == 248046
    assert config.pad_token_id == tok.pad_token_id == 248044
    assert config.bos_token_id is None and config.tie_word_embeddings
    assert tok.get_vocab() == bundled.get_vocab()
    assert tok.chat_template == bundled.chat_template == tokenizer.BUNDLED_TEMPLATE.read_text("utf-8")

    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.get_input_embeddings().weight.shape == (248077, 64)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] <= ids["input_ids"].shape[1] + 3
    assert int(out.max()) < 248077

    # specials never reach the top 20 it samples from, except <|im_end|>, which does
    torch.manual_seed(0)
    context = torch.randint(0, 248044, (8, 40))
    with torch.no_grad():
        top = model(context).logits[:, 4:, :].topk(20, dim=-1).indices
    assert not ((top >= 248044) & (top != 248046)).any()
    assert 0.05 < (top == 248046).any(-1).float().mean().item() < 0.9

    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [248046, 248044] and gen["do_sample"] is True


@pytest.mark.slow  # builds a demo model
def test_current_build_is_reused_and_stale_one_rebuilt(built, monkeypatch):
    path = built[0]
    weights = path / "model.safetensors"
    before = (weights.stat().st_ino, weights.stat().st_mtime_ns)
    calls = []
    real = tinymodel.build
    monkeypatch.setattr(tinymodel, "build", lambda *a: (calls.append(1), real(*a)))

    assert tinymodel.ensure_model(path) == path
    assert calls == [] and (weights.stat().st_ino, weights.stat().st_mtime_ns) == before

    stamp = json.loads((path / tinymodel.STAMP).read_text())
    stamp["build_version"] = -1  # as if built by an older version of this module
    (path / tinymodel.STAMP).write_text(json.dumps(stamp))
    assert tinymodel.ensure_model(path) == path
    assert calls == [1]
    assert _sha(weights) == _sha(built[1] / "model.safetensors")
    assert json.loads((path / tinymodel.STAMP).read_text())["build_version"] == tinymodel.BUILD_VERSION


@pytest.mark.slow  # builds the demo model twice
def test_build_does_not_disturb_the_callers_random_state(built):
    import torch

    _, _, after_build = built
    torch.manual_seed(123)
    assert torch.equal(after_build, torch.rand(3))


@pytest.mark.slow  # builds a demo model
def test_the_vllm_variant_has_heads_of_64_and_its_own_build(tmp_path):
    from transformers import AutoConfig

    path = tinymodel.ensure_model(tmp_path / "vllm", tinymodel.VLLM)
    config = AutoConfig.from_pretrained(path)
    assert (config.head_dim, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.num_hidden_layers) == (64, 128, 2, 1, 2)
    assert config.vocab_size == 248077 and not config.tie_word_embeddings
    stamp = json.loads((path / tinymodel.STAMP).read_text())
    assert stamp["stop"] == [tinymodel.STOP_SHARED, 0.8, 2.0, -2.0]
