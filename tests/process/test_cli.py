"""The stage command line: its paths come from dvc.yaml's cmd, beside what DVC tracks."""

from __future__ import annotations

import importlib

import pytest
import yaml

from stages.process import cli

# read by merge only to find their hashes in dvc.lock for the lineage card: not deps
UNTRACKED = {("merge", "prompts"), ("merge", "completions")}


def tracked(stage: dict) -> list[str]:
    """Every path DVC tracks for a stage: deps, outs, metrics and plots."""
    paths = []
    for key in ("deps", "outs", "metrics", "plots"):
        for entry in stage.get(key, []):
            paths.append(next(iter(entry)) if isinstance(entry, dict) else entry)
    return paths


@pytest.mark.parametrize("section", ["prepare", "generate", "tokenize", "merge", "validate"])
def test_every_path_a_stage_is_given_is_one_dvc_tracks(section):
    stage = yaml.safe_load(cli.PIPELINE.read_text())["stages"][section]
    spec = importlib.import_module(f"stages.{section}").PATHS
    given = vars(cli.pipeline_paths(section, spec))
    assert set(given) == set(spec)
    paths = tracked(stage)
    for name, path in given.items():
        if (section, name) in UNTRACKED:
            continue
        assert any(p == str(path) or p.startswith(f"{path}/") for p in paths), (name, path)
