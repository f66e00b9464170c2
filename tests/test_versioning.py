"""What users do between runs, with the real git and dvc CLIs in a throwaway clone.

One demo clone is built once for the module (`history`): v1 is the demo run (commit A),
then a tokenize param changes (commit B), then a sampling param changes (commit C). The
tests read that history — what each `dvc repro` ran, the sha256 of every file of every
out at each commit — and then roll back, diff, push, pull and run experiments on it. Each
test leaves the clone at C with its data checked out. Generation (a `transformers
serve` process) runs twice in all: for A and for C.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from stages.common import reports
from tests.helpers.repo import ROOT, demo_clone, env, git_commit, run, small_training_check

pytestmark = pytest.mark.slow

OUTS = ("data/prompts", "data/completions", "data/tokenized", "data/merged")
TEMPERATURES = (0.7, 0.9)  # A/B and C
SMALL_GENERATE = {"limit": 12, "max_tokens": 24, "temperature": TEMPERATURES[0]}


# --------------------------------------------------------------------------- helpers


def run_env(cmd: list[str], repo: Path, extra_env: dict[str, str]) -> str:
    """tests.helpers.repo.run with extra environment variables."""
    proc = subprocess.run(cmd, cwd=repo, env={**env(), **extra_env}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    return proc.stdout


def dvc_json(repo: Path, *args: str):
    return json.loads(run(["dvc", *args, "--json"], repo))


def digest(path: Path, algorithm: str = "sha256") -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def md5(path: Path) -> str:
    """The name DVC 3 gives a file's object in its cache and remotes."""
    return digest(path, "md5")


def files(repo: Path, outs=OUTS) -> list[Path]:
    return sorted(p for out in outs for p in (repo / out).rglob("*") if p.is_file())


def out_hashes(repo: Path) -> dict[str, str]:
    """sha256 of every file of every DVC out, by path: the bytes a training job reads."""
    return {str(p.relative_to(repo)): digest(p) for p in files(repo)}


def stages_of(output: str) -> tuple[list[str], list[str]]:
    """(stages run, stages skipped as unchanged) from `dvc repro` output."""
    ran = re.findall(r"Running stage '([^']+)'", output)
    skipped = re.findall(r"Stage '([^']+)' didn't change, skipping", output)
    return ran, skipped


def set_param(repo: Path, section: str, key: str, value) -> None:
    """Edit params.yaml the way a user does (the values DVC tracks; layout is free)."""
    path = repo / "params.yaml"
    doc = yaml.safe_load(path.read_text())
    doc[section][key] = value
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def namespaces(repo: Path) -> dict[str, dict]:
    """Request-cache key spaces of the generate stage: name -> meta.json."""
    root = repo / ".cache" / "requests"
    return {d.name: json.loads((d / "meta.json").read_text())
            for d in sorted(root.iterdir()) if (d / "meta.json").exists()}


def segment_sizes(repo: Path, namespace: str) -> dict[str, int]:
    folder = repo / ".cache" / "requests" / namespace
    return {p.name: p.stat().st_size for p in folder.glob("seg-*.log")}


def report(repo: Path, stage: str) -> dict:
    return reports.read(repo / "reports", stage)


def token_lengths(repo: Path) -> list[int]:
    lengths: list[int] = []
    for shard in sorted((repo / "data/tokenized").glob("*.arrow")):
        with pa.memory_map(str(shard)) as source:
            lengths += pa.ipc.open_stream(source).read_all().column("num_tokens").to_pylist()
    return lengths


def between(values: list[int], q: float) -> int:
    """A max_seq_len that keeps the rows up to quantile q and drops the rest, chosen
    strictly between two distinct lengths so no row sits on the boundary."""
    distinct = sorted(set(values))
    assert len(distinct) >= 2, f"every demo row has the same length: {distinct}"
    i = min(max(int(len(distinct) * q), 0), len(distinct) - 2)
    lo, hi = distinct[i], distinct[i + 1]
    return (lo + hi) // 2 if hi - lo >= 2 else lo


@contextlib.contextmanager
def checked_out(repo: Path, rev: str, data: str = "checkout"):
    """`git checkout REV` + `dvc checkout` (or `dvc pull`); back to main + data after."""
    try:
        run(["git", "checkout", "-q", rev], repo)
        run(["dvc", data], repo)
        yield
    finally:
        run(["git", "checkout", "-q", "main"], repo)
        run(["dvc", "checkout"], repo)


def remote_objects(remote: Path) -> dict[str, int]:
    """Objects in a local DVC remote: md5 (with .dir suffix for listings) -> size."""
    root = remote / "files" / "md5"
    if not root.exists():
        return {}
    return {p.parent.name + p.name: p.stat().st_size for p in root.rglob("*") if p.is_file()}


def pushed_count(output: str) -> int:
    if "Everything is up to date" in output:
        return 0
    m = re.search(r"(\d+) files? pushed", output)
    assert m, output
    return int(m.group(1))


def is_run_key(name: str) -> bool:
    """Whether a metric's dotted name ends in a key the split sends to reports/runs/."""
    return name.rsplit(".", 1)[-1] in {k.rsplit(".", 1)[-1] for keys in reports.RUN.values()
                                       for k in keys}


def delete_cache_and_data(repo: Path) -> None:
    shutil.rmtree(repo / ".dvc" / "cache")
    for out in OUTS:
        shutil.rmtree(repo / out)


# --------------------------------------------------------------------------- the history


@dataclasses.dataclass
class History:
    repo: Path
    commits: dict[str, str]
    hashes: dict[str, dict[str, str]]
    repros: dict[str, str]  # `dvc repro` output that produced each commit
    namespaces: dict[str, dict[str, dict]]
    segments_a: dict[str, int]  # segment sizes of A's key space right after A
    lengths_a: list[int]  # num_tokens of A's tokenized rows
    rows_b: int  # rows of B's tokenized set
    max_seq_len: dict[str, int]
    seconds: dict[str, float]


