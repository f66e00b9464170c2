"""What every benchmark shares about running things: the size switch, and the environment
and shell of the stage and `dvc` commands it starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quick() -> bool:
    """Smaller inputs (`BENCH_QUICK=1` or `--quick`): a quick look, fixed costs weigh more."""
    return os.environ.get("BENCH_QUICK") == "1" or "--quick" in sys.argv


def env() -> dict:
    """This interpreter's bin first on PATH (dvc.yaml's commands run `python`), offline,
    the project importable."""
    out = dict(os.environ)
    out["PATH"] = str(Path(sys.executable).parent) + os.pathsep + out.get("PATH", "")
    out.update(DVC_NO_ANALYTICS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return out


def sh(cmd: list[str], cwd: Path) -> str:
    """Run `cmd` in `cwd`; its stdout, or RuntimeError with the end of its stderr."""
    proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{cmd} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout
