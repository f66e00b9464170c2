"""dvc.yaml's deps hold the code that shapes each stage.

A stage's code is the module its `cmd` runs and every module of the project it imports,
at the top of a file or inside a function, followed through the modules they import in
turn (read with `ast`: nothing is imported here). Each of those files must be a dep of
the stage (itself or a folder holding it), unless LEFT_OUT says why not; and each code
dep must be something the stage imports, so no stale dep reruns a stage for nothing: a
file dep is imported, and a folder dep has every module in it imported.
"""

from __future__ import annotations

import ast
import shlex
from pathlib import Path
from typing import Optional

import pytest
import yaml

from tests.helpers.repo import ROOT
from tests.helpers.stagecli import covers

PIPELINE = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
PACKAGE = "stages"
EVERY_STAGE = frozenset(PIPELINE)

# Imported by these stages and still not their deps, on purpose: editing them must not
# rerun the stage. Neither are the modules only they import followed. A folder stands for
# every module in it.
LEFT_OUT = {
    # how a stage process runs, shaping no byte of any out: the command line (options,
    # logging, signals, one-line errors; it hands the params, a dep, to the stage
    # unchanged), how worker processes live and end (results come back in order), the
    # CPU count behind `num_proc: 0` / `threads: 0` (outputs are the same for any count)
    "stages/process": EVERY_STAGE,
    # the demo model, for `demo:` model names: editing demo code must never rerun a
    # 15-hour generation (validate depends on it: its training check's default model)
    "stages/models/tinymodel.py": frozenset({"generate"}),
    # the trainer formats, which the viewer's rows module reads for `stages.show` on an
    # export: validate's samples page shows data/merged only, never an export
    "stages/trainers": frozenset({"validate"}),
}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_file(name: str, root: Path = ROOT) -> Optional[Path]:
    """The file of module `name` in this checkout; None when `name` is no module (a
    class or function imported from one)."""
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported(path: Path, root: Path = ROOT) -> set[str]:
    """The project's modules (and their packages) that the file imports, anywhere in it."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, one level up per extra dot
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if module_file(sub, root) else base)
    mine = {m for m in found if m.split(".")[0] == PACKAGE}
    return mine | {m.rsplit(".", k)[0] for m in mine for k in range(1, m.count(".") + 1)}


def holds_code(path: Path) -> bool:
    """False for a package marker: an __init__.py with nothing but a docstring."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
               for n in body)