def timed(seconds: dict, name: str, fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    seconds[name] = round(time.perf_counter() - start, 1)
    return result


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> History:
    repo = demo_clone(tmp_path_factory.mktemp("versioning"))
    tracked = [o for o in OUTS if run(["git", "ls-files", o], repo).strip()]
    assert not tracked, (
        f"DVC outs are committed to git: {tracked}; `dvc repro` in a fresh clone stops with "
        "'already tracked by SCM' (git rm -r --cached them; commit data/.gitignore)")
    seconds: dict[str, float] = {}
    commits, hashes, repros, spaces, max_len = {}, {}, {}, {}, {}
    # A smaller demo: generation (transformers serve on CPU) is most of the time
    for key, value in SMALL_GENERATE.items():
        set_param(repo, "generate", key, value)
    set_param(repo, "tokenize", "keep_truncated", True)  # short answers are mostly cut off
    small_training_check(repo)
    git_commit(repo, "a smaller demo")

    repros["A"] = timed(seconds, "demo", run, [sys.executable, "-m", "stages.demo"], repo)
    commits["A"] = git_commit(repo, "v1: the demo run")
    hashes["A"] = out_hashes(repo)
    spaces["A"] = namespaces(repo)
    (space_a,) = spaces["A"]
    segments_a = segment_sizes(repo, space_a)
    lengths_a = token_lengths(repo)
    max_len["A"] = yaml.safe_load((repo / "params.yaml").read_text())["tokenize"]["max_seq_len"]

    # B: a shorter max_seq_len that drops about the longer half of the new rows
    max_len["B"] = between(lengths_a, 0.5)
    set_param(repo, "tokenize", "max_seq_len", max_len["B"])
    repros["B"] = timed(seconds, "repro B", run, ["dvc", "repro"], repo)
    commits["B"] = git_commit(repo, "v2: tokenize.max_seq_len")
    hashes["B"] = out_hashes(repo)
    rows_b = len(token_lengths(repo))

    # C: another temperature: a new generation in a new request-cache key space
    set_param(repo, "generate", "temperature", TEMPERATURES[1])
    repros["C"] = timed(seconds, "repro C", run, ["dvc", "repro"], repo)
    commits["C"] = git_commit(repo, "v3: generate.temperature")
    hashes["C"] = out_hashes(repo)
    spaces["C"] = namespaces(repo)
    max_len["C"] = max_len["B"]
    return History(repo, commits, hashes, repros, spaces, segments_a, lengths_a, rows_b,
                   max_len, seconds)


# --------------------------------------------------------------------------- 1: repro


def test_first_run_builds_every_stage(history):
    print(f"\nseconds: {history.seconds}")
    ran, _ = stages_of(history.repros["A"])
    assert ran == ["prepare", "generate", "tokenize", "merge", "validate"]
    assert history.hashes["A"], "no data in the outs"
    for out in OUTS:
        assert any(k.startswith(out + "/") for k in history.hashes["A"]), out
    assert "nothing changed" not in history.repros["A"]


def test_tokenize_param_reruns_only_what_depends_on_it(history):
    ran, skipped = stages_of(history.repros["B"])
    assert ran == ["tokenize", "merge", "validate"], history.repros["B"]
    assert set(skipped) == {"prepare", "generate"}, history.repros["B"]
    a, b = history.hashes["A"], history.hashes["B"]
    for out in ("data/prompts", "data/completions"):
        assert {k: v for k, v in a.items() if k.startswith(out)} == \
               {k: v for k, v in b.items() if k.startswith(out)}, out
    expected_rows = sum(n <= history.max_seq_len["B"] for n in history.lengths_a)
    assert 0 < expected_rows < len(history.lengths_a)
    assert history.rows_b == expected_rows


def test_sampling_param_reruns_generation_in_a_new_key_space(history):
    repo = history.repo
    ran, skipped = stages_of(history.repros["C"])
    assert ran == ["generate", "tokenize", "merge", "validate"], history.repros["C"]
    assert skipped == ["prepare"], history.repros["C"]

    old, new = history.namespaces["A"], history.namespaces["C"]
    assert set(old) < set(new) and len(new) == len(old) + 1
    (space_c,) = set(new) - set(old)
    (space_a,) = old
    assert old[space_a]["sampling"]["temperature"] == TEMPERATURES[0]
    assert new[space_c]["sampling"]["temperature"] == TEMPERATURES[1]
    # the old key space is kept as it was: rolling back to A needs no new request
    assert segment_sizes(repo, space_a) == history.segments_a
    gen = report(repo, "generate")
    assert gen["from_cache"] == 0 and gen["sent"] == gen["requests"] > 0
    assert gen["cache_dir"].endswith(space_c)


def test_nothing_changed_runs_nothing(history):
    start = time.perf_counter()
    out = run(["dvc", "repro"], history.repo)
    print(f"\nno-op dvc repro on the demo: {time.perf_counter() - start:.1f} s")
    ran, skipped = stages_of(out)
    assert ran == [] and set(skipped) == {"prepare", "generate", "tokenize", "merge",
                                          "validate"}, out
    assert "Data and pipelines are up to date" in run(["dvc", "status"], history.repo)


# --------------------------------------------------------------------------- 2: roll back


def test_checkout_rolls_back_byte_identical(history):
    repo = history.repo
    start = time.perf_counter()
    with checked_out(repo, history.commits["A"]):
        rollback = time.perf_counter() - start
        assert out_hashes(repo) == history.hashes["A"]
        assert "Data and pipelines are up to date" in run(["dvc", "status"], repo)
        assert report(repo, "generate")["sampling_params"]["temperature"] == TEMPERATURES[0]
    assert out_hashes(repo) == history.hashes["C"]
    assert history.hashes["A"] != history.hashes["C"]
    merged = [k for k in history.hashes["A"] if k.startswith("data/merged/")]
    assert any(history.hashes["A"][k] != history.hashes["C"].get(k) for k in merged)
    print(f"\nrollback (git checkout + dvc checkout): {rollback:.1f} s")


# --------------------------------------------------------------------------- 3: compare


def test_params_and_metrics_diff_between_commits(history):
    repo, a, b = history.repo, history.commits["A"], history.commits["B"]
    params = dvc_json(repo, "params", "diff", a, b)["params.yaml"]
    assert params == {"tokenize.max_seq_len": {
        "old": history.max_seq_len["A"], "new": history.max_seq_len["B"],
        "diff": history.max_seq_len["B"] - history.max_seq_len["A"]}}

    metrics = dvc_json(repo, "metrics", "diff", a, b)
    rows_a, rows_b = len(history.lengths_a), sum(n <= history.max_seq_len["B"]
                                                 for n in history.lengths_a)
    tok = metrics["reports/tokenize.json"]
    assert tok["rows"]["old"] == rows_a and tok["rows"]["new"] == rows_b, tok
    assert tok["tokens"]["new"] < tok["tokens"]["old"], tok
    merged = metrics["reports/merge.json"]
    assert merged["merged.rows"]["diff"] == rows_b - rows_a, merged
    assert merged["merged.tokens"]["diff"] < 0, merged
    # generation did not change between A and B: nothing of it is in the diff
    assert "reports/generate.json" not in metrics and "reports/prepare.json" not in metrics
    # nor any timing of the stages that reran: those are in reports/runs/, not metrics
    assert not [k for f in metrics.values() for k in f if is_run_key(k)]

    params_ac = dvc_json(repo, "params", "diff", a, history.commits["C"])["params.yaml"]
    assert set(params_ac) == {"tokenize.max_seq_len", "generate.temperature"}


# --------------------------------------------------------------------------- 6: one copy


def test_outs_are_hardlinks_into_the_cache(history):
    repo = history.repo
    cache = repo / ".dvc" / "cache" / "files" / "md5"
    # DVC writes empty files instead of linking them (one inode for every empty file
    # would hit the filesystem's link limit); they hold no data blocks anyway
    for path in (p for p in files(repo) if p.stat().st_size):
        name = md5(path)
        obj = cache / name[:2] / name[2:]
        st, co = path.stat(), obj.stat()
        assert (st.st_ino, st.st_dev) == (co.st_ino, co.st_dev), f"{path} is a copy"
        assert st.st_nlink >= 2
    # merge linked the base shards; DVC kept that link: data/base, data/merged and the
    # cache hold one inode per base shard
    base = sorted((repo / "data/base").glob("*.arrow"))
    assert base
    merged = {p.stat().st_ino for p in (repo / "data/merged").glob("*.arrow")}
    assert all(p.stat().st_ino in merged for p in base)


# --------------------------------------------------------------------------- 4: back up


def test_push_pull_and_only_new_shards_are_sent(history):
    repo = history.repo
    remote = repo / ".dvc-remote"
    assert remote_objects(remote) == {}, "the remote must start empty"
    with checked_out(repo, history.commits["A"]):
        first = pushed_count(run(["dvc", "push"], repo))
    after_a = remote_objects(remote)
    assert first == len(after_a) > 0

    with checked_out(repo, history.commits["B"]):
        second = pushed_count(run(["dvc", "push"], repo))
        new_files = {md5(p) for p in files(repo)}
    after_b = remote_objects(remote)
    added = {k: after_b[k] for k in set(after_b) - set(after_a)}
    assert second == len(added)
    # exactly the files B has and A had not, plus the listings of the two changed dirs
    old_files = {k for k in after_a if not k.endswith(".dir")}
    assert {k for k in added if not k.endswith(".dir")} == new_files - old_files
    assert sum(k.endswith(".dir") for k in added) == 2  # data/tokenized, data/merged
    base_shards = {md5(p) for p in (repo / "data/base").glob("*.arrow")}
    assert base_shards <= old_files and not base_shards & set(added)
    print(f"\nsecond push: {len(added)} objects, {sum(added.values())} bytes "
          f"(the remote held {len(after_a)} objects, {sum(after_a.values())} bytes)")

    run(["dvc", "push"], repo)  # C
    delete_cache_and_data(repo)
    assert "Everything is up to date" not in run(["dvc", "pull"], repo)
    assert out_hashes(repo) == history.hashes["C"]
    # another machine rolling back: fetch A from the remote, not from a local cache
    with checked_out(repo, history.commits["A"], data="pull"):
        assert out_hashes(repo) == history.hashes["A"]
    assert out_hashes(repo) == history.hashes["C"]


# --------------------------------------------------------------------------- 5: experiments


KEEP_COLUMNS = (r"^(Experiment|tokenize\.max_seq_len|reports/tokenize\.json:(rows|tokens)"
                r"|merged\.(rows|tokens))$")


def test_exp_run_and_show_lists_both_runs(history):
    repo = history.repo
    lengths = token_lengths(repo)
    value = between(lengths, 0.25)
    assert value != history.max_seq_len["C"]
    try:
        out = run(["dvc", "exp", "run", "-n", "shorter", "-S",
                   f"tokenize.max_seq_len={value}"], repo)
        assert stages_of(out)[0] == ["tokenize", "merge", "validate"], out
        shown = dvc_json(repo, "exp", "show")
        table = run(["dvc", "exp", "show", "--md", "--drop", ".*",
                     "--keep", KEEP_COLUMNS], repo)
    finally:
        run(["git", "reset", "-q", "--hard"], repo)
        run(["dvc", "checkout"], repo)
    assert out_hashes(repo) == history.hashes["C"]

    (baseline,) = [row for row in shown if row["rev"] == history.commits["C"]]
    exps = {e["name"]: e["revs"][0]["data"] for e in baseline["experiments"] or []}
    assert "shorter" in exps, list(exps)
    runs = {"baseline": (baseline["data"], history.max_seq_len["C"]),
            "shorter": (exps["shorter"], value)}
    rows = {}
    for name, (data, max_seq_len) in runs.items():
        assert data["params"]["params.yaml"]["data"]["tokenize"]["max_seq_len"] == max_seq_len
        metrics = data["metrics"]
        rows[name] = metrics["reports/tokenize.json"]["data"]["rows"]
        assert rows[name] == sum(n <= max_seq_len for n in lengths), name
        assert metrics["reports/merge.json"]["data"]["merged"]["rows"] > rows[name]
    assert rows["shorter"] < rows["baseline"]
    assert "shorter" in table and str(value) in table
    print("\n" + table)


# what every table of experiments shows whatever changed
EXP_COLUMNS = {"Experiment", "rev", "typ", "Created", "parent", "State", "Executor"}


def changed_columns(repo: Path) -> tuple[list[str], list[dict]]:
    """`dvc exp show --only-changed` for the current commit: its columns less the ones
    naming the row, and its rows."""
    import csv

    table = list(csv.DictReader(run(["dvc", "exp", "show", "--only-changed", "--csv"],
                                    repo).splitlines()))
    assert table, "dvc exp show printed no rows"
    return [c for c in table[0] if c not in EXP_COLUMNS], table


def test_an_experiment_shows_only_what_changed_in_the_data(history):
    """A data-neutral param (num_proc) moves no metric; max_seq_len moves the counts."""
    repo = history.repo
    value = between(token_lengths(repo), 0.5)
    assert value != history.max_seq_len["C"]
    try:
        run(["dvc", "exp", "remove", "--all-commits"], repo)  # only this test's runs
        out = run(["dvc", "exp", "run", "-n", "procs2", "-S", "tokenize.num_proc=2"], repo)
        ran, skipped = stages_of(out)
        assert ran == ["tokenize"] and {"merge", "validate"} <= set(skipped), out
        columns, _ = changed_columns(repo)
        assert columns == ["tokenize.num_proc"], columns

        run(["git", "reset", "-q", "--hard"], repo)
        run(["dvc", "checkout"], repo)
        run(["dvc", "exp", "run", "-n", "seq", "-S", f"tokenize.max_seq_len={value}"], repo)
        columns, table = changed_columns(repo)
    finally:
        run(["git", "reset", "-q", "--hard"], repo)
        run(["dvc", "checkout"], repo)
    assert out_hashes(repo) == history.hashes["C"]
    print("\n" + ", ".join(columns))
    rows = {r["Experiment"] or r["rev"]: r for r in table}
    for column in ("reports/tokenize.json:rows", "reports/tokenize.json:tokens",
                   "merged.rows", "merged.tokens", "tokenize.max_seq_len"):
        assert column in columns, columns
        assert rows["procs2"][column] == rows["main"][column] != rows["seq"][column], column
    assert not [c for c in columns if is_run_key(c.rsplit(":", 1)[-1])]


def test_every_key_the_split_names_is_in_a_real_run_report(history):
    """reports.RUN names keys the stages really write (none renamed away unnoticed). The
    history's longest batch is off (tests/helpers/repo.py): test_validate holds its keys."""
    validated = json.loads((history.repo / "reports" / "validate.json").read_text())
    assert "skipped" in validated["train_check"]["longest_batch"]
    for stage, keys in reports.RUN.items():
        written = json.loads((history.repo / "reports" / "runs" / f"{stage}.json").read_text())
        for key in keys:
            if key.startswith("train_check.longest_batch."):
                continue
            value = written
            for name in key.split("."):
                assert isinstance(value, dict) and name in value, (
                    f"reports/runs/{stage}.json has no {key}")
                value = value[name]


def test_cpu_host_runs_only_the_cpu_stages_from_the_remote(history, tmp_path):
    """The GPU host generated and pushed; a CPU-only host clones the repo, freezes
    generate, changes a tokenize param and runs `dvc repro --pull --allow-missing`:
    it fetches the completions and nothing upstream of them, and never generates."""
    repo = history.repo
    run(["dvc", "push"], repo)  # a no-op when the push test ran
    cpu = tmp_path / "cpu-host"
    run(["git", "clone", "-q", str(repo), str(cpu)], tmp_path)
    # not data: the tokenizer build (deterministic), and the base set, which a real
    # setup reads from shared storage (merge.base)
    shutil.copytree(repo / ".cache" / "tokenizers", cpu / ".cache" / "tokenizers",
                    copy_function=os.link)
    shutil.copytree(repo / "data" / "base", cpu / "data" / "base")
    run(["dvc", "remote", "modify", "--local", "demo", "url", str(repo / ".dvc-remote")], cpu)
    run(["dvc", "freeze", "generate"], cpu)
    assert yaml.safe_load((cpu / "dvc.yaml").read_text())["stages"]["generate"]["frozen"]

    lengths = token_lengths(repo)
    value = between(lengths, 0.75)
    assert value != history.max_seq_len["C"]
    set_param(cpu, "tokenize", "max_seq_len", value)
    out = run(["dvc", "repro", "--pull", "--allow-missing"], cpu)
    assert stages_of(out)[0] == ["tokenize", "merge", "validate"], out
    assert not (cpu / "data" / "prompts").exists()
    assert not (cpu / ".cache" / "requests").exists()
    completions = {k: v for k, v in history.hashes["C"].items()
                   if k.startswith("data/completions/")}
    assert {k: v for k, v in out_hashes(cpu).items() if k in completions} == completions
    assert report(cpu, "tokenize")["rows"] == sum(n <= value for n in lengths)
    assert report(cpu, "validate")["passed"] is True


# --------------------------------------------------------------------------- 7: SSH remote


SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sshd(tmp_path):
    """A real OpenSSH server on a loopback port, with keys made here, its own config."""
    if not Path(SSHD).exists():
        pytest.skip("openssh-server is not installed (apt-get install openssh-server; "
                    ".ci/run installs it)")
    d = tmp_path / "ssh"
    d.mkdir()
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)],
                       check=True)
    shutil.copy(d / "client_key.pub", d / "authorized_keys")
    port = free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\nPidFile {d / 'sshd.pid'}\n"
        "PubkeyAuthentication yes\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nUsePAM no\n"
        "StrictModes no\nSubsystem sftp internal-sftp\nLogLevel VERBOSE\n"
    )
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
    log = open(d / "sshd.log", "w")
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (d / "sshd.log").read_text()
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "sshd did not listen within 60 s"
            time.sleep(0.1)
        home = d / "home"
        (home / ".ssh").mkdir(parents=True)
        host_key = (d / "host_key.pub").read_text().split()[:2]
        (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{port} {' '.join(host_key)}\n")
        yield {"port": port, "key": d / "client_key", "home": home, "log": d / "sshd.log",
               "user": getpass.getuser()}
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def test_push_pull_through_ssh_remote(history, sshd, tmp_path):
    repo = history.repo
    store = tmp_path / "ssh-store"
    url = f"ssh://{sshd['user']}@127.0.0.1:{sshd['port']}{store}"
    # a user's HOME with only this server's host key, so the client checks it
    home = {"HOME": str(sshd["home"])}
    run(["dvc", "remote", "add", "backup", url], repo)
    run(["dvc", "remote", "modify", "--local", "backup", "keyfile", str(sshd["key"])], repo)
    try:
        config = (repo / ".dvc" / "config").read_text()
        local = (repo / ".dvc" / "config.local").read_text()
        assert "keyfile" not in config and str(sshd["key"]) in local
        assert run(["git", "check-ignore", ".dvc/config.local"], repo).strip()

        run_env(["dvc", "push", "-r", "backup"], repo, home)
        assert {md5(p) for p in files(repo)} <= set(remote_objects(store))
        delete_cache_and_data(repo)
        run_env(["dvc", "pull", "-r", "backup"], repo, home)
        assert out_hashes(repo) == history.hashes["C"]
        assert "Accepted publickey" in sshd["log"].read_text()
    finally:
        # the local half first: DVC refuses a config whose local part names no url
        run(["dvc", "remote", "remove", "--local", "backup"], repo)
        run(["dvc", "remote", "remove", "backup"], repo)
        shutil.rmtree(store, ignore_errors=True)
    assert "backup" not in (repo / ".dvc" / "config").read_text()


# --------------------------------------------------------------------------- 8: S3 remote


BUCKET = "distill-versions"


@pytest.fixture
def s3(tmp_path):
    """A real S3 API on a loopback port (moto's server), with one empty bucket, and the
    environment that keeps dvc off the user's own AWS setup (empty config files)."""
    import boto3

    binary = Path(sys.executable).parent / "moto_server"
    assert binary.exists(), f"{binary} is missing: pip install -e '.[dev]' (moto[server])"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "moto.log", "w")
    proc = subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "moto.log").read_text()
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "moto_server did not listen within 60 s"
            time.sleep(0.1)
        client = boto3.client("s3", endpoint_url=url, aws_access_key_id="test",
                              aws_secret_access_key="test", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        empty = tmp_path / "aws-config"
        empty.touch()
        env = {"AWS_CONFIG_FILE": str(empty), "AWS_SHARED_CREDENTIALS_FILE": str(empty),
               "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1"}
        yield {"url": url, "client": client, "env": env}
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def s3_objects(client) -> set[str]:
    """Objects under the remote's prefix, named like remote_objects() names them."""
    names = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="dvc/"):
        for obj in page.get("Contents", []):
            *_, folder, name = obj["Key"].split("/")
            names.add(folder + name)
    return names


