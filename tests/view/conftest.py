"""The bundled tokenizer, loaded once for the view tests."""

from __future__ import annotations

import os

import pytest

from tests.helpers.repo import ROOT


@pytest.fixture(scope="session")
def text():
    from stages.view.tokens import text_for

    cwd = os.getcwd()
    os.chdir(ROOT)  # the bundled tokenizer is cached under ./.cache
    try:
        return text_for({"tokenizer": {"name": "bundled:qwen3.6"}})
    finally:
        os.chdir(cwd)