def stage_code(stage: str, left_out: dict = LEFT_OUT) -> set[str]:
    """Paths (relative to the repo) of the code `stage` runs, less what `left_out` skips."""
    argv = shlex.split(PIPELINE[stage]["cmd"])
    assert argv[:2] == ["python", "-m"], PIPELINE[stage]["cmd"]
    todo, seen, files = [argv[2]], set(), set()
    while todo:
        name = todo.pop()
        path = module_file(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        rel = path.relative_to(ROOT).as_posix()
        if any(stage in stages and covers(left, rel) for left, stages in left_out.items()):
            continue
        if path.name != "__init__.py" or holds_code(path):
            files.add(rel)
        todo += imported(path)
    return files


def deps(stage: str) -> list[str]:
    return [d if isinstance(d, str) else next(iter(d)) for d in PIPELINE[stage]["deps"]]


def code_deps(stage: str) -> list[str]:
    """The deps that are code: a .py file, or a folder holding one."""
    return [d for d in deps(stage) if d.endswith(".py") or modules_in(d)]


def modules_in(folder: str) -> list[str]:
    """The modules holding code in `folder` (a path relative to the repo), at any depth."""
    root = ROOT / folder
    if not root.is_dir():
        return []
    return sorted(p.relative_to(ROOT).as_posix() for p in root.rglob("*.py") if holds_code(p))


@pytest.mark.parametrize("stage", sorted(PIPELINE))
def test_every_module_a_stage_imports_is_its_dep(stage):
    missing = sorted(p for p in stage_code(stage) if not any(covers(d, p) for d in deps(stage)))
    assert not missing, (
        f"{stage} imports {missing}, which dvc.yaml does not list as its deps: add them "
        "(or, if editing them must not rerun the stage, to LEFT_OUT with the reason)")


@pytest.mark.parametrize("stage", sorted(PIPELINE))
def test_every_code_dep_of_a_stage_is_imported_by_it(stage):
    code = stage_code(stage)
    stale = [d for d in code_deps(stage) if d.endswith(".py") and d not in code]
    assert not stale, f"dvc.yaml lists {stale} as deps of {stage}, which never imports them"
    for folder in [d for d in code_deps(stage) if not d.endswith(".py")]:
        unused = [m for m in modules_in(folder) if m not in code]
        assert not unused, (
            f"dvc.yaml lists the folder {folder} as a dep of {stage}, which never imports "
            f"{unused}: list the modules it imports instead")


def test_what_is_left_out_is_imported_and_not_a_dep():
    for path, stages in LEFT_OUT.items():
        for stage in stages:
            assert any(covers(path, p) for p in stage_code(stage, left_out={})), (
                f"LEFT_OUT: {stage} imports nothing in {path}: remove it there")
            assert not any(covers(d, path) or covers(path, d) for d in deps(stage)), (
                f"{path} is in LEFT_OUT for {stage} and in its dvc.yaml deps")


def test_imports_are_found_at_any_depth_and_relative(tmp_path):
    """The reader itself, on a package laid out in subpackages."""
    pkg = tmp_path / PACKAGE
    (pkg / "io").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""marker"""\n')
    (pkg / "io" / "__init__.py").write_text("from .atomic import write\n")
    (pkg / "io" / "atomic.py").write_text("def write(): pass\n")
    (pkg / "io" / "names.py").write_text("X = 1\n")
    (pkg / "run.py").write_text(
        "import os\nfrom stages.io import atomic\n"
        "def later():\n    from .io.names import X\n    return X\n")
    assert imported(pkg / "run.py", tmp_path) == {"stages", "stages.io", "stages.io.atomic",
                                        "stages.io.names"}
    assert imported(pkg / "io" / "__init__.py", tmp_path) == {"stages", "stages.io", "stages.io.atomic"}
    assert not holds_code(pkg / "__init__.py") and holds_code(pkg / "io" / "__init__.py")


# ------------------------------------------- docs/versions.md's table, held to dvc.yaml

STAGE_ORDER = ("prepare", "generate", "tokenize", "merge", "validate")


def _stage_names(cell: str, rest: frozenset = frozenset()) -> frozenset:
    """The stages a cell of the table names: `all five`, `nothing`/`none`, `the rest`."""
    if "all five" in cell:
        return EVERY_STAGE
    if cell.strip() in ("nothing", "none"):
        return frozenset()
    if "the rest" in cell:
        return EVERY_STAGE - rest
    return frozenset(s for s in STAGE_ORDER if s in cell)


def rerun_rows() -> list[tuple[list[str], str, str]]:
    """(modules, runs, skipped) of each row of the rerun table that names modules."""
    text = (ROOT / "docs/versions.md").read_text(encoding="utf-8")
    table = text.split("| you change | `dvc repro` runs | skipped |", 1)[1].split("\n\n", 1)[0]
    cells = [[c.strip() for c in line.strip("|").split("|")]
             for line in table.strip().splitlines()[1:]]
    named = [[m for m in change.split("`")[1::2] if "/" in m and m.endswith((".py", "/"))]
             for change, _, _ in cells]
    files = {f"stages/{m}" for row in named for m in row if m.endswith(".py")}
    rows = []
    for (_, runs, skipped), names in zip(cells, named):
        # a folder stands for its modules that no row names by themselves
        modules = [m for name in names for m in (
            [m for m in modules_in(f"stages/{name}") if m not in files]
            if name.endswith("/") else [f"stages/{name}"])]
        if modules:
            rows.append((modules, runs, skipped))
    return rows


def test_the_rerun_table_says_what_dvc_yaml_says():
    """Each row that names modules: the stages it says rerun first (outside parentheses,
    before a `;`) are exactly those whose deps hold each module, and what it says is
    skipped is every stage it does not name."""
    rows = rerun_rows()
    assert len(rows) >= 10
    for modules, runs, skipped in rows:
        first = runs.split(";")[0]
        while "(" in first:
            first = first[:first.index("(")] + first[first.index(")") + 1:]
        said = _stage_names(first)
        for module in modules:
            assert (ROOT / module).is_file(), f"{module}: named in docs/versions.md, not a file"
            deps_it = frozenset(s for s in PIPELINE if any(covers(d, module) for d in deps(s)))
            assert deps_it == said, f"{module}: dvc.yaml reruns {sorted(deps_it)}, the table says {runs!r}"
        named = _stage_names(runs)
        assert _stage_names(skipped, rest=named) == EVERY_STAGE - named, (modules, skipped)


def test_bytecode_beside_a_folder_dep_changes_no_dep(tmp_path):
    """Python writes __pycache__ into stages/... whenever a stage runs (unless
    PYTHONDONTWRITEBYTECODE is set, as on CI): counted by dvc, it would make every folder
    dep of every stage look changed after the first run, and `dvc repro` rerun them."""
    import shutil
    import subprocess
    import sys

    dvc = [sys.executable, "-m", "dvc"]
    (tmp_path / "code").mkdir()
    (tmp_path / "code/a.py").write_text("x = 1\n")
    shutil.copy(ROOT / ".dvcignore", tmp_path / ".dvcignore")
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n  s:\n    cmd: echo run > out.txt\n    deps: [code]\n    outs: [out.txt]\n")
    for cmd in (["git", "init", "-q"], [*dvc, "init", "-q"], [*dvc, "repro", "-q"]):
        subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True)
    (tmp_path / "code/__pycache__").mkdir()
    (tmp_path / "code/__pycache__/a.cpython-311.pyc").write_bytes(b"\x00" * 16)
    (tmp_path / "code/b.pyc").write_bytes(b"\x00" * 16)
    status = subprocess.run([*dvc, "status"], cwd=tmp_path, check=True, capture_output=True,
                            text=True)
    assert "up to date" in status.stdout, status.stdout