def test_push_pull_roll_back_and_gc_through_an_s3_remote(history, s3):
    repo, commits = history.repo, history.commits
    pull = ["dvc", "pull", "-r", "store"]
    run(["dvc", "remote", "add", "store", f"s3://{BUCKET}/dvc"], repo)
    run(["dvc", "remote", "modify", "store", "endpointurl", s3["url"]], repo)
    run(["dvc", "remote", "modify", "--local", "store", "access_key_id", "test"], repo)
    run(["dvc", "remote", "modify", "--local", "store", "secret_access_key", "test"], repo)
    try:
        assert "secret_access_key" not in (repo / ".dvc" / "config").read_text()
        for name in ("A", "B", "C"):  # every version, as each would have been pushed
            # (the tests before may have left only C in the cache: the others are pulled)
            with checked_out(repo, commits[name], data="pull"):
                run_env(["dvc", "push", "-r", "store"], repo, s3["env"])
        pushed = s3_objects(s3["client"])
        assert {md5(p) for p in files(repo)} < pushed

        # another machine: nothing local, every version from S3, links read-only
        delete_cache_and_data(repo)
        run_env(pull, repo, s3["env"])
        assert out_hashes(repo) == history.hashes["C"]
        for path in (p for p in files(repo) if p.stat().st_size):
            st = path.stat()
            assert st.st_nlink >= 2 and not st.st_mode & 0o222, f"{path} is a writable copy"
        delete_cache_and_data(repo)
        try:
            run(["git", "checkout", "-q", commits["A"]], repo)
            run_env(pull, repo, s3["env"])
            assert out_hashes(repo) == history.hashes["A"]
        finally:
            run(["git", "checkout", "-q", "main"], repo)
        run_env(pull, repo, s3["env"])
        assert out_hashes(repo) == history.hashes["C"]

        # gc keeps what the workspace version needs, in the cache and on S3
        run_env(["dvc", "gc", "-w", "-c", "-r", "store", "-f"], repo, s3["env"])
        kept = s3_objects(s3["client"])
        assert {k for k in kept if not k.endswith(".dir")} == {md5(p) for p in files(repo)}
        assert sum(k.endswith(".dir") for k in kept) == len(OUTS) and kept < pushed
        delete_cache_and_data(repo)
        run_env(pull, repo, s3["env"])
        assert out_hashes(repo) == history.hashes["C"]
    finally:
        run(["dvc", "remote", "remove", "--local", "store"], repo)
        run(["dvc", "remote", "remove", "store"], repo)


