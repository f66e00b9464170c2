"""The layout README.md draws is the one on disk: stages/ holds the entry points, the
library lives in subpackages by concern, and every module is named in the tree, small
enough to read, with a short docstring (the behaviour reference lives in docs/)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.helpers.repo import ROOT

STAGES = ROOT / "stages"
MAX_LINES = 800
MAX_DOCSTRING_LINES = 15
TREE_LINE = re.compile(r"^((?:│   |    )*)(?:├── |└── )(\S+)")


def modules() -> list[str]:
    """Every module of stages/, as a path relative to the repo."""
    return sorted(p.relative_to(ROOT).as_posix() for p in STAGES.rglob("*.py"))


def readme_tree() -> dict[str, str]:
    """Path (relative to the repo) -> what the README's layout tree says it holds."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("\nLayout:\n\n```\n", 1)[1].split("\n```", 1)[0].splitlines()
    start = next(i for i, line in enumerate(block) if line.startswith("stages/ "))
    named, folders = {}, []
    for line in block[start + 1:]:
        m = TREE_LINE.match(line)
        if not m:
            break
        depth, name = len(m[1]) // 4, m[2]
        folders[depth:] = [name.rstrip("/")] if name.endswith("/") else []
        path = "/".join(["stages", *folders[:depth], name.rstrip("/")])
        named[path] = line[m.end():].strip()
    return named


def test_the_tree_is_read_whole():
    """The reader of the tree itself: a folder's modules are under it, the next folder is
    apart, and every line says what it holds."""
    tree = readme_tree()
    assert "stages/prepare.py" in tree and "stages/dataset/loader.py" in tree
    assert "stages/process/cli.py" in tree and "stages/models/templates" in tree
    assert all(tree.values()), [path for path, what in tree.items() if not what]


def test_the_readme_names_every_module():
    tree = readme_tree()
    unnamed = [m for m in modules() if not m.endswith("__init__.py") and m not in tree]
    assert not unnamed, f"README.md's layout does not name {unnamed}: add a line for each"
    packages = sorted({Path(m).parent.as_posix() + "/" for m in modules()} - {"stages/"})
    assert [p for p in packages if p.rstrip("/") not in tree] == []


def test_every_name_in_the_tree_exists():
    gone = [path for path in readme_tree() if not (ROOT / path).exists()]
    assert not gone, f"README.md's layout names {gone}, which do not exist"


def test_the_top_level_holds_only_entry_points():
    """A module at stages/ top level runs as `python -m stages.X`; everything else is in a
    subpackage, which says what it holds."""
    top = sorted(p.name for p in STAGES.glob("*.py") if p.name != "__init__.py")
    library = [name for name in top if "__name__ == \"__main__\"" not in (STAGES / name).read_text()]
    assert not library, f"stages/ top level holds {library}, which are not entry points"
    for folder in sorted(p for p in STAGES.iterdir() if p.is_dir() and p.name != "__pycache__"):
        if any(folder.glob("*.py")):
            init = folder / "__init__.py"
            assert init.is_file() and ast.get_docstring(ast.parse(init.read_text())), (
                f"{folder.relative_to(ROOT)} needs an __init__.py docstring saying what it holds")


