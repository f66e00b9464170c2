"""Throwaway git+DVC copies of this repo, for tests that drive the real CLIs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = str(Path(sys.executable).parent)


def env() -> dict:
    e = dict(os.environ)
    e["PATH"] = BIN + os.pathsep + e.get("PATH", "")
    e["HF_HUB_OFFLINE"] = "1"
    e["DVC_NO_ANALYTICS"] = "1"
    return e


def run(cmd, cwd: Path, check: bool = True, timeout: float = 900) -> str:
    # A session of its own, so a timeout kills dvc, the stage and any server it started.
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd} timed out after {timeout} s:\n{out[-4000:]}") from None
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}:\n{out[-4000:]}")
    return out


def git_commit(repo: Path, message: str) -> str:
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com",
         "commit", "-q", "--allow-empty", "-m", message], repo)
    return run(["git", "rev-parse", "HEAD"], repo).strip()


def prebuilt_caches() -> None:
    """Build the tokenizer and demo model once in the project so clones can link them."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        from stages.models import tinymodel, tokenizer

        tokenizer.load_tokenizer("bundled:qwen3.6")
        tinymodel.ensure_model()
    finally:
        os.chdir(cwd)


def link_caches(dest: Path) -> None:
    """dest/.cache is the project's, the bundled tokenizer and demo model built in it first
    (a clean clone has no .cache until something builds one)."""
    prebuilt_caches()
    (Path(dest) / ".cache").symlink_to(ROOT / ".cache")


def run_products() -> list[str]:
    """What runs write into a checkout besides ignored folders: dvc.lock and every out,
    metric and plot of dvc.yaml (`make demo` leaves them, untracked, in the project)."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    paths = ["dvc.lock"]
    for stage in stages.values():
        for kind in ("outs", "metrics", "plots"):
            paths += [e if isinstance(e, str) else next(iter(e)) for e in stage.get(kind) or []]
    return paths


def demo_clone(dest: Path) -> Path:
    """Copy the working tree (tracked + untracked, not ignored) into a fresh git repo,
    less what earlier runs left in it (run_products): a test starts where a fresh clone
    does, whatever the user ran before.

    The bundled tokenizer and demo model are linked in from the project's .cache (they
    are deterministic builds); the request cache and all data start empty.
    """
    prebuilt_caches()
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    left = run_products()
    repo = dest / "repo"
    for name in filter(None, files):
        src = ROOT / name
        if not src.is_file() or any(name == p or name.startswith(p + "/") for p in left):
            continue
        target = repo / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    for sub in ("tokenizers", "demo-model"):
        shutil.copytree(ROOT / ".cache" / sub, repo / ".cache" / sub, copy_function=os.link)
    run(["git", "init", "-q", "-b", "main"], repo)
    git_commit(repo, "initial")
    return repo


def small_training_check(repo: Path) -> None:
    """validate's training check on 256-token batches, its longest batch off (null: off on
    a CPU), in a clone's params.yaml: for the tests that run the whole pipeline for
    something else. Each validate run with the shipped 2,048-token batches of the demo
    model's 248K-entry vocabulary costs ~30 s of CPU; tests/test_pipeline.py runs those."""
    path = repo / "params.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["validate"]["train_check"].update(tokens_per_batch=256, longest_batch_tokens=None)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
