"""SpecForge 0.2.0 on a CPU, for the tests: its offline features and its own trainer.

    python -m tests.helpers.specforgecpu features --config RUN.yaml --prompts train.jsonl
    python -m tests.helpers.specforgecpu train --config RUN.yaml      (EAGLE-3; DFlash: `specforge train`)

`features` writes the target's hidden states in SpecForge's offline layout for the rows
SpecForge's own prompt reader (`prepare_prompt_tasks`, with the run's loss-mask rule) keeps,
each record built by SpecForge's own `resolve_offline_capture(cfg).layout`; only the
forward is transformers' (SpecForge's writer needs SGLang on a GPU): the output of layer k
is `hidden_states[k + 1]`. `train` is SpecForge's CLI with one part replaced: EAGLE-3's
loss is a Triton kernel (Triton has no CPU driver); the same file, specforge/core/loss.py,
holds SpecForge's reference implementation of that loss, `_compute_loss`, run here instead.
A stand-in `triton` exists only while that file is imported. Test environment only.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types
from pathlib import Path


def write_features(config: Path, prompts: Path) -> int:
    """The offline feature files of `config`'s run (data.hidden_states_path, made new),
    one per row SpecForge keeps from `prompts`; returns how many."""
    import torch
    from specforge.application.composition import resolve_offline_capture
    from specforge.config import load_config
    from specforge.data.prompt_builder import prepare_prompt_tasks
    from transformers import AutoModelForCausalLM

    cfg = load_config(str(config))
    capture = resolve_offline_capture(cfg)
    minimum = capture.run.algorithm.providers.model.minimum_loss_tokens(cfg, capture.draft_config)
    tasks = prepare_prompt_tasks(
        prompts, None, chat_template=None, max_length=cfg.data.max_length,
        is_preformatted=False, train_only_last_turn=False, cache_dir=None, cache_key=None,
        num_proc=None, min_loss_tokens=minimum, loss_mask_filter=capture.loss_mask_filter)
    model = AutoModelForCausalLM.from_pretrained(
        cfg.model.target_model_path, dtype=getattr(torch, cfg.model.torch_dtype)).eval()
    out = Path(cfg.data.hidden_states_path)
    out.mkdir(parents=True)
    for index, task in enumerate(tasks):
        payload = task["payload"]
        input_ids = torch.tensor(payload["input_ids"], dtype=torch.long)
        with torch.no_grad():
            states = model(input_ids=input_ids[None], output_hidden_states=True).hidden_states
        record = capture.layout.materialize({
            "input_ids": input_ids,
            "loss_mask": torch.tensor(payload["loss_mask"], dtype=torch.long),
            "aux_hidden_states": torch.cat([states[k + 1] for k in capture.capture_layers], -1),
            "last_hidden_states": states[-1],  # after the final norm, as the LM head reads it
        })
        torch.save(record, out / f"data_{index:08d}.ckpt")
    return len(tasks)


def _stand_in_triton() -> dict[str, types.ModuleType]:
    """Just enough of `triton` for loss.py's kernel definitions to be read, never run."""
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    triton.language = language
    language.constexpr = object
    return {"triton": triton, "triton.language": language}


def use_reference_loss() -> None:
    """LogSoftmaxLoss.apply computes SpecForge's reference loss: the same quantity (the
    masked cross-entropy against the target distribution, mean over batch and positions),
    uncompiled (torch.compile's warm-up would cost more than the run)."""
    # torch decides whether Triton exists when these load: before the stand-in is there
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    stand_ins = _stand_in_triton()
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        loss = importlib.import_module("specforge.core.loss")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    reference = getattr(loss._compute_loss, "_torchdynamo_orig_callable", loss._compute_loss)
    loss.LogSoftmaxLoss.apply = staticmethod(
        lambda logits, target, mask: reference(logits, target,
                                               mask if mask.dim() == 3 else mask.unsqueeze(-1)))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["features"]:
        p = argparse.ArgumentParser(prog="python -m tests.helpers.specforgecpu features")
        p.add_argument("--config", type=Path, required=True)
        p.add_argument("--prompts", type=Path, required=True)
        args = p.parse_args(argv[1:])
        print(f"features: {write_features(args.config, args.prompts)} rows")
        return 0
    use_reference_loss()
    from specforge.cli import main as specforge_main

    return specforge_main(argv)


if __name__ == "__main__":
    sys.exit(main())
