"""Atomic outputs: whole or absent, and no temporaries left behind, even when killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.common import outputs
from stages.common.errors import StageError
from tests.helpers.repo import ROOT


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_failed_block_leaves_the_old_output_and_no_temporary(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with outputs.atomic_dir(target) as tmp:
            (tmp / "new.txt").write_text("half")
            raise RuntimeError("boom")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (target / "old.txt").read_text() == "old"


def test_temporaries_of_a_killed_writer_are_removed_by_the_next(tmp_path):
    target = tmp_path / "merged"
    gone = dead_pid()
    stale = [tmp_path / f".merged.tmp-{gone}-abc", tmp_path / f".merged.old-{gone}"]
    for path in stale:
        path.mkdir()
        (path / "data-00000.arrow").write_bytes(b"partial")
    live = tmp_path / f".merged.tmp-{os.getppid()}-xyz"  # a running process's: kept
    live.mkdir()
    other = tmp_path / f".prompts.tmp-{gone}-abc"  # another target's: not ours to judge
    other.mkdir()
    with outputs.atomic_dir(target) as tmp:
        (tmp / "ok").write_text("1")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["merged", live.name, other.name])
    with outputs.atomic_file(tmp_path / "report.json") as f:
        f.write("{}")
    assert (tmp_path / "report.json").read_text() == "{}"



def test_a_run_killed_between_the_two_renames_loses_no_version(tmp_path):
    """atomic_dir moves the old output aside, then the new one in: a kill between the two
    leaves only `.NAME.old-PID`. The next writer puts it back before anything else, so a
    run that then fails leaves the user's last version where it was."""
    target = tmp_path / "merged"
    aside = tmp_path / f".merged.old-{dead_pid()}"
    aside.mkdir()
    (aside / "data-00000.arrow").write_text("v1")
    with pytest.raises(RuntimeError):
        with outputs.atomic_dir(target):
            raise RuntimeError("this run fails too")
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]
    assert (target / "data-00000.arrow").read_text() == "v1"


def test_an_input_holding_a_link_into_a_replaced_folder_is_refused(tmp_path):
    """A base whose shard is a link into the merged set would change when merge replaces
    that set (its rows filtered, its state.json another version's)."""
    (tmp_path / "merged").mkdir()
    (tmp_path / "merged/data-00000.arrow").write_text("v1")
    (tmp_path / "base/sub").mkdir(parents=True)
    (tmp_path / "base/own.arrow").write_text("b")
    outputs.check_apart({"merge.base": tmp_path / "base"}, [("--out", tmp_path / "merged")])
    (tmp_path / "base/sub/data-00000.arrow").symlink_to("../../merged/data-00000.arrow")
    with pytest.raises(StageError, match=r"^merge.base: .*base/sub/data-00000.arrow links "
                                         r"into --out .*merged, which this stage replaces"):
        outputs.check_apart({"merge.base": tmp_path / "base"}, [("--out", tmp_path / "merged")])


CHILD = """
import sys, time
from pathlib import Path
from stages.common import outputs
from stages.common.errors import StageError
from stages.process import cli

def run(cfg, paths):
    with outputs.atomic_dir(Path(sys.argv[1])) as tmp:
        (tmp / "part").write_bytes(b"x" * 1000)
        print("writing", flush=True)
        time.sleep(60)

sys.exit(cli.main("merge", "", run, {}, ["--params", sys.argv[2]]))
"""


def test_sigterm_unwinds_a_stage_and_removes_its_temporary(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("merge: {}\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "out"), str(params)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    assert list(tmp_path.glob(".out.tmp-*"))
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "error: merge terminated; nothing partial was written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


def test_a_scratch_folder_of_a_killed_run_is_removed_by_the_next_writer(tmp_path):
    target = tmp_path / "prompts"
    code = ("import sys, time; from pathlib import Path; from stages.common import outputs\n"
            "folder = outputs.scratch_dir(Path(sys.argv[1]), 'evals')\n"
            "(folder / 'index.bin').write_bytes(b'x' * 1000)\n"
            "print(folder, flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(target)], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    left = Path(proc.stdout.readline().strip())
    proc.kill()  # SIGKILL: nothing of its own cleanup runs
    proc.wait()
    assert left.parent == tmp_path and left.name.startswith(f".prompts.tmp-{proc.pid}-evals-")
    mine = outputs.scratch_dir(target, "evals")  # the next run: its own stays, the old goes
    assert not left.exists() and mine.is_dir()
    with outputs.atomic_dir(target):  # a writer of the target sweeps them too
        pass
    assert mine.is_dir()  # ours: this process is alive


# ------------------------------------------------ no room for an output (issue 32)

@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_write_with_no_room_in_an_output_names_that_output(tmp_path):
    """/dev/full fails every write with ENOSPC, as a full disk does."""
    target = tmp_path / "out"
    target.mkdir()
    (target / "kept").write_text("what was there")
    with pytest.raises(outputs.NoRoom, match=rf"^{target}: no room to write this output "
                                             r"\(No space left on device\)"):
        with outputs.atomic_dir(target):
            with open("/dev/full", "wb") as f:
                f.write(b"x" * 100)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing half-written beside
    assert (target / "kept").read_text() == "what was there"
    with pytest.raises(outputs.NoRoom, match=rf"^{tmp_path / 'file'}: no room"):
        with outputs.atomic_file(tmp_path / "file", "wb"):
            with open("/dev/full", "wb", buffering=0) as f:
                f.write(b"x")
    assert not (tmp_path / "file").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_shard_written_with_no_room_is_no_room_not_an_oserror_of_its_reader(tmp_path):
    """A reader's `except OSError` around a read and a write (merge's rewrite) must not
    take the output's full disk for its input's failure."""
    import pyarrow as pa

    from stages.dataset.schema import ARROW_SCHEMA

    from stages.dataset.shards import ShardFile

    batch = pa.RecordBatch.from_pylist(
        [{"id": "a", "source": "s", "input_ids": [1] * 5000, "loss_mask": [1] * 5000,
          "num_tokens": 5000, "num_loss_tokens": 5000}], schema=ARROW_SCHEMA)
    with pytest.raises(outputs.NoRoom):
        try:
            with ShardFile("/dev/full") as shard:
                shard.write(batch)
        except OSError:
            pytest.fail("a full disk came out as a plain OSError")
    assert not outputs.no_room(OSError(2, "No such file or directory"))
    assert outputs.no_room(OSError(27, "File too large"))


def test_a_rust_library_s_no_room_is_named_as_the_output_s_too(tmp_path):
    """tokenizers' save raises a plain Exception, "File too large (os error 27)"."""
    assert not outputs.no_room(Exception("(os error 2)")) and not outputs.no_room(
        Exception("(os error 280)"))
    with pytest.raises(outputs.NoRoom, match=rf"^{tmp_path / 'tok'}: no room to write this "
                                             r"output \(File too large\)"):
        with outputs.atomic_dir(tmp_path / "tok"):
            raise Exception("File too large (os error 27)")
    assert list(tmp_path.iterdir()) == []