@pytest.mark.parametrize("module", modules())
def test_a_module_is_small_enough_to_read(module):
    lines = len((ROOT / module).read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{module}: {lines} lines, over {MAX_LINES}: split it by concern"


@pytest.mark.parametrize("module", modules())
def test_a_module_docstring_says_what_it_is_in_a_few_lines(module):
    doc = ast.get_docstring(ast.parse((ROOT / module).read_text(encoding="utf-8")), clean=False)
    assert doc, f"{module} has no docstring"
    lines = len(doc.strip().splitlines())
    assert lines <= MAX_DOCSTRING_LINES, (
        f"{module}: a {lines}-line docstring; say what the module is and how to call it, "
        "and move the behaviour reference to docs/")



# ------------------------------------------- new code stays on the shared mechanisms

def calls(module: str) -> list[tuple[str, int]]:
    """(dotted name of what is called, line) for every call in `module`."""
    found = []
    for node in ast.walk(ast.parse((ROOT / module).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            parts, f = [], node.func
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            # a call on an expression, `(folder / "x").read_text()`, is named `?.read_text`
            parts.append(f.id if isinstance(f, ast.Name) else "?")
            found.append((".".join(reversed(parts)), node.lineno))
    return found


# files written whole that hold only what our own code made (no user or server text)
OWN_METADATA = {
    "stages/models/tokenizer.py": "the bundled tokenizer's config and stamp",
    "stages/models/tinymodel.py": "the demo model's stamp",
    "stages/dataset/shards.py": "datasets' state.json/dataset_info.json: file names, features",
    "stages/sources/decontam.py": "the n-gram index's scratch metadata, never shared",
}


@pytest.mark.parametrize("module", modules())
def test_text_and_json_files_are_written_through_the_one_redactor(module):
    """A report, run report, card, lineage.json, fingerprint or cache metadata written
    whole goes through outputs.write_json/write_text (secrets.WRITTEN) -- issue 32."""
    if module == "stages/common/outputs.py" or module in OWN_METADATA:
        return
    direct = [f"{name} (line {line})" for name, line in calls(module)
              if (name.endswith(".write_text") and name != "outputs.write_text")
              or name == "json.dump"]
    assert not direct, (f"{module} writes {direct} itself: use outputs.write_json or "
                        "outputs.write_text, which redact")


def test_every_stage_reports_its_failures_through_the_cli():
    """cli.reported redacts logs and error lines and tells the redactor the paths given."""
    for path in sorted(STAGES.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "__name__ == \"__main__\"" not in text or path.name == "demo.py":
            continue
        assert "cli.entry(" in text or "cli.reported(" in text, path.name


@pytest.mark.parametrize("module", modules())
def test_every_replaced_folder_is_checked_against_the_inputs(module):
    """A stage entry point that replaces a folder (outputs.atomic_dir) calls the one rule
    for where outputs go (outputs.check_apart) -- issue 32."""
    if not module.count("/") == 1 or module.endswith(("demo.py", "__init__.py")):
        return
    names = {name for name, _ in calls(module)}
    if "outputs.atomic_dir" in names or "outputs.scratch_dir" in names:
        assert "outputs.check_apart" in names or module == "stages/generate.py" and (
            "check_cache_dir" in names), f"{module} replaces a folder without check_apart"


# how a file is opened by name: the one reader (stages/common/reading.py) checks first
RAW_READS = ("open", "io.open", "pq.ParquetFile", "pq.read_table", "pq.read_schema",
             "pq.read_metadata", "pq.ParquetDataset", "pa.memory_map", "pa.OSFile",
             "pa.input_stream", "mmap.mmap", "json.load")
# every module that still opens a file by name itself, how many times, and why that is
# safe (exactly that many: a count above what is left fails too); a new call or module
# goes through reading.open_regular / read_regular / json_file / arrow_input / parquet
OPENS_ITSELF = {
    "stages/common/reading.py": (3, "the reader itself: open_regular's open of the checked "
                                   "descriptor, parquet's ParquetFile over it, and arrow_input's "
                                   "OSFile of that same descriptor (/proc/self/fd)"),
    "stages/process/children.py": (1, "/proc/PID/stat: made by the kernel, never a user path"),
    "stages/serving/processgroup.py": (1, "/proc/PID/stat: made by the kernel, never a user path"),
    "stages/process/cli.py": (2, "dvc.yaml beside the code (PIPELINE), shipped with it"),
    "stages/serving/probes.py": (1, "an HTTP request (urllib opener), not a file; its body "
                                    "is read bounded by probes itself"),
}


def _writes(node: ast.Call) -> bool:
    """A call given a write mode ("w", "ab", mode="x"...): it opens for writing."""
    given = list(node.args) + [k.value for k in node.keywords if k.arg == "mode"]
    return any(isinstance(a, ast.Constant) and isinstance(a.value, str)
               and set(a.value) & set("wax+") for a in given)


def raw_reads(module: str) -> list[str]:
    found = []
    tree = ast.parse((ROOT / module).read_text(encoding="utf-8"))
    writes = {n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and _writes(n)}
    for name, line in calls(module):
        if line in writes:
            continue
        if name in RAW_READS or name.endswith((".read_text", ".read_bytes")) or (
                name.endswith(".open") and name != "os.open"
                and not name.startswith(("gzip.", "bz2.", "lzma.", "self."))):
            found.append(f"{name} (line {line})")
    return found


@pytest.mark.parametrize("module", modules())
def test_files_are_read_through_the_one_reader(module):
    """No module opens a file by name beyond what OPENS_ITSELF lists (issue 32): a FIFO
    named like a shard, a base file or a report would hang it, a huge or deeply nested
    JSON file would make it fail with a traceback."""
    found = raw_reads(module)
    allowed, why = OPENS_ITSELF.get(module, (0, ""))
    assert len(found) == allowed, (
        f"{module} opens files itself: {found}; read through stages/common/reading.py "
        "(open_regular, read_regular, json_file, arrow_input, parquet); or, where it opens "
        f"fewer than OPENS_ITSELF says ({allowed}: {why}), lower that count")


def test_every_module_the_reader_allowlist_names_exists():
    assert all((ROOT / module).is_file() for module in OPENS_ITSELF), OPENS_ITSELF


# ------------------------------------------------ tests and benchmarks: public names only


def crossings(path: Path) -> list[str]:
    """Where a test or benchmark file reaches into private code: a `_name` imported from
    stages/ or read off a stages module, or an import from another `test_*.py`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] == "stages":
                for alias in node.names:
                    if alias.name.startswith("_"):
                        found.append(f"line {node.lineno}: {node.module}.{alias.name}")
                    modules.add(alias.asname or alias.name)
            if any(part.startswith("test_") for part in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module}")
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name.split(".")[0] for a in node.names
                           if a.name.split(".")[0] == "stages")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            owner = ast.unparse(node.value)
            if owner in modules or owner.startswith("stages."):
                found.append(f"line {node.lineno}: {owner}.{node.attr}")
    return found


TESTS_AND_BENCHES = sorted(
    p.relative_to(ROOT).as_posix() for d in ("tests", "bench") for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("path", TESTS_AND_BENCHES)
def test_tests_and_benchmarks_use_public_names_only(path):
    """A test holds a module to what its callers may use, so the module can change inside;
    what tests share lives in tests/helpers/, not in another test module."""
    found = crossings(ROOT / path)
    assert not found, f"{path} reaches into private code: {found}"


def test_the_crossing_finder_sees_each_kind(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from stages.tokenize import _load\nfrom stages.dataset import lineage\n"
                     "from tests.test_merge import rows\nimport stages.merge\n"
                     "lineage._turns({})\nstages.merge._read(1)\nlineage.build()\n")
    assert [f.split(": ")[1] for f in crossings(probe)] == [
        "stages.tokenize._load", "from tests.test_merge", "lineage._turns", "stages.merge._read"]
