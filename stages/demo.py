"""Run the whole pipeline on the embedded default and summarise it (`make demo`).

Prepares what the default params need and that is never committed (the bundled Qwen3.6
tokenizer, the tiny random-weight demo model, a small tokenized base set in data/base),
runs `dvc repro`, then prints rows and tokens after each stage.

  python -m stages.demo            prepare, dvc repro, summary
  python -m stages.demo setup      prepare only
  python -m stages.demo summary    summary of the last run only
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

from stages.common import params, reports, stagefiles
from stages.common.errors import StageError
from stages.dataset import charts
from stages.process import cli

BASE_ROWS = 24


def where() -> tuple[Path, Path]:
    """The merged set and the reports folder, as dvc.yaml gives them to validate."""
    from stages import validate

    paths = cli.pipeline_paths("validate", validate.PATHS)
    return paths.merged, paths.reports


def setup() -> None:
    from stages.models import tinymodel, tokenizer

    tokenizer.load_tokenizer("bundled:qwen3.6")
    tinymodel.ensure_model()
    base = params.load("merge", "params.yaml").base
    if base and not (Path(base) / "state.json").exists():
        build_base(Path(base))


def base_conversations(n: int = BASE_ROWS, seed: int = 1234) -> list[dict]:
    """Deterministic stand-ins for an existing training set: arithmetic Q&A with thinking."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        op, value = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
        rows.append(
            {
                "id": f"base-{i:04d}",
                "source": "demo_base",
                "messages": [
                    {"role": "user", "content": f"What is {a} {op} {b}?"},
                    {
                        "role": "assistant",
                        "reasoning_content": f"I need {a} {op} {b}. That is {value}.",
                        "content": f"{a} {op} {b} = {value}.",
                    },
                ],
            }
        )
    return rows


def build_base(target: Path) -> None:
    """Write the demo base set the way the tokenize stage writes its output."""
    from stages import tokenize

    with tokenize_scratch() as scratch:
        completions = scratch / stagefiles.COMPLETIONS_FILE
        with completions.open("w", encoding="utf-8") as f:
            for row in base_conversations():
                row.update(finish_reason="stop", truncated=False)
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        # the rows carry their thinking: said here, as no generate run wrote generation.json
        tokenize.tokenize_file(completions, target, shard_rows=BASE_ROWS // 2, enable_thinking=True)


class tokenize_scratch:
    """A scratch folder under .cache that is removed afterwards."""

    def __enter__(self) -> Path:
        self.path = Path(".cache/demo-scratch")
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True)
        return self.path

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def repro() -> list[str]:
    """Run `dvc repro`, echo its output, return the names of the stages that ran."""
    if not Path(".git").exists():
        raise StageError("not a git repository: clone the project with git (dvc needs it)")
    proc = subprocess.Popen(
        ["dvc", "repro"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    ran = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        m = re.match(r"Running stage '([^']+)'", line)
        if m:
            ran.append(m.group(1))
    if proc.wait() != 0:
        raise StageError(f"dvc repro failed (exit {proc.returncode}); see the output above")
    return ran


def summary(ran: list[str] | None) -> str:
    merged, folder = where()
    prep, gen, tok, mer, val = (
        reports.read(folder, s) for s in ("prepare", "generate", "tokenize", "merge", "validate")
    )
    lines = ["", "=== demo summary ==="]
    if ran is not None:
        lines.append(
            "stages run: " + (", ".join(ran) if ran else "none - nothing changed, all up to date")
        )
    total = prep.get("totals", {})
    lines.append(f"prepare   {total.get('kept', '?')} prompts from {len(prep.get('sources', {}))} sources")
    lines.append(
        f"generate  {gen.get('completed', '?')} completions ({gen.get('truncated', '?')} truncated), "
        f"{gen.get('failed', '?')} failed, {gen.get('output_tokens', '?')} output tokens"
    )
    served = tok.get("serve_check", {})
    lines.append(f"tokenize  {tok.get('rows', '?')} rows, {tok.get('tokens', '?')} tokens "
                 f"({tok.get('loss_tokens', '?')} supervised); served prompts checked "
                 f"{served.get('checked', '?')}, mismatches {served.get('mismatches', '?')}")
    lines.append(
        f"merge     {mer.get('base', {}).get('rows', '?')} base + {mer.get('new', {}).get('rows', '?')} new"
        f" = {mer.get('merged', {}).get('rows', '?')} rows, {mer.get('merged', {}).get('tokens', '?')} tokens"
    )
    lines.append(f"validate  {'passed' if val.get('passed') else 'FAILED'}")
    lines += training_lines(val, folder)
    lines.append(f"merged dataset: {merged.resolve()}")
    card = merged / "README.md"
    if card.exists():
        lines.append(f"its lineage card (version {mer.get('version', '?')}): {card} "
                     f"(facts for machines: {merged / 'lineage.json'})")
    lines.append(
        "load it:  python -c \"from stages.dataset.loader import batches; "
        f"print(next(batches('{merged}', 4096, packed=True)))\""
    )
    lines.append(f"export:   python -m stages.export --for trl --merged {merged} --out export/trl"
                 "   (or specforge, axolotl)")
    lines.append(f"look:     python -m stages.show --row 0   (supervised tokens marked; --id ID, "
                 f"--html rows.html; sample rows: {charts.samples(folder)})")
    return "\n".join(lines)


def training_lines(val: dict, folder: Path) -> list[str]:
    """The training check, the token budget and the pictures, from validate's report (its
    facts and its run's figures) in the reports folder."""
    lines = []
    check, budget = val.get("train_check") or {}, val.get("budget")
    if "skipped" in check or "failed" in check:
        lines.append(f"train     {check.get('skipped') or check.get('failed')}")
    elif check:
        longest = check.get("longest_batch") or {}
        lines.append(
            f"train     {check['batches']} {check['layout']} steps of {check['tokens_per_batch']} "
            f"tokens on {check['device']} ({check['model']}): loss {check['loss'][-1]:.3f}, "
            f"{check['tokens_per_second']:.0f} tokens/s, peak {check['peak_memory_mb']:.0f} MB "
            f"(validate: {check['process_peak_rss_mb']:.0f} MB)"
        )
        if "tokens" in longest:
            lines.append(f"          longest batch {longest['tokens']} tokens: peak "
                         f"{longest['peak_memory_mb']:.0f} MB, {longest['seconds']:.1f} s")
        elif longest:
            lines.append(f"          longest batch {longest['skipped']}")
        worst = max(check["max_loss_difference"].values(), default=0.0)
        lines.append(f"          labels follow loss_mask; packed = padded = alone per token "
                     f"(max difference {worst:.1g})")
    if budget:
        padded, packed = budget["padded"], budget["packed"]
        lines.append(
            f"budget    an epoch at {budget['tokens_per_batch']} tokens per batch: "
            f"{packed['batches']} packed batches ({packed['padding_fraction']:.0%} unused) or "
            f"{padded['batches']} padded ({padded['padding_fraction']:.0%} padding)"
        )
        lines.append(f"          {packed['supervised_tokens_per_step']:.0f} supervised tokens per "
                     f"packed step (by source: reports/validate.json)")
    pictures = sorted(str(p) for p in charts.plots(folder).glob("*.svg"))
    if pictures:
        lines.append(f"pictures  {', '.join(pictures)}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stages.demo", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", nargs="?", default="run", choices=["run", "setup", "summary"])
    args = parser.parse_args(argv)
    try:
        if args.action in ("run", "setup"):
            setup()
        if args.action == "run":
            print(summary(repro()))
        elif args.action == "summary":
            print(summary(None))
    except StageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