# --------------------------------------------------------------------------- 6: disk use


WRITE_BASE = """\
import os, sys
os.makedirs("data/base")
for i in range(int(sys.argv[1])):
    with open(f"data/base/data-{i:05d}.arrow", "wb") as f:
        f.write(os.urandom(4 << 20))
"""

# like stages/merge.py: base shards hardlinked into the new version, one new shard
MERGE = """\
import os
os.makedirs("data/merged")
names = sorted(os.listdir("data/base"))
for name in names:
    os.link(f"data/base/{name}", f"data/merged/{name}")
with open(f"data/merged/data-{len(names):05d}.arrow", "wb") as f:
    f.write(os.urandom(4 << 20))
"""

SMALL_PIPELINE = """\
stages:
  base:
    cmd: python write_base.py 4
    deps: [write_base.py]
    outs: [data/base]
  merge:
    cmd: python merge.py
    deps: [merge.py, data/base]
    outs: [data/merged]
"""


def du(path: Path) -> int:
    """Bytes on disk, each inode once (GNU du counts a hardlinked file once)."""
    return int(subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True,
                              check=True).stdout.split()[0])


def small_pipeline(repo: Path, project_config: bool) -> int:
    """A 20 MB base + new-shard pipeline; its disk use after `dvc repro`."""
    repo.mkdir()
    run(["git", "init", "-q"], repo)
    run(["dvc", "init", "-q"], repo)
    if project_config:
        shutil.copy(ROOT / ".dvc" / "config", repo / ".dvc" / "config")
    (repo / "write_base.py").write_text(WRITE_BASE)
    (repo / "merge.py").write_text(MERGE)
    (repo / "dvc.yaml").write_text(SMALL_PIPELINE)
    run(["dvc", "repro"], repo)
    return du(repo)


def test_project_cache_config_stores_data_once(tmp_path):
    data = 5 * (4 << 20)  # distinct bytes: 4 base shards + 1 new
    linked = small_pipeline(tmp_path / "linked", project_config=True)
    default = small_pipeline(tmp_path / "default", project_config=False)
    print(f"\n20 MiB of distinct shards: du {linked / 2**20:.1f} MiB with the project's "
          f"cache.type, {default / 2**20:.1f} MiB with DVC's default")
    assert linked < data * 1.15
    assert default > data * 2
